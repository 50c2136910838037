"""Tree attention (EAGLE-style verification of a draft tree) over the paged cache.

A draft tree of N nodes per sequence is written at slots ``cache_start[b] + n`` (node order is
the slot order). Node n attends to
  * every committed prefix slot ``j < cache_start[b]`` with **no mask at all**, and
  * tree node n' < num_nodes[b] iff n' is n itself or one of its ancestors (the N x N ancestor
    mask).
The mask never touches the prefix: ``paged_attention``'s kernel runs the prefix key blocks in a
loop without any masking and applies the per-row ancestor bitmask only in the block(s) holding
the tree, so a tree costs what a chain verify of N tokens costs (the production system saw up to
50% slowdown from a custom mask over the whole sequence). The tree is given as a parent array and
turned into the ancestor mask once (in a model, once per step, shared by every layer).

Same kernel, grid and tunables as ``pallas_kernels.paged_attention`` (``BlockSizes`` re-exported).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels import paged_attention as _paged

BlockSizes = _paged.BlockSizes


def ancestor_mask(parents):
    """Ancestor-or-self mask of a forest given by parent pointers (pointer doubling).

    Args:
      parents: [B, N] int; ``parents[b, n]`` is node n's parent, or -1 for a root (a child of
        the committed prefix). Any node order works; pointers must form a forest (no cycles).
    Returns:
      [B, N, N] bool: ``mask[b, n, n']`` iff n' is n or an ancestor of n.
    """
    b, n = parents.shape
    idx = jnp.arange(n, dtype=parents.dtype)
    reach = (idx[:, None] == idx[None, :])[None] | (parents[:, :, None] == idx[None, None, :])
    # reach holds paths of length <= 1; each squaring doubles that, so ceil(log2 N) squarings
    # cover every ancestor chain (depth < N).
    for _ in range(max(1, (n - 1).bit_length())):
        r = reach.astype(jnp.float32)
        reach = reach | (jnp.einsum("bik,bkj->bij", r, r) > 0)
    return reach


def ancestor_mask_reference(parents):
    """Plain twin of ``ancestor_mask``: walk every node's parent chain one step at a time."""
    b, n = parents.shape
    idx = jnp.arange(n, dtype=parents.dtype)
    mask = jnp.broadcast_to(idx[:, None] == idx[None, :], (b, n, n))

    def step(_, carry):
        mask, cur = carry  # cur [B, N]: the ancestor reached so far (-1 once past a root)
        mask = mask | ((cur[:, :, None] == idx[None, None, :]) & (cur >= 0)[:, :, None])
        nxt = jnp.take_along_axis(parents, jnp.maximum(cur, 0), axis=1)
        return mask, jnp.where(cur >= 0, nxt, -1)

    mask, _ = lax.fori_loop(0, n, step, (mask, parents))
    return mask


def _validate(q, parents, num_nodes):
    if q.ndim != 4:
        raise ValueError(f"q must be [B, N, H, D], got shape {q.shape}")
    b, n = q.shape[:2]
    if parents.shape != (b, n) or not jnp.issubdtype(parents.dtype, jnp.integer):
        raise ValueError(f"parents must be int [B, N] = {(b, n)}, got {parents.dtype} "
                         f"{parents.shape}")
    if num_nodes is not None and (num_nodes.shape != (b,)
                                  or not jnp.issubdtype(num_nodes.dtype, jnp.integer)):
        raise ValueError(f"num_nodes must be int [B={b}], got {num_nodes.dtype} {num_nodes.shape}")


def tree_attention_reference(q, k_pages, v_pages, page_table, cache_start, parents,
                             num_nodes=None, *, scale=None):
    """Plain-jnp twin of ``tree_attention`` (walked ancestor mask + the reference attention)."""
    _validate(q, parents, num_nodes)
    b, n = parents.shape
    if num_nodes is None:
        num_nodes = jnp.full((b,), n, jnp.int32)
    return _paged.paged_attention_reference(q, k_pages, v_pages, page_table, cache_start,
                                            num_nodes, ancestor_mask_reference(parents),
                                            scale=scale)


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret"))
def tree_attention(q, k_pages, v_pages, page_table, cache_start, parents, num_nodes=None, *,
                   scale: float | None = None, block_sizes: BlockSizes = BlockSizes(),
                   interpret: bool | None = None):
    """Attention of N draft-tree nodes per sequence: unmasked prefix + ancestor mask in the tree.

    Args:
      q: [B, N, H, D] queries of the tree nodes (RoPE at each node's depth already applied).
      k_pages, v_pages: [Hkv, P, S, D] pools; node n's K/V already written at slot
        ``cache_start[b] + n``.
      page_table: [B, Pmax] int page ids.
      cache_start: [B] int committed prefix length (slot of node 0).
      parents: [B, N] int parent of each node, -1 for a root (attends only to the prefix and
        itself).
      num_nodes: optional [B] int valid nodes per sequence (default N); padding nodes are never
        attended to.
      scale: softmax scale, default D ** -0.5.
      block_sizes: tunables of the paged kernel (split-K, tiles, warps).
      interpret: run the Pallas interpreter; None means "True unless the default backend is GPU".
    Returns:
      [B, N, H, D] in q's dtype.
    Raises:
      ValueError: on inconsistent shapes or dtypes (the message names the argument).
    """
    _validate(q, parents, num_nodes)
    b, n = parents.shape
    if num_nodes is None:
        num_nodes = jnp.full((b,), n, jnp.int32)
    return _paged.paged_attention(q, k_pages, v_pages, page_table, cache_start, num_nodes,
                                  ancestor_mask(parents), scale=scale, block_sizes=block_sizes,
                                  interpret=interpret)
