"""Helpers shared by the attention kernels: tile arithmetic, input checks, compiler params."""

from __future__ import annotations

import jax
import jax.numpy as jnp

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
