"""Continuous-batching scheduler: admission, chunked prefill, page allocation ahead, preemption.

Host code (it never calls into jax; it imports only the step kinds from
specjax.engine.steps). Every request that holds a slot is either PREFILL (its prompt, or its
prompt plus the tokens generated before a preemption, is being written in chunks) or DECODE (the
device holds its state). Each ``schedule()`` call plans one device step:

1. Running prefills get their next chunk (at most the largest token bucket, within the step's
   prefill-token budget).
2. Pages are allocated *ahead* for every row of the step: a decode row of a request with
   (upper-bound) length n writes slot n-1 and at most w slots beyond it (w = ``write_ahead``:
   k+1 for a chain, ``SpecConfig.extra_slots`` for trees), so pages cover n + w tokens; a chunk
   ending at e needs e + w. The upper bound n_ub = known length + the growth of the steps still in flight
   (k+1 per speculative step, 1 per ordinary one), so a step may be planned before the previous
   one's accepted lengths are known.
3. If the pool cannot cover that, the most recently admitted requests are preempted (pages and
   slot freed, epoch bumped so in-flight results are discarded) and go back to the *front* of the
   queue; they are recomputed later by prefilling prompt + generated tokens. Nothing is ever
   corrupted: a freed page is only reused by steps dispatched after every step that wrote it.
4. If nothing was preempted, waiting requests are admitted first-come first-served while a slot,
   the prefill budget and pages (keeping one spare page per decode row) allow.
5. The step kind: any prefill chunk -> an ordinary ("extend") step where decode rows take one
   token; decode rows only -> a speculative step, unless the method is "none" or the batch is
   larger than ``spec_max_batch`` (then an ordinary one-token step).
6. With window page release (a target with sliding-window layers, specjax.engine.kv_groups)
   the sliding layers' pages come from their own pool: each request's pages below every later
   query's window go back at the start of ``schedule()``, new pages are taken from both pools
   (preemption and admission check both), every planned row's window is checked mapped, and a
   prefix hit is cut to the pages whose sliding copies its first window still needs are cached.
7. When decode rows would speculate, prefill chunks are not mixed into their step: a mixed
   step pads every decode row to the chunk width T (a [B, T] target forward that advances each
   decode row by one token, instead of a speculative step) -- with continuous batching and
   staggered finishes that happens at nearly every admission. Instead the step runs the
   prefill rows alone (a small batch bucket) and the next step is a speculative step over the
   decode rows; the two alternate while prompts are being prefilled.
"""

from __future__ import annotations

import collections
import dataclasses

from specjax.engine.allocator import PageAllocator
from specjax.engine.steps import KIND_DECODE, KIND_PREFILL

WAITING, PREFILL, DECODE, FINISHED = "waiting", "prefill", "decode", "finished"


@dataclasses.dataclass(eq=False)
class Request:
    """Host record of one request (mutable; identity equality)."""

    id: int
    prompt: list
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: frozenset
    arrival: float
    handle: object = None
    callback: object = None
    output: list = dataclasses.field(default_factory=list)
    state: str = WAITING
    slot: int = -1
    pages: list = dataclasses.field(default_factory=list)
    window_pages: list = dataclasses.field(default_factory=list)  # sliding group's (-1 released)
    seq: list = dataclasses.field(default_factory=list)  # tokens to prefill (prompt + output)
    num_prefilled: int = 0
    cached_prefix: int = 0  # tokens the prefix cache supplied at admission (not yet seeded)
    epoch: int = 0  # bumped at preemption: results of older dispatches are ignored
    inflight_growth: int = 0  # upper bound on tokens added by dispatched, unread steps
    admitted_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    num_preemptions: int = 0
    # one (output index of its first token, accepted drafts, drafts proposed) per speculative step
    spec_steps: list = dataclasses.field(default_factory=list)
    matcher: object = None  # a specjax.structured.Matcher (structured outputs), else None

    @property
    def num_known(self) -> int:
        """Committed tokens the host has seen (prompt + generated)."""
        return len(self.prompt) + len(self.output)


@dataclasses.dataclass
class Row:
    """One row of a planned step."""

    req: Request
    epoch: int
    kind: int  # steps.KIND_PREFILL | steps.KIND_DECODE
    growth: int = 0  # max tokens this row adds to the request's length
    commit: bool = False  # the row samples a token the request keeps
    start: int = 0
    tokens: list = dataclasses.field(default_factory=list)
    final: bool = False
    next_token: int = 0


@dataclasses.dataclass
class Plan:
    """One device step: "extend" (ordinary sampling, T tokens per row) or "spec"."""

    kind: str
    rows: list
    t: int  # token bucket (0 for "spec")
    k: int = 0  # drafts per row of a "spec" step (EngineConfig.num_speculative_tokens_per_batch_size)


def _q_min(r: Request) -> int:
    """A lower bound on every position a later step of ``r`` writes or queries (before a
    drafter's margin): a decoding request writes from slot n - 1 with n >= the host's known
    length; a prefilling one from its next chunk's start (specjax.engine.kv_groups)."""
    return r.num_known - 1 if r.state == DECODE else r.num_prefilled


def bucket(n: int, buckets) -> int:
    """Smallest bucket >= n (buckets sorted ascending; n <= the largest)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


class Scheduler:
    """Owns the queue, the slots and the page allocator (see the module docstring)."""

    def __init__(self, allocator: PageAllocator, *, num_slots: int, token_buckets, k_eff: int,
                 write_ahead: int, speculative: bool, spec_max_batch: int | None, pages_per_seq: int,
                 max_prefill_tokens: int | None, prefix_caching: bool = False,
                 k_table: tuple | None = None, window=None):
        self.alloc = allocator
        self.window = window  # kv_groups.WindowGroup (sliding layers' pages) or None
        self.num_slots = num_slots
        self.token_buckets = tuple(token_buckets)
        self.k1 = k_eff + 1  # most tokens a speculative step adds
        self.ahead = max(write_ahead, 1)  # slots a step may write from n - 1
        self.speculative = speculative
        self.spec_max_batch = spec_max_batch
        self.max_tokens_per_seq = pages_per_seq * allocator.page_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: collections.deque = collections.deque()
        self.running: list = []  # admission order (latest last = first preemption victim)
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.num_preemptions = 0
        self.prefix_caching = prefix_caching
        self.k_table = k_table  # ((lo, hi, k), ...) drafts per decode batch size; None = k_eff
        self.k_eff = k_eff
        self.prefix_cache_queries = 0  # tokens looked up at admission (vLLM's counters)
        self.prefix_cache_hits = 0  # of those, tokens found cached (not prefilled)
        self._last_prefill_only = False  # the previous plan ran prefill rows without decode rows

    # -------------------------------------------------------------------------- bookkeeping
    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def _release(self, req: Request) -> None:
        self.alloc.free(req.pages, req)
        req.pages = []
        if self.window is not None:
            self.window.free(req)
        self.free_slots.append(req.slot)
        req.slot = -1
        self.running.remove(req)

    def finish(self, req: Request, reason: str) -> None:
        """Ends a request: its pages and slot go back (in-flight steps may still write them;
        they run before any step that reuses them)."""
        self._release(req)
        req.state = FINISHED
        req.finish_reason = reason

    def preempt(self, req: Request) -> None:
        """Frees a running request and requeues it at the front for recomputation."""
        self._release(req)
        req.state = WAITING
        req.epoch += 1
        req.inflight_growth = 0
        req.num_prefilled = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def _need_pages(self, req: Request, tokens: int) -> int:
        tokens = min(tokens, self.max_tokens_per_seq)
        return max(0, self.alloc.pages_for(tokens) - len(req.pages))

    # -------------------------------------------------------------------------- planning
    def schedule(self, now: float) -> Plan | None:
        """Plans the next step (mutates request states: chunks advance, pages are allocated)."""
        tmax = self.token_buckets[-1]
        budget = self.max_prefill_tokens if self.max_prefill_tokens is not None else float("inf")
        n_decode = sum(r.state == DECODE for r in self.running)
        split = n_decode > 0 and self._speculates(n_decode)
        if split and self._last_prefill_only:
            budget = 0  # a speculative step for the decode rows first (point 7)
        chunks: dict = {}
        win = self.window
        if win is not None:  # sliding pages no later step of a request reads go back first
            for r in self.running:
                win.release(r, _q_min(r))
        for r in self.running:
            if r.state == PREFILL and budget > 0:
                c = int(min(len(r.seq) - r.num_prefilled, tmax, budget))
                chunks[r] = c
                budget -= c

        def need(r):
            if r.state == DECODE:
                return self._need_pages(r, r.num_known + r.inflight_growth + self.ahead)
            if r in chunks:
                return self._need_pages(r, r.num_prefilled + chunks[r] + self.ahead)
            return 0

        preempted = False

        def num_free():  # new pages come from both pools with window release
            return self.alloc.num_free if win is None else min(self.alloc.num_free, win.num_free)

        while self.running and sum(need(r) for r in self.running) > num_free():
            victim = self.running[-1]
            chunks.pop(victim, None)
            self.preempt(victim)
            preempted = True
        for r in self.running:
            n = need(r)
            if n:
                r.pages += self.alloc.allocate(n, r)
                if win is not None:
                    win.allocate(n, r)

        if not preempted:
            spare = sum(r.state == DECODE for r in self.running)  # one growth page per decode row
            while self.waiting and self.free_slots and budget > 0:
                r = self.waiting[0]
                seq = r.prompt + r.output
                # cached full pages of the prefix, never the last token (it is prefilled: the
                # drafter's carried logits / hidden state are per slot)
                hit = self.alloc.lookup(seq, len(seq) - 1) if self.prefix_caching else []
                whit = []  # the sliding copies the hit's first query reads (kv_groups)
                if win is not None and hit:
                    m, whit = win.lookup(seq, len(hit))
                    hit = hit[:m]
                h = len(hit) * self.alloc.page_size
                c = int(min(len(seq) - h, tmax, budget))
                n = self.alloc.pages_for(min(h + c + self.ahead, self.max_tokens_per_seq)) - len(hit)
                if n + self.alloc.num_evictable(hit) + spare > self.alloc.num_free or (
                        win is not None
                        and n + win.alloc.num_evictable(whit) + spare > win.num_free):
                    break
                self.waiting.popleft()
                r.slot = self.free_slots.pop()
                r.pages = self.alloc.acquire(hit, r) + self.alloc.allocate(n, r)
                if win is not None:
                    win.acquire(r, len(hit), whit)
                    win.allocate(n, r)
                r.seq, r.num_prefilled, r.cached_prefix, r.state = seq, h, h, PREFILL
                if self.prefix_caching:
                    self.prefix_cache_queries += len(seq)
                    self.prefix_cache_hits += h
                if r.admitted_at is None:
                    r.admitted_at = now
                self.running.append(r)
                chunks[r] = c
                budget -= c

        rows = []
        for r in self.running:
            if win is not None and win.check_rows and (r.state == DECODE or r in chunks):
                win.check(r, _q_min(r), len(r.pages) * self.alloc.page_size)
            if r.state == DECODE:
                rows.append(Row(r, r.epoch, KIND_DECODE, commit=True))
            elif r in chunks:
                c, start = chunks[r], r.num_prefilled
                final = start + c == len(r.seq)
                rows.append(Row(r, r.epoch, KIND_PREFILL, growth=int(final), commit=final,
                                start=start, tokens=r.seq[start:start + c], final=final,
                                next_token=0 if final else r.seq[start + c]))
                r.num_prefilled += c
                if self.prefix_caching:  # KV of these pages is written by this step
                    limit = min(r.num_prefilled, len(r.seq) - 1)
                    self.alloc.register(r.pages, r.seq, limit, r)
                    if win is not None:
                        win.alloc.register(r.window_pages, r.seq, limit, r)
                if final:
                    r.state = DECODE  # from the next step on, the device holds its state
        self._last_prefill_only = False
        if not rows:
            return None
        if chunks:
            if split:  # prefill rows alone; decode rows speculate in the next step
                rows = [row for row in rows if row.kind != KIND_DECODE]
                self._last_prefill_only = True
            for row in rows:
                if row.kind == KIND_DECODE:
                    row.growth = 1
            return Plan("extend", rows, bucket(max(chunks.values()), self.token_buckets))
        if self._speculates(len(rows)):
            k = self.k_for(len(rows))
            for row in rows:
                row.growth = k + 1
            return Plan("spec", rows, 0, k)
        for row in rows:
            row.growth = 1
        return Plan("extend", rows, 1)

    def k_for(self, num_decode: int) -> int:
        """Drafts per row for a decode-only step of this many rows (0 = plain)."""
        if self.k_table is None:
            return self.k_eff
        return next(k for lo, hi, k in self.k_table if lo <= num_decode <= hi)

    def _speculates(self, num_decode: int) -> bool:
        """Whether a decode-only step of this many rows is speculative."""
        return (self.speculative and self.k_for(num_decode) > 0
                and (self.spec_max_batch is None or num_decode <= self.spec_max_batch))
