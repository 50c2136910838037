"""Entry points ``specjax.attention`` calls for ``impl="pallas"`` (same signatures as the reference)."""

from __future__ import annotations

from pallas_kernels import paged_attention as _paged


def paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask, scale=None):
    """Multi-query paged attention through the Pallas kernel (interpreted unless on GPU).

    Shapes as in ``specjax.attention.paged_attention_reference``: q [B, T, H, D], pools
    [Hkv, P, S, D], page_table [B, Pmax], cache_start/num_new [B], new_mask [B, T, T] or None.
    """
    return _paged.paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask,
                                  scale=scale)
