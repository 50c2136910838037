"""DeepSeek-V2/V3-family decoders (MLA + MoE) as pure functions over a params pytree.

Same contract as ``specjax.model.forward`` (tokens, positions, a paged cache, page table,
cache_start, num_new, new_mask) so the fused speculative step, chain and tree verification and
the MTP head run unchanged; ``specjax.registry`` picks the family from the static config type.
``softmax_topk_moe`` is Qwen3-MoE's sparse MLP (Llama attention, ``model.decoder_layer``) over the
same grouped expert computation (``specjax.moe``).

Multi-head latent attention (MLA). Per token the cache holds only the *latent*
``[c_kv (R) | k_rope (Dr)]`` (R = kv_lora_rank, Dr = qk_rope_head_dim), one "KV head" of width
R + Dr, instead of H expanded keys and values of Dn + Dr and Dv. Attention is *absorbed*:
``wkv_b`` [R, H, Dn + Dv] splits into w_uk [R, H, Dn] and w_uv [R, H, Dv], and

    score(t, j) = q_nope_t . (w_uk c_j) + q_rope_t . k_rope_j = [q_nope_t w_uk^T | q_rope_t] . latent_j
    out_t       = w_uv^T sum_j p(t, j) c_j

so the core is ordinary multi-query paged attention (``specjax.attention``; same prefix-unmasked
+ new-token-mask semantics, hence chains and trees) over queries of width R + Dr with the latent
as both key and value; the value's rope columns are dropped after the softmax-weighted sum.

Params layout (weights [in, out])::

    {"embed": [V, E], "norm": [E], "lm_head": [E, V] (absent when tied),
     "layers": [{"attn_norm": [E],
                 "wq": [E, H*Dq]  or  "wq_a": [E, Rq], "q_norm": [Rq], "wq_b": [Rq, H*Dq],
                 "wkv_a": [E, R + Dr], "kv_norm": [R], "wkv_b": [R, H*(Dn + Dv)], "wo": [H*Dv, E],
                 "mlp_norm": [E],
                 dense (layer < first_k_dense_replace): "w_gate", "w_up": [E, F], "w_down": [F, E]
                 MoE: "router": [E, X], ("router_bias": [X], V3), "we_gate", "we_up": [X, E, Fm],
                      "we_down": [X, Fm, E], "ws_gate", "ws_up": [E, Fs], "ws_down": [Fs, E]}, ...]}

Dq = Dn + Dr; X routed experts; Fm moe_intermediate_size; Fs = Fm * n_shared_experts. A layer is
MoE exactly when its dict has a "router" (so the MTP block needs no extra flag).

MoE: ``route`` (DeepSeek's V2 / V3 routing) gives each token's top-k experts and weights;
``specjax.moe.moe_ffn`` runs them as a grouped dispatch (tokens sorted by expert, grouped
matmuls), over an ``ep`` mesh axis with all-to-alls when the config's ``expert_parallel`` says
so (``with_expert_parallel``); shared experts are a plain MLP added here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from specjax import attention as attn_lib
from specjax.config import eos_ids, parse_eos
from specjax import kv_cache
from specjax import moe as moe_lib
from specjax.model import decoder_stack, rms_norm, valid_mask


@dataclasses.dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling as DeepSeek-V2/V3 configure it (HF ``rope_type="yarn"``)."""

    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class DeepseekConfig:
    """A DeepSeek-V2/V3-family decoder (static, hashable).

    Letters: V vocab, E model dim, H heads, R kv_lora_rank, Rq q_lora_rank, Dn/Dr/Dv the
    no-RoPE / RoPE / value head dims, X routed experts, L layers.
    """

    vocab_size: int  # V
    hidden_size: int  # E
    intermediate_size: int  # F (dense layers)
    moe_intermediate_size: int  # Fm (each expert)
    num_layers: int  # L
    num_heads: int  # H
    kv_lora_rank: int  # R
    qk_nope_head_dim: int  # Dn
    qk_rope_head_dim: int  # Dr
    v_head_dim: int  # Dv
    q_lora_rank: int | None = None  # Rq (None: a plain q_proj, as in V2-Lite)
    n_routed_experts: int = 8  # X
    n_shared_experts: int = 1
    num_experts_per_tok: int = 2
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring: str = "sigmoid"  # "sigmoid" (V3, bias-corrected grouped top-k) | "softmax" (V2)
    topk_method: str = "noaux_tc"  # V3 "noaux_tc"; V2 "greedy" | "group_limited_greedy"
    first_k_dense_replace: int = 1
    rope_theta: float = 10000.0
    rope_interleave: bool = True  # DeepSeek's interleaved RoPE pairs (V2 always, V3 default)
    rope_scaling: YarnScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    num_mtp_layers: int = 0
    moe_micro_batches: int = 1  # 2: MoE layers run the tokens as two equal halves
    # Routed experts split over a mesh axis (all-to-all dispatch); None: one device / the SPMD
    # partitioner. Set by ``with_expert_parallel``; not part of the saved config.
    expert_parallel: moe_lib.ExpertParallel | None = None

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                     "num_layers", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim",
                     "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DeepseekConfig.{name} must be a positive int, got {value!r}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        if self.scoring not in ("sigmoid", "softmax"):
            raise ValueError(f"scoring must be 'sigmoid' or 'softmax', got {self.scoring!r}")
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {self.topk_method!r} is not supported")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ValueError(f"n_group {self.n_group} must divide n_routed_experts "
                             f"{self.n_routed_experts} and be >= topk_group {self.topk_group}")
        if self.moe_micro_batches not in (1, 2):
            raise ValueError(f"moe_micro_batches must be 1 or 2, got {self.moe_micro_batches}")
        ep = self.expert_parallel
        if ep is not None:
            if not isinstance(ep, moe_lib.ExpertParallel):
                raise TypeError(f"expert_parallel must be a specjax.moe.ExpertParallel or None, "
                                f"got {type(ep).__name__}")
            if self.n_routed_experts % ep.size:
                raise ValueError(f"expert_parallel: {ep.axis}={ep.size} must divide "
                                 f"n_routed_experts={self.n_routed_experts}")

    # The Llama config's name that shared code reads (sharding's cache-pool specs).
    @property
    def num_kv_heads(self) -> int:
        return 1  # the latent is one shared "head"

    @property
    def latent_dim(self) -> int:
        """Cached floats per token per layer: R + Dr."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_ids(self.eos_token_id)

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense_replace

    def with_layers(self, layers) -> "DeepseekConfig":
        """The config of a model made of layers ``layers`` (indices, in order), as
        ``ModelConfig.with_layers``: the dense layers come first here, so the picks must too."""
        layers = tuple(layers)
        moe = [self.is_moe_layer(i) for i in layers]
        dense = moe.index(True) if True in moe else len(moe)
        if any(not m for m in moe[dense:]):
            raise ValueError(f"layers {layers!r}: a DeepSeek model's dense layers come before its MoE "
                             "layers, so dense picks must precede MoE picks")
        return dataclasses.replace(self, num_layers=len(layers), first_k_dense_replace=dense)

    def mtp_block_config(self) -> "DeepseekConfig":
        """Config of the MTP head's block (index L in the HF layout): one layer, dims of the target."""
        return dataclasses.replace(self, num_layers=1, num_mtp_layers=0,
                                   first_k_dense_replace=0 if self.is_moe_layer(self.num_layers) else 1)

    def to_dict(self) -> dict:
        """The saved fields (a placement, ``expert_parallel``, is not saved)."""
        d = dataclasses.asdict(dataclasses.replace(self, expert_parallel=None))
        del d["expert_parallel"]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DeepseekConfig":
        d = dict(d)
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = YarnScaling(**d["rope_scaling"])
        return cls(**d)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any] | Any, **overrides) -> "DeepseekConfig":
        """From a transformers ``DeepseekV3Config`` / ``DeepseekV2Config`` (object or dict)."""
        d = dict(hf) if isinstance(hf, Mapping) else hf.to_dict()
        v3 = d.get("model_type", "deepseek_v3") == "deepseek_v3"
        if d.get("attention_bias"):
            raise ValueError("attention_bias=True is not supported for DeepSeek models")
        rope = d.get("rope_scaling") or d.get("rope_parameters") or {}
        theta = d.get("rope_theta") or rope.get("rope_theta") or 10000.0
        scaling = None
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind == "yarn":
            factor = rope.get("factor")
            if factor is None:
                factor = d["max_position_embeddings"] / rope["original_max_position_embeddings"]
            scaling = YarnScaling(
                factor=float(factor),
                original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
                mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
                attention_factor=rope.get("attention_factor"), truncate=bool(rope.get("truncate", True)))
        elif kind not in (None, "default"):
            raise ValueError(f"rope type {kind!r} is not supported for DeepSeek (yarn or default)")
        eos = parse_eos(d.get("eos_token_id"))
        heads = d["num_attention_heads"]
        kw = dict(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            moe_intermediate_size=d["moe_intermediate_size"], num_layers=d["num_hidden_layers"],
            num_heads=heads, kv_lora_rank=d["kv_lora_rank"],
            qk_nope_head_dim=d["qk_nope_head_dim"], qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"], q_lora_rank=d.get("q_lora_rank"),
            n_routed_experts=d["n_routed_experts"], n_shared_experts=d.get("n_shared_experts") or 0,
            num_experts_per_tok=d["num_experts_per_tok"], n_group=d.get("n_group") or 1,
            topk_group=d.get("topk_group") or 1,
            routed_scaling_factor=float(d.get("routed_scaling_factor") or 1.0),
            norm_topk_prob=bool(d.get("norm_topk_prob")) if v3 else False,
            scoring="sigmoid" if v3 else "softmax",
            topk_method="noaux_tc" if v3 else (d.get("topk_method") or "greedy"),
            first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
            rope_theta=float(theta), rope_interleave=bool(d.get("rope_interleave", True)) if v3 else True,
            rope_scaling=scaling, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            bos_token_id=d.get("bos_token_id"), eos_token_id=eos,
            num_mtp_layers=int(d.get("num_nextn_predict_layers") or d.get("num_mtp_layers") or 0)
            if v3 else 0)
        kw.update(overrides)
        return cls(**kw)


# ----------------------------------------------------------------------------------- RoPE

def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(cfg: DeepseekConfig) -> tuple[np.ndarray, float]:
    """(inv_freq [Dr/2] float32, cos/sin multiplier), with YaRN when configured (HF's formulas)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = np.float32(base) ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    inv = (np.float32(1.0) / pos_freqs).astype(np.float32)
    ys = cfg.rope_scaling
    if ys is None:
        return inv, 1.0
    if ys.attention_factor is not None:
        att = float(ys.attention_factor)
    elif ys.mscale and ys.mscale_all_dim:
        att = _yarn_mscale(ys.factor, ys.mscale) / _yarn_mscale(ys.factor, ys.mscale_all_dim)
    else:
        att = _yarn_mscale(ys.factor)

    def corr_dim(rot):
        return dim * math.log(ys.original_max_position_embeddings / (rot * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr_dim(ys.beta_fast), corr_dim(ys.beta_slow)
    if ys.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extra = 1 - ramp  # extrapolation weight
    inter = (np.float32(1.0) / (np.float32(ys.factor) * pos_freqs)).astype(np.float32)
    return (inter * (1 - extra) + inv * extra).astype(np.float32), att


def softmax_scale(cfg: DeepseekConfig) -> float:
    """Dq ** -0.5, times YaRN's mscale(factor, mscale_all_dim) ** 2 (as HF and DeepSeek do)."""
    scale = cfg.qk_head_dim ** -0.5
    ys = cfg.rope_scaling
    if ys is not None and ys.mscale_all_dim:
        m = _yarn_mscale(ys.factor, ys.mscale_all_dim)
        scale *= m * m
    return scale


def apply_rope(x, positions, cfg: DeepseekConfig):
    """x: [B, T, H, Dr]; positions [B, T]. Interleaved pairs (x0, x1), (x2, x3)... are rotated and
    returned de-interleaved (evens then odds) — q and k alike, so dot products are unchanged."""
    inv, att = rope_tables(cfg)
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)[None, None, :]  # [B, T, Dr/2]
    cos, sin = jnp.cos(ang)[:, :, None, :] * att, jnp.sin(ang)[:, :, None, :] * att
    xf = x.astype(jnp.float32)
    if cfg.rope_interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ---------------------------------------------------------------------------- attention (MLA)

def mla_attention(lp, cfg: DeepseekConfig, y, positions, pool, page_table, cache_start, valid,
                  new_mask, attn_impl):
    """Absorbed MLA over the paged latent cache (see the module docstring).

    Args:
      y: [B, T, E] normed input; pool: [1, P, S, R + Dr] this layer's latent pages; the rest as
        in ``model.attention_core``.
    Returns:
      (out [B, T, E], pool).
    """
    b, t, _ = y.shape
    h, r, dn, dr, dv = (cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                        cfg.qk_rope_head_dim, cfg.v_head_dim)
    if "wq" in lp:
        q = y @ lp["wq"]
    else:
        q = rms_norm(y @ lp["wq_a"], lp["q_norm"], cfg.rms_norm_eps) @ lp["wq_b"]
    q = q.reshape(b, t, h, dn + dr)
    q_nope, q_rope = q[..., :dn], q[..., dn:]
    ckv = y @ lp["wkv_a"]  # [B, T, R + Dr]
    c = rms_norm(ckv[..., :r], lp["kv_norm"], cfg.rms_norm_eps)  # [B, T, R]
    k_rope = apply_rope(ckv[..., None, r:], positions, cfg)  # [B, T, 1, Dr]
    q_rope = apply_rope(q_rope, positions, cfg)
    wkv_b = lp["wkv_b"].reshape(r, h, dn + dv)
    q_abs = jnp.einsum("bthn,rhn->bthr", q_nope, wkv_b[..., :dn])  # absorb w_uk into the query
    qq = jnp.concatenate([q_abs, q_rope], axis=-1)  # [B, T, H, R + Dr]
    latent = jnp.concatenate([c[:, :, None, :], k_rope], axis=-1)  # [B, T, 1, R + Dr]
    pool, _ = kv_cache.write_layer(pool, pool, latent, latent, page_table, cache_start, valid)
    num_new = jnp.sum(valid, axis=1, dtype=jnp.int32)
    o = attn_lib.paged_attention(qq, pool, pool, page_table, cache_start, num_new, new_mask,
                                 impl=attn_impl, scale=softmax_scale(cfg))  # [B, T, H, R + Dr]
    o = jnp.einsum("bthr,rhv->bthv", o[..., :r], wkv_b[..., dn:])  # absorb w_uv after the sum
    return o.reshape(b, t, h * dv) @ lp["wo"], pool


def mla_attention_expanded(lp, cfg: DeepseekConfig, y, positions):
    """The slow twin: expanded per-head K/V, plain causal attention over T tokens (no cache).
    y: [B, T, E] -> [B, T, E]. Used by the tests to check the absorbed path."""
    b, t, _ = y.shape
    h, r, dn, dr, dv = (cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim,
                        cfg.qk_rope_head_dim, cfg.v_head_dim)
    q = (y @ lp["wq"] if "wq" in lp else
         rms_norm(y @ lp["wq_a"], lp["q_norm"], cfg.rms_norm_eps) @ lp["wq_b"]).reshape(b, t, h, dn + dr)
    ckv = y @ lp["wkv_a"]
    kv = (rms_norm(ckv[..., :r], lp["kv_norm"], cfg.rms_norm_eps) @ lp["wkv_b"]).reshape(b, t, h, dn + dv)
    k_rope = jnp.broadcast_to(apply_rope(ckv[..., None, r:], positions, cfg), (b, t, h, dr))
    qf = jnp.concatenate([q[..., :dn], apply_rope(q[..., dn:], positions, cfg)], axis=-1)
    kf = jnp.concatenate([kv[..., :dn], k_rope], axis=-1)
    s = jnp.einsum("bthd,bshd->bhts", qf, kf) * softmax_scale(cfg)
    s = jnp.where(attn_lib.causal_mask(t)[None, None], s, -jnp.inf)
    o = jnp.einsum("bhts,bshv->bthv", jax.nn.softmax(s, axis=-1), kv[..., dn:])
    return o.reshape(b, t, h * dv) @ lp["wo"]


# ------------------------------------------------------------------------------------ MoE

def route(lp, cfg: DeepseekConfig, x):
    """Top-k routing. x: [N, E] -> (weights [N, k] float32, expert ids [N, k] int32).

    V3: sigmoid scores; the choice adds ``router_bias`` (e_score_correction_bias), keeps the
    topk_group groups with the largest sum of their two best biased scores, takes the top-k
    experts there; weights are the *unbiased* scores, normalised if norm_topk_prob.
    V2: softmax scores; "greedy" top-k, or "group_limited_greedy" (groups ranked by their max).
    Both scale by routed_scaling_factor.
    """
    n = x.shape[0]
    xg, g = cfg.n_routed_experts, cfg.n_group
    logits = x.astype(jnp.float32) @ lp["router"].astype(jnp.float32)  # [N, X]
    if cfg.scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        choice = scores + lp["router_bias"].astype(jnp.float32) if "router_bias" in lp else scores
    else:
        scores = jax.nn.softmax(logits, axis=-1)
        choice = scores
    if cfg.topk_method != "greedy":
        grouped = choice.reshape(n, g, xg // g)
        if cfg.topk_method == "noaux_tc":
            group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [N, G]
        else:
            group_scores = jnp.max(grouped, axis=-1)
        _, gidx = jax.lax.top_k(group_scores, cfg.topk_group)
        keep = jnp.any(jax.nn.one_hot(gidx, g, dtype=bool), axis=1)  # [N, G]
        keep = jnp.repeat(keep, xg // g, axis=1)  # [N, X]
        choice = jnp.where(keep, choice, -jnp.inf if cfg.topk_method == "noaux_tc" else 0.0)
    _, idx = jax.lax.top_k(choice, cfg.num_experts_per_tok)
    w = jnp.take_along_axis(scores, idx, axis=1)
    if cfg.norm_topk_prob and cfg.scoring == "sigmoid":
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return w * cfg.routed_scaling_factor, idx.astype(jnp.int32)


def _mlp(x, w_gate, w_up, w_down):
    return (jax.nn.silu(x @ w_gate) * (x @ w_up)) @ w_down


def _moe_tokens(lp, cfg: DeepseekConfig, x):
    """x: [N, E] -> [N, E]: routed experts (grouped dispatch, ``specjax.moe``) + shared experts."""
    w, idx = route(lp, cfg, x)
    out = moe_lib.moe_ffn(x, idx, w, lp["we_gate"], lp["we_up"], lp["we_down"],
                          expert_parallel=cfg.expert_parallel)
    if "ws_gate" in lp:
        out = out + _mlp(x, lp["ws_gate"], lp["ws_up"], lp["ws_down"])
    return out


def moe(lp, cfg: DeepseekConfig, x):
    """x: [B, T, E] -> [B, T, E]. With ``moe_micro_batches=2`` and an even token count the
    tokens run as two equal halves (rows [0, B/2) and [B/2, B) when B is even: the two-half
    verify of 2·D tokens), so one half's expert exchange can overlap the other's compute."""
    b, t, e = x.shape
    flat = x.reshape(b * t, e)
    if cfg.moe_micro_batches == 2 and (b * t) % 2 == 0:
        half = b * t // 2
        out = jnp.concatenate([_moe_tokens(lp, cfg, flat[:half]),
                               _moe_tokens(lp, cfg, flat[half:])], axis=0)
    else:
        out = _moe_tokens(lp, cfg, flat)
    return out.reshape(b, t, e)


def softmax_topk_moe(lp, cfg, x):
    """Qwen3-MoE's sparse MLP (``model.decoder_layer``'s ``moe``; cfg a ``Qwen3MoeConfig``).
    x: [B, T, E] -> [B, T, E]. Softmax over all X router logits (float32), top-k, weights
    renormalised to sum to 1 when ``norm_topk_prob``; no shared experts; the experts run as
    ``specjax.moe``'s grouped dispatch."""
    b, t, e = x.shape
    flat = x.reshape(b * t, e)
    ids, w = moe_lib.softmax_topk(flat.astype(jnp.float32) @ lp["router"].astype(jnp.float32),
                                  cfg.num_experts_per_tok, cfg.norm_topk_prob)
    out = moe_lib.moe_ffn(flat, ids, w, lp["we_gate"], lp["we_up"], lp["we_down"])
    return out.reshape(b, t, e)


# --------------------------------------------------------------------------------- the model

def decoder_layer(lp, cfg: DeepseekConfig, x, positions, pool, page_table, cache_start, valid,
                  new_mask, attn_impl):
    """One pre-norm MLA + (MoE | dense MLP) block. x: [B, T, E]; pool [1, P, S, R + Dr].
    Returns (x [B, T, E], pool)."""
    with jax.named_scope("mla"):
        y = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
        o, pool = mla_attention(lp, cfg, y, positions, pool, page_table, cache_start, valid,
                                new_mask, attn_impl)
        x = x + o
    with jax.named_scope("moe" if "router" in lp else "mlp"):
        y = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        x = x + (moe(lp, cfg, y) if "router" in lp else
                 _mlp(y, lp["w_gate"], lp["w_up"], lp["w_down"]))
    return x, pool


def init_cache(cfg: DeepseekConfig, num_pages: int, page_size: int, dtype=jnp.float32):
    """Latent page pools: ``k`` holds L x [1, P, S, R + Dr]; ``v`` is empty (the latent is both
    key and value)."""
    if num_pages < 1 or page_size < 1:
        raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
    shape = (1, num_pages, page_size, cfg.latent_dim)
    return kv_cache.KVCache(k=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)), v=())


def cache_bytes_per_token(kv: kv_cache.KVCache) -> int:
    """Bytes the pools hold per cache slot (all layers), measured from the arrays."""
    pools = list(kv.k) + list(kv.v)
    return sum(p.size * p.dtype.itemsize for p in pools) // (kv.num_pages * kv.page_size)


def expanded_bytes_per_token(cfg: DeepseekConfig, dtype=jnp.float32) -> int:
    """What an expanded per-head K/V cache would hold: L * H * (Dn + Dr + Dv) floats per token."""
    return cfg.num_layers * cfg.num_heads * (cfg.qk_head_dim + cfg.v_head_dim) * jnp.dtype(dtype).itemsize


def forward(params, cfg: DeepseekConfig, tokens, positions, kv: kv_cache.KVCache, page_table,
            cache_start, num_new=None, new_mask=None, *, attn_impl: str = "reference",
            return_logits: bool = True, inputs_embeds=None, aux_layers: tuple = ()):
    """Same contract as ``specjax.model.forward`` (see there), over the latent cache.

    Returns:
      (logits [B, T, V] float32 or None, hidden [B, T, E] final pre-norm hidden states, kv), and
      with ``aux_layers`` the hidden states entering those layers [B, T, len(aux_layers) * E].
    """
    valid = valid_mask(positions.shape, num_new)

    def layer(lp, x, pool):
        return decoder_layer(lp, cfg, x, positions, pool, page_table, cache_start, valid,
                             new_mask, attn_impl)

    logits, x, pools, aux = decoder_stack(params, cfg, layer, tokens, kv.k,
                                          return_logits=return_logits,
                                          inputs_embeds=inputs_embeds, aux_layers=aux_layers)
    kv = kv_cache.KVCache(k=tuple(pools), v=kv.v)
    return (logits, x, kv, aux) if aux_layers else (logits, x, kv)


def init_layer(cfg: DeepseekConfig, key, moe_layer: bool, dtype=jnp.float32, scale: float = 0.02):
    """Random params of one block (norms at 1)."""
    e, h, r, dv = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.v_head_dim
    dq, dr = cfg.qk_head_dim, cfg.qk_rope_head_dim
    keys = iter(jax.random.split(key, 16))

    def w(*shape):
        return (scale * jax.random.normal(next(keys), shape)).astype(dtype)

    lp = {"attn_norm": jnp.ones((e,), dtype), "wkv_a": w(e, r + dr), "kv_norm": jnp.ones((r,), dtype),
          "wkv_b": w(r, h * (cfg.qk_nope_head_dim + dv)), "wo": w(h * dv, e),
          "mlp_norm": jnp.ones((e,), dtype)}
    if cfg.q_lora_rank:
        lp.update(wq_a=w(e, cfg.q_lora_rank), q_norm=jnp.ones((cfg.q_lora_rank,), dtype),
                  wq_b=w(cfg.q_lora_rank, h * dq))
    else:
        lp["wq"] = w(e, h * dq)
    if moe_layer:
        xg, fm = cfg.n_routed_experts, cfg.moe_intermediate_size
        lp.update(router=w(e, xg), we_gate=w(xg, e, fm), we_up=w(xg, e, fm), we_down=w(xg, fm, e))
        if cfg.scoring == "sigmoid":
            lp["router_bias"] = w(xg)
        if cfg.n_shared_experts:
            fs = fm * cfg.n_shared_experts
            lp.update(ws_gate=w(e, fs), ws_up=w(e, fs), ws_down=w(fs, e))
    else:
        f = cfg.intermediate_size
        lp.update(w_gate=w(e, f), w_up=w(e, f), w_down=w(f, e))
    return lp


def init_params(cfg: DeepseekConfig, key, dtype=jnp.float32, scale: float = 0.02):
    """Random params for tests."""
    keys = jax.random.split(key, cfg.num_layers + 2)
    e, v = cfg.hidden_size, cfg.vocab_size
    params = {"embed": (scale * jax.random.normal(keys[0], (v, e))).astype(dtype),
              "layers": [init_layer(cfg, keys[i + 2], cfg.is_moe_layer(i), dtype, scale)
                         for i in range(cfg.num_layers)],
              "norm": jnp.ones((e,), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = (scale * jax.random.normal(keys[1], (e, v))).astype(dtype)
    return params


# ------------------------------------------------------------------------------ sharding

MESH_AXES = ("tp", "ep")  # tensor parallel (heads / MLP hidden / vocab), expert parallel


def make_mesh(tp: int = 1, ep: int = 1, devices=None) -> Mesh:
    """A ``(tp, ep)`` mesh over the first tp * ep devices."""
    devices = jax.devices() if devices is None else devices
    if tp * ep > len(devices):
        raise ValueError(f"tp * ep = {tp * ep} exceeds the {len(devices)} available devices")
    return Mesh(np.asarray(devices[:tp * ep]).reshape(tp, ep), MESH_AXES)


def with_expert_parallel(cfg: DeepseekConfig, mesh: Mesh) -> DeepseekConfig:
    """The config whose MoE layers dispatch over ``mesh``'s ep axis with all-to-alls (expert
    weights placed by ``param_specs``; their hidden dim over tp when tp divides it). Without it a
    sharded model still runs, the SPMD partitioner gathering the expert weights."""
    tp = mesh.shape["tp"]
    split_f = tp > 1 and cfg.moe_intermediate_size % tp == 0  # as layer_specs places them
    return dataclasses.replace(cfg, expert_parallel=moe_lib.ExpertParallel(
        mesh, "ep", "tp" if split_f else None))


def layer_specs(lp: dict, cfg: DeepseekConfig, tp: int, ep: int) -> dict:
    """Partition specs of one block: heads over tp (wq/wq_b/wkv_b columns, wo rows), the latent
    projections (wq_a, wkv_a) and the latent pool replicated (one shared "head"), routed experts
    over ep (their hidden dim over tp), dense and shared MLP hidden over tp."""
    def ax(name, n, size):
        return name if size % n == 0 and n > 1 else None

    h, f = ax("tp", tp, cfg.num_heads), None
    specs = {}
    for name, arr in lp.items():
        if name in ("wq", "wq_b", "wkv_b"):
            specs[name] = P(None, h)
        elif name == "wo":
            specs[name] = P(h, None)
        elif name in ("w_gate", "w_up", "ws_gate", "ws_up"):
            specs[name] = P(None, ax("tp", tp, arr.shape[1]))
        elif name in ("w_down", "ws_down"):
            specs[name] = P(ax("tp", tp, arr.shape[0]), None)
        elif name in ("we_gate", "we_up"):
            f = ax("tp", tp, cfg.moe_intermediate_size)
            specs[name] = P(ax("ep", ep, cfg.n_routed_experts), None, f)
        elif name == "we_down":
            specs[name] = P(ax("ep", ep, cfg.n_routed_experts), ax("tp", tp, cfg.moe_intermediate_size), None)
        else:
            specs[name] = P()
    return specs


def param_specs(params: dict, cfg: DeepseekConfig, mesh: Mesh) -> dict:
    """Specs for a whole params pytree (vocab-parallel embed / lm_head over tp)."""
    tp, ep = mesh.shape["tp"], mesh.shape["ep"]
    v = "tp" if cfg.vocab_size % tp == 0 and tp > 1 else None
    specs = {"embed": P(v, None), "norm": P(),
             "layers": [layer_specs(lp, cfg, tp, ep) for lp in params["layers"]]}
    if "lm_head" in params:
        specs["lm_head"] = P(None, v)
    return specs


def head_param_specs(head_params: dict, cfg: DeepseekConfig, mesh: Mesh) -> dict:
    """Specs for an MTP head over a DeepSeek block (norms and eh_proj replicated)."""
    tp, ep = mesh.shape["tp"], mesh.shape["ep"]
    specs = {k: P() for k in head_params if k != "layer"}
    if "lm_head" in head_params:
        specs["lm_head"] = P(None, "tp" if cfg.vocab_size % tp == 0 and tp > 1 else None)
    specs["layer"] = layer_specs(head_params["layer"], cfg, tp, ep)
    return specs


def shard(tree, specs, mesh: Mesh):
    """Places a pytree with the given PartitionSpecs on the mesh."""
    return jax.tree.map(lambda s, x: jax.device_put(x, NamedSharding(mesh, s)), specs, tree,
                        is_leaf=lambda s: isinstance(s, P))
