"""Meshes, partition specs and placement for the sharded decode loop (no programs here).

A ``Mesh`` has two axes: ``dp`` splits the batch, ``tp`` splits each model's tensors (Megatron
style). ``ShardingPlan`` = a mesh + the draft's placement (a static jit argument).

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
    norms, output biases        -            (Gemma 3's post-attention / post-MLP norms and
                                            per-head q/k norms [D] too)
    KV pools   [Hkv, P, S, D]  (tp, dp, -, -)   pages split over dp, KV heads over tp
    batch state [B, ...]       (dp, ...)    page_table, lengths, tokens, keys, out buffer
    MTP / EAGLE head           sharded with the target: its block as a target layer, the
                               shared embedding / lm_head vocab-parallel, eh_proj replicated
    draft LLM                  "replicated" (default: every device runs the small draft, no
                               collectives), "sharded" (like the target), or "leader" (one
                               device; for host-driven steps, not the fused loop: see specjax.sharding)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax import model, registry, speculate
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

def check_family(cfg, what: str = "model") -> None:
    """Raises ValueError for a model this (dp, tp) layout cannot shard: the families whose
    registry record supports "tp_sharding" (llama, gemma3; qwen3_moe's experts and DeepSeek
    have no rules here)."""
    fam = registry.family_of(cfg) if type(cfg) in registry.FAMILIES_CLASSES else None
    if fam is None or "tp_sharding" in dict(fam.unsupported):
        raise ValueError(
            f"specjax.sharding's (dp, tp) mesh shards Llama-family models (llama, mistral, qwen2, "
            f"...) and Gemma 3; the {what} has a {type(cfg).__name__}. DeepSeek models shard on "
            f"deepseek.make_mesh(tp=..., ep=...) with deepseek.param_specs / deepseek.shard (and "
            f"deepseek.with_expert_parallel for all-to-all expert dispatch), then run sj.generate "
            f"without mesh=")


def check_tp(cfg: ModelConfig, tp: int, what: str = "model") -> None:
    """Raises ValueError when ``tp`` cannot split this model's heads or MLP (or the family is
    not shardable here)."""
    check_family(cfg, what)
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
    rules = {"attn_norm": P(), "mlp_norm": P(), "q_norm": P(), "k_norm": P(),  # [D] per head
             "post_attn_norm": P(), "post_mlp_norm": P(),  # Gemma 3's norms after attn / MLP
             "wq": P(None, "tp"), "bq": P("tp"), "wk": P(None, kv), "bk": P(kv),
             "wv": P(None, kv), "bv": P(kv), "wo": P("tp", None), "bo": P(),
             "w_gate": P(None, "tp"), "b_gate": P("tp"), "w_up": P(None, "tp"), "b_up": P("tp"),
             "w_down": P("tp", None), "b_down": P()}
    unknown = sorted(set(lp) - set(rules))
    if unknown:
        raise ValueError(f"no sharding rule for layer tensors {unknown}")
    return {name: rules[name] for name in lp}


def model_specs(params: dict, cfg: ModelConfig, tp: int, what: str = "target") -> dict:
    """PartitionSpecs of a Llama-family or Gemma 3 params pytree, tensor-parallel over ``tp``."""
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
    check_family(cfg)
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
    if is_head(draft_cfg):
        draft_cfg = dataclasses.replace(draft_cfg, layer=rep(draft_cfg.layer))
    elif draft_cfg is not None and plan.draft_placement == "sharded":
        draft_cfg = rep(draft_cfg)
    return target_cfg, draft_cfg


def prepare(params, cfg, tp):
    """(params, cfg) with repeated KV heads, for a Model-like config or a head config."""
    if is_head(cfg):
        lp, layer = repeat_kv_heads({"layers": [params["layer"]]}, cfg.layer, tp)
        return dict(params, layer=lp["layers"][0]), dataclasses.replace(cfg, layer=layer)
    return repeat_kv_heads(params, cfg, tp)


def is_head(draft_cfg) -> bool:
    """A head config (MTP / EAGLE: its block is ``.layer``), not a Model config."""
    return isinstance(draft_cfg, HeadConfig)


def draft_specs(draft_params, draft_cfg, plan: ShardingPlan):
    """Specs of the draft's params under the plan (None without a draft)."""
    if draft_params is None:
        return None
    if is_head(draft_cfg):  # heads share the target's embedding / lm_head: sharded with it
        return head_specs(draft_params, draft_cfg, plan.tp)
    if plan.draft_placement == "sharded":
        return model_specs(draft_params, draft_cfg, plan.tp, "draft")
    return replicated_specs(draft_params)


def draft_kv_spec(draft_cfg, plan: ShardingPlan):
    if draft_cfg is None:
        return None
    if is_head(draft_cfg):
        return kv_spec(draft_cfg.layer.num_kv_heads, plan.tp)
    return kv_spec(draft_cfg.num_kv_heads, plan.tp, plan.draft_placement == "sharded")


def state_specs(state: speculate.DecodeState, plan: ShardingPlan, target_cfg, draft_cfg) -> dict:
    """Field name -> spec for the decoding state (fields without a rule stay unconstrained; the
    drafter's ``carry`` leaves are all [B, X]: rows over dp)."""
    rows, rows2, vec = P("dp"), P("dp", None), P("dp", _U)
    specs = {"target_kv": kv_spec(target_cfg.num_kv_heads, plan.tp),
             "draft_kv": draft_kv_spec(draft_cfg, plan),
             "page_table": rows2, "out_tokens": rows2, "lengths": rows, "last_token": rows,
             "num_out": rows, "done": rows, "row_keys": rows,
             "carry": vec, "step": P(), "row_steps": P(), "accepted_per_pos": P()}
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


# ------------------------------------------------------------------------------- placement

def put(x, sharding: NamedSharding):
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
    return jax.tree.map(lambda x, s: put(x, plan.sharding(s)), tree, specs,
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
    if plan.draft_placement == "leader" and not is_head(draft.config):
        return dataclasses.replace(draft, params=jax.device_put(
            draft.params, jax.sharding.SingleDeviceSharding(plan.leader_device)))
    params, cfg = draft.params, draft.config
    if is_head(cfg) or plan.draft_placement == "sharded":
        params, cfg = prepare(params, cfg, plan.tp)
    return dataclasses.replace(draft, params=place(params, draft_specs(params, cfg, plan), plan),
                               config=cfg)
