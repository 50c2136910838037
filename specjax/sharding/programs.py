"""The sharded programs: prefill + the whole decode loop under ``jax.jit`` on a mesh, and
teacher-forced logits. The caches, the batch state and the weights keep one layout for the
whole ``lax.while_loop``, so the loop never reshards (``hlo.collectives`` reads that off the
compiled HLO).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from specjax import kv_cache, model, registry, speculate
from specjax.sharding.distributed import barrier
from specjax.sharding.dp_attention import ShardedAttention
from specjax.sharding.specs import (ShardingPlan, as_plan, constrain_state, draft_specs, is_head,
                                    model_specs, place, prepare, put, repeat_kv_heads,
                                    sharded_configs)


def _run(target_params, draft_params, tokens, prompt_lens, rp, seed, *, plan, target_cfg,
         draft_cfg, lc, num_pages_per_seq, out_len):
    # The attention implementation of the plan, explicit in the (static) loop config.
    lc = dataclasses.replace(lc, attn_impl=ShardedAttention.for_models(
        plan, target_cfg, draft_cfg, impl=lc.attn_impl))
    state = speculate.prefill(target_params, target_cfg, draft_params, draft_cfg, tokens,
                              prompt_lens, rp, seed, lc, num_pages_per_seq, out_len,
                              kv_dtype=target_params["embed"].dtype)
    state = constrain_state(state, plan, target_cfg, draft_cfg)
    return speculate.decode_loop(target_params, target_cfg, draft_params, draft_cfg, state,
                                 rp, lc)


_STATIC = ("plan", "target_cfg", "draft_cfg", "lc", "num_pages_per_seq", "out_len")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _generate_jit(*args, **kw):
    s = _run(*args, **kw)
    out = (s.out_tokens, s.num_out, s.accepted_per_pos, s.row_steps, s.step,
           {"drafted": s.drafted, "spec_steps": s.spec_steps})
    # Replicated results (one small all-gather after the loop): every process can read them.
    return lax.with_sharding_constraint(out, kw["plan"].sharding(P()))


_state_jit = jax.jit(_run, static_argnames=_STATIC)


def place_inputs(plan: ShardingPlan, target_params, draft_params, tokens, prompt_lens, rp, seed,
                 *, target_cfg, draft_cfg):
    """The dynamic arguments of the sharded program, placed per the plan (no-ops for arrays
    already placed; KV heads repeated as ``sharded_configs`` says). Returns (target_params,
    draft_params, tokens, prompt_lens, rp, seed) for ``lower_generate`` / the jitted program."""
    if draft_params is not None and plan.draft_placement == "leader" and not is_head(draft_cfg):
        raise ValueError(
            'draft_placement="leader" keeps the draft on one device, outside the SPMD program; the '
            "fused on-device loop runs one program on every device of the mesh and cannot host it. "
            'Use draft_placement="replicated" (same per-step latency: the other devices would wait '
            'for the draft tokens anyway) or "sharded", or drive leader drafts from the host.')
    b = tokens.shape[0]
    if b % plan.dp:
        raise ValueError(f"the batch ({b} rows) must be a multiple of dp={plan.dp}")
    rows, rows2 = plan.sharding(P("dp")), plan.sharding(P("dp", None))
    target_params, target_cfg = prepare(target_params, target_cfg, plan.tp)
    target_params = place(target_params, model_specs(target_params, target_cfg, plan.tp), plan)
    if draft_params is not None:
        if is_head(draft_cfg) or plan.draft_placement == "sharded":
            draft_params, draft_cfg = prepare(draft_params, draft_cfg, plan.tp)
        draft_params = place(draft_params, draft_specs(draft_params, draft_cfg, plan), plan)
    rp = dataclasses.replace(
        rp, **{f.name: put(getattr(rp, f.name), rows) for f in dataclasses.fields(rp)
               if f.name != "eos_ids"}, eos_ids=put(rp.eos_ids, plan.sharding(P())))
    return (target_params, draft_params, put(tokens, rows2), put(prompt_lens, rows), rp,
            put(seed, plan.sharding(P())))


def generate_device(plan: ShardingPlan, target_params, draft_params, tokens, prompt_lens, rp,
                    seed, *, target_cfg, draft_cfg, lc, num_pages_per_seq: int, out_len: int):
    """``speculate.generate_device`` on a mesh: prefill + the whole decode loop, one program.

    Args and returns as ``speculate.generate_device`` (tokens [B, Tp] with B a multiple of dp);
    params are placed per the plan (a no-op when already placed by shard_model / shard_draft).
    The returned arrays are replicated, so every process of a multi-host run can read them.
    """
    args = place_inputs(plan, target_params, draft_params, tokens, prompt_lens, rp, seed,
                        target_cfg=target_cfg, draft_cfg=draft_cfg)
    target_cfg, draft_cfg = sharded_configs(plan, target_cfg, draft_cfg)
    static = dict(plan=plan, target_cfg=target_cfg, draft_cfg=draft_cfg, lc=lc,
                  num_pages_per_seq=num_pages_per_seq, out_len=out_len)
    if jax.process_count() == 1:
        return _generate_jit(*args, **static)
    # Several processes: compile, wait until every process has, then run. Compile times differ
    # across hosts, and a collective's first rendezvous (gloo on CPU) times out after 30 s: the
    # barrier's tiny collective absorbs the skew, so the long program's collectives start together.
    key = (tuple(sorted(static.items(), key=lambda kv: kv[0])), jax.tree.structure(args),
           tuple((a.shape, a.dtype, a.sharding) for a in jax.tree.leaves(args)))
    if key not in _COMPILED:
        _COMPILED[key] = _generate_jit.lower(*args, **static).compile()
    barrier("specjax_generate")
    return _COMPILED[key](*args)


_COMPILED: dict = {}  # multi-process executables (jit's own cache is not shared with .lower())


def lower_generate(plan: ShardingPlan, *placed, full_state: bool = False, **static):
    """The jax ``Lowered`` of the sharded program for ``place_inputs(...)`` arguments.

    ``.compile()`` gives a callable (``compiled(*placed)``) whose ``.as_text()`` is the
    partitioned HLO (see ``collectives``). full_state=True: the program returns the whole final
    DecodeState (sharded; carried draft logits, caches) instead of generate_device's outputs.
    """
    static["target_cfg"], static["draft_cfg"] = sharded_configs(plan, static["target_cfg"],
                                                                static["draft_cfg"])
    return (_state_jit if full_state else _generate_jit).lower(*placed, plan=plan, **static)


@functools.partial(jax.jit, static_argnames=("cfg", "plan"))
def _logits_jit(params, tokens, lengths, *, cfg, plan):
    b, t = tokens.shape
    kv, page_table = kv_cache.init_contiguous(cfg, b, t, dtype=params["embed"].dtype)
    page_table = lax.with_sharding_constraint(page_table, plan.sharding(P("dp", None)))
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out, _, _ = registry.forward(params, cfg, tokens, pos, kv, page_table,
                              jnp.zeros((b,), jnp.int32), lengths,
                              attn_impl=ShardedAttention.for_models(plan, cfg))
    return lax.with_sharding_constraint(out, plan.sharding(P()))


def logits(m: model.Model, tokens, mesh_or_plan, lengths=None) -> np.ndarray:
    """Teacher-forced logits on a mesh. tokens: [B, T] int (B a multiple of dp) -> [B, T, V]."""
    plan = as_plan(mesh_or_plan)
    tokens = np.asarray(tokens, np.int32)
    if tokens.ndim != 2 or tokens.shape[0] % plan.dp:
        raise ValueError(f"tokens must be [B, T] with B a multiple of dp={plan.dp}, "
                         f"got shape {tokens.shape}")
    b, t = tokens.shape
    lengths = np.full((b,), t, np.int32) if lengths is None else np.asarray(lengths, np.int32)
    params, cfg = repeat_kv_heads(m.params, m.config, plan.tp)
    params = place(params, model_specs(params, cfg, plan.tp), plan)
    out = _logits_jit(params, put(tokens, plan.sharding(P("dp", None))),
                      put(lengths, plan.sharding(P("dp"))), cfg=cfg, plan=plan)
    return np.asarray(out)
