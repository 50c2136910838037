"""The jitted decoding core: one Drafter interface, the step functions, the on-device loop.

Layers (no arrow runs back up): ``state`` (DecodeState, RowParams, Drafts, the shared
sampling / acceptance / commit pieces) < ``drafters/`` (one module per drafter kind behind
``drafters.base.Drafter``) < ``steps`` (prefill, plain, chain, tree) < ``adaptive_steps``
< ``loop`` (the dispatcher and the while_loop). See each module's docstring.

The functions below keep the positional form ``(target_params, target_cfg, draft_params,
draft_cfg, state, rp, lc)`` used by the engine, the sharded programs and the tests; they build
``Models`` / ``Plan`` and call the step functions.
"""

from __future__ import annotations

import jax.numpy as jnp

from specjax.config import METHODS
from specjax.registry import forward, init_cache
from specjax.speculate import adaptive_steps, drafters, loop, steps
from specjax.speculate.drafters import Custom, Drafter, Span
from specjax.speculate.loop import generate_device, make_plan
from specjax.speculate.state import (LAG_WINDOW, DecodeState, Drafts, Models, Plan, RowParams,
                                     Verified, target_forward)

__all__ = ["Custom", "DecodeState", "Drafter", "Drafts", "LAG_WINDOW", "METHODS", "Models",
           "Plan", "RowParams", "Span", "Verified", "adaptive_steps", "catch_up_state", "decode_loop",
           "drafters", "forward", "generate_device", "init_cache", "loop",
           "make_plan", "prefill", "spec_step", "spec_step_counted", "steps", "target_forward"]


def prefill(target_params, target_cfg, draft_params, draft_cfg, tokens, prompt_lens, rp: RowParams,
            seed, lc, num_pages_per_seq: int, out_len: int, kv_dtype=jnp.float32, cost=None,
            lag_window: int = LAG_WINDOW) -> DecodeState:
    """Fills the target cache and the drafter over the prompts and samples the first token
    (``loop.prefill_plan``)."""
    return loop.prefill_plan(Models(target_params, draft_params),
                             make_plan(target_cfg, draft_cfg, lc), tokens, prompt_lens, rp, seed,
                             num_pages_per_seq, out_len, kv_dtype, cost, lag_window)


def spec_step_counted(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
                      rp: RowParams, lc):
    """One fused step -> (state, verified [B] draft tokens verified per row)."""
    return loop.step_counted(Models(target_params, draft_params), state, rp,
                             make_plan(target_cfg, draft_cfg, lc))


def spec_step(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
              rp: RowParams, lc) -> DecodeState:
    """One fused speculative (or plain) decoding step for the whole batch."""
    return spec_step_counted(target_params, target_cfg, draft_params, draft_cfg, state, rp, lc)[0]


def decode_loop(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
                rp: RowParams, lc) -> DecodeState:
    """Runs spec_step under lax.while_loop until every row is done: no host sync inside."""
    return loop.run_loop(Models(target_params, draft_params), state, rp,
                         make_plan(target_cfg, draft_cfg, lc))


def catch_up_state(target_params, target_cfg, draft_params, draft_cfg, state, lc, keep: int):
    """steps.catch_up_state in the positional form."""
    return steps.catch_up_state(Models(target_params, draft_params), make_plan(target_cfg, draft_cfg, lc),
                                state, keep)


_catch_up_state = catch_up_state  # the name tests/test_ngram.py uses
HEAD_METHODS = ("mtp", "eagle", "eagle3", "eagle-tree")  # methods drafting with a specjax.heads.Head
