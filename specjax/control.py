"""Branching over values that hold KV pools, without copying them: ``cond`` and ``switch``.

XLA (measured on CPU, jax 0.10) updates a buffer carried by a ``while_loop`` in place, but a buffer
that flows through a ``lax.cond`` / ``lax.switch`` inside the loop body is copied: the copy pass
gives each branch its own output buffer, so a branch that writes a few K/V rows into a pool
copies the whole pool, and the loop body copies the conditional's result back into the carry.
In the fused decode loop that is every layer's K and V pool on every step (measured with
``benchmarks/probe_adaptive_copies.py``: 6 pool copies per step for a 2-layer target with a
1-layer draft under ``lax.switch``, 0 with these helpers), which costs more as batch x context
grows.

A ``while_loop`` that runs zero times or once is a branch XLA does keep in place. ``cond`` runs
``fn`` on the operand when ``pred`` holds (else returns it unchanged); ``switch`` runs
``branches[index]`` by chaining one such loop per branch, each taken only when the index matches.
Every branch maps the operand to a value of the *same* pytree structure, shapes and dtypes
(carry extra outputs inside the operand, initialised by the caller).

Cost: one scalar loop condition per branch; only the taken branch runs.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax import lax


def cond(pred: jax.Array, fn: Callable, operand):
    """``fn(operand)`` if ``pred`` else ``operand``; ``fn`` must keep the operand's structure."""

    def body(carry):
        _, x = carry
        return jnp.zeros((), bool), fn(x)

    return lax.while_loop(lambda carry: carry[0], body, (jnp.asarray(pred, bool), operand))[1]


def switch(index: jax.Array, branches: Sequence[Callable], operand):
    """``branches[clip(index, 0, len - 1)](operand)``, like ``lax.switch``, without copying the
    operand's buffers. Every branch maps the operand to a value of the same structure."""
    if not branches:
        raise ValueError("switch: branches must be a non-empty sequence of callables")
    index = jnp.clip(jnp.asarray(index, jnp.int32), 0, len(branches) - 1)
    for i, fn in enumerate(branches):
        operand = cond(index == i, fn, operand)
    return operand
