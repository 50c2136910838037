"""Multi-query paged attention (decode, chain and tree verification) as a Pallas kernel.

Semantics are exactly those of ``paged_attention_reference`` below (the plain-jnp twin, which
``specjax.attention`` re-exports as its reference implementation): the T new tokens of sequence b
sit at cache slots ``cache_start[b] + t``; query t attends to every prefix slot
``j < cache_start[b]`` and to new slot ``cache_start[b] + t'`` (``t' < num_new[b]``) where
``new_mask[b, t, t']`` holds. Stale slots are never read: their scores are masked and their
values zeroed, so even NaN-poisoned pages cannot leak in.

Kernel layout (backend-neutral ``pl.pallas_call`` + ``BlockSpec``; runs with ``interpret=True`` on
CPU and lowers through Triton on GPU):

* grid ``(B, Hkv, row_blocks[, num_splits])``; one program owns one KV head of one sequence, a
  block of rows and (split-K) one share of the sequence's key blocks. The G = H / Hkv query heads
  sharing a KV head and the T queries are folded into G*T rows (row ``g*T + t``), so GQA with
  small T wastes no work;
* the page table and the two lengths are ordinary blocked inputs (Triton has no scalar
  prefetch); each loop step gathers ``pages_per_block`` pages of the KV head's pool with a
  vector index, and the loops stop at the sequence's own length ``cache_start + num_new``;
* two loops per program: key blocks that lie wholly inside the committed prefix run with no mask
  at all (the tree / causal mask never touches the prefix), then the few blocks holding the new
  tokens apply the [T, T] mask, which travels as per-row int32 bitmasks (bit t' of word t' // 32)
  so the test is shifts and ands on [rows, keys] tiles, with no in-kernel gather;
* split-K (``BlockSizes.num_splits`` > 1, chosen automatically when B * Hkv programs cannot fill
  the GPU): split s takes its share of *this* sequence's key blocks and writes an unnormalised
  partial (acc, m, l); a small jnp log-sum-exp merge combines the splits;
* online softmax in float32; in the masked loop stale slots are removed with ``jnp.where`` on the
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

from pallas_kernels import _common as C

_BITS = 32  # new-mask bits per int32 word
_TARGET_PROGRAMS = 264  # about two waves of 132 SMs (H100/H200): auto split-K aims here
_MIN_SPLIT_KEYS = 512  # auto split-K never gives a split fewer keys than this


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables of the kernel (hashable: a static jit argument).

    Attributes:
      pages_per_block: pages gathered per loop step (a power of two); None picks enough pages
        for a 64-slot key tile.
      block_rows: most (query head, token) rows one program holds; more rows split the grid.
      num_splits: split-K factor: each (sequence, KV head, row block) is spread over this many
        programs, each reading ~1/num_splits of the sequence's keys, merged by log-sum-exp.
        None chooses by the grid size and the longest possible sequence (1 when B * Hkv already
        fills the GPU or the page table is short).
      num_warps, num_stages: Triton compiler parameters (ignored in interpret mode).
    """

    pages_per_block: int | None = None
    block_rows: int = 64
    num_splits: int | None = None
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        if self.pages_per_block is not None and not C.is_pow2(self.pages_per_block):
            raise ValueError(f"pages_per_block must be a power of two, got {self.pages_per_block}")
        if not C.is_pow2(self.block_rows) or self.block_rows < C.MIN_DOT:
            raise ValueError(f"block_rows must be a power of two >= {C.MIN_DOT}, "
                             f"got {self.block_rows}")
        if self.num_splits is not None and (not isinstance(self.num_splits, int)
                                             or self.num_splits < 1):
            raise ValueError(f"num_splits must be None or an int >= 1, got {self.num_splits!r}")


def causal_mask(t: int):
    """[T, T] bool lower-triangular mask among new tokens."""
    return jnp.tril(jnp.ones((t, t), dtype=bool))


def paged_attention_reference(q, k_pages, v_pages, page_table, cache_start, num_new,
                              new_mask=None, *, scale=None, window=None, q_pos=None):
    """Plain-jnp paged attention with a prefix + new-token mask (the kernel's twin).

    Args:
      q: [B, T, H, D] queries (RoPE applied).
      k_pages, v_pages: [Hkv, P, S, D] pools holding the prefix and the new tokens.
      page_table: [B, Pmax] int32.
      cache_start: [B] int32 number of prefix tokens (slot of the first new token).
      num_new: [B] int32 number of valid new tokens (<= T).
      new_mask: optional [B, T, T] bool mask among the new tokens; default causal.
      scale: softmax scale, default D ** -0.5.
      window: optional sliding window: key slot j is visible to query t only if
        ``q_pos[b, t] - j < window`` (Gemma 3 local layers; HF's sliding_window_overlay).
      q_pos: [B, T] int32 query positions for the window (default ``cache_start + t``).
    Returns:
      [B, T, H, D] in q's dtype.
    """
    b, t, h, d = q.shape
    hkv, _, s, _ = k_pages.shape
    g = h // hkv
    pmax = page_table.shape[1]
    scale = d ** -0.5 if scale is None else scale
    if new_mask is None:
        new_mask = jnp.broadcast_to(causal_mask(t), (b, t, t))
    # Every mapped page of each sequence in cache order: [Hkv, B, Pmax, S, D] -> [B, Hkv, N, D].
    keys = k_pages[:, page_table].transpose(1, 0, 2, 3, 4).reshape(b, hkv, pmax * s, d)
    vals = v_pages[:, page_table].transpose(1, 0, 2, 3, 4).reshape(b, hkv, pmax * s, d)
    n = keys.shape[2]
    j = jnp.arange(n, dtype=jnp.int32)[None, :]  # [1, N]
    start = cache_start[:, None]  # [B, 1]
    rel = j - start  # [B, N] index among the new tokens
    in_new = (rel >= 0) & (rel < num_new[:, None])  # [B, N]
    readable = (j < start) | in_new  # [B, N]
    # new-token part of the mask: new_mask[b, t, rel] where the slot is a new token
    rel_c = jnp.clip(rel, 0, t - 1)
    new_allowed = jnp.take_along_axis(new_mask, jnp.broadcast_to(rel_c[:, None, :], (b, t, n)),
                                      axis=2)
    allowed = (j < start)[:, None, :] | (in_new[:, None, :] & new_allowed)  # [B, T, N]
    if window is not None:
        if q_pos is None:
            q_pos = cache_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        allowed = allowed & ((q_pos[:, :, None] - j[:, None, :]) < window)
    vals = jnp.where(readable[:, None, :, None], vals, 0)
    qg = q.reshape(b, t, hkv, g, d).astype(jnp.float32)
    sc = jnp.einsum("btkgd,bknd->bkgtn", qg, keys.astype(jnp.float32)) * scale
    sc = jnp.where(allowed[:, None, None, :, :], sc, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(sc, axis=-1)
    p = jnp.where(allowed[:, None, None, :, :], p, 0.0)
    o = jnp.einsum("bkgtn,bknd->btkgd", p, vals.astype(jnp.float32))
    return o.reshape(b, t, h, d).astype(q.dtype)


def _kernel(q_ref, k_ref, v_ref, pt_ref, start_ref, nnew_ref, bits_ref, *out_refs, scale: float,
            pages_per_block: int, num_slots: int, num_words: int, num_splits: int):
    """One (sequence, KV head, row block[, split]): flash loops over the sequence's own pages."""
    rows, d = q_ref.shape  # [R, Dp]
    page_size = k_ref.shape[1]
    block_k = pages_per_block * page_size
    start = jnp.clip(start_ref[0], 0, num_slots)
    nnew = nnew_ref[0]
    length = jnp.clip(start + nnew, start, num_slots)
    n_blocks = pl.cdiv(length, block_k)
    n_prefix = start // block_k  # blocks wholly inside the committed prefix: no mask
    if num_splits > 1:  # this program's share of the sequence's key blocks
        per = pl.cdiv(n_blocks, num_splits)
        lo = jnp.minimum(pl.program_id(3) * per, n_blocks)
        hi = jnp.minimum(lo + per, n_blocks)
    else:
        lo, hi = 0, n_blocks
    mid = jnp.clip(n_prefix, lo, hi)

    q = q_ref[...]  # [R, Dp]
    precision = C.precision_for(q.dtype)

    def load(i):
        return C.load_kv_block(k_ref, v_ref, pt_ref, i, pages_per_block, q.dtype)

    def update(carry, s, allowed, v):
        return C.softmax_update(carry, s, allowed, v, precision)

    def prefix_body(i, carry):  # every slot is a committed prefix token: no mask, no guard
        k, v = load(i)
        return update(carry, C.scores(q, k, scale), None, v)

    words = [bits_ref[w, :] for w in range(num_words)]  # num_words x [R] int32

    def masked_body(i, carry):  # the block(s) holding the new tokens (and the prefix's tail)
        k, v = load(i)
        j = i * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # slot ids
        rel = j - start  # index among the new tokens
        in_prefix = j < start
        in_new = (rel >= 0) & (j < length)
        # Stale slots may hold NaN: zero them before any product.
        readable = (in_prefix | in_new)[:, None]
        k = jnp.where(readable, k, jnp.zeros_like(k))
        v = jnp.where(readable, v, jnp.zeros_like(v))
        s = C.scores(q, k, scale)
        # new_mask[t, rel] from the row's bitmask words.
        rel_c = jnp.clip(rel, 0, num_words * _BITS - 1)
        word_id, bit = rel_c // _BITS, rel_c % _BITS
        word = jnp.zeros((rows, block_k), jnp.int32)
        for w in range(num_words):
            word = jnp.where((word_id == w)[None, :], words[w][:, None], word)
        new_ok = ((word >> bit[None, :]) & 1) == 1
        allowed = in_prefix[None, :] | (in_new[None, :] & new_ok)
        s = jnp.where(allowed, s, C.MASK_VALUE)
        return update(carry, s, allowed, v)

    carry = lax.fori_loop(lo, mid, prefix_body, C.softmax_init(rows, d))
    acc, m, l = lax.fori_loop(mid, hi, masked_body, carry)
    if num_splits == 1:
        (o_ref,) = out_refs
        o_ref[...] = C.softmax_finish(acc, l).astype(o_ref.dtype)
    else:
        acc_ref, m_ref, l_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        l_ref[...] = l


def merge_splits(acc, m, l):
    """Log-sum-exp merge of split-K partials (the split axis is 2).

    Args:
      acc: [B, Hkv, NS, R, D] float32 unnormalised outputs; m, l: [B, Hkv, NS, R] float32 running
        max and denominator of each split (an empty split has l == 0, acc == 0).
    Returns:
      [B, Hkv, R, D] float32; rows with nothing to attend to are 0.
    """
    m_max = m.max(axis=2, keepdims=True)  # [B, Hkv, 1, R]
    # jax's decode_attention merge needs this barrier to keep XLA from fusing NaNs in on GPU.
    m_max = lax.optimization_barrier(m_max)
    w = jnp.exp(m - m_max)  # [B, Hkv, NS, R]; 0 for empty splits beside non-empty ones
    l_tot = (w * l).sum(axis=2)  # [B, Hkv, R]
    o = (w[..., None] * acc).sum(axis=2)  # [B, Hkv, R, D]
    return o / jnp.where(l_tot == 0.0, 1.0, l_tot)[..., None]


def _mask_bits(new_mask, num_words: int):
    """[B, T, T] bool -> [B, T, num_words] int32: bit i of word w is new_mask[..., 32*w + i]."""
    b, t, _ = new_mask.shape
    m = jnp.pad(new_mask, ((0, 0), (0, 0), (0, num_words * _BITS - t)))
    m = m.reshape(b, t, num_words, _BITS).astype(jnp.uint32)
    shifts = jnp.arange(_BITS, dtype=jnp.uint32)
    bits = jnp.sum(m << shifts, axis=-1, dtype=jnp.uint32)  # distinct bits: sum == or
    return lax.bitcast_convert_type(bits, jnp.int32)


def auto_num_splits(programs: int, max_keys: int) -> int:
    """Split-K factor for a grid of ``programs`` (sequence, KV head, row block) programs whose
    longest possible sequence has ``max_keys`` slots: enough splits for ~two waves of an H200,
    but never splits shorter than 512 keys."""
    by_grid = -(-_TARGET_PROGRAMS // max(programs, 1))
    by_length = max(1, max_keys // _MIN_SPLIT_KEYS)
    return max(1, min(by_grid, by_length))


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret"))
def paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask=None, *,
                    scale: float | None = None, block_sizes: BlockSizes = BlockSizes(),
                    interpret: bool | None = None):
    """Paged attention of T new queries per sequence (decode, chain or tree verification).

    Args:
      q: [B, T, H, D] queries (RoPE applied).
      k_pages, v_pages: [Hkv, P, S, D] pools; the new tokens' K/V are already written at slots
        ``cache_start[b] + t``.
      page_table: [B, Pmax] int page ids (entries past a sequence's length are never read).
      cache_start: [B] int number of prefix tokens (slot of the first new token).
      num_new: [B] int number of valid new tokens (<= T).
      new_mask: optional [B, T, T] bool mask among the new tokens; default causal.
      scale: softmax scale, default D ** -0.5.
      block_sizes: kernel tunables (tiles, split-K, Triton warps/stages).
      interpret: run the Pallas interpreter; None means "True unless the default backend is GPU".
    Returns:
      [B, T, H, D] in q's dtype.
    Raises:
      ValueError: on inconsistent shapes or dtypes (the message names the argument).
    """
    interpret = C.resolve_interpret(interpret)
    C.validate_paged(q, k_pages, v_pages, page_table, cache_start, num_new, interpret)
    b, t, h, d = q.shape
    if new_mask is not None and (new_mask.shape != (b, t, t) or new_mask.dtype != jnp.bool_):
        raise ValueError(f"new_mask must be bool [B, T, T] = {(b, t, t)}, got {new_mask.dtype} "
                         f"{new_mask.shape}")
    hkv, num_pages, page_size, _ = k_pages.shape
    g = h // hkv
    pmax = page_table.shape[1]
    scale = d ** -0.5 if scale is None else float(scale)
    if new_mask is None:
        new_mask = jnp.broadcast_to(causal_mask(t), (b, t, t))

    tl = C.tiling(block_sizes.pages_per_block or max(1, 64 // page_size), pmax, d, g * t,
                  block_sizes.block_rows)
    ppb, p_pad, d_pad, n_rows, block_r, r_pad = (tl.ppb, tl.p_pad, tl.d_pad, tl.n_rows,
                                                 tl.block_r, tl.r_pad)
    num_words = pl.cdiv(t, _BITS)
    w_pad = C.next_pow2(num_words)
    num_slots = pmax * page_size
    splits = block_sizes.num_splits
    if splits is None:
        splits = auto_num_splits(b * hkv * (r_pad // block_r), num_slots)
    splits = max(1, min(splits, p_pad // ppb))  # never more splits than key blocks

    # Rows: [B, T, Hkv*G, D] -> [B, Hkv, G*T, D]  (row g*T + t).
    qr = q.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, n_rows, d)
    qr = C.pad_rows(qr, tl)
    kp, vp = C.pad_head_dim(k_pages, d_pad), C.pad_head_dim(v_pages, d_pad)
    pt = C.clamped_page_table(page_table, num_pages, p_pad)  # [B, p_pad]
    bits = _mask_bits(new_mask, num_words)  # [B, T, W]
    bits = jnp.tile(bits, (1, g, 1))  # [B, G*T, W], row g*T + t
    bits = jnp.pad(bits, ((0, 0), (0, r_pad - n_rows), (0, w_pad - num_words)))
    bits = bits.transpose(0, 2, 1)  # [B, Wp, Rp]
    start = cache_start.astype(jnp.int32)
    nnew = num_new.astype(jnp.int32)

    kernel = functools.partial(_kernel, scale=scale, pages_per_block=ppb, num_slots=num_slots,
                               num_words=num_words, num_splits=splits)
    grid = (b, hkv, r_pad // block_r) + ((splits,) if splits > 1 else ())
    in_specs = [
        pl.BlockSpec((None, None, block_r, d_pad), lambda i, k, r, *_: (i, k, r, 0)),  # q
        pl.BlockSpec((None, num_pages, page_size, d_pad), lambda i, k, r, *_: (k, 0, 0, 0)),
        pl.BlockSpec((None, num_pages, page_size, d_pad), lambda i, k, r, *_: (k, 0, 0, 0)),
        pl.BlockSpec((None, p_pad), lambda i, k, r, *_: (i, 0)),  # page table
        pl.BlockSpec((1,), lambda i, k, r, *_: (i,)),  # cache_start
        pl.BlockSpec((1,), lambda i, k, r, *_: (i,)),  # num_new
        pl.BlockSpec((None, w_pad, block_r), lambda i, k, r, *_: (i, 0, r)),  # mask bits
    ]
    if splits == 1:
        out_specs = pl.BlockSpec((None, None, block_r, d_pad), lambda i, k, r: (i, k, r, 0))
        out_shape = jax.ShapeDtypeStruct((b, hkv, r_pad, d_pad), q.dtype)
    else:
        out_specs = [
            pl.BlockSpec((None, None, None, block_r, d_pad), lambda i, k, r, s: (i, k, s, r, 0)),
            pl.BlockSpec((None, None, None, block_r), lambda i, k, r, s: (i, k, s, r)),
            pl.BlockSpec((None, None, None, block_r), lambda i, k, r, s: (i, k, s, r)),
        ]
        out_shape = [jax.ShapeDtypeStruct((b, hkv, splits, r_pad, d_pad), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, splits, r_pad), jnp.float32),
                     jax.ShapeDtypeStruct((b, hkv, splits, r_pad), jnp.float32)]
    out = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=C.compiler_params(interpret, block_sizes.num_warps,
                                          block_sizes.num_stages),
        interpret=interpret,
        name="specjax_paged_attention",
    )(qr, kp, vp, pt, start, nnew, bits)
    if splits > 1:
        out = merge_splits(*out).astype(q.dtype)  # [B, Hkv, Rp, Dp]
    out = out[:, :, :n_rows, :d].reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4)
    return out.reshape(b, t, h, d)
