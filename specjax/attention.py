"""Attention over a paged cache: one entry point, a plain-jnp reference or the Pallas kernels.

Both implementations live in ``pallas_kernels`` (the reference is ``pallas_kernels.paged_attention.
paged_attention_reference``, re-exported here).

Semantics (shared by every implementation): the T new tokens of sequence b have already been
written at cache slots ``cache_start[b] + t``. Query t attends to
  * every slot j < cache_start[b] (the committed prefix) with no mask at all, and
  * new slot cache_start[b] + t' for t' < num_new[b] where ``new_mask[b, t, t']`` holds
    (causal ``t' <= t`` by default; an ancestor mask for draft trees).
Everything else (stale entries beyond the sequence, other sequences' pages) is never read:
its scores are masked and its values zeroed, so even NaN-poisoned pages cannot leak in.
"""

from __future__ import annotations

# The plain-jnp reference lives beside its kernels (each kernel file keeps its twin); specjax
# imports pallas_kernels, never the other way round.
from pallas_kernels import dispatch as _pallas
from pallas_kernels.paged_attention import causal_mask, paged_attention_reference  # noqa: F401

IMPLS = ("reference", "pallas")


def paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new, new_mask=None, *,
                    impl: str = "reference", scale=None):
    """Dispatches to the reference or the Pallas implementation (same semantics)."""
    if impl == "reference":
        return paged_attention_reference(q, k_pages, v_pages, page_table, cache_start, num_new,
                                         new_mask, scale=scale)
    if impl == "pallas":
        return _pallas.paged_attention(q, k_pages, v_pages, page_table, cache_start, num_new,
                                        new_mask, scale=scale)
    raise ValueError(f"attention impl must be one of {IMPLS}, got {impl!r}")
