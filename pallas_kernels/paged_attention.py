"""Multi-query paged attention (chain / tree verification) as a Pallas kernel.

Semantics are exactly those of ``specjax.attention.paged_attention_reference`` (the plain-jnp twin,
re-exported here as ``paged_attention_reference``): the T new tokens of sequence b sit at cache
slots ``cache_start[b] + t``; query t attends to every prefix slot ``j < cache_start[b]`` and to
new slot ``cache_start[b] + t'`` (``t' < num_new[b]``) where ``new_mask[b, t, t']`` holds.

Kernel layout (backend-neutral ``pl.pallas_call`` + ``BlockSpec``; runs with ``interpret=True`` on
CPU and lowers through Triton on GPU):

* grid ``(B, Hkv, row_blocks)``; one program owns one KV head of one sequence and a block of
  rows, where the G = H / Hkv query heads sharing that KV head and the T queries are folded into
  G*T rows (row ``g*T + t``), so GQA with small T wastes no work;
* the page table and the two lengths are ordinary blocked inputs (Triton has no scalar
  prefetch); each loop step gathers ``pages_per_block`` pages of the KV head's pool with a
  vector index, and the loop stops at the sequence's own length ``cache_start + num_new``;
* the [T, T] new-token mask travels as per-row int32 bitmasks (bit t' of word t' // 32), so the
  mask test is shifts and ands on [rows, keys] tiles, with no in-kernel gather;
* online softmax in float32; masked or stale slots are removed with ``jnp.where`` on the
  scores, the probabilities *and* the K/V tiles, so NaN-poisoned pages cannot leak in.

Triton needs power-of-two tiles of at least 16 for ``dot``: rows and head dim are zero-padded by
the wrapper (padded q columns meet padded zero K columns, padded V columns are sliced off).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specjax import attention as _attention

_MASK_VALUE = float(jnp.finfo(jnp.float32).min)
_MIN_DOT = 16  # smallest tile side Triton's tl.dot accepts
_BITS = 32  # new-mask bits per int32 word


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables of the kernel (hashable: a static jit argument).

    Attributes:
      pages_per_block: pages gathered per loop step (a power of two); None picks enough pages
        for a 32-slot key tile.
      block_rows: most (query head, token) rows one program holds; more rows split the grid.
      num_warps, num_stages: Triton compiler parameters (ignored in interpret mode).
    """

    pages_per_block: int | None = None
    block_rows: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.pages_per_block is not None and not _is_pow2(self.pages_per_block):
            raise ValueError(f"pages_per_block must be a power of two, got {self.pages_per_block}")
        if not _is_pow2(self.block_rows) or self.block_rows < _MIN_DOT:
            raise ValueError(f"block_rows must be a power of two >= {_MIN_DOT}, got {self.block_rows}")


def _is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def paged_attention_reference(q, k_pages, v_pages, page_table, cache_start, num_new,
                              new_mask=None, *, scale=None):
    """The plain-jnp twin (``specjax.attention.paged_attention_reference``); same signature."""
    return _attention.paged_attention_reference(q, k_pages, v_pages, page_table, cache_start,
                                                num_new, new_mask, scale=scale)


def _kernel(q_ref, k_ref, v_ref, pt_ref, start_ref, nnew_ref, bits_ref, o_ref, *, scale: float,
            pages_per_block: int, num_slots: int, num_words: int, max_blocks: int):
    """One (sequence, KV head, row block): flash loop over the sequence's own pages."""
    rows, d = q_ref.shape
    page_size = k_ref.shape[1]
    block_k = pages_per_block * page_size
    start = start_ref[0]
    nnew = nnew_ref[0]
    length = jnp.minimum(start + nnew, num_slots)
    n_blocks = jnp.minimum(pl.cdiv(jnp.maximum(length, 0), block_k), max_blocks)

    q = q_ref[...]  # [R, Dp]
    words = [bits_ref[w, :] for w in range(num_words)]  # num_words x [R] int32
    precision = lax.Precision.HIGHEST if q.dtype == jnp.float32 else None

    def body(i, carry):
        acc, m_prev, l_prev = carry
        pages = pt_ref[pl.ds(i * pages_per_block, pages_per_block)]  # [ppb]
        k = k_ref[pages].reshape(block_k, d)  # [Kb, Dp]
        v = v_ref[pages].reshape(block_k, d)
        j = i * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # slot ids
        rel = j - start  # index among the new tokens
        in_prefix = j < start
        in_new = (rel >= 0) & (rel < nnew)
        readable = (in_prefix | in_new) & (j < num_slots)
        # Stale slots may hold NaN: zero them before any product.
        k = jnp.where(readable[:, None], k, jnp.zeros_like(k))
        v = jnp.where(readable[:, None], v, jnp.zeros_like(v))
        s = lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale  # [R, Kb]
        # new_mask[t, rel] from the row's bitmask words.
        rel_c = jnp.clip(rel, 0, num_words * _BITS - 1)
        word_id, bit = rel_c // _BITS, rel_c % _BITS
        word = jnp.zeros((rows, block_k), jnp.int32)
        for w in range(num_words):
            word = jnp.where((word_id == w)[None, :], words[w][:, None], word)
        new_ok = ((word >> bit[None, :]) & 1) == 1
        allowed = (in_prefix & readable)[None, :] | ((in_new & readable)[None, :] & new_ok)
        s = jnp.where(allowed, s, _MASK_VALUE)
        # Online softmax step.
        m_next = jnp.maximum(m_prev, s.max(axis=-1))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.where(allowed, jnp.exp(s - m_next[:, None]), 0.0)
        l_next = alpha * l_prev + p.sum(axis=-1)
        pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)
        return alpha[:, None] * acc + pv, m_next, l_next

    acc = jnp.zeros((rows, d), jnp.float32)
    m = jnp.full((rows,), _MASK_VALUE, jnp.float32)
    l = jnp.zeros((rows,), jnp.float32)
    acc, m, l = lax.fori_loop(0, n_blocks, body, (acc, m, l))
    # Rows that may attend to nothing give 0, like the reference.
    o_ref[...] = (acc / jnp.where(l == 0.0, 1.0, l)[:, None]).astype(o_ref.dtype)


def _mask_bits(new_mask, num_words: int):
    """[B, T, T] bool -> [B, T, num_words] int32: bit i of word w is new_mask[..., 32*w + i]."""
    b, t, _ = new_mask.shape
    m = jnp.pad(new_mask, ((0, 0), (0, 0), (0, num_words * _BITS - t)))
    m = m.reshape(b, t, num_words, _BITS).astype(jnp.uint32)
    shifts = jnp.arange(_BITS, dtype=jnp.uint32)
    bits = jnp.sum(m << shifts, axis=-1, dtype=jnp.uint32)  # distinct bits: sum == or
    return lax.bitcast_convert_type(bits, jnp.int32)


def _validate(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask, interpret):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D], got shape {q.shape}")
    b, t, h, d = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [Hkv, P, S, D], got {k_pages.shape} "
                         f"and {v_pages.shape}")
    hkv, _, s, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"head dim mismatch: q has {d}, pages have {dk}")
    if h % hkv:
        raise ValueError(f"num heads {h} must be a multiple of num kv heads {hkv}")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    if k_pages.dtype != v_pages.dtype or not jnp.issubdtype(k_pages.dtype, jnp.floating):
        raise ValueError(f"k_pages/v_pages must share a floating dtype, got {k_pages.dtype}, "
                         f"{v_pages.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be [B={b}, Pmax], got {page_table.shape}")
    for name, x in (("page_table", page_table), ("cache_start", cache_start), ("num_new", num_new)):
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {x.dtype}")
    for name, x in (("cache_start", cache_start), ("num_new", num_new)):
        if x.shape != (b,):
            raise ValueError(f"{name} must be [B={b}], got {x.shape}")
    if new_mask is not None and (new_mask.shape != (b, t, t) or new_mask.dtype != jnp.bool_):
        raise ValueError(f"new_mask must be bool [B, T, T] = {(b, t, t)}, got {new_mask.dtype} "
                         f"{new_mask.shape}")
    if not interpret and not _is_pow2(s):
        raise ValueError(f"the Triton kernel needs a power-of-two page size, got {s}")


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret"))
def paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask=None, *,
                    scale: float | None = None, block_sizes: BlockSizes = BlockSizes(),
                    interpret: bool | None = None):
    """Paged attention of T new queries per sequence (chain or tree verification).

    Args:
      q: [B, T, H, D] queries (RoPE applied).
      k_pages, v_pages: [Hkv, P, S, D] pools; the new tokens' K/V are already written at slots
        ``cache_start[b] + t``.
      page_table: [B, Pmax] int page ids (entries past a sequence's length are never read).
      cache_start: [B] int number of prefix tokens (slot of the first new token).
      num_new: [B] int number of valid new tokens (<= T).
      new_mask: optional [B, T, T] bool mask among the new tokens; default causal.
      scale: softmax scale, default D ** -0.5.
      block_sizes: kernel tunables.
      interpret: run the Pallas interpreter; None means "True unless the default backend is GPU".
    Returns:
      [B, T, H, D] in q's dtype.
    Raises:
      ValueError: on inconsistent shapes or dtypes.
    """
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    _validate(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask, interpret)
    b, t, h, d = q.shape
    hkv, num_pages, page_size, _ = k_pages.shape
    g = h // hkv
    pmax = page_table.shape[1]
    scale = d ** -0.5 if scale is None else float(scale)
    if new_mask is None:
        new_mask = jnp.broadcast_to(_attention.causal_mask(t), (b, t, t))

    # Static tiling.
    ppb = block_sizes.pages_per_block or max(1, 32 // page_size)
    ppb = min(ppb, _next_pow2(pmax))
    p_pad = _next_pow2(max(pmax, ppb))
    d_pad = max(_MIN_DOT, _next_pow2(d))
    n_rows = g * t
    block_r = min(block_sizes.block_rows, max(_MIN_DOT, _next_pow2(n_rows)))
    r_pad = pl.cdiv(n_rows, block_r) * block_r
    num_words = pl.cdiv(t, _BITS)
    w_pad = _next_pow2(num_words)

    # Rows: [B, T, Hkv*G, D] -> [B, Hkv, G*T, D]  (row g*T + t).
    qr = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, n_rows, d)
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, r_pad - n_rows), (0, d_pad - d)))
    kp = jnp.pad(k_pages, ((0, 0), (0, 0), (0, 0), (0, d_pad - d))) if d_pad != d else k_pages
    vp = jnp.pad(v_pages, ((0, 0), (0, 0), (0, 0), (0, d_pad - d))) if d_pad != d else v_pages
    # Clamp ids so no load is ever out of bounds (out-of-length slots are masked anyway).
    pt = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    pt = jnp.pad(pt, ((0, 0), (0, p_pad - pmax)))
    bits = _mask_bits(new_mask, num_words)  # [B, T, W]
    bits = jnp.tile(bits, (1, g, 1))  # [B, G*T, W], row g*T + t
    bits = jnp.pad(bits, ((0, 0), (0, r_pad - n_rows), (0, w_pad - num_words)))
    bits = bits.transpose(0, 2, 1)  # [B, Wp, Rp]
    start = cache_start.astype(jnp.int32)
    nnew = num_new.astype(jnp.int32)

    kernel = functools.partial(_kernel, scale=scale, pages_per_block=ppb,
                               num_slots=pmax * page_size, num_words=num_words,
                               max_blocks=p_pad // ppb)
    pool_spec = pl.BlockSpec((None, num_pages, page_size, d_pad), lambda i, k, r: (k, 0, 0, 0))
    compiler_params = None
    if not interpret:
        from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415 - GPU only
        compiler_params = plgpu.CompilerParams(num_warps=block_sizes.num_warps,
                                               num_stages=block_sizes.num_stages)
    out = pl.pallas_call(
        kernel,
        grid=(b, hkv, r_pad // block_r),
        in_specs=[
            pl.BlockSpec((None, None, block_r, d_pad), lambda i, k, r: (i, k, r, 0)),  # q
            pool_spec,  # k_pages
            pool_spec,  # v_pages
            pl.BlockSpec((None, p_pad), lambda i, k, r: (i, 0)),  # page table
            pl.BlockSpec((1,), lambda i, k, r: (i,)),  # cache_start
            pl.BlockSpec((1,), lambda i, k, r: (i,)),  # num_new
            pl.BlockSpec((None, w_pad, block_r), lambda i, k, r: (i, 0, r)),  # mask bits
        ],
        out_specs=pl.BlockSpec((None, None, block_r, d_pad), lambda i, k, r: (i, k, r, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, r_pad, d_pad), q.dtype),
        compiler_params=compiler_params,
        interpret=interpret,
        name="specjax_paged_attention",
    )(qr, kp, vp, pt, start, nnew, bits)
    out = out[:, :, :n_rows, :d].reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, h, d)
