"""Attention over a paged cache: one entry point, a plain-jnp reference or the Pallas kernels.

Semantics (shared by every implementation): the T new tokens of sequence b have already been
written at cache slots ``cache_start[b] + t``. Query t attends to
  * every slot j < cache_start[b] (the committed prefix) with no mask at all, and
  * new slot cache_start[b] + t' for t' < num_new[b] where ``new_mask[b, t, t']`` holds
    (causal ``t' <= t`` by default; an ancestor mask for draft trees).
Everything else (stale entries beyond the sequence, other sequences' pages) is never read:
its scores are masked and its values zeroed, so even NaN-poisoned pages cannot leak in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax import kv_cache

IMPLS = ("reference", "pallas")


def causal_mask(t: int):
    """[T, T] bool lower-triangular mask among new tokens."""
    return jnp.tril(jnp.ones((t, t), dtype=bool))


def paged_attention_reference(q, k_pages, v_pages, page_table, cache_start, num_new,
                              new_mask=None, *, scale=None):
    """Plain-jnp paged attention with a prefix + new-token mask.

    Args:
      q: [B, T, H, D] queries (RoPE applied).
      k_pages, v_pages: [Hkv, P, S, D] pools holding the prefix and the new tokens.
      page_table: [B, Pmax] int32.
      cache_start: [B] int32 number of prefix tokens (slot of the first new token).
      num_new: [B] int32 number of valid new tokens (<= T).
      new_mask: optional [B, T, T] bool mask among the new tokens; default causal.
      scale: softmax scale, default D ** -0.5.
    Returns:
      [B, T, H, D] in q's dtype.
    """
    b, t, h, d = q.shape
    hkv = k_pages.shape[0]
    g = h // hkv
    scale = d ** -0.5 if scale is None else scale
    if new_mask is None:
        new_mask = jnp.broadcast_to(causal_mask(t), (b, t, t))
    keys = kv_cache.gather_layer(k_pages, page_table)  # [B, Hkv, N, D], N = Pmax*S
    vals = kv_cache.gather_layer(v_pages, page_table)
    n = keys.shape[2]
    j = jnp.arange(n, dtype=jnp.int32)[None, :]  # [1, N]
    start = cache_start[:, None]  # [B, 1]
    rel = j - start  # [B, N] index among the new tokens
    in_new = (rel >= 0) & (rel < num_new[:, None])  # [B, N]
    readable = (j < start) | in_new  # [B, N]
    # new-token part of the mask: new_mask[b, t, rel] where the slot is a new token
    rel_c = jnp.clip(rel, 0, t - 1)
    new_allowed = jnp.take_along_axis(new_mask, jnp.broadcast_to(rel_c[:, None, :], (b, t, n)), axis=2)
    allowed = (j < start)[:, None, :] | (in_new[:, None, :] & new_allowed)  # [B, T, N]
    vals = jnp.where(readable[:, None, :, None], vals, 0)
    qg = q.reshape(b, t, hkv, g, d).astype(jnp.float32)
    s = jnp.einsum("btkgd,bknd->bkgtn", qg, keys.astype(jnp.float32)) * scale
    s = jnp.where(allowed[:, None, None, :, :], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(allowed[:, None, None, :, :], p, 0.0)
    o = jnp.einsum("bkgtn,bknd->btkgd", p, vals.astype(jnp.float32))
    return o.reshape(b, t, h, d).astype(q.dtype)


def paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask=None, *,
                    impl: str = "reference", scale=None):
    """Dispatches to the reference or the Pallas implementation (same semantics)."""
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, page_table, cache_start, num_new,
                                         new_mask, scale=scale)
    if impl == "pallas":
        from pallas_kernels import dispatch  # noqa: PLC0415 - optional heavy import
        return dispatch.paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new,
                                        new_mask, scale=scale)
    raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
