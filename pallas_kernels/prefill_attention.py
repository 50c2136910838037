"""Causal prefill attention over the paged cache (flash-style, variable lengths) as a Pallas kernel.

The caller has already written the T new tokens' K/V into the paged pools at slots
``cache_start[b] + t`` (``kv_cache.write_layer``); this kernel reads them back through the page
table, so plain prefill (``cache_start == 0``) and chunked prefill after a cached prefix are one
kernel. Semantics equal ``paged_attention_reference`` with the default causal mask: query t of
sequence b attends to slots ``j <= cache_start[b] + t`` with ``j < cache_start[b] + num_new[b]``
(padding queries ``t >= num_new[b]`` therefore see the whole sequence, as in the reference).

Kernel layout (``pl.pallas_call`` + ``BlockSpec``; Triton on GPU, ``interpret=True`` on CPU):

* grid ``(B, Hkv, row_blocks)``; the G query heads of one KV head are folded into rows
  token-major (row ``t*G + g``), so a row block covers consecutive tokens of all G heads and each
  K/V tile is loaded once for G heads (no padding for G = 3);
* the key loop of a row block stops at its last token's causal horizon (flash-style block
  skipping) and at the sequence's length, so short sequences in a padded batch cost little;
* blocks that every row of the block may see in full (the cached prefix and earlier new tokens)
  run with no mask at all; only the diagonal blocks compute the causal/length mask, zero stale
  K/V before the products and drop masked probabilities (NaN-poisoned pages cannot leak in);
* online softmax in float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _common as C
from pallas_kernels.paged_attention import paged_attention_reference


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tunables of the prefill kernel (hashable: a static jit argument).

    Attributes:
      block_rows: (token, query head) rows per program, a power of two >= 16.
      block_keys: key slots per loop step, a power of two >= 16 (whole pages are gathered:
        ``max(1, block_keys // page_size)`` pages per step).
      num_warps, num_stages: Triton compiler parameters (ignored in interpret mode).
    """

    block_rows: int = 64
    block_keys: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def __post_init__(self):
        for name in ("block_rows", "block_keys"):
            n = getattr(self, name)
            if not C.is_pow2(n) or n < C.MIN_DOT:
                raise ValueError(f"{name} must be a power of two >= {C.MIN_DOT}, got {n}")


def prefill_attention_reference(q, k_pages, v_pages, page_table, cache_start, num_new, *,
                                scale=None):
    """Plain-jnp twin: ``paged_attention_reference`` with the causal mask among new tokens.

    Shapes as in ``prefill_attention``.
    """
    return paged_attention_reference(q, k_pages, v_pages, page_table, cache_start, num_new, None,
                                     scale=scale)


def _kernel(q_ref, k_ref, v_ref, pt_ref, start_ref, nnew_ref, o_ref, *, scale: float,
            pages_per_block: int, num_slots: int, group: int):
    """One (sequence, KV head, row block): causal flash loop over the sequence's pages."""
    rows, d = q_ref.shape  # [R, Dp]
    page_size = k_ref.shape[1]
    block_k = pages_per_block * page_size
    start = jnp.clip(start_ref[0], 0, num_slots)
    length = jnp.clip(start + nnew_ref[0], start, num_slots)
    row0 = pl.program_id(2) * rows
    tok = (row0 + lax.broadcasted_iota(jnp.int32, (rows,), 0)) // group  # [R] token of each row
    horizon = start + tok  # [R] last slot each row may see (causal)
    first_tok, last_tok = row0 // group, (row0 + rows - 1) // group
    # Key blocks: [0, n_full) seen in full by every row; [n_full, n_blocks) need the mask.
    n_blocks = pl.cdiv(jnp.minimum(length, start + last_tok + 1), block_k)
    n_full = jnp.minimum(jnp.minimum(length, start + first_tok + 1) // block_k, n_blocks)

    q = q_ref[...]  # [R, Dp]
    precision = C.precision_for(q.dtype)

    def step(i, carry, masked: bool):
        k, v = C.load_kv_block(k_ref, v_ref, pt_ref, i, pages_per_block, q.dtype)  # [Kb, Dp]
        allowed = None
        if masked:
            j = i * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)  # slot ids
            live = j < length
            # Stale slots may hold NaN: zero them before any product.
            k = jnp.where(live[:, None], k, jnp.zeros_like(k))
            v = jnp.where(live[:, None], v, jnp.zeros_like(v))
            allowed = live[None, :] & (j[None, :] <= horizon[:, None])
        s = C.scores(q, k, scale)  # [R, Kb]
        if masked:
            s = jnp.where(allowed, s, C.MASK_VALUE)
        return C.softmax_update(carry, s, allowed, v, precision)

    carry = lax.fori_loop(0, n_full, functools.partial(step, masked=False),
                          C.softmax_init(rows, d))
    acc, _, l = lax.fori_loop(n_full, n_blocks, functools.partial(step, masked=True), carry)
    o_ref[...] = C.softmax_finish(acc, l).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret"))
def prefill_attention(q, k_pages, v_pages, page_table, cache_start, num_new, *,
                      scale: float | None = None, block_sizes: BlockSizes = BlockSizes(),
                      interpret: bool | None = None):
    """Causal attention of T new tokens per sequence (prefill / chunked prefill) over the pages.

    Args:
      q: [B, T, H, D] queries (RoPE applied).
      k_pages, v_pages: [Hkv, P, S, D] pools; the new tokens' K/V are already written at slots
        ``cache_start[b] + t`` (the caller writes them, e.g. with ``kv_cache.write_layer``).
      page_table: [B, Pmax] int page ids (entries past a sequence's length are never read).
      cache_start: [B] int number of already cached tokens (0 for a fresh prompt).
      num_new: [B] int valid new tokens per sequence (<= T): variable prompt lengths.
      scale: softmax scale, default D ** -0.5.
      block_sizes: kernel tunables.
      interpret: run the Pallas interpreter; None means "True unless the default backend is GPU".
    Returns:
      [B, T, H, D] in q's dtype.
    Raises:
      ValueError: on inconsistent shapes or dtypes (the message names the argument).
    """
    interpret = C.resolve_interpret(interpret)
    C.validate_paged(q, k_pages, v_pages, page_table, cache_start, num_new, interpret)
    b, t, h, d = q.shape
    hkv, num_pages, page_size, _ = k_pages.shape
    g = h // hkv
    pmax = page_table.shape[1]
    scale = d ** -0.5 if scale is None else float(scale)

    tl = C.tiling(block_sizes.block_keys // page_size, pmax, d, t * g, block_sizes.block_rows)
    ppb, p_pad, d_pad, n_rows, block_r, r_pad = (tl.ppb, tl.p_pad, tl.d_pad, tl.n_rows,
                                                 tl.block_r, tl.r_pad)

    # Rows: [B, T, Hkv*G, D] -> [B, Hkv, T*G, D]  (row t*G + g).
    qr = q.reshape(b, t, hkv, g, d).transpose(0, 2, 1, 3, 4).reshape(b, hkv, n_rows, d)
    qr = C.pad_rows(qr, tl)
    kp, vp = C.pad_head_dim(k_pages, d_pad), C.pad_head_dim(v_pages, d_pad)
    pt = C.clamped_page_table(page_table, num_pages, p_pad)  # [B, p_pad]

    kernel = functools.partial(_kernel, scale=scale, pages_per_block=ppb,
                               num_slots=pmax * page_size, group=g)
    pool_spec = pl.BlockSpec((None, num_pages, page_size, d_pad), lambda i, k, r: (k, 0, 0, 0))
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
        ],
        out_specs=pl.BlockSpec((None, None, block_r, d_pad), lambda i, k, r: (i, k, r, 0)),
        out_shape=jax.ShapeDtypeStruct((b, hkv, r_pad, d_pad), q.dtype),
        compiler_params=C.compiler_params(interpret, block_sizes.num_warps,
                                          block_sizes.num_stages),
        interpret=interpret,
        name="specjax_prefill_attention",
    )(qr, kp, vp, pt, cache_start.astype(jnp.int32), num_new.astype(jnp.int32))
    out = out[:, :, :n_rows, :d].reshape(b, hkv, t, g, d).transpose(0, 2, 1, 3, 4)
    return out.reshape(b, t, h, d)
