"""Host-side KV page allocator shared by a target and its draft, with a prefix cache.

Both models' caches have the same number of pages P and page size S, so one page id names the
same token range in the target pool *and* the draft pool (a draft LLM's KV, a head's KV): one
allocation, one page table, serves the pair, and a cached page covers both. The allocator only
hands out ids; the device never sees it.

Pages are taken from a LIFO free list (recently freed pages are reused first, which keeps the
working set small). Every page has a set of owners (its reference count); freeing a page its
caller does not own is an error instead of a silent corruption.

Prefix cache (vLLM-style automatic prefix caching): a full page of a sequence is named by a hash
chain over page contents, ``h_i = H(h_{i-1}, tokens of page i, lookahead)`` where ``lookahead``
is the first ``lookahead`` tokens after the page (1 for head drafters: a head's KV at a page's
last position consumes the next token, so that token is part of what the page holds). Once its
KV has been written (``register``), a page stays findable (``lookup``) while anyone owns it and,
after its last owner frees it, in an LRU of free cached pages; ``allocate`` evicts from that LRU
(least recently freed first) only when the free list is empty. ``num_free`` counts both kinds.

KV groups (specjax.engine.kv_groups): with a target that has sliding-window layers (Gemma 3)
and window page release on, this allocator serves the *global* group (full-attention layers,
and every layer of a draft or head of that type); the sliding layers' pages come from a second
PageAllocator of their own (``WindowGroup.alloc``, no prefix cache) whose logical page i names
the same token range as logical page i here, and those pages go back as soon as no later query's
window reads them. Prefix-cache rule: both allocators cache pages under the same hash chain
(``register`` skips released entries, -1). A released sliding page that was registered goes to
the sliding allocator's LRU with its content intact, so it stays findable until evicted; a prefix
hit of m pages here counts only as far as the sliding copies that its first query's window reads
(pages ``first_needed(m * S)..m-1``) are still cached there, else it shrinks to the longest m
that has them (``WindowGroup.lookup``): a hit whose sliding copy is gone is a miss for those pages.
"""

from __future__ import annotations

import collections
import hashlib

import numpy as np

from specjax.kv_cache import pages_needed


class OutOfPages(RuntimeError):
    """Raised by ``allocate`` when fewer pages are free than requested (callers check first)."""


def page_hashes(tokens, page_size: int, lookahead: int = 0, limit: int | None = None) -> list:
    """Chained hashes of the full pages of ``tokens`` (bytes, 16 each).

    Page i is hashed only when its ``lookahead`` following tokens exist and it ends at or before
    ``limit`` tokens (default: all of ``tokens``).
    """
    end = len(tokens) if limit is None else min(limit, len(tokens))
    out, parent = [], b""
    arr = np.asarray(tokens, np.int64)
    for i in range(end // page_size):
        stop = (i + 1) * page_size
        if stop + lookahead > len(tokens):
            break
        parent = hashlib.blake2b(parent + arr[i * page_size:stop + lookahead].tobytes(),
                                 digest_size=16).digest()
        out.append(parent)
    return out


class PageAllocator:
    """Fixed pool of ``num_pages`` page ids ``[0, num_pages)`` with reference-counted sharing.

    Args:
      num_pages: P, the pool size (the caches are allocated with the same P).
      page_size: S, tokens per page.
      lookahead: tokens after a page that its cached content depends on (module docstring).
    """

    def __init__(self, num_pages: int, page_size: int, lookahead: int = 0):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        if lookahead not in (0, 1):
            raise ValueError(f"lookahead must be 0 or 1, got {lookahead!r}")
        self.num_pages = num_pages
        self.page_size = page_size
        self.lookahead = lookahead
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self._owners: dict[int, list] = {}  # page -> owners (identity), one entry per reference
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._lru: collections.OrderedDict = collections.OrderedDict()  # free cached pages
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Pages an ``allocate`` can hand out (never used, or cached with no owner)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        return self.num_pages - self.num_free

    @property
    def num_cached(self) -> int:
        """Pages findable by ``lookup`` (owned or in the LRU)."""
        return len(self._hash_of)

    @property
    def usage(self) -> float:
        """Fraction of pages in use (vLLM's ``kv_cache_usage_perc``, SGLang's ``token_usage``)."""
        return self.num_used / self.num_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens."""
        return pages_needed(max(num_tokens, 0), self.page_size)

    def allocate(self, n: int, owner) -> list[int]:
        """Takes ``n`` free pages for ``owner`` (evicting cached ones, least recently freed
        first, once the free list is empty); raises OutOfPages (taking nothing) if short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > self.num_free:
            raise OutOfPages(f"{n} pages requested, {self.num_free} free")
        pages = []
        for _ in range(n):
            if self._free:
                p = self._free.pop()
            else:
                p, _ = self._lru.popitem(last=False)
                del self._by_hash[self._hash_of.pop(p)]
                self.num_evictions += 1
            self._owners[p] = [owner]
            pages.append(p)
        return pages

    def free(self, pages, owner) -> None:
        """Drops ``owner``'s reference to each of ``pages``; a page nobody owns any more goes
        back to the free list, or to the LRU if it is cached."""
        for p in pages:
            if not any(o is owner for o in self._owners.get(p, ())):
                raise ValueError(f"page {p} is not owned by {owner!r}")
        for p in reversed(pages):
            owners = self._owners[p]
            owners.pop(next(i for i, o in enumerate(owners) if o is owner))
            if owners:
                continue
            del self._owners[p]
            if p in self._hash_of:
                self._lru[p] = None
            else:
                self._free.append(p)

    # -------------------------------------------------------------------------- prefix cache
    def lookup(self, tokens, limit: int) -> list[int]:
        """Cached pages holding the longest page-aligned prefix of ``tokens`` that ends at or
        before ``limit`` tokens (callers pass len - 1: the last token is always prefilled)."""
        pages = []
        for h in page_hashes(tokens, self.page_size, self.lookahead, limit):
            p = self._by_hash.get(h)
            if p is None:
                break
            pages.append(p)
        return pages

    def find(self, hashes) -> list:
        """The cached page of each of ``hashes`` (``page_hashes``), None where there is none."""
        return [self._by_hash.get(h) for h in hashes]

    def num_evictable(self, pages) -> int:
        """How many of ``pages`` sit in the LRU (acquiring them takes them out of ``num_free``)."""
        return sum(p in self._lru for p in pages)

    def acquire(self, pages, owner) -> list[int]:
        """Adds ``owner`` as an owner of the cached ``pages`` (from ``lookup``); returns them."""
        for p in pages:
            if p not in self._hash_of:
                raise ValueError(f"page {p} is not cached")
        for p in pages:
            if p in self._lru:
                del self._lru[p]
                self._owners[p] = [owner]
            else:
                self._owners[p].append(owner)
        return list(pages)

    def register(self, pages, tokens, limit: int, owner) -> int:
        """Makes ``owner``'s full pages of ``tokens`` (its page table ``pages``) that end at or
        before ``limit`` findable, once their KV is written (or dispatched to be written: steps
        run in order). A page whose content is cached already under another id stays private.
        Returns the number of pages newly cached."""
        new = 0
        for i, h in enumerate(page_hashes(tokens, self.page_size, self.lookahead, limit)):
            p = pages[i]
            if p < 0:
                continue  # a released sliding-window page (kv_groups): nothing to cache
            if not any(o is owner for o in self._owners.get(p, ())):
                raise ValueError(f"page {p} is not owned by {owner!r}")
            if h in self._by_hash or p in self._hash_of:
                continue
            self._by_hash[h], self._hash_of[p] = p, h
            new += 1
        return new

    def snapshot(self) -> tuple:
        """Hashable allocator state (sorted free ids incl. free cached ones, owned ids): equal
        snapshots = nothing leaked."""
        return tuple(sorted(self._free + list(self._lru))), tuple(sorted(self._owners))
