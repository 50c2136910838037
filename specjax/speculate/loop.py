"""The step dispatcher, prefill with the adaptive fields, and the on-device decode loop.

``spec_step`` picks the step kind from the static plan — a tree, adaptive by history or by
confidence, or a fixed chain / plain step — and ``decode_loop`` runs it under lax.while_loop
until every row is done: a whole generation is one device program with no host sync.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from specjax import adaptive
from specjax.speculate import adaptive_steps, steps
from specjax.speculate.drafters import resolve
from specjax.speculate.state import LAG_WINDOW, DecodeState, Models, Plan, RowParams


def make_plan(target_cfg, draft_cfg, lc) -> Plan:
    """The static plan of a SpecConfig with a draft of static config ``draft_cfg``."""
    return Plan(target_cfg=target_cfg, drafter=resolve(lc, target_cfg, draft_cfg), lc=lc)


def init_adaptive(state: DecodeState, plan: Plan, cost, rows: int, lag_window: int,
                  dtype) -> DecodeState:
    """Adds adaptive k's fields (counts, the cost model, the lazy-upkeep window) to a state."""
    kk = plan.lc.k_eff
    if cost is None:
        raise ValueError("adaptive speculation needs the cost model (cost=[K+1..K+3] array)")
    cost = jnp.asarray(cost, jnp.float32).reshape(-1)
    if cost.shape[0] not in (kk + 1, kk + 2, kk + 3):
        raise ValueError(f"cost must have K+1 = {kk + 1}, K+2 or K+3 entries, got {cost.shape[0]}")
    return dataclasses.replace(
        state, cost=cost, **adaptive.init_counts(kk, plan.lc.adaptive_by == "confidence"),
        **steps.init_lag(plan.drafter, rows, lag_window, dtype))


def prefill_plan(models: Models, plan: Plan, tokens, prompt_lens, rp: RowParams, seed,
                 num_pages_per_seq: int, out_len: int, kv_dtype=jnp.float32, cost=None,
                 lag_window: int = LAG_WINDOW) -> DecodeState:
    """``steps.init_state`` plus adaptive k's fields (cost: [K+1..K+3] relative k-step costs,
    specjax.cost_model; lag_window: static W of the lazy drafter upkeep)."""
    state = steps.init_state(models, plan, tokens, prompt_lens, rp, seed, num_pages_per_seq,
                             out_len, kv_dtype)
    if plan.lc.adaptive:
        state = init_adaptive(state, plan, cost, tokens.shape[0], lag_window, kv_dtype)
    return state


def step_counted(models: Models, state: DecodeState, rp: RowParams, plan: Plan):
    """One fused speculative (or plain) step for the whole batch -> (state, verified [B] int32
    draft tokens the target verified per row: 0 for plain steps and finished rows)."""
    step = steps.fixed_step
    if plan.lc.adaptive:
        step = (adaptive_steps.confidence_step if plan.lc.adaptive_by == "confidence"
                else adaptive_steps.history_step)
    new, _, verified = step(models, state, rp, plan)
    return new, jnp.where(state.done, 0, verified).astype(jnp.int32)


def run_loop(models: Models, state: DecodeState, rp: RowParams, plan: Plan) -> DecodeState:
    """Runs steps under lax.while_loop until every row is done: no host sync inside."""
    max_steps = state.out_tokens.shape[1] + 1

    def cond(s):
        return jnp.any(~s.done) & (s.step <= max_steps)

    return lax.while_loop(cond, lambda s: step_counted(models, s, rp, plan)[0], state)


def _generate_device(target_params, draft_params, tokens, prompt_lens, rp, seed, cost=None, *,
                     target_cfg, draft_cfg, lc, num_pages_per_seq, out_len):
    plan = make_plan(target_cfg, draft_cfg, lc)
    models = Models(target_params, draft_params)
    state = prefill_plan(models, plan, tokens, prompt_lens, rp, seed, num_pages_per_seq, out_len,
                         kv_dtype=target_params["embed"].dtype, cost=cost)
    state = run_loop(models, state, rp, plan)
    extra = {"drafted": state.drafted, "spec_steps": state.spec_steps}
    if state.k_hist is not None:
        extra["k_hist"] = state.k_hist
    if lc.adaptive and lc.adaptive_by == "confidence":  # the calibration table at the end
        extra["table"] = (state.acc_hits, state.acc_obs)
    return (state.out_tokens, state.num_out, state.accepted_per_pos, state.row_steps, state.step,
            extra)


generate_device = jax.jit(
    _generate_device,
    static_argnames=("target_cfg", "draft_cfg", "lc", "num_pages_per_seq", "out_len"))
