"""Helpers shared by the attention kernels: tile arithmetic and padding, input checks, compiler
params, and the online-softmax (flash) update every kernel loop runs."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

MASK_VALUE = float(jnp.finfo(jnp.float32).min)  # masked scores (finite: exp(MASK - m) is 0, not NaN)
MIN_DOT = 16  # smallest tile side Triton's tl.dot accepts


def is_pow2(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def resolve_interpret(interpret: bool | None) -> bool:
    """None means: interpret unless the default backend is a GPU."""
    return jax.default_backend() != "gpu" if interpret is None else bool(interpret)


def compiler_params(interpret: bool, num_warps: int, num_stages: int):
    """Triton parameters on GPU; None for the interpreter (which takes none)."""
    if interpret:
        return None
    from jax.experimental.pallas import triton as plgpu  # noqa: PLC0415 - GPU only
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def validate_paged(q, k_pages, v_pages, page_table, cache_start, num_new, interpret: bool):
    """ValueError (naming the argument) unless the shapes/dtypes form one paged-attention call.

    q [B, T, H, D] float; k_pages/v_pages [Hkv, P, S, D] of one float dtype with H % Hkv == 0;
    page_table [B, Pmax] int; cache_start/num_new [B] int (num_new may be None).
    """
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, D], got shape {q.shape}")
    b, _, h, d = q.shape
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape:
        raise ValueError(f"k_pages and v_pages must both be [Hkv, P, S, D], got {k_pages.shape} "
                         f"and {v_pages.shape}")
    hkv, _, s, dk = k_pages.shape
    if dk != d:
        raise ValueError(f"head dim mismatch: q has {d}, k_pages/v_pages have {dk}")
    if h % hkv:
        raise ValueError(f"q's num heads {h} must be a multiple of num kv heads {hkv} (k_pages)")
    if not jnp.issubdtype(q.dtype, jnp.floating):
        raise ValueError(f"q must be floating point, got {q.dtype}")
    if k_pages.dtype != v_pages.dtype or not jnp.issubdtype(k_pages.dtype, jnp.floating):
        raise ValueError(f"k_pages/v_pages must share a floating dtype, got {k_pages.dtype}, "
                         f"{v_pages.dtype}")
    if page_table.ndim != 2 or page_table.shape[0] != b:
        raise ValueError(f"page_table must be [B={b}, Pmax], got {page_table.shape}")
    for name, x in (("page_table", page_table), ("cache_start", cache_start), ("num_new", num_new)):
        if x is not None and not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {x.dtype}")
    for name, x in (("cache_start", cache_start), ("num_new", num_new)):
        if x is not None and x.shape != (b,):
            raise ValueError(f"{name} must be [B={b}], got {x.shape}")
    if not interpret and not is_pow2(s):
        raise ValueError(f"the Triton kernels need a power-of-two page size (k_pages), got {s}")


def pad_head_dim(x, d_pad: int):
    """Zero-pads the last axis to d_pad (a no-op when it already fits)."""
    d = x.shape[-1]
    if d == d_pad:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, d_pad - d)])


def clamped_page_table(page_table, num_pages: int, p_pad: int):
    """[B, Pmax] -> [B, p_pad] int32 ids clamped into the pool, so no load is out of bounds
    (slots past a sequence's length are masked, whatever page they name)."""
    pt = jnp.clip(page_table.astype(jnp.int32), 0, num_pages - 1)
    return jnp.pad(pt, ((0, 0), (0, p_pad - page_table.shape[1])))


# ----------------------------------------------------------------------------- static tiling


@dataclasses.dataclass(frozen=True)
class Tiling:
    """Static tile sizes of one kernel call (Python ints, chosen from shapes only).

    ppb: pages gathered per key block; p_pad: page-table width padded to a multiple of ppb
    (a power of two); d_pad: head dim padded for ``tl.dot``; n_rows: (query head, token) rows of
    one KV head; block_r: rows per program; r_pad: n_rows padded to a multiple of block_r.
    """

    ppb: int
    p_pad: int
    d_pad: int
    n_rows: int
    block_r: int
    r_pad: int

    @property
    def row_blocks(self) -> int:
        return self.r_pad // self.block_r


def tiling(pages_per_block: int, pmax: int, d: int, n_rows: int, block_rows: int) -> Tiling:
    """Tiles for ``pages_per_block`` wanted pages per key block over a [B, Pmax] page table,
    head dim d and n_rows rows per KV head (at most ``block_rows`` per program)."""
    ppb = min(max(1, pages_per_block), next_pow2(pmax))
    block_r = min(block_rows, max(MIN_DOT, next_pow2(n_rows)))
    return Tiling(ppb=ppb, p_pad=next_pow2(max(pmax, ppb)), d_pad=max(MIN_DOT, next_pow2(d)),
                  n_rows=n_rows, block_r=block_r, r_pad=pl.cdiv(n_rows, block_r) * block_r)


def pad_rows(qr, tl: Tiling):
    """[B, Hkv, n_rows, D] -> [B, Hkv, r_pad, d_pad] (zero rows and columns)."""
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, tl.r_pad - tl.n_rows), (0, 0)))
    return pad_head_dim(qr, tl.d_pad)


# ----------------------------------------------------------------------- in-kernel helpers


def load_kv_block(k_ref, v_ref, pt_ref, i, pages_per_block: int, dtype):
    """Key block i of one sequence: gathers ``pages_per_block`` pages of the KV head's pools.

    Returns k [Kb, Dp] in ``dtype`` (``tl.dot`` needs one operand dtype: a cache stored in
    another dtype than q is cast here) and v [Kb, Dp] as stored.
    """
    page_size, d = k_ref.shape[1], k_ref.shape[2]
    pages = pt_ref[pl.ds(i * pages_per_block, pages_per_block)]  # [ppb]
    k = k_ref[pages].reshape(pages_per_block * page_size, d)
    v = v_ref[pages].reshape(pages_per_block * page_size, d)
    return k.astype(dtype), v


def precision_for(dtype):
    """float32 inputs get full-precision dots (the tests compare against exact references)."""
    return lax.Precision.HIGHEST if dtype == jnp.float32 else None


def scores(q, k, scale: float):
    """q [R, Dp] . k [Kb, Dp] -> [R, Kb] float32 scaled scores."""
    return lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision_for(q.dtype),
                           preferred_element_type=jnp.float32) * scale


def softmax_init(rows: int, d: int):
    """Empty online-softmax state: (acc [R, Dp], running max m [R], denominator l [R])."""
    return (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), MASK_VALUE, jnp.float32),
            jnp.zeros((rows,), jnp.float32))


def softmax_update(carry, s, allowed, v, precision):
    """One flash step: folds scores s [R, Kb] (masked entries already MASK_VALUE) and values
    v [Kb, Dp] into (acc, m, l). ``allowed`` [R, Kb] bool or None (no mask): a fully masked row
    has m == MASK_VALUE and exp(0) == 1, so masked probabilities are zeroed explicitly.
    ``precision``: that of the score dot (``precision_for(q.dtype)``)."""
    acc, m_prev, l_prev = carry
    m_next = jnp.maximum(m_prev, s.max(axis=-1))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.exp(s - m_next[:, None])
    if allowed is not None:
        p = jnp.where(allowed, p, 0.0)
    l_next = alpha * l_prev + p.sum(axis=-1)
    pv = lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())),
                         precision=precision, preferred_element_type=jnp.float32)
    return alpha[:, None] * acc + pv, m_next, l_next


def softmax_finish(acc, l):
    """Normalised output [R, Dp] float32; rows that attended to nothing give 0 (as the
    reference does)."""
    return acc / jnp.where(l == 0.0, 1.0, l)[:, None]
