"""Paged attention as one native CPU call per layer (specjax/csrc/paged_attention.cc).

``specjax.attention.paged_attention(impl="reference")`` runs this on CPU when the native kernels
are built (``native_build.available()``), the inputs are float32 and the call has few query rows
(``MAX_ROWS``: decode, verify, trees) in a process with one device; prefill, every other
backend and multi-device processes keep the blockwise jnp path (a custom call has no SPMD
partitioning rule: under a tp-sharded cache XLA would gather the pools to run it). Same semantics (specjax.attention's module docstring) and the same plain twin,
``paged_attention_reference``, which the tests hold it to. Each query row is computed on its
own, so a row's output does not depend on T or on the other rows (decode and verify agree).

No gradient of its own: ``specjax.attention`` wraps it in a custom VJP whose backward pass is
the jnp path's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from specjax.native_build import ATTENTION_TARGET, available

MAX_ROWS = 64  # B * T query rows up to which the native call runs (above: the jnp path)


def paged_attention_call(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask, q_pos,
                         scale: float, window: int):
    """The custom call: every argument explicit (``new_mask`` [B, T, T] bool, ``q_pos`` [B, T],
    ``window`` 0 for none); no gradient (``specjax.attention`` wraps it in a custom VJP)."""
    call = jax.ffi.ffi_call(ATTENTION_TARGET[0], jax.ShapeDtypeStruct(q.shape, jnp.float32),
                            vmap_method="sequential")
    return call(q, k_pages, v_pages, page_table.astype(jnp.int32), cache_start.astype(jnp.int32),
                num_new.astype(jnp.int32), new_mask.astype(bool), q_pos.astype(jnp.int32),
                scale=np.float32(scale), window=np.int64(window))


def applies(q, k_pages, scale, v_pages=None) -> bool:
    """Whether the native call runs for these shapes / dtypes (static: decided while tracing)."""
    return (q.dtype == jnp.float32 and k_pages.dtype == jnp.float32
            and q.shape[0] * q.shape[1] <= MAX_ROWS and q.shape[2] % k_pages.shape[0] == 0
            and q.shape[3] == k_pages.shape[3]
            and (v_pages is None or (v_pages.shape == k_pages.shape and v_pages.dtype == k_pages.dtype))
            and (scale is None or isinstance(scale, (int, float))) and available()
            and jax.device_count() == 1)
