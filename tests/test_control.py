"""specjax.control: branches that keep large carried buffers in place.

Semantics match lax.cond / lax.switch (index clamped like lax.switch), and a while loop whose
body branches with them compiles without copying the carried buffer, where lax.switch copies it
(the negative control: the property this module exists for is measurable and can fail). The
real decode loop is checked by benchmarks/probe_adaptive_copies.py (slow test below)."""

import importlib.util
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from specjax import control

N = 1 << 18  # a "pool" large enough that a copy of it is unmistakable in the HLO


def _write(buf, i, width):
    return lax.dynamic_update_slice(buf, jnp.full((width,), width, buf.dtype), (i,))


def _branches(i):
    return [lambda op, w=w: (_write(op[0], i, w), op[1] + w) for w in (1, 2, 3)]


@pytest.mark.parametrize("index", [-2, 0, 1, 2, 7])
def test_switch_matches_lax_switch(index):
    op = (jnp.zeros(16), jnp.int32(0))
    got = jax.jit(lambda k, op: control.switch(k, _branches(4), op))(index, op)
    want = lax.switch(index, _branches(4), op)
    np.testing.assert_array_equal(got[0], want[0])
    assert int(got[1]) == int(want[1])


@pytest.mark.parametrize("pred", [True, False])
def test_cond_runs_fn_only_when_pred(pred):
    out = jax.jit(lambda p, x: control.cond(p, lambda v: v * 2 + 1, x))(pred, jnp.arange(4.0))
    np.testing.assert_array_equal(out, np.arange(4.0) * 2 + 1 if pred else np.arange(4.0))


def _pool_copies(branching) -> int:
    def body(c):
        i, buf, total = c
        buf, total = branching(i % 3, _branches(i), (buf, total))
        return i + 1, buf, total

    loop = jax.jit(lambda buf: lax.while_loop(lambda c: c[0] < 10, body, (0, buf, jnp.int32(0))),
                   donate_argnums=(0,))
    text = loop.lower(jnp.zeros(N)).compile().as_text()
    return len(re.findall(rf"= f32\[{N}\]\{{0\}} copy\(", text))


def test_switch_keeps_the_carried_buffer_in_place():
    assert _pool_copies(lax.switch) > 0  # the negative control: XLA copies through lax.switch
    assert _pool_copies(control.switch) == 0
    # and the loop still computes the right thing: step i writes width i % 3 + 1 at i
    def body(c):
        i, buf, total = c
        buf, total = control.switch(i % 3, _branches(i), (buf, total))
        return i + 1, buf, total
    _, buf, total = jax.jit(lambda b: lax.while_loop(lambda c: c[0] < 10, body,
                                                     (0, b, jnp.int32(0))))(jnp.zeros(N))
    want = np.zeros(N)
    for i in range(10):
        want[i:i + i % 3 + 1] = i % 3 + 1
    np.testing.assert_array_equal(np.asarray(buf)[:16], want[:16])
    assert int(total) == sum(i % 3 + 1 for i in range(10))


def test_switch_rejects_no_branches():
    with pytest.raises(ValueError, match="branches"):
        control.switch(0, [], jnp.zeros(2))


@pytest.mark.slow
def test_adaptive_decode_loop_copies_no_kv_pool():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location(
        "_probe_copies", os.path.join(root, "benchmarks", "probe_adaptive_copies.py"))
    probe = importlib.util.module_from_spec(spec)
    sys.modules["_probe_copies"] = probe
    spec.loader.exec_module(probe)
    assert probe.pool_copies_per_step(adaptive=True) == (0, 0)
    assert probe.pool_copies_per_step(adaptive=False) == (0, 0)
