"""Tensor- and data-parallel sharding of the fused speculative loop (JAX SPMD, one program).

A ``Mesh`` has two axes: ``dp`` splits the batch (independent sequences, each dp group an
independent replica of the decode loop) and ``tp`` splits each model's tensors (Megatron style).
``generate_device`` runs ``speculate.prefill`` + ``speculate.decode_loop`` under ``jax.jit`` with
the layouts below; the caches, the batch state and the weights keep one layout for the whole
``lax.while_loop``, so the loop never reshards (``collectives`` reads that off the compiled HLO).

Layouts (``-`` = replicated; a dimension listed as ``tp`` is split over the tp axis)::

    embed      [V, E]          (tp, -)      vocab-parallel (replicated when tp does not divide V)
    lm_head    [E, V]          (-, tp)
    wq         [E, H*D]        (-, tp)      attention heads (tp must divide H)
    wk, wv     [E, Hkv*D]      (-, tp)      KV heads; when tp does not divide Hkv, each KV head
                                            is first repeated to lcm(Hkv, tp) heads (GQA with
                                            few KV heads: repeat_kv_heads, as vLLM does)
    wo         [H*D, E]        (tp, -)      one all-reduce of [B, T, E] per layer
    w_gate/up  [E, F]          (-, tp)      MLP hidden (tp must divide F)
    w_down     [F, E]          (tp, -)      one all-reduce of [B, T, E] per layer
    norms, output biases        -
    KV pools   [Hkv, P, S, D]  (tp, dp, -, -)   pages split over dp, KV heads over tp
    batch state [B, ...]       (dp, ...)    page_table, lengths, tokens, keys, out buffer
    MTP / EAGLE head           sharded with the target: its block as a target layer, the
                               shared embedding / lm_head vocab-parallel, eh_proj replicated
    draft LLM                  "replicated" (default: every device runs the small draft, no
                               collectives), "sharded" (like the target), or "leader" (one
                               device; for host-driven steps, not the fused loop — see below)

Pages over dp: each dp group holds only its rows' pages. The attention core (K/V write + paged
attention, ``model.attention_core``) runs per dp shard in a ``shard_map`` over ``dp`` (``tp``
left to the SPMD partitioner) with shard-local page ids, so reading the cache needs no
communication. Contract: a row in dp group i only uses pages ``[i*P/dp, (i+1)*P/dp)`` (the
contiguous page table that ``speculate.prefill`` builds satisfies it; an allocator must keep
one free list per dp group).

Collectives per fused step (read from the compiled HLO; the table in docs/sharding.md):
per target layer two all-reduces of [B/dp, T, E] (after wo and w_down) plus one for the
vocab-parallel embedding lookup; argmax over the vocab-split logits all-gathers one (value,
index) pair per tp shard; the loop condition and the all-greedy test reduce a few [B/dp]
vectors / scalars over dp. None moves a weight or a page pool.

Draft on the leader rank: SPEC's draft-target schedule runs the draft only on one device of the
TP group. Inside one SPMD program every device runs the same program over the same buffers, so
"one device only" cannot live in the fused loop; the replicated draft gives the same latency
there (the other devices would otherwise wait for the draft tokens) at the cost of its weights
and cache on each device. ``draft_placement="leader"`` places the draft on ``leader_device`` for
host-driven steps; ``generate_device`` rejects it with that explanation.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import math
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax import kv_cache, model, registry, speculate
from specjax.config import ModelConfig
from specjax.heads import HeadConfig

AXES = ("dp", "tp")
PLACEMENTS = ("replicated", "sharded", "leader")
_U = P.UNCONSTRAINED


# ------------------------------------------------------------------------------------ the mesh

def make_mesh(tp: int = 1, dp: int = 1, devices=None) -> Mesh:
    """A ``(dp, tp)`` mesh over the first ``dp * tp`` devices, tp groups within one process.

    Devices are ordered by (process, id), so with tp <= devices per host a TP group never spans
    hosts (TP all-reduces stay on NVLink; only dp crosses hosts, and dp needs no collectives
    beyond a few scalars per step).
    """
    for name, value in (("tp", tp), ("dp", dp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    devices = sorted(jax.devices() if devices is None else devices,
                     key=lambda d: (d.process_index, d.id))
    if tp * dp > len(devices):
        raise ValueError(f"a mesh of dp={dp} x tp={tp} needs {tp * dp} devices, "
                         f"only {len(devices)} are available")
    return Mesh(np.asarray(devices[:tp * dp], dtype=object).reshape(dp, tp), AXES)


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """A mesh plus the draft's placement (hashable: a static jit argument)."""

    mesh: Mesh
    draft_placement: str = "replicated"  # "replicated" | "sharded" | "leader"

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh) or tuple(self.mesh.axis_names) != AXES:
            raise ValueError(f"mesh must be a jax Mesh with axes {AXES} (see make_mesh), "
                             f"got {getattr(self.mesh, 'axis_names', self.mesh)!r}")
        if self.draft_placement not in PLACEMENTS:
            raise ValueError(f"draft_placement must be one of {PLACEMENTS}, "
                             f"got {self.draft_placement!r}")

    @property
    def tp(self) -> int:
        return self.mesh.shape["tp"]

    @property
    def dp(self) -> int:
        return self.mesh.shape["dp"]

    @property
    def leader_device(self):
        """The first device of the first TP group (where a "leader" draft lives)."""
        return self.mesh.devices[0, 0]

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)


def as_plan(mesh_or_plan) -> ShardingPlan:
    """Accepts a Mesh (default placements) or a ShardingPlan."""
    if isinstance(mesh_or_plan, ShardingPlan):
        return mesh_or_plan
    if isinstance(mesh_or_plan, Mesh):
        return ShardingPlan(mesh_or_plan)
    raise TypeError(f"mesh must be a jax.sharding.Mesh or a specjax.sharding.ShardingPlan, "
                    f"got {type(mesh_or_plan).__name__}")


# ------------------------------------------------------------------------------- partition specs

def check_tp(cfg: ModelConfig, tp: int, what: str = "model") -> None:
    """Raises ValueError when ``tp`` cannot split this model's heads or MLP."""
    for field in ("num_heads", "intermediate_size"):
        size = getattr(cfg, field)
        if size % tp:
            divisors = [d for d in range(1, size + 1) if size % d == 0 and d <= 64]
            raise ValueError(
                f"tp={tp} does not divide the {what}'s {field}={size}: attention heads and the MLP "
                f"hidden dimension are split over tp. Use tp in {divisors} (or replicate a small "
                f"draft with draft_placement='replicated')")


def _axis_if(divisible: bool):
    return "tp" if divisible else None


def layer_specs(lp: dict, cfg: ModelConfig, tp: int) -> dict:
    """PartitionSpecs of one decoder layer's params (see the module docstring). wk / wv stay
    replicated when tp does not divide Hkv: repeat_kv_heads first to split them."""
    kv = _axis_if(cfg.num_kv_heads % tp == 0)
    rules = {"attn_norm": P(), "mlp_norm": P(), "q_norm": P(), "k_norm": P(),  # [D], per head
             "wq": P(None, "tp"), "bq": P("tp"), "wk": P(None, kv), "bk": P(kv),
             "wv": P(None, kv), "bv": P(kv), "wo": P("tp", None), "bo": P(),
             "w_gate": P(None, "tp"), "b_gate": P("tp"), "w_up": P(None, "tp"), "b_up": P("tp"),
             "w_down": P("tp", None), "b_down": P()}
    unknown = sorted(set(lp) - set(rules))
    if unknown:
        raise ValueError(f"no sharding rule for layer tensors {unknown}")
    return {name: rules[name] for name in lp}


def model_specs(params: dict, cfg: ModelConfig, tp: int, what: str = "target") -> dict:
    """PartitionSpecs of a Llama-family params pytree, tensor-parallel over ``tp``."""
    check_tp(cfg, tp, what)
    vocab = _axis_if(cfg.vocab_size % tp == 0)
    rules = {"embed": P(vocab, None), "lm_head": P(None, vocab), "norm": P()}
    specs = {name: rules.get(name, P()) for name in params if name != "layers"}
    specs["layers"] = [layer_specs(lp, cfg, tp) for lp in params["layers"]]
    return specs


def head_specs(params: dict, head_cfg, tp: int) -> dict:
    """PartitionSpecs of an MTP / EAGLE head: its block sharded as a target layer."""
    check_tp(head_cfg.layer, tp, "head")
    specs = {name: P() for name in params if name != "layer"}
    # eh_proj [2E, E] stays replicated: split row-parallel, the partitioner resharded the head's
    # input every head run (all-to-alls and permutes of [B, T, E] in the HLO); replicated, the
    # head adds only its block's two all-reduces and the embedding lookup's one.
    specs["layer"] = layer_specs(params["layer"], head_cfg.layer, tp)
    return specs


def replicated_specs(params) -> dict:
    return jax.tree.map(lambda _: P(), params)


def kv_spec(num_kv_heads: int, tp: int, heads_over_tp: bool = True) -> P:
    """Spec of one [Hkv, P, S, D] pool: pages over dp, KV heads over tp when tp divides Hkv."""
    return P(_axis_if(heads_over_tp and num_kv_heads % tp == 0), "dp", None, None)


def kv_heads_for(num_kv_heads: int, tp: int) -> int:
    """KV heads of the sharded model: lcm(Hkv, tp), so that they split evenly over tp."""
    return math.lcm(num_kv_heads, tp)


def repeat_kv_heads(params: dict, cfg: ModelConfig, tp: int):
    """An equivalent model whose KV heads split evenly over ``tp`` (GQA with tp not dividing Hkv).

    Each KV head is repeated r = lcm(Hkv, tp) / Hkv times (the wk / wv / bk / bv columns), as
    vLLM and TensorRT-LLM replicate KV heads over TP ranks: query head j still attends to a copy
    of KV head j // (H / Hkv), outputs are unchanged, and every device computes and caches only
    the KV heads its query heads read (Hkv' / tp of them) instead of all Hkv.
    Returns (params, cfg); unchanged when tp already divides Hkv.
    """
    registry.require(cfg, "tp_sharding")  # the Llama family's dp/tp layouts (this module)
    hkv, d = cfg.num_kv_heads, cfg.head_dim
    new = kv_heads_for(hkv, tp)
    if new == hkv:
        return params, cfg

    def rep(w):  # [..., Hkv*D] -> [..., Hkv'*D], head h -> heads h*r .. h*r + r - 1
        w = jnp.asarray(w)
        lead = w.shape[:-1]
        return jnp.repeat(w.reshape(*lead, hkv, d), new // hkv, axis=-2).reshape(*lead, new * d)

    def layer(lp):
        return dict(lp, **{n: rep(lp[n]) for n in ("wk", "wv", "bk", "bv") if n in lp})

    return (dict(params, layers=[layer(lp) for lp in params["layers"]]),
            dataclasses.replace(cfg, num_kv_heads=new))


def sharded_configs(plan: ShardingPlan, target_cfg, draft_cfg):
    """The (target, draft) configs the sharded program runs: KV heads repeated to lcm(Hkv, tp)
    for the target, an MTP / EAGLE head and a "sharded" draft LLM; a replicated draft as is."""
    def rep(cfg):
        return dataclasses.replace(cfg, num_kv_heads=kv_heads_for(cfg.num_kv_heads, plan.tp))

    target_cfg = rep(target_cfg)
    if _is_head(draft_cfg):
        draft_cfg = dataclasses.replace(draft_cfg, layer=rep(draft_cfg.layer))
    elif draft_cfg is not None and plan.draft_placement == "sharded":
        draft_cfg = rep(draft_cfg)
    return target_cfg, draft_cfg


def _prepare(params, cfg, tp):
    """(params, cfg) with repeated KV heads, for a Model-like config or a head config."""
    if _is_head(cfg):
        lp, layer = repeat_kv_heads({"layers": [params["layer"]]}, cfg.layer, tp)
        return dict(params, layer=lp["layers"][0]), dataclasses.replace(cfg, layer=layer)
    return repeat_kv_heads(params, cfg, tp)


def _is_head(draft_cfg) -> bool:
    return isinstance(draft_cfg, HeadConfig)


def draft_specs(draft_params, draft_cfg, plan: ShardingPlan):
    """Specs of the draft's params under the plan (None without a draft)."""
    if draft_params is None:
        return None
    if _is_head(draft_cfg):  # heads share the target's embedding / lm_head: sharded with it
        return head_specs(draft_params, draft_cfg, plan.tp)
    if plan.draft_placement == "sharded":
        return model_specs(draft_params, draft_cfg, plan.tp, "draft")
    return replicated_specs(draft_params)


def _draft_kv_spec(draft_cfg, plan: ShardingPlan):
    if draft_cfg is None:
        return None
    if _is_head(draft_cfg):
        return kv_spec(draft_cfg.layer.num_kv_heads, plan.tp)
    return kv_spec(draft_cfg.num_kv_heads, plan.tp, plan.draft_placement == "sharded")


def state_specs(state: speculate.DecodeState, plan: ShardingPlan, target_cfg, draft_cfg) -> dict:
    """Field name -> spec for the decoding state (fields without a rule stay unconstrained)."""
    rows, rows2, vec = P("dp"), P("dp", None), P("dp", _U)
    specs = {"target_kv": kv_spec(target_cfg.num_kv_heads, plan.tp),
             "draft_kv": _draft_kv_spec(draft_cfg, plan),
             "page_table": rows2, "out_tokens": rows2, "lengths": rows, "last_token": rows,
             "num_out": rows, "done": rows, "row_keys": rows, "draft_logits": vec,
             "head_hidden": vec, "step": P(), "row_steps": P(), "accepted_per_pos": P()}
    return {f.name: specs[f.name] for f in dataclasses.fields(state)
            if f.name in specs and specs[f.name] is not None and getattr(state, f.name) is not None}


def constrain_state(state, plan: ShardingPlan, target_cfg, draft_cfg):
    """with_sharding_constraint on every state field with a rule (the while-loop carry layout)."""
    updates = {}
    for name, spec in state_specs(state, plan, target_cfg, draft_cfg).items():
        sh = plan.sharding(spec)
        updates[name] = jax.tree.map(lambda a, sh=sh: lax.with_sharding_constraint(a, sh),
                                     getattr(state, name))
    return dataclasses.replace(state, **updates)


# ------------------------------------------------------------------- attention per dp shard

def _per_dp_shard(core, mesh, q, k, v, k_pages, v_pages, page_table, cache_start, valid,
                  new_mask):
    """Runs the attention core on each dp shard's rows and pages, with shard-local page ids."""
    rows, pool = P("dp"), P(None, "dp")
    masks = () if new_mask is None else (new_mask,)

    def local(q, k, v, kp, vp, pt, cs, valid, *mask):
        first = lax.axis_index("dp") * kp.shape[1]  # this shard's first global page id
        pt = jnp.where(pt >= 0, pt - first, pt)  # -1 (unallocated) stays -1
        return core(q, k, v, kp, vp, pt, cs, valid, mask[0] if mask else None)

    in_specs = (rows,) * 3 + (pool, pool) + (rows,) * (3 + len(masks))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(rows, pool, pool),
                         axis_names={"dp"}, check_vma=False)(
        q, k, v, k_pages, v_pages, page_table, cache_start, valid, *masks)


def _pool_specs(plan: ShardingPlan, target_cfg, draft_cfg) -> dict:
    """Layer config -> pool spec; a config used by two differently laid out models maps to
    None (its pools are then left to the partitioner between the pinned loop carries)."""
    specs = {target_cfg: kv_spec(target_cfg.num_kv_heads, plan.tp)}
    if draft_cfg is not None:
        dcfg = draft_cfg.layer if _is_head(draft_cfg) else draft_cfg
        dspec = _draft_kv_spec(draft_cfg, plan)
        specs[dcfg] = dspec if specs.get(dcfg, dspec) == dspec else None
    return specs


@contextlib.contextmanager
def use_plan(plan: ShardingPlan, target_cfg, draft_cfg=None):
    """While tracing: runs every attention core per dp shard and pins its pools' layout."""
    mesh = plan.mesh
    pool_specs = _pool_specs(plan, target_cfg, draft_cfg)

    def wrap(core, cfg):
        spec = pool_specs.get(cfg)

        def run(q, k, v, k_pages, v_pages, page_table, cache_start, valid, new_mask):
            if plan.dp > 1:
                o, k_pages, v_pages = _per_dp_shard(core, mesh, q, k, v, k_pages, v_pages,
                                                    page_table, cache_start, valid, new_mask)
            else:
                o, k_pages, v_pages = core(q, k, v, k_pages, v_pages, page_table, cache_start,
                                           valid, new_mask)
            if spec is not None:
                k_pages = lax.with_sharding_constraint(k_pages, plan.sharding(spec))
                v_pages = lax.with_sharding_constraint(v_pages, plan.sharding(spec))
            return o, k_pages, v_pages
        return run

    token = model._ATTENTION_CORE_WRAPPER.set(wrap)
    try:
        yield
    finally:
        model._ATTENTION_CORE_WRAPPER.reset(token)


# ------------------------------------------------------------------------------- placement

def _put(x, sharding: NamedSharding):
    """Places x (host or device array) with ``sharding``; works when the mesh spans processes
    (every process passes the same global value)."""
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    host = np.asarray(jax.device_get(x))
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def place(tree, specs, plan: ShardingPlan):
    """Puts every leaf of ``tree`` with the matching PartitionSpec of ``specs``."""
    return jax.tree.map(lambda x, s: _put(x, plan.sharding(s)), tree, specs,
                        is_leaf=lambda s: isinstance(s, P))


def shard_model(m: model.Model, mesh_or_plan) -> model.Model:
    """The target with its params placed tensor-parallel (do it once; generate reuses them).

    When tp does not divide its KV heads the result is the equivalent model with KV heads
    repeated to lcm(Hkv, tp) (``repeat_kv_heads``; its config says so)."""
    plan = as_plan(mesh_or_plan)
    params, cfg = repeat_kv_heads(m.params, m.config, plan.tp)
    return dataclasses.replace(m, params=place(params, model_specs(params, cfg, plan.tp), plan),
                               config=cfg)


def shard_draft(draft, mesh_or_plan):
    """A draft Model / Head placed per the plan ("leader": on the leader device only)."""
    plan = as_plan(mesh_or_plan)
    if plan.draft_placement == "leader" and not _is_head(draft.config):
        return dataclasses.replace(draft, params=jax.device_put(
            draft.params, jax.sharding.SingleDeviceSharding(plan.leader_device)))
    params, cfg = draft.params, draft.config
    if _is_head(cfg) or plan.draft_placement == "sharded":
        params, cfg = _prepare(params, cfg, plan.tp)
    return dataclasses.replace(draft, params=place(params, draft_specs(params, cfg, plan), plan),
                               config=cfg)


# ------------------------------------------------------------------------------ the programs

def _run(target_params, draft_params, tokens, prompt_lens, rp, seed, *, plan, target_cfg,
         draft_cfg, lc, num_pages_per_seq, out_len):
    with use_plan(plan, target_cfg, draft_cfg):
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
    out = (s.out_tokens, s.num_out, s.accepted_per_pos, s.row_steps, s.step)
    # Replicated results (one small all-gather after the loop): every process can read them.
    return lax.with_sharding_constraint(out, kw["plan"].sharding(P()))


_state_jit = jax.jit(_run, static_argnames=_STATIC)


def place_inputs(plan: ShardingPlan, target_params, draft_params, tokens, prompt_lens, rp, seed,
                 *, target_cfg, draft_cfg):
    """The dynamic arguments of the sharded program, placed per the plan (no-ops for arrays
    already placed; KV heads repeated as ``sharded_configs`` says). Returns (target_params,
    draft_params, tokens, prompt_lens, rp, seed) for ``lower_generate`` / the jitted program."""
    if draft_params is not None and plan.draft_placement == "leader" and not _is_head(draft_cfg):
        raise ValueError(
            'draft_placement="leader" keeps the draft on one device, outside the SPMD program; the '
            "fused on-device loop runs one program on every device of the mesh and cannot host it. "
            'Use draft_placement="replicated" (same per-step latency: the other devices would wait '
            'for the draft tokens anyway) or "sharded", or drive leader drafts from the host.')
    b = tokens.shape[0]
    if b % plan.dp:
        raise ValueError(f"the batch ({b} rows) must be a multiple of dp={plan.dp}")
    rows, rows2 = plan.sharding(P("dp")), plan.sharding(P("dp", None))
    target_params, target_cfg = _prepare(target_params, target_cfg, plan.tp)
    target_params = place(target_params, model_specs(target_params, target_cfg, plan.tp), plan)
    if draft_params is not None:
        if _is_head(draft_cfg) or plan.draft_placement == "sharded":
            draft_params, draft_cfg = _prepare(draft_params, draft_cfg, plan.tp)
        draft_params = place(draft_params, draft_specs(draft_params, draft_cfg, plan), plan)
    rp = dataclasses.replace(
        rp, **{f.name: _put(getattr(rp, f.name), rows) for f in dataclasses.fields(rp)
               if f.name != "eos_ids"}, eos_ids=_put(rp.eos_ids, plan.sharding(P())))
    return (target_params, draft_params, _put(tokens, rows2), _put(prompt_lens, rows), rp,
            _put(seed, plan.sharding(P())))


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
    # across hosts, and the collectives' first rendezvous (gloo on CPU) times out after 30 s.
    key = (tuple(sorted(static.items(), key=lambda kv: kv[0])), jax.tree.structure(args),
           tuple((a.shape, a.dtype, a.sharding) for a in jax.tree.leaves(args)))
    if key not in _COMPILED:
        _COMPILED[key] = _generate_jit.lower(*args, **static).compile()
    _barrier("specjax_generate")
    return _COMPILED[key](*args)


_COMPILED: dict = {}  # multi-process executables (jit's own cache is not shared with .lower())
_BARRIERS = collections.Counter()


def _barrier(name: str, timeout_s: int = 3600) -> None:
    """Blocks until every process arrives (the coordinator's barrier; no device collective)."""
    from jax._src import distributed  # noqa: PLC0415 - no public barrier without a collective

    client = distributed.global_state.client
    if client is None:
        return
    _BARRIERS[name] += 1  # every process calls in the same order, so ids match
    client.wait_at_barrier(f"{name}_{_BARRIERS[name]}", timeout_in_ms=timeout_s * 1000)


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
    with use_plan(plan, cfg):
        out, _, _ = model.forward(params, cfg, tokens, pos, kv, page_table,
                                  jnp.zeros((b,), jnp.int32), lengths)
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
    out = _logits_jit(params, _put(tokens, plan.sharding(P("dp", None))),
                      _put(lengths, plan.sharding(P("dp"))), cfg=cfg, plan=plan)
    return np.asarray(out)


# ---------------------------------------------------------------------------- HLO inspection

_COMP = re.compile(r"^(ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_CALLED = re.compile(r"(?:condition|body|calls|to_apply|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_WHILE = re.compile(r"\bwhile\(.*?condition=%?([\w.\-]+), body=%?([\w.\-]+)")
_COLLECTIVE = re.compile(r"^\s*(?:ROOT )?%?[\w.\-]+ = (.+?) (all-gather|all-reduce|reduce-scatter|"
                         r"collective-permute|all-to-all|collective-broadcast)(?:-start)?\(")
_ARRAY = re.compile(r"(pred|[subf]\d+|bf16|f8\w*)\[([\d,]*)\]")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of a compiled program."""

    op: str  # "all-gather", "all-reduce", ...
    shape: str  # its result type, e.g. "f32[4,1,64]"
    elements: int  # elements of the largest array in the result
    in_loop: bool  # inside a top-level while loop (the decode loop)


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled (SPMD-partitioned) HLO module, marked in-loop or not.

    "In loop" = reachable from the body or condition of a while loop of the entry computation
    (the decode loop; scans nested in it count as in-loop too).
    """
    comps, entry, cur = {}, None, None
    for line in hlo_text.splitlines():
        m = _COMP.match(line)
        if m and cur is None:
            cur = m.group(2)
            comps[cur] = []
            entry = cur if m.group(1) else entry
        elif line.startswith("}"):
            cur = None
        elif cur is not None:
            comps[cur].append(line)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")

    def reachable(roots):
        seen, stack = set(), list(roots)
        while stack:
            c = stack.pop()
            if c in seen or c not in comps:
                continue
            seen.add(c)
            for line in comps[c]:
                stack += _CALLED.findall(line)
                for group in _BRANCHES.findall(line):
                    stack += [g.strip().lstrip("%") for g in group.split(",")]
        return seen

    loops = reachable([c for line in comps[entry] for pair in _WHILE.findall(line) for c in pair])
    found = []
    for c in sorted(reachable([entry])):
        for line in comps[c]:
            m = _COLLECTIVE.match(line)
            if m:
                sizes = [int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
                         for _, dims in _ARRAY.findall(m.group(1))]
                shape = re.sub(r"\{[^}]*\}", "", m.group(1))  # drop layouts
                found.append(Collective(m.group(2), shape, max(sizes, default=0), c in loops))
    return found


def summarize(colls: list[Collective]) -> dict:
    """{(in_loop, op, shape): count} for documentation and tests."""
    return dict(collections.Counter((c.in_loop, c.op, c.shape) for c in colls))


# ------------------------------------------------------------------------------- multi-process

def initialize_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                           process_id: int | None = None, local_device_ids=None, **kwargs) -> bool:
    """Joins this process to a multi-process JAX runtime (call before any other JAX work).

    Arguments default to the environment: ``JAX_COORDINATOR_ADDRESS`` ("host:port" of process
    0, reachable from every host), ``JAX_NUM_PROCESSES``, ``JAX_PROCESS_ID`` and
    ``JAX_LOCAL_DEVICE_IDS`` (e.g. "0,1,2,3"); when none is set JAX auto-detects SLURM, Open MPI,
    Kubernetes and Cloud TPU. Afterwards ``jax.devices()`` lists every process's devices and
    ``make_mesh`` spans them. Returns False when JAX was already initialised (nothing done).
    """
    if jax.distributed.is_initialized():
        return False
    env = os.environ
    coordinator_address = coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    if num_processes is None and env.get("JAX_NUM_PROCESSES"):
        num_processes = int(env["JAX_NUM_PROCESSES"])
    if process_id is None and env.get("JAX_PROCESS_ID"):
        process_id = int(env["JAX_PROCESS_ID"])
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               local_device_ids=local_device_ids, **kwargs)
    return True
