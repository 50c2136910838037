"""Host-side KV page allocator shared by a target and its draft.

Both models' caches have the same number of pages P and page size S, so one page id names the
same token range in the target pool *and* the draft pool: one allocation, one page table, serves
the pair. The allocator only hands out ids; the device never sees it.

Pages are taken from a LIFO free list (recently freed pages are reused first, which keeps the
working set small) and every page has exactly one owner, so a double free or a foreign free is
an error instead of a silent corruption.
"""

from __future__ import annotations

from specjax.kv_cache import pages_needed


class OutOfPages(RuntimeError):
    """Raised by ``allocate`` when fewer pages are free than requested (callers check first)."""


class PageAllocator:
    """Fixed pool of ``num_pages`` page ids ``[0, num_pages)``, each owned by at most one request.

    Args:
      num_pages: P, the pool size (the caches are allocated with the same P).
      page_size: S, tokens per page.
    """

    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"num_pages and page_size must be >= 1, got {num_pages}, {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out 0, 1, 2, ... first
        self._owner: dict[int, object] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of pages in use (vLLM's ``kv_cache_usage_perc``, SGLang's ``token_usage``)."""
        return self.num_used / self.num_pages

    def pages_for(self, num_tokens: int) -> int:
        """Pages that hold ``num_tokens`` tokens."""
        return pages_needed(max(num_tokens, 0), self.page_size)

    def allocate(self, n: int, owner) -> list[int]:
        """Takes ``n`` free pages for ``owner``; raises OutOfPages (taking nothing) if short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise OutOfPages(f"{n} pages requested, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._owner[p] = owner
        return pages

    def free(self, pages, owner) -> None:
        """Returns ``owner``'s ``pages`` to the pool."""
        for p in pages:
            if self._owner.get(p, None) is not owner:
                raise ValueError(f"page {p} is not owned by {owner!r}")
        for p in reversed(pages):
            del self._owner[p]
            self._free.append(p)

    def snapshot(self) -> tuple:
        """Hashable allocator state (sorted free ids, owned ids): equal snapshots = nothing leaked."""
        return tuple(sorted(self._free)), tuple(sorted(self._owner))
