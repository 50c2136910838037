"""Paged KV cache: a pytree of page pools, plus the pure functions that write into it.

One page table serves a target and its draft: both models keep pools with the same number of
pages P and page size S, and a sequence's page ``page_table[b, i]`` holds its tokens
``[i*S, (i+1)*S)`` in *both* pools. The page table and per-sequence lengths therefore live
outside the pools (in the decoding state), and every forward takes them as arguments.

Entries at or beyond a sequence's length are stale (rejected drafts, padding): they are never
read (attention masks them and zeroes their values) and are simply overwritten later.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Per-layer key/value page pools of one model.

    Page index P (one past the end) is the "null page": writes aimed there are dropped.
    """

    k: tuple  # L x [Hkv, P, S, D]
    v: tuple  # L x [Hkv, P, S, D]

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[1]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[2]


def init_cache(cfg, num_pages, page_size: int, dtype=jnp.float32) -> KVCache:
    """Allocates zeroed pools: num_pages pages of page_size tokens for every layer of ``cfg``
    (any config with num_layers, num_kv_heads and head_dim; kv_cache imports no config module).

    ``num_pages`` may be a pair ``(P, P_window)`` (the engine's window page release,
    specjax.engine.kv_groups): then the layers with a sliding window (``cfg.window(i)`` not None)
    get pools of ``P_window`` pages and the others ``P``; such pools are addressed by a grouped
    page table (``group_table``)."""
    pages = (num_pages, num_pages) if not isinstance(num_pages, tuple) else num_pages
    if len(pages) != 2 or min(pages) < 1 or page_size < 1:
        raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
    windowed = getattr(cfg, "window", None)

    def shape(i):
        n = pages[1] if windowed is not None and windowed(i) is not None else pages[0]
        return (cfg.num_kv_heads, n, page_size, cfg.head_dim)

    return KVCache(k=tuple(jnp.zeros(shape(i), dtype) for i in range(cfg.num_layers)),
                   v=tuple(jnp.zeros(shape(i), dtype) for i in range(cfg.num_layers)))


def layer_windows(cfg) -> tuple:
    """Each layer's sliding window (None: full attention; every layer of a config without
    ``window``)."""
    fn = getattr(cfg, "window", None)
    return tuple(None if fn is None else fn(i) for i in range(cfg.num_layers))


def group_table(page_table, window):
    """The page table of a layer: ``page_table`` itself when it is [B, Pmax] (one KV group, every
    family), else row ``1`` (sliding-window layers) or ``0`` (full attention) of a grouped table
    [B, 2, Pmax] (specjax.engine.kv_groups: the sliding layers' pages live in their own pool)."""
    if page_table.ndim == 2:
        return page_table
    return page_table[:, 0 if window is None else 1]


def locate_slots(page_table, slots, num_pages: int, page_size: int):
    """Page and offset of cache slots: the one slot -> page lookup.

    Args:
      page_table: [B, Pmax] int32 (-1 or out-of-pool entries are unmapped).
      slots: [B, L] int32 slot indices of each row.
    Returns:
      (page [B, L], offset [B, L]) int32; slots that are negative, past the page table or on an
      unmapped page get the null page ``num_pages`` (a write there is dropped with mode="drop").
    """
    pmax = page_table.shape[1]
    page_idx = slots // page_size
    page = jnp.take_along_axis(page_table, jnp.clip(page_idx, 0, pmax - 1), axis=1)
    ok = (slots >= 0) & (page_idx < pmax) & (page >= 0) & (page < num_pages)
    return jnp.where(ok, page, num_pages), slots % page_size


def write_layer(k_pages, v_pages, k_new, v_new, page_table, cache_start, valid):
    """Writes new keys/values of one layer at slots cache_start[b] + t.

    Args:
      k_pages, v_pages: [Hkv, P, S, D] pools.
      k_new, v_new: [B, T, Hkv, D] the new tokens' keys/values.
      page_table: [B, Pmax] int32.
      cache_start: [B] int32 slot of the first new token.
      valid: [B, T] bool; False entries (padding) are not written.
    Returns:
      the updated (k_pages, v_pages). Donate the cache for an in-place update.
    """
    hkv, num_pages, page_size, d = k_pages.shape
    b, t = valid.shape
    slots = cache_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    pages, offsets = locate_slots(page_table, slots, num_pages, page_size)
    pages = jnp.where(valid, pages, num_pages)  # padding -> dropped
    pages, offsets = pages.reshape(-1), offsets.reshape(-1)  # [B*T]
    k_rows = k_new.reshape(b * t, hkv, d).transpose(1, 0, 2).astype(k_pages.dtype)  # [Hkv, B*T, D]
    v_rows = v_new.reshape(b * t, hkv, d).transpose(1, 0, 2).astype(v_pages.dtype)
    k_pages = k_pages.at[:, pages, offsets].set(k_rows, mode="drop")
    v_pages = v_pages.at[:, pages, offsets].set(v_rows, mode="drop")
    return k_pages, v_pages


def gather_layer(pages, page_table):
    """Reads every mapped page of each sequence into cache order.

    Args:
      pages: [Hkv, P, S, D]; page_table: [B, Pmax].
    Returns:
      [B, Hkv, Pmax*S, D] (slots in cache order; callers mask by length).
    """
    hkv, _, s, d = pages.shape
    b, pmax = page_table.shape
    g = pages[:, page_table]  # [Hkv, B, Pmax, S, D]
    return g.transpose(1, 0, 2, 3, 4).reshape(b, hkv, pmax * s, d)


def pages_needed(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def init_contiguous(cfg, batch: int, num_tokens: int, page_size: int = 16,
                    dtype=jnp.float32):
    """A cache of ``batch`` sequences of up to ``num_tokens`` tokens with contiguous pages.

    Returns (KVCache, page_table [B, Pmax]) for one-shot forwards (teacher forcing, training).
    """
    per_seq = pages_needed(num_tokens, page_size)
    return (init_cache(cfg, batch * per_seq, page_size, dtype),
            contiguous_page_table(batch, per_seq))


def contiguous_page_table(batch: int, pages_per_seq: int):
    """A page table giving row b the pages [b*pages_per_seq, (b+1)*pages_per_seq)."""
    return jnp.arange(batch * pages_per_seq, dtype=jnp.int32).reshape(batch, pages_per_seq)
