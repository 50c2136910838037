"""Pallas attention kernels; each kernel file holds its plain-jnp ``*_reference`` twin.

* ``paged_attention``: decode / chain / tree verification (T queries per sequence), split-K.
* ``prefill_attention``: causal flash-style prefill over the paged cache, variable lengths.
* ``tree_attention``: draft trees from parent arrays (unmasked prefix + ancestor mask).
* ``dispatch``: what ``specjax.attention.paged_attention(..., impl="pallas")`` calls.
"""
