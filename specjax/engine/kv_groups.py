"""KV groups: window page release for sliding-window layers (Gemma 3) in the engine's paged KV.

A target whose layers mix full attention and a sliding window W (``cfg.window(i)``: an int for
sliding layers, None for global ones) has two KV groups, as in vLLM's hybrid KV cache manager
(``SlidingWindowManager``): the global layers keep every page of a sequence, but a sliding layer's
query at position q reads only positions > q - W, so once every future query of a request sits
at or past ``q_min``, its sliding-layer pages wholly below ``q_min - W + 1`` are never read
again. The sliding group therefore gets its own page pool (``WindowGroup.alloc``, same page size)
and its own per-request page list (``Request.window_pages``, aligned with ``Request.pages``:
logical page i of both lists holds the same token range), and the scheduler hands those pages
back as the request advances (``release``). A released entry is -1 in the step's page table:
writes there are dropped, reads gather some pool page whose scores the window masks and whose
values the attention zeroes (``specjax.attention``: slots below every query's window of a row),
so stale or reused pages never reach the output (no 0 * inf either).

The bound ``q_min`` (a lower bound on every position a later step of the request writes or
queries, in the target *and* the drafter):

* decoding: the device holds n >= ``num_known`` committed tokens (the host reads accepted counts
  late; in-flight steps only add), and a step writes from slot n - 1 on: ``num_known - 1``;
  draft/verify tokens beyond n are written at larger positions and rolled back to >= n - 1, tree
  nodes sit at n - 1 + depth, so speculation never goes below it;
* prefilling: the next chunk's start (``num_prefilled``; chunks only move forward);
* minus the drafter's ``margin``: its ``lag_offset`` (a head's pending position ends one before
  the target's) plus, with adaptive k, ``speculate.LAG_WINDOW`` (a lagging drafter catches up
  from up to that many positions back).

A draft that shares the paged KV (an early-exit draft of the target's first layers, a Gemma head)
follows the same tables: its pools are built from the same ``(P, P_window)`` pair
(``kv_cache.init_cache``) and each of its layers reads the table of its own type
(``kv_cache.group_table``), so one logical page names the same token range in every pool of its
group. Drafters with a pool of another kind (DFlash) turn release off.

Pool size: a request holds at most ``per_slot`` live sliding pages (``bound_per_slot``: the window,
the margin, the write-ahead and one step's or chunk's tokens, rounded to pages), so the sliding
pool defaults to ``max_slots * per_slot`` pages instead of ``max_slots * pages_per_seq``; a short
pool only preempts (the scheduler checks both pools), it never corrupts.

Prefix caching (the rule, as vLLM's sliding-window manager): the sliding pool is a
``PageAllocator`` with its own prefix cache over the same hash chain as the global one. A
request's sliding pages are registered with its global ones and released as usual; a released
page that is registered goes to the pool's LRU with its content intact (findable until evicted).
A prefix hit of m global pages needs only the sliding copies its first query's window reads,
pages ``first_needed(m * S)..m-1``; ``lookup`` shrinks the hit to the longest m whose copies are
all still cached (a hit that needs a released-and-evicted sliding page is a miss for those pages),
and the new request's table has -1 below them.
"""

from __future__ import annotations

import logging

from specjax.engine.allocator import PageAllocator, page_hashes
from specjax.kv_cache import pages_needed

log = logging.getLogger(__name__)


def window_of(cfg) -> int | None:
    """The sliding window shared by ``cfg``'s sliding layers, or None (no sliding layer).
    Raises ValueError for several different windows (one sliding group only)."""
    fn = getattr(cfg, "window", None)
    if fn is None:
        return None
    windows = {fn(i) for i in range(cfg.num_layers)} - {None}
    if len(windows) > 1:
        raise ValueError(f"window page release supports one sliding window, got {sorted(windows)}")
    return windows.pop() if windows else None


def bound_per_slot(window: int, margin: int, ahead: int, step_tokens: int, page_size: int) -> int:
    """Most live sliding pages one request holds: positions from ``q_min - margin - W + 1`` to
    the last slot a planned step may write (``q_min + 1 + step_tokens + ahead``: the tokens of
    the steps still in flight or a prefill chunk, plus the write-ahead), plus one page of
    rounding at each end."""
    return pages_needed(window + margin + step_tokens + ahead + 1, page_size) + 1


class WindowGroup:
    """The sliding layers' page pool and release rule (module docstring).

    Args:
      num_pages: the sliding pool's size.
      page_size: S, as the global pool's.
      window: W of the sliding layers.
      margin: positions a drafter may write or query below the target's ``q_min``.
      per_slot: the bound on live sliding pages per request (``bound_per_slot``).
      lookahead: as ``PageAllocator`` (the global allocator's: one hash chain for both).
    """

    def __init__(self, num_pages: int, page_size: int, window: int, margin: int, per_slot: int,
                 lookahead: int = 0):
        self.alloc = PageAllocator(num_pages, page_size, lookahead=lookahead)
        self.page_size, self.window, self.margin, self.per_slot = page_size, window, margin, per_slot
        self.check_rows = True  # verify every planned row's window is mapped (cheap, host-side)
        self.num_released = 0  # pages handed back early (counter)
        self.max_live = 0  # most live sliding pages one request has held

    @property
    def num_pages(self) -> int:
        return self.alloc.num_pages

    @property
    def num_free(self) -> int:
        return self.alloc.num_free

    def first_needed(self, q_min: int) -> int:
        """Index of a request's first sliding page that a query at position >= ``q_min`` (target
        or drafter) may still read: pages before it end at or below ``q_min - margin - W``."""
        return max(0, q_min - self.margin - self.window + 1) // self.page_size

    def lookup(self, tokens, num_pages: int) -> tuple[int, list]:
        """(m, pages): the longest prefix of the ``num_pages`` cached global pages of ``tokens``
        whose sliding copies a first query at position m * S still reads (pages
        ``first_needed(m * S)..m-1``) are all cached here, and those sliding pages."""
        s = self.page_size
        found = self.alloc.find(page_hashes(tokens, s, self.alloc.lookahead,
                                            num_pages * s)[:num_pages])
        for m in range(len(found), 0, -1):
            window = found[self.first_needed(m * s):m]
            if None not in window:
                return m, window
        return 0, []

    def acquire(self, req, num_pages: int, pages) -> None:
        """Starts ``req``'s sliding table with a prefix hit of ``num_pages`` pages whose last
        ``len(pages)`` sliding copies are ``pages`` (from ``lookup``; -1 below them)."""
        req.window_pages = [-1] * (num_pages - len(pages)) + self.alloc.acquire(pages, req)

    def allocate(self, n: int, req) -> None:
        """Extends ``req.window_pages`` by ``n`` pages (callers check ``num_free`` first)."""
        req.window_pages += self.alloc.allocate(n, req)
        self.max_live = max(self.max_live, sum(p >= 0 for p in req.window_pages))

    def release(self, req, q_min: int) -> int:
        """Hands back ``req``'s sliding pages below ``first_needed(q_min)``; returns how many."""
        pages = req.window_pages
        stop = min(self.first_needed(q_min), len(pages))
        drop = [p for p in pages[:stop] if p >= 0]
        if drop:
            self.alloc.free(drop, req)
            pages[:stop] = [-1] * stop
            self.num_released += len(drop)
        return len(drop)

    def free(self, req) -> None:
        """Hands back every live sliding page of ``req`` (finish, abort, preemption)."""
        self.alloc.free([p for p in req.window_pages if p >= 0], req)
        req.window_pages = []

    def check(self, req, q_min: int, end: int) -> None:
        """Raises RuntimeError unless every sliding page a step querying positions ``q_min..``
        and writing up to token ``end`` may touch is mapped: a guard on ``release`` computed from
        the positions, not from ``first_needed``."""
        lo = max(0, q_min - self.margin - (self.window - 1))  # oldest position still read
        pages = req.window_pages
        need = range(lo // self.page_size, min(pages_needed(end, self.page_size), len(pages)))
        gone = [i for i in need if pages[i] < 0]
        if gone:
            raise RuntimeError(f"request {req.id}: sliding-window pages {gone} were released "
                               f"but a step from position {q_min} may still read them")

    def live(self, req) -> int:
        return sum(p >= 0 for p in req.window_pages)


def _per_layer_kv(drafter) -> bool:
    """Whether ``drafter``'s pool (if any) is a per-layer K/V cache built by
    ``kv_cache.init_cache`` (draft LLMs, heads) that follows a grouped page table."""
    from specjax.speculate.drafters import base, head, llm, ngram  # noqa: PLC0415

    inner = drafter.inner if isinstance(drafter, ngram.Hybrid) else drafter
    return isinstance(inner, (base.NoDrafter, ngram.NgramDrafter, llm.DraftLLM, head.HeadDrafter))


def make_window_group(cfg, target_cfg, drafter, *, max_slots: int, pages_per_seq: int,
                      num_pages: int, write_ahead: int, step_tokens: int, lag_window: int):
    """The engine's WindowGroup for ``EngineConfig`` ``cfg``, or None: no sliding layer (every
    family but Gemma 3), ``window_page_release`` off, or a drafter whose pool is not a per-layer
    K/V cache (logged).

    step_tokens: most tokens a planned step adds beyond the host's known length (in-flight
    growth, a prefill chunk); lag_window: positions a lagging drafter catches up (adaptive k)."""
    window = window_of(target_cfg)
    if window is None or not cfg.window_page_release:
        return None
    if not _per_layer_kv(drafter):
        log.info("window page release is off: drafter %s keeps another kind of pool",
                 type(drafter).__name__)
        return None
    margin = drafter.lag_offset + (lag_window if cfg.spec.adaptive else 0)
    s = cfg.spec.page_size
    per_slot = min(bound_per_slot(window, margin, write_ahead, step_tokens, s), pages_per_seq)
    size = cfg.num_window_pages or min(max_slots * per_slot, num_pages)
    if size < per_slot:
        raise ValueError(f"num_window_pages {size} cannot hold one sequence's window "
                         f"({per_slot} pages of {s})")
    return WindowGroup(size, s, window, margin, per_slot, lookahead=drafter.lag_offset)
