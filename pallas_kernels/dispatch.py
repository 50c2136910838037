"""Entry points ``specjax.attention`` calls for ``impl="pallas"`` (same signatures as the reference).

Dispatch rule (static, from shapes only, so one jit trace picks one kernel):

* ``new_mask is None`` (causal) and ``T >= PREFILL_MIN_TOKENS`` -> ``prefill_attention``:
  prompts and chunked prefill (the engine buckets prompts to >= 16 tokens), and long chains.
  Token-major rows, causal block skipping and no bitmask words make it the better kernel once
  many new tokens share a sequence.
* everything else -> ``paged_attention``: decode (T = 1), chain verification (T = k + 1) and
  trees (an explicit ancestor ``new_mask``), with split-K over long prefixes chosen by
  ``BlockSizes(num_splits=None)``. Tree callers holding parent arrays can call
  ``pallas_kernels.tree_attention.tree_attention`` directly; it is the same kernel.
"""

from __future__ import annotations

from pallas_kernels import paged_attention as _paged
from pallas_kernels import prefill_attention as _prefill

PREFILL_MIN_TOKENS = 16


def paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask, scale=None):
    """Multi-query paged attention through a Pallas kernel (interpreted unless on GPU).

    Shapes as in ``pallas_kernels.paged_attention.paged_attention_reference``: q [B, T, H, D], pools
    [Hkv, P, S, D], page_table [B, Pmax], cache_start/num_new [B], new_mask [B, T, T] or None.
    """
    if new_mask is None and q.shape[1] >= PREFILL_MIN_TOKENS:
        return _prefill.prefill_attention(q, k_pages, v_pages, page_table, cache_start, num_new,
                                          scale=scale)
    return _paged.paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask,
                                  scale=scale)
