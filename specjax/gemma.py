"""Gemma 3 text decoders (transformers ``gemma3_text`` / ``Gemma3ForCausalLM``) as pure functions.

What differs from the Llama block (``specjax.model``), all as in transformers' ``modeling_gemma3``:

* embeddings scaled by sqrt(E) (in the embedding's dtype);
* RMSNorm multiplies by ``(1 + w)``: we store the multiplier ``1 + w`` itself (llama.cpp's
  convention), so Llama's ``model.rms_norm`` and ``model.lm_head`` compute Gemma's norms
  exactly (float32 inside) and every caller of ``model.lm_head`` (the decode loops) is right;
* four norms per layer: before and after attention, before and after the MLP;
* per-head q/k RMSNorm (also ``(1 + w)``) before RoPE;
* GeGLU MLP with the tanh GELU (``gelu_pytorch_tanh``);
* attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``D ** -0.5``;
* ``layer_types``: "sliding_attention" layers attend to the last ``sliding_window`` positions
  only (key position p is visible to query position q iff ``q - p < sliding_window``, HF's
  ``sliding_window_overlay``) with RoPE base ``rope_local_base_freq``; "full_attention" layers
  see the whole prefix with base ``rope_theta`` (and optional linear RoPE scaling);
* tied embeddings (the lm_head is ``embed.T``).

Params layout (weights [in, out], HF rotate-half Q/K order)::

    {"embed": [V, E],
     "layers": [{"attn_norm": [E], "wq": [E, H*D], "wk": [E, Hkv*D], "wv": [E, Hkv*D],
                 "q_norm": [D], "k_norm": [D], "wo": [H*D, E], "post_attn_norm": [E],
                 "mlp_norm": [E], "w_gate": [E, F], "w_up": [E, F], "w_down": [F, E],
                 "post_mlp_norm": [E]}, ...],   # L dicts
     "norm": [E]}                  # every norm weight holds 1 + w (w: transformers' weight)

The forward shares ``model.decoder_stack`` / ``model.apply_rope`` / ``model.valid_mask`` and the
paged cache layout (``kv_cache``) with the Llama family; the window is applied by
``specjax.attention.paged_attention(window=..., q_pos=...)``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from specjax import attention as attn_lib
from specjax import kv_cache
from specjax import model as llama
from specjax.config import ModelConfig, parse_eos

SLIDING, FULL = "sliding_attention", "full_attention"
# config.json keys whose non-default values we do not implement -> ValueError naming the key
_UNSUPPORTED_SET = ("attn_logit_softcapping", "final_logit_softcapping", "vision_config")


@dataclasses.dataclass(frozen=True)
class Gemma3Config(ModelConfig):
    """A Gemma 3 text decoder (letters as in ModelConfig). ``rope_theta`` is the full-attention
    layers' RoPE base; ``rope_linear_factor`` their linear RoPE scaling (1 = none)."""

    query_pre_attn_scalar: float = 256.0
    sliding_window: int = 512
    layer_types: tuple[str, ...] = ()  # one of SLIDING / FULL per layer
    rope_local_base_freq: float = 10000.0
    rope_linear_factor: float = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers \
                or any(t not in (SLIDING, FULL) for t in self.layer_types):
            raise ValueError(f"Gemma3Config.layer_types must be a tuple of {self.num_layers} "
                             f"{SLIDING!r} / {FULL!r} entries, got {self.layer_types!r}")
        if not isinstance(self.sliding_window, int) or self.sliding_window < 1:
            raise ValueError(f"Gemma3Config.sliding_window must be a positive int, got "
                             f"{self.sliding_window!r}")
        if not self.query_pre_attn_scalar > 0:
            raise ValueError(f"Gemma3Config.query_pre_attn_scalar must be > 0, got "
                             f"{self.query_pre_attn_scalar!r}")

    def with_layers(self, layers) -> "Gemma3Config":
        """The config of the picked layers: their layer types (windows, RoPE bases) kept."""
        return dataclasses.replace(self, num_layers=len(layers),
                                   layer_types=tuple(self.layer_types[i] for i in layers))

    def window(self, i: int) -> int | None:
        """Layer i's attention window (None: full attention)."""
        return self.sliding_window if self.layer_types[i] == SLIDING else None

    @property
    def attn_scale(self) -> float:
        return float(self.query_pre_attn_scalar) ** -0.5

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any] | Any) -> "Gemma3Config":
        """From a transformers Gemma3TextConfig (object or config.json dict; transformers 4
        ``rope_theta`` / ``rope_local_base_freq`` / ``rope_scaling`` or 5 ``rope_parameters``)."""
        d = dict(hf) if isinstance(hf, Mapping) else hf.to_dict()
        for key in _UNSUPPORTED_SET:
            if d.get(key) is not None:
                raise ValueError(f"Gemma 3 config key {key!r}={d[key]!r} is not supported "
                                 "(text-only decoders without logit soft-capping)")
        if d.get("use_bidirectional_attention"):
            raise ValueError("Gemma 3 config key 'use_bidirectional_attention' is not supported")
        if d.get("attention_bias"):
            raise ValueError("Gemma 3 config key 'attention_bias' is not supported")
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"Gemma 3 config key 'hidden_activation'={act!r} is not supported "
                             "(gelu_pytorch_tanh)")
        n = int(d["num_hidden_layers"])
        types = d.get("layer_types")
        if not types:
            pattern = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
            types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        rp = d.get("rope_parameters") or {}
        full = rp.get(FULL) or {"rope_type": "default", "rope_theta": d.get("rope_theta"),
                                **(d.get("rope_scaling") or {})}
        local = rp.get(SLIDING) or {"rope_type": "default",
                                    "rope_theta": d.get("rope_local_base_freq")}
        factor = 1.0
        for name, r in (("full_attention", full), ("sliding_attention", local)):
            kind = r.get("rope_type", r.get("type", "default"))
            if kind == "linear" and name == "full_attention":
                factor = float(r["factor"])
            elif kind not in (None, "default"):
                raise ValueError(f"Gemma 3 config key 'rope_scaling' ({name}): rope type "
                                 f"{kind!r} is not supported (default, or linear on full layers)")
        heads = int(d["num_attention_heads"])
        return cls(
            vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]), num_layers=n, num_heads=heads,
            num_kv_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            rope_theta=float(full.get("rope_theta") or 1e6),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
            max_position_embeddings=int(d.get("max_position_embeddings", 131072)),
            bos_token_id=d.get("bos_token_id"), eos_token_id=parse_eos(d.get("eos_token_id")),
            qk_norm=True, query_pre_attn_scalar=float(d.get("query_pre_attn_scalar", 256)),
            sliding_window=int(d.get("sliding_window") or 4096), layer_types=tuple(types),
            rope_local_base_freq=float(local.get("rope_theta") or 10000.0),
            rope_linear_factor=factor)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Gemma3Config":
        d = dict(d)
        d["eos_token_id"] = parse_eos(d.get("eos_token_id"))
        d["layer_types"] = tuple(d.get("layer_types") or ())
        return cls(**d)


# ----------------------------------------------------------------------------- building blocks

rms_norm = llama.rms_norm  # norm weights are stored as Gemma's multiplier 1 + w


def inv_freq(cfg: Gemma3Config, i: int) -> np.ndarray:
    """[D/2] RoPE inverse frequencies of layer i (local or global base; linear scaling)."""
    d = cfg.head_dim
    base = cfg.rope_local_base_freq if cfg.layer_types[i] == SLIDING else cfg.rope_theta
    inv = (1.0 / (base ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d)))
    if cfg.layer_types[i] == FULL:
        inv = inv / cfg.rope_linear_factor
    return inv.astype(np.float32)


def window_new_mask(new_mask, positions, window):
    """The tree mask with the window folded in: new token t sees new token t' only if
    positions[t] - positions[t'] < window. new_mask [B, T, T] or None (left as is: a causal
    chain's slots are its positions, which the attention's slot window already covers)."""
    if new_mask is None or window is None:
        return new_mask
    return new_mask & ((positions[:, :, None] - positions[:, None, :]) < window)


def attention_core(q, k, v, k_pages, v_pages, page_table, cache_start, valid, new_mask, q_pos,
                   *, attn_impl, scale, window):
    """``model.attention_core`` with Gemma's scale and layer window: writes the new K/V, then
    attends (q_pos [B, T]: the queries' positions, for the window). Returns (o, k_pages,
    v_pages)."""
    k_pages, v_pages = kv_cache.write_layer(k_pages, v_pages, k, v, page_table, cache_start, valid)
    num_new = jnp.sum(valid, axis=1, dtype=jnp.int32)
    o = attn_lib.paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask,
                                 impl=attn_impl, scale=scale, window=window, q_pos=q_pos)
    return o, k_pages, v_pages


def decoder_layer(lp, cfg: Gemma3Config, i: int, x, positions, k_pages, v_pages, page_table,
                  cache_start, valid, new_mask, attn_impl):
    """One Gemma 3 block (layer index i picks window and RoPE base); writes its K/V.

    x: [B, T, E]; positions: [B, T]; pools [Hkv, P, S, D]; valid: [B, T]; new_mask [B, T, T] or
    None. Returns (x [B, T, E], k_pages, v_pages)."""
    b, t, _ = x.shape
    h, hkv, d, eps = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
    window = cfg.window(i)
    page_table = kv_cache.group_table(page_table, window)  # [B, Pmax] (a grouped table: its row)
    freqs = jnp.asarray(inv_freq(cfg, i))
    with jax.named_scope("attention"):
        y = rms_norm(x, lp["attn_norm"], eps)
        q, k, v = llama._fused(y, lp, ("wq", "wk", "wv"), (None,) * 3)  # one product if packed
        q, k, v = q.reshape(b, t, h, d), k.reshape(b, t, hkv, d), v.reshape(b, t, hkv, d)
        q = llama.apply_rope(rms_norm(q, lp["q_norm"], eps), positions, freqs)
        k = llama.apply_rope(rms_norm(k, lp["k_norm"], eps), positions, freqs)
        core = llama.resolve_attention_core(  # a kernel name, or sharding.ShardedAttention
            attn_impl, cfg, functools.partial(attention_core, scale=cfg.attn_scale, window=window))
        o, k_pages, v_pages = core(q, k, v, k_pages, v_pages, page_table, cache_start, valid,
                                   window_new_mask(new_mask, positions, window), positions)
        o = o.reshape(b, t, h * d) @ lp["wo"]
        x = x + rms_norm(o, lp["post_attn_norm"], eps)
    with jax.named_scope("mlp"):
        y = rms_norm(x, lp["mlp_norm"], eps)
        gate, up = llama._fused(y, lp, ("w_gate", "w_up"), (None, None))
        y = (jax.nn.gelu(gate, approximate=True) * up) @ lp["w_down"]
        x = x + rms_norm(y, lp["post_mlp_norm"], eps)
    return x, k_pages, v_pages


def embed(params, cfg: Gemma3Config, tokens):
    """tokens [B, T] -> [B, T, E] scaled by sqrt(E) (the scale rounded to the embed dtype)."""
    e = params["embed"]
    return jnp.take(e, tokens, axis=0) * jnp.asarray(math.sqrt(cfg.hidden_size), e.dtype)


lm_head = llama.lm_head  # final norm (stored 1 + w) + tied output projection


def forward(params, cfg: Gemma3Config, tokens, positions, kv: kv_cache.KVCache, page_table,
            cache_start, num_new=None, new_mask=None, *, attn_impl: str = "reference",
            return_logits: bool = True, inputs_embeds=None, aux_layers: tuple = ()):
    """Same contract as ``specjax.model.forward`` (prefill, decode, chain and tree verify)."""
    valid = llama.valid_mask(positions.shape, num_new)
    if inputs_embeds is None:
        inputs_embeds = embed(params, cfg, tokens)

    def layer(lp, x, cache):  # cache: (layer index, k pool, v pool)
        i, k, v = cache
        x, k, v = decoder_layer(lp, cfg, i, x, positions, k, v, page_table, cache_start, valid,
                                new_mask, attn_impl)
        return x, (i, k, v)

    caches = [(i, k, v) for i, (k, v) in enumerate(zip(kv.k, kv.v))]
    logits, x, caches, aux = llama.decoder_stack(params, cfg, layer, tokens, caches,
                                                 return_logits=return_logits,
                                                 inputs_embeds=inputs_embeds,
                                                 aux_layers=aux_layers)
    kv = kv_cache.KVCache(k=tuple(k for _, k, _ in caches), v=tuple(v for _, _, v in caches))
    return (logits, x, kv, aux) if aux_layers else (logits, x, kv)


def block(lp, cfg, x, positions, kv, page_table, cache_start, valid, new_mask, attn_impl):
    """One Gemma 3 layer over a one-layer cache (draft heads' blocks): layer 0's type (a head
    for a Gemma target takes the target's last layer type, ``HeadConfig.for_target``)."""
    h, k0, v0 = decoder_layer(lp, cfg, 0, x, positions, kv.k[0], kv.v[0], page_table,
                              cache_start, valid, new_mask, attn_impl)
    return h, kv_cache.KVCache(k=(k0,), v=(v0,))


_LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "q_norm", "k_norm", "wo", "post_attn_norm",
               "mlp_norm", "w_gate", "w_up", "w_down", "post_mlp_norm")


def init_params(cfg: Gemma3Config, key, dtype=jnp.float32, scale: float = 0.02):
    """Random params (normal * scale; norm multipliers 1 + w at 1, i.e. w = 0) for tests."""
    e, f, h, hkv, d = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                       cfg.head_dim)
    shapes = {"attn_norm": (e,), "wq": (e, h * d), "wk": (e, hkv * d), "wv": (e, hkv * d),
              "q_norm": (d,), "k_norm": (d,), "wo": (h * d, e), "post_attn_norm": (e,),
              "mlp_norm": (e,), "w_gate": (e, f), "w_up": (e, f), "w_down": (f, e),
              "post_mlp_norm": (e,)}
    keys = iter(jax.random.split(key, len(_LAYER_KEYS) * cfg.num_layers + 1))

    def w(name):
        if len(shapes[name]) == 1:
            return jnp.ones(shapes[name], dtype)
        return (scale * jax.random.normal(next(keys), shapes[name])).astype(dtype)

    layers = [{name: w(name) for name in _LAYER_KEYS} for _ in range(cfg.num_layers)]
    params = {"embed": (scale * jax.random.normal(next(keys), (cfg.vocab_size, e))).astype(dtype),
              "layers": layers, "norm": jnp.ones((e,), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = (scale * jax.random.normal(jax.random.fold_in(key, 1),
                                                       (e, cfg.vocab_size))).astype(dtype)
    return params
