"""Attention over a paged cache: one entry point, plain XLA or the Pallas kernels.

Semantics (shared by every implementation): the T new tokens of sequence b have already been
written at cache slots ``cache_start[b] + t``. Query t attends to
  * every slot j < cache_start[b] (the committed prefix) with no mask at all, and
  * new slot cache_start[b] + t' for t' < num_new[b] where ``new_mask[b, t, t']`` holds
    (causal ``t' <= t`` by default; an ancestor mask for draft trees).
With a sliding ``window`` (Gemma 3's local layers), query t also needs
``q_pos[b, t] - j < window`` for key slot j (a slot counts as its position: exact for the prefix
and for chains, where slot = position; tree callers fold the window into ``new_mask`` by node
positions, ``gemma.window_new_mask``); ``q_pos`` defaults to ``cache_start + t``.
Everything else (stale entries beyond the sequence, other sequences' pages, and with a window
the slots below every query's window of the row: the engine's released window pages,
specjax.engine.kv_groups) is never read: its scores are masked and its values zeroed, so even
NaN-poisoned pages cannot leak in.

Implementations (``impl``):
  * "reference": plain jnp/XLA, ``paged_attention_blockwise`` below: an online softmax over
    blocks of pages that skips the blocks past the batch's longest live sequence (``max(
    cache_start + num_new)``) instead of reading the whole page table (a ``lax.scan`` over
    blocks with a ``lax.cond`` per block, so it stays differentiable for head training), with
    the KV heads and the batch kept as the dots' batch dimensions (no transpose of the gathered
    keys). Decoding reads only the live part of a cache sized for the longest request.
  * "pallas": the kernels (``pallas_kernels``).
``paged_attention_reference`` (in ``pallas_kernels.paged_attention``, re-exported here) is the
one-shot twin every implementation is tested against: it reads the whole page table.

Shapes: B batch, T new tokens, H query heads, Hkv KV heads (G = H / Hkv), D head dim, S page size,
P pool pages, Pmax page-table width, C pages per block.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

# The plain-jnp reference lives beside its kernels (each kernel file keeps its twin); specjax
# imports pallas_kernels, never the other way round.
from pallas_kernels import dispatch as _pallas
from pallas_kernels.paged_attention import causal_mask, paged_attention_reference  # noqa: F401
from specjax import native_attention

IMPLS = ("reference", "pallas")
BLOCK_TOKENS = 256  # keys per block of the blockwise path (rounded to whole pages)


def paged_attention_blockwise(q, k_pages, v_pages, page_table, cache_start, num_new,
                              new_mask=None, *, scale=None, block_pages: int | None = None,
                              window: int | None = None, q_pos=None):
    """Paged attention as an online softmax over blocks of C pages, up to the live length.

    Args:
      q: [B, T, H, D] queries (RoPE applied).
      k_pages, v_pages: [Hkv, P, S, D] pools holding the prefix and the new tokens.
      page_table: [B, Pmax] int32; cache_start: [B] int32; num_new: [B] int32 (<= T).
      new_mask: optional [B, T, T] bool mask among the new tokens; default causal.
      block_pages: C, pages per block (default: BLOCK_TOKENS keys).
      window: optional sliding window (static int >= 1): key slot j is visible to query t only
        if ``q_pos[b, t] - j < window``; blocks wholly below every query's window are skipped.
      q_pos: [B, T] int32 query positions for the window (default ``cache_start + t``).
    Returns:
      [B, T, H, D] in q's dtype.
    """
    b, t, h, d = q.shape
    hkv, _, s, _ = k_pages.shape
    g = h // hkv
    pmax = page_table.shape[1]
    scale = d ** -0.5 if scale is None else scale
    c = max(1, min(pmax, block_pages or BLOCK_TOKENS // s))
    num_blocks = -(-pmax // c)
    bk = c * s  # keys per block
    table = jnp.pad(page_table, ((0, 0), (0, num_blocks * c - pmax)))  # pad pages: never readable
    if new_mask is None:
        new_mask = jnp.broadcast_to(causal_mask(t), (b, t, t))
    start = cache_start[:, None]  # [B, 1]
    live = jnp.max(cache_start + num_new)  # [] keys any row may read
    todo = jnp.minimum((live + bk - 1) // bk, num_blocks)
    neg = jnp.finfo(jnp.float32).min
    # rows r = g * T + t of each (KV head, sequence): [Hkv, B, G*T, D], scaled once
    if window is not None:
        _check_window(window)
        if q_pos is None:
            q_pos = cache_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        first = jnp.maximum(jnp.min(q_pos) - window + 1, 0) // bk  # [] first block in a window
        row_qmin = jnp.min(q_pos, axis=1)[:, None]  # [B, 1]
    else:
        first = jnp.int32(0)
    qr = (q.reshape(b, t, hkv, g, d).transpose(2, 0, 3, 1, 4).reshape(hkv, b, g * t, d)
          .astype(jnp.float32) * scale)

    def body(i, carry):
        m, l, acc = carry  # [Hkv, B, R], [Hkv, B, R], [Hkv, B, R, D]
        pages = lax.dynamic_slice_in_dim(table, i * c, c, axis=1)  # [B, C]
        keys = k_pages[:, pages].reshape(hkv, b, bk, d).astype(jnp.float32)
        vals = v_pages[:, pages].reshape(hkv, b, bk, d).astype(jnp.float32)
        j = i * bk + jnp.arange(bk, dtype=jnp.int32)[None, :]  # [1, bk]
        rel = j - start  # [B, bk] index among the new tokens
        in_new = (rel >= 0) & (rel < num_new[:, None])
        readable = (j < start) | in_new
        if window is not None:  # below every query's window: released pages, never read
            readable = readable & ((row_qmin - j) < window)  # (zeroed: no 0 * garbage)
        rel_c = jnp.clip(rel, 0, t - 1)
        new_ok = jnp.take_along_axis(new_mask, jnp.broadcast_to(rel_c[:, None, :], (b, t, bk)),
                                     axis=2)
        allowed = (j < start)[:, None, :] | (in_new[:, None, :] & new_ok)  # [B, T, bk]
        if window is not None:
            allowed = allowed & ((q_pos[:, :, None] - j[:, None, :]) < window)
        allowed = jnp.broadcast_to(allowed[:, None], (b, g, t, bk)).reshape(1, b, g * t, bk)
        vals = jnp.where(readable[None, :, :, None], vals, 0.0)
        sc = jnp.where(allowed, jnp.einsum("kbrd,kbnd->kbrn", qr, keys), neg)
        m_new = jnp.maximum(m, jnp.max(sc, axis=-1))
        p = jnp.where(allowed, jnp.exp(sc - m_new[..., None]), 0.0)
        alpha = jnp.exp(m - m_new)
        l = alpha * l + jnp.sum(p, axis=-1)
        acc = alpha[..., None] * acc + jnp.einsum("kbrn,kbnd->kbrd", p, vals)
        return m_new, l, acc

    init = (jnp.full((hkv, b, g * t), neg, jnp.float32), jnp.zeros((hkv, b, g * t), jnp.float32),
            jnp.zeros((hkv, b, g * t, d), jnp.float32))

    def step(carry, i):  # blocks past the live length are skipped (a cond, so grads still flow)
        return lax.cond((i < todo) & (i >= first), body, lambda _, x: x, i, carry), None

    (_, l, acc), _ = lax.scan(step, init, jnp.arange(num_blocks, dtype=jnp.int32))
    o = acc / jnp.where(l > 0, l, 1.0)[..., None]  # rows that may read nothing: 0
    return o.reshape(hkv, b, g, t, d).transpose(1, 3, 0, 2, 4).reshape(b, t, h, d).astype(q.dtype)


def _check_window(window) -> None:
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be None or an int >= 1, got {window!r}")


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _native(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask, q_pos, scale, window):
    """The native CPU call, with the blockwise jnp path's gradient."""
    return native_attention.paged_attention_call(q, k_pages, v_pages, page_table, cache_start,
                                                 num_new, new_mask, q_pos, scale, window)


def _native_fwd(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask, q_pos, scale,
                window):
    out = _native(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask, q_pos, scale,
                  window)
    return out, (q, k_pages, v_pages, page_table, cache_start, num_new, new_mask, q_pos)


def _native_bwd(scale, window, res, g):
    q, k_pages, v_pages, page_table, cache_start, num_new, new_mask, q_pos = res
    _, vjp = jax.vjp(lambda a, b, c: paged_attention_blockwise(
        a, b, c, page_table, cache_start, num_new, new_mask, scale=scale,
        window=window or None, q_pos=q_pos), q, k_pages, v_pages)
    return (*vjp(g), None, None, None, None, None)


_native.defvjp(_native_fwd, _native_bwd)


def paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask=None, *,
                    impl: str = "reference", scale=None, window: int | None = None, q_pos=None):
    """Dispatches to the plain-XLA or the Pallas implementation (same semantics; ``window`` /
    ``q_pos``: the sliding window, see the module docstring). "reference" runs the native CPU
    call (``specjax.native_attention``) for few float32 query rows when it is built, the
    blockwise jnp path otherwise."""
    if impl == "reference":
        if window is not None:
            _check_window(window)
        if native_attention.applies(q, k_pages, scale, v_pages):
            b, t, _, d = q.shape
            if new_mask is None:
                new_mask = jnp.broadcast_to(causal_mask(t), (b, t, t))
            if q_pos is None:
                q_pos = cache_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            return _native(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask, q_pos,
                           d ** -0.5 if scale is None else float(scale),
                           0 if window is None else int(window))
        return paged_attention_blockwise(q, k_pages, v_pages, page_table, cache_start, num_new,
                                         new_mask, scale=scale, window=window, q_pos=q_pos)
    if window is not None:
        _check_window(window)
        if impl == "pallas":
            raise ValueError("attention impl 'pallas' has no sliding-window kernel yet "
                             "(window is only supported by impl='reference')")
    if impl == "pallas":
        return _pallas.paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new,
                                        new_mask, scale=scale)
    raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
