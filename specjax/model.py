"""A Llama-family decoder as pure functions over a params pytree.

Params layout (weights stored [in, out]; Q/K columns in the HF rotate-half RoPE order)::

    {"embed": [V, E],
     "layers": [{"attn_norm": [E], "wq": [E, H*D], "wk": [E, Hkv*D], "wv": [E, Hkv*D],
                 "wo": [H*D, E], ("bq", "bk", "bv": biases if attention_bias, "bo"),
                 ("q_norm", "k_norm": [D] if qk_norm, Qwen3),
                 "mlp_norm": [E], "w_gate": [E, F], "w_up": [E, F], "w_down": [F, E],
                 ("b_gate", "b_up", "b_down" if mlp_bias)
                 or, in a sparse MoE layer (Qwen3-MoE): "router": [E, X],
                 "we_gate", "we_up": [X, E, Fm], "we_down": [X, Fm, E]}, ...],   # L dicts
     "norm": [E],
     "lm_head": [E, V]}            # absent when embeddings are tied

For inference on CPU, ``specjax.native.inference_params`` swaps the linear weights for
``PackedWeight``s (same values plus a panel-packed copy; q/k/v and gate/up fused into one
weight each, which ``_fused`` splits back) and adds ``"lm_head_packed"``; the functions here
write ``x @ w`` either way, and the weight picks the product.

Layers are a Python list (unrolled under jit): on CPU a ``lax.scan`` over stacked layers was
~45% slower. The same decoder layer serves targets, draft LLMs and the EAGLE/MTP heads, and the
Llama-attention families of ``specjax.registry`` (llama, mistral, qwen2, qwen3, qwen3_moe): a
layer whose dict has a "router" runs the ``moe`` function it is given instead of the dense MLP.
``decoder_stack`` (embedding -> layers with aux taps -> lm_head) and ``valid_mask`` are the
forward skeleton every family shares (``deepseek.forward`` runs its MLA layers through them).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from specjax import attention as attn_lib
from specjax import kv_cache
from specjax.config import ModelConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Model:
    """Params (pytree data) plus their static config."""

    params: dict
    config: ModelConfig = dataclasses.field(metadata=dict(static=True))
    source: str | None = dataclasses.field(default=None, metadata=dict(static=True))  # load path

    @property
    def dtype(self):
        return self.params["embed"].dtype


# ----------------------------------------------------------------------------- building blocks

def rms_norm(x, weight, eps):
    """RMSNorm computed in float32, cast back to x's dtype. x: [..., E], weight: [E] or None
    (None = identity: EAGLE-1's head block has no input norm)."""
    if weight is None:
        return x
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * weight.astype(jnp.float32)).astype(x.dtype)


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """[D/2] inverse frequencies, with llama3 scaling when configured (HF's formulas)."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.int64).astype(np.float32) / d))
    inv = inv.astype(np.float32)
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(medium, smoothed, scaled).astype(np.float32)


def apply_rope(x, positions, inv_freq):
    """Rotate-half RoPE. x: [B, T, H, D]; positions: [B, T] int32; inv_freq: [D/2]."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq[None, None, :]  # [B, T, D/2]
    ang = jnp.concatenate([ang, ang], axis=-1)[:, :, None, :]  # [B, T, 1, D]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def _linear(x, w, b=None):
    y = x @ w
    return y if b is None else y + b


def _fused(x, lp, names, biases):
    """``[x @ lp[name] (+ lp[bias])]`` for weights that read the same input. A layer packed by
    ``specjax.native`` holds them as one weight under "+".join(names) (one pass over the input
    rows instead of several; its static ``parts`` give the split); else one product each."""
    fused = lp.get("+".join(names))
    if fused is None:
        return [_linear(x, lp[n], lp.get(bn)) for n, bn in zip(names, biases)]
    outs = jnp.split(x @ fused, np.cumsum(fused.parts)[:-1].tolist(), axis=-1)
    return [o if lp.get(bn) is None else o + lp[bn] for o, bn in zip(outs, biases)]


def attention_core(q, k, v, k_pages, v_pages, page_table, cache_start, valid, new_mask, *,
                   attn_impl):
    """Writes the new tokens' K/V into the paged pools, then attends over prefix + new tokens.

    Args:
      q: [B, T, H, D]; k, v: [B, T, Hkv, D] (RoPE applied); k_pages, v_pages: [Hkv, P, S, D];
      page_table: [B, Pmax]; cache_start: [B]; valid: [B, T] bool; new_mask: [B, T, T] or None.
    Returns:
      (o [B, T, H, D], k_pages, v_pages).
    """
    k_pages, v_pages = kv_cache.write_layer(k_pages, v_pages, k, v, page_table, cache_start, valid)
    num_new = jnp.sum(valid, axis=1, dtype=jnp.int32)
    o = attn_lib.paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask,
                                 impl=attn_impl)
    return o, k_pages, v_pages


def resolve_attention_core(attn_impl, cfg: ModelConfig, core=attention_core):
    """The attention core to run for ``attn_impl``: a kernel name ("reference" | "pallas"), or a
    hashable implementation object with ``.impl`` (the kernel name) and ``.wrap(core, cfg) ->
    core`` (``specjax.sharding.ShardedAttention``: per dp shard, pools pinned). Explicit and
    static, so the jit cache sees the choice. ``core`` (keyword ``attn_impl``) is the family's
    core: ``attention_core``, or Gemma 3's with its window (extra [B, ...] row arguments after
    ``new_mask`` are passed through, split over dp like the rows)."""
    if isinstance(attn_impl, str):
        return functools.partial(core, attn_impl=attn_impl)
    if not (isinstance(getattr(attn_impl, "impl", None), str)
            and callable(getattr(attn_impl, "wrap", None))):
        raise TypeError(f"attn_impl must be 'reference', 'pallas' or an implementation with .impl "
                        f"and .wrap (specjax.sharding.ShardedAttention), got {attn_impl!r}")
    return attn_impl.wrap(functools.partial(core, attn_impl=attn_impl.impl), cfg)


def decoder_layer(lp, cfg: ModelConfig, x, positions, k_pages, v_pages, page_table, cache_start,
                  valid, new_mask, attn_impl, moe=None, attn_in=None):
    """One pre-norm Llama block; writes this layer's K/V for the new tokens.

    Args:
      lp: the layer's params dict; x: [B, T, E] (the residual stream); positions: [B, T] RoPE
        positions.
      attn_in: optional [B, T, E'] attention input used instead of ``rms_norm(x, attn_norm)``
        (EAGLE-3's midlayer attends over concat(embedding, hidden), E' = 2E; q/k/v are [E', .]).
      k_pages, v_pages: [Hkv, P, S, D]; page_table: [B, Pmax]; cache_start: [B];
      valid: [B, T] bool (padding tokens are not written); new_mask: [B, T, T] bool or None.
      moe: ``moe(lp, cfg, y [B, T, E]) -> [B, T, E]`` for layers with a "router" (sparse MoE).
    Returns:
      (x [B, T, E], k_pages, v_pages).
    """
    b, t, _ = x.shape
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    page_table = kv_cache.group_table(page_table, None)  # a Gemma head's Llama midlayer: global
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    with jax.named_scope("attention"):
        y = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps) if attn_in is None else attn_in
        q, k, v = _fused(y, lp, ("wq", "wk", "wv"), ("bq", "bk", "bv"))
        q, k, v = q.reshape(b, t, h, d), k.reshape(b, t, hkv, d), v.reshape(b, t, hkv, d)
        if "q_norm" in lp:  # Qwen3: RMSNorm over D per head, before RoPE
            q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        core = resolve_attention_core(attn_impl, cfg)
        o, k_pages, v_pages = core(q, k, v, k_pages, v_pages, page_table, cache_start, valid,
                                   new_mask)
        x = x + _linear(o.reshape(b, t, h * d), lp["wo"], lp.get("bo"))
    if "router" in lp:
        if moe is None:
            raise ValueError("a sparse MoE layer needs its family's moe function "
                             "(run it through specjax.registry.forward)")
        with jax.named_scope("moe"):
            return x + moe(lp, cfg, rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)), k_pages, v_pages
    with jax.named_scope("mlp"):
        y = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
        gate, up = _fused(y, lp, ("w_gate", "w_up"), ("b_gate", "b_up"))
        x = x + _linear(jax.nn.silu(gate) * up, lp["w_down"], lp.get("b_down"))
    return x, k_pages, v_pages


def lm_head(params, cfg: ModelConfig, hidden):
    """Final norm + output projection. hidden: [..., E] (pre-norm) -> float32 logits [..., V]."""
    x = rms_norm(hidden, params["norm"], cfg.rms_norm_eps)
    if "lm_head_packed" in params:  # specjax.native.inference_params: the same matrix, packed
        w = params["lm_head_packed"]
    else:
        w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return (x @ w).astype(jnp.float32)


def embed(params, tokens):
    """tokens: [B, T] int32 -> [B, T, E]."""
    return jnp.take(params["embed"], tokens, axis=0)


def forward(params, cfg: ModelConfig, tokens, positions, kv: kv_cache.KVCache, page_table,
            cache_start, num_new=None, new_mask=None, *, attn_impl: str = "reference",
            return_logits: bool = True, inputs_embeds=None, aux_layers: tuple = (), moe=None):
    """Runs the decoder over T new tokens per sequence against a paged cache.

    One function for prefill (cache_start = 0, T = prompt length), decode (T = 1) and
    verification (T = k + 1 chain tokens, or N tree tokens with an ancestor ``new_mask``).

    Args:
      params: the params pytree (layout in the module docstring).
      cfg: static ModelConfig.
      tokens: [B, T] int32 ids (ignored when inputs_embeds is given).
      positions: [B, T] int32 RoPE positions (cache_start + t for chains; depth-based in trees).
      kv: this model's KVCache; the new tokens' K/V are written at slots cache_start + t.
      page_table: [B, Pmax] int32 page ids shared with the paired model.
      cache_start: [B] int32 committed prefix length (slot of the first new token).
      num_new: [B] int32 valid new tokens per row (default T); padding is neither written nor
        attended to.
      new_mask: optional [B, T, T] bool attention mask among the new tokens (default causal).
      attn_impl: "reference" or "pallas", or an implementation object (``resolve_attention_core``).
      return_logits: False skips the lm_head (returns None for logits).
      inputs_embeds: optional [B, T, E] to feed instead of embedding ``tokens`` (draft heads).
      aux_layers: static tuple of layer indices i in [0, L]: also return the hidden states
        *entering* layer i (transformers' ``hidden_states[i]``; 0 = the embeddings, L = the final
        pre-norm output), concatenated in the given order (EAGLE-3 features, same pass).
      moe: the sparse-MoE MLP of MoE layers (see decoder_layer; the registry passes it).
    Returns:
      (logits [B, T, V] float32 or None, hidden [B, T, E] final pre-norm hidden states, kv), and
      with ``aux_layers`` a fourth item aux [B, T, len(aux_layers) * E].
    """
    valid = valid_mask(positions.shape, num_new)

    def layer(lp, x, cache):
        x, k, v = decoder_layer(lp, cfg, x, positions, *cache, page_table, cache_start, valid,
                                new_mask, attn_impl, moe)
        return x, (k, v)

    logits, x, caches, aux = decoder_stack(params, cfg, layer, tokens, list(zip(kv.k, kv.v)),
                                           return_logits=return_logits,
                                           inputs_embeds=inputs_embeds, aux_layers=aux_layers)
    kv = kv_cache.KVCache(k=tuple(k for k, _ in caches), v=tuple(v for _, v in caches))
    return (logits, x, kv, aux) if aux_layers else (logits, x, kv)


# ------------------------------------------------------ the forward skeleton every family shares

def valid_mask(shape, num_new=None):
    """[B, T] bool: new token t of row b is real (t < num_new[b]; every token when num_new is
    None). shape: (B, T); num_new: [B] int32 or None."""
    b, t = shape
    if num_new is None:
        num_new = jnp.full((b,), t, jnp.int32)
    return jnp.arange(t, dtype=jnp.int32)[None, :] < num_new[:, None]


def decoder_stack(params, cfg, layer, tokens, caches, *, return_logits: bool = True,
                  inputs_embeds=None, aux_layers: tuple = ()):
    """Embedding -> decoder layers -> lm_head, for any family (``deepseek.forward`` too).

    Args:
      params: {"embed", "layers", "norm", ("lm_head")} of the family's layout.
      layer: ``layer(lp, x [B, T, E], cache) -> (x, cache)``: one of the family's decoder layers
        over that layer's cache (the family's forward closes it over positions, page table...).
      tokens: [B, T] int32 (ignored when inputs_embeds [B, T, E] is given).
      caches: one cache per layer, in any form ``layer`` takes.
      return_logits, inputs_embeds, aux_layers: as in ``forward``.
    Returns:
      (logits [B, T, V] float32 or None, hidden [B, T, E] final pre-norm, caches (a list), aux
      [B, T, len(aux_layers) * E] or None).
    """
    check_aux_layers(aux_layers, cfg.num_layers)
    x = embed(params, tokens) if inputs_embeds is None else inputs_embeds
    caches, taps = list(caches), {}  # taps: EAGLE-3 features, hidden states entering layers
    for i, lp in enumerate(params["layers"]):
        if i in aux_layers:
            taps[i] = x
        with jax.named_scope(f"layer_{i}"):
            x, caches[i] = layer(lp, x, caches[i])
    taps[len(params["layers"])] = x
    logits = lm_head(params, cfg, x) if return_logits else None
    aux = jnp.concatenate([taps[i] for i in aux_layers], axis=-1) if aux_layers else None
    return logits, x, caches, aux


def check_aux_layers(aux_layers, num_layers: int) -> None:
    """ValueError unless ``aux_layers`` is a tuple of ints in [0, num_layers] (forward's taps)."""
    if not isinstance(aux_layers, tuple) or any(
            isinstance(i, bool) or not isinstance(i, int) or not 0 <= i <= num_layers
            for i in aux_layers):
        raise ValueError(f"aux_layers must be a tuple of ints in [0, {num_layers}], "
                         f"got {aux_layers!r}")


def init_params(cfg: ModelConfig, key, dtype=jnp.float32, scale: float = 0.02):
    """Random params (normal * scale, norms at 1) for tests and fresh heads."""
    e, f, h, hkv, d, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    keys = iter(jax.random.split(key, 10 * cfg.num_layers + 4))
    extra = iter(range(1, 1 << 30))  # keys past the split (layers with attention and MLP biases)

    def w(*shape):
        k = next(keys, None)
        k = jax.random.fold_in(key, next(extra)) if k is None else k
        return (scale * jax.random.normal(k, shape)).astype(dtype)

    layers = []
    for i in range(cfg.num_layers):
        lp = {"attn_norm": jnp.ones((e,), dtype), "wq": w(e, h * d), "wk": w(e, hkv * d),
              "wv": w(e, hkv * d), "wo": w(h * d, e), "mlp_norm": jnp.ones((e,), dtype)}
        if cfg.is_moe_layer(i):
            x, fm = cfg.num_experts, cfg.moe_intermediate_size
            lp.update(router=w(e, x), we_gate=w(x, e, fm), we_up=w(x, e, fm), we_down=w(x, fm, e))
        else:
            lp.update(w_gate=w(e, f), w_up=w(e, f), w_down=w(f, e))
        if cfg.qk_norm:
            lp.update(q_norm=jnp.ones((d,), dtype), k_norm=jnp.ones((d,), dtype))
        if cfg.attention_bias:
            lp.update(bq=w(h * d), bk=w(hkv * d), bv=w(hkv * d), bo=w(e))
        if cfg.mlp_bias and "w_gate" in lp:
            lp.update(b_gate=w(f), b_up=w(f), b_down=w(e))
        layers.append(lp)
    params = {"embed": w(v, e), "layers": layers, "norm": jnp.ones((e,), dtype)}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = w(e, v)
    return params


def check_params(params, cfg: ModelConfig) -> None:
    """Asserts every tensor has the shape the config implies (a loader's last line of defence)."""
    e, f, h, hkv, d, v = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads,
                          cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)
    want = {"attn_norm": (e,), "wq": (e, h * d), "wk": (e, hkv * d), "wv": (e, hkv * d),
            "wo": (h * d, e), "mlp_norm": (e,), "w_gate": (e, f), "w_up": (e, f), "w_down": (f, e),
            "bq": (h * d,), "bk": (hkv * d,), "bv": (hkv * d,), "bo": (e,),
            "b_gate": (f,), "b_up": (f,), "b_down": (e,), "q_norm": (d,), "k_norm": (d,)}
    if any(cfg.is_moe_layer(i) for i in range(cfg.num_layers)):
        x, fm = cfg.num_experts, cfg.moe_intermediate_size
        want.update(router=(e, x), we_gate=(x, e, fm), we_up=(x, e, fm), we_down=(x, fm, e))
    missing = [k for k in ("embed", "layers", "norm") + (() if cfg.tie_word_embeddings else ("lm_head",))
               if k not in params]
    if missing:
        raise ValueError(f"params are missing {missing}")
    if tuple(params["embed"].shape) != (v, e):
        raise ValueError(f"embed has shape {params['embed'].shape}, expected {(v, e)}")
    if len(params["layers"]) != cfg.num_layers:
        raise ValueError(f"{len(params['layers'])} layers in params, config says {cfg.num_layers}")
    for i, lp in enumerate(params["layers"]):
        for name, arr in lp.items():
            if name not in want:
                raise ValueError(f"layer {i}: unexpected tensor {name!r}")
            if tuple(arr.shape) != want[name]:
                raise ValueError(f"layer {i}: {name} has shape {arr.shape}, expected {want[name]}")
    if not cfg.tie_word_embeddings and tuple(params["lm_head"].shape) != (e, v):
        raise ValueError(f"lm_head has shape {params['lm_head'].shape}, expected {(e, v)}")
