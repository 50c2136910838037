"""The serving engine: submission, the overlapped step loop, streaming, metrics.

Usage::

    engine = Engine(target, draft, EngineConfig(SpecConfig(method="draft", num_draft_tokens=4),
                                                max_slots=8))
    engine.warmup()                                   # compile every bucket once
    h = engine.submit([1, 2, 3], RequestParams(max_tokens=32, temperature=0.7, seed=1))
    for tok in h: ...                                 # stream (drives the engine if no thread)
    engine.start()                                    # or: serve from a background thread
    engine.abort(h.id)                                # cancel (any thread): pages freed
    ...; engine.stop()

One ``step()`` = plan the next batch on the host, dispatch its device step (JAX returns at once:
async dispatch), and read back the results of an earlier step. The two schedules differ in
where the one blocking read sits:

* ``"sync"`` (draft-target): plan step t+1 while step t runs on the device (the plan uses
  upper-bound lengths), then block on step t's accepted tokens (the one host sync per step),
  drop rows that just finished, pack and dispatch t+1; streaming callbacks and metrics for step
  t run while t+1 executes. The draft catch-up is fused into the step (speculate.spec_step), so
  the sync also waits for it; only plan-fixup, packing and dispatch leave the device idle.
* ``"async"`` (one-token MTP, also used for plain decoding): step t+1 is planned and dispatched
  *before* step t's accepted lengths are read: the device computes the next inputs itself (last
  token, lengths and carried draft state live in its slot state), and the host reads t's lengths
  while t+1 runs. The device never waits for the host; the cost is at most one wasted row-step
  per finished request and a page of extra allocation ahead.

Determinism: a greedy request's output depends only on its prompt and parameters (it equals the
target's own greedy decoding, whatever the batch, arrival order, preemption, schedule or
speculation method, up to floating-point reassociation across batch shapes). A sampled request
draws every token from the target's exact distribution (lossless acceptance); its random stream
at position p is ``fold_in(key(seed), p)``, so with method "none" a seeded request's tokens do not
depend on batching, preemption or schedule either; with speculation they also depend on which
steps speculated (batch composition), i.e. they are reproducible for the same arrival sequence.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
import time
import warnings

import jax
import numpy as np

from specjax import native, registry, request, speculate
from specjax.api import check_draft
from specjax.engine import grammar, kv_groups, steps
from specjax.engine.config import (SCHEDULES, EngineConfig, RequestParams,  # noqa: F401
                                   _is_int, check_spec_table, parse_spec_tokens_per_batch_size,
                                   resolve)
from specjax.engine.handle import RequestHandle
from specjax.engine.allocator import PageAllocator
from specjax.engine.metrics import EngineMetrics
from specjax.engine.scheduler import FINISHED, WAITING, Request, Scheduler, bucket
from specjax.kv_cache import pages_needed
from specjax.model import Model

@dataclasses.dataclass
class _InFlight:
    plan: object
    outputs: tuple
    dispatched_at: float
    index: int


class Engine:
    """Continuous-batching speculative decoding server over one target (+ draft).

    Args:
      target: the target Model.
      draft: a draft Model (method "draft") or a heads.Head (method "mtp" / "eagle"), else None.
      config: EngineConfig (keyword overrides are applied on top).
      tokenizer: the target's tokenizer (a specjax Tokenizer), needed only for structured outputs
        (``RequestParams.constraint``; specjax.engine.grammar); settable later as ``.tokenizer``.
    """

    def __init__(self, target: Model, draft=None, config: EngineConfig | None = None, *,
                 tokenizer=None, **overrides):
        cfg = dataclasses.replace(config or EngineConfig(), **overrides)
        if not isinstance(target, Model):
            raise TypeError(f"target must be a specjax Model, got {type(target).__name__}")
        registry.require(target.config, "engine")  # an unsupported family fails here, not in a step
        schedule, batch_buckets, token_buckets = resolve(cfg, target.config)
        spec = cfg.spec
        check_draft(draft, target, spec.method)

        self.target, self.draft, self.config = target, draft, cfg
        self.schedule = schedule
        self.batch_buckets, self.token_buckets = batch_buckets, token_buckets
        self.k_eff = spec.k_eff  # most drafts one step accepts (the tree depth for trees)
        # A step adds at most k_eff + 1 tokens and writes at most `write_ahead` slots from n - 1.
        # (a block drafter writes its whole block from n - 1: Drafter.slots_ahead)
        drafter = speculate.make_plan(target.config, None if draft is None else draft.config,
                                      spec).drafter
        write_ahead = max(spec.extra_slots, drafter.slots_ahead) if self.k_eff else 1
        pages_per_seq = pages_needed(cfg.max_model_len + self.k_eff + 1 + write_ahead,
                                     spec.page_size)
        num_pages = cfg.num_pages or cfg.max_slots * pages_per_seq
        if num_pages < pages_per_seq:
            raise ValueError(f"num_pages {num_pages} cannot hold one sequence of max_model_len "
                             f"{cfg.max_model_len} (needs {pages_per_seq} pages of {spec.page_size})")
        history_len = (pages_per_seq * spec.page_size + token_buckets[-1] + 1) if spec.uses_history else 0
        # sliding-window layers' pages in a pool of their own, released as requests advance
        self.window = kv_groups.make_window_group(
            cfg, target.config, drafter, max_slots=cfg.max_slots, pages_per_seq=pages_per_seq,
            num_pages=num_pages, write_ahead=write_ahead, lag_window=speculate.LAG_WINDOW,
            step_tokens=max(token_buckets[-1], self.k_eff + 1))
        pools = num_pages if self.window is None else (num_pages, self.window.num_pages)
        self.sc = steps.StepConfig(lc=spec, num_slots=cfg.max_slots, pages_per_seq=pages_per_seq,
                                   history_len=history_len, groups=1 + (self.window is not None))
        self._costs: dict = {}  # batch bucket -> [K+1] device array (adaptive k)
        # CPU: linear weights packed for the native few-row matmul (specjax.native)
        self._target_params = native.inference_params(target)
        self._draft_params = None if draft is None else native.inference_params(draft, target)
        self._draft_cfg = None if draft is None else draft.config
        self._state = steps.init_state(target.config, self._draft_cfg, self.sc, pools,
                                       target.dtype)
        if not isinstance(cfg.enable_prefix_caching, bool):
            raise TypeError(f"enable_prefix_caching must be a bool, got "
                            f"{cfg.enable_prefix_caching!r}")
        # a head's KV at position j consumes token j + 1 (module docstring of the allocator):
        # the drafter's lag_offset says how many tokens past a position its cache entry reads
        lookahead = drafter.lag_offset
        self.allocator = PageAllocator(num_pages, spec.page_size, lookahead=lookahead)
        k_table = cfg.num_speculative_tokens_per_batch_size
        self._spec_sc = {}  # k -> StepConfig of a speculative step drafting k tokens
        if k_table is not None:
            if spec.tree is not None or spec.adaptive or self.k_eff != spec.num_draft_tokens:
                raise ValueError("num_speculative_tokens_per_batch_size needs a chain method "
                                 "without adaptive k")
            k_table = check_spec_table(k_table, cfg.max_slots, spec.num_draft_tokens)
            for _, _, k in k_table:
                if k > 0:
                    self._spec_sc[k] = dataclasses.replace(
                        self.sc, lc=dataclasses.replace(spec, num_draft_tokens=k))
        self.scheduler = Scheduler(
            self.allocator, num_slots=cfg.max_slots, token_buckets=token_buckets, k_eff=self.k_eff,
            write_ahead=write_ahead,
            speculative=self.k_eff > 0, spec_max_batch=cfg.spec_max_batch,
            pages_per_seq=pages_per_seq, max_prefill_tokens=cfg.max_prefill_tokens,
            prefix_caching=cfg.enable_prefix_caching, k_table=k_table, window=self.window)
        self.metrics = EngineMetrics(self.k_eff)
        self.timeline: list = []
        self.host_time_s = 0.0  # time in step() not spent blocked on the device
        self.blocked_time_s = 0.0  # time in step() blocked reading device results
        self.num_steps = 0
        self._inflight: collections.deque = collections.deque()
        self._outbox: list = []
        self._submitted: queue.SimpleQueue = queue.SimpleQueue()
        self._aborts: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict = {}  # id -> Request, from drained submission until finished
        # the last requests the engine finished itself (stop token / length), for a stop string
        # the server finds in text the engine already finished (finish_stopped)
        self._recent: collections.OrderedDict = collections.OrderedDict()
        self._ids = itertools.count()
        self._rng = np.random.default_rng(cfg.seed)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._thread = None
        self._stop_flag = False
        self._failure = None
        self._stop_ids = tuple(target.config.eos_token_ids)
        self.tokenizer = tokenizer
        self._grammar = None  # specjax.structured.GrammarCompiler, built at first use
        self.structured_steps = 0  # steps with a constrained row
        self.grammar_mask_time_s = 0.0  # host time building their token masks
        self.grammar_sync_time_s = 0.0  # time blocked reading drafts between propose and verify

    # ------------------------------------------------------------------------- submission
    def submit(self, prompt, params: RequestParams | None = None, *, callback=None) -> RequestHandle:
        """Validates and queues a request; safe to call from any thread while the engine runs.

        Args:
          prompt: token ids (non-empty, each in [0, V)).
          params: RequestParams (default: greedy, 16 tokens, the model's EOS).
          callback: optional ``callback(handle, new_tokens)`` called as tokens arrive (on the
            engine's thread; exceptions are stored in ``handle.callback_error``).
        Raises:
          ValueError / TypeError for a bad prompt or parameters; nothing is queued then.
        """
        params = RequestParams() if params is None else params
        if not isinstance(params, RequestParams):
            raise TypeError(f"params must be a RequestParams, got {type(params).__name__}")
        v = self.target.config.vocab_size
        ids = request.check_request(prompt, v, self.config.max_model_len, params.max_tokens,
                                    params.temperature, params.top_k, params.top_p,
                                    max_new_name="max_tokens", max_len_name="max_model_len")
        request.check_seed(params.seed, allow_none=True)
        stop = request.check_stop_ids(params.stop_token_ids, v, self._stop_ids, "stop_token_ids")
        matcher = None
        if params.constraint is not None:  # ValueError for a grammar xgrammar rejects
            matcher = self.grammar_compiler().matcher(params.constraint)
        with self._lock:
            rid = next(self._ids)
            seed = params.seed if params.seed is not None else int(self._rng.integers(-2**31, 2**31))
        handle = RequestHandle(self, rid, ids)
        req = Request(id=rid, prompt=ids, max_tokens=int(params.max_tokens),
                      temperature=float(params.temperature), top_k=min(int(params.top_k), v),
                      top_p=float(params.top_p), seed=int(seed), stop=frozenset(stop),
                      arrival=time.perf_counter(), handle=handle, callback=callback,
                      matcher=matcher)
        handle._req = req
        self._submitted.put(req)
        self._wake.set()
        return handle

    def grammar_compiler(self):
        """The engine's ``specjax.structured.GrammarCompiler`` (built at first use from
        ``tokenizer``; stop tokens: the model's EOS ids and the tokenizer's)."""
        with self._lock:
            if self._grammar is None:
                if self.tokenizer is None:
                    raise ValueError("structured outputs (RequestParams.constraint) need the "
                                     "engine's tokenizer: Engine(..., tokenizer=...)")
                from specjax.structured import GrammarCompiler  # noqa: PLC0415 - xgrammar ~2 s

                stop = set(self._stop_ids)
                if getattr(self.tokenizer, "eos_token_id", None) is not None:
                    stop.add(int(self.tokenizer.eos_token_id))
                self._grammar = GrammarCompiler(self.tokenizer, self.target.config.vocab_size,
                                                stop)
            return self._grammar

    def abort(self, request_id: int) -> None:
        """Cancels a request; safe to call from any thread, a no-op once it has finished.

        Applied at the start of the next ``step()``: a waiting request leaves the queue, a running
        one gives back its slot and pages (results of its in-flight steps are discarded), and its
        handle finishes with ``finish_reason`` "abort" (callback called with no new tokens).
        """
        if not _is_int(request_id):
            raise TypeError(f"request_id must be an int, got {request_id!r}")
        self._aborts.put((int(request_id), None))
        self._wake.set()

    def finish_stopped(self, request_id: int, num_tokens: int) -> None:
        """Ends a request whose client found a stop string in its text, as a *success*.

        Safe to call from any thread. If the engine has already finished the request by length
        or a stop token (it may run ahead of the server's detokenizer), its count is restated as
        finished by "stop" with only the first ``num_tokens`` tokens. Applied at the start
        of the next ``step()`` like ``abort`` (slot and pages go back, in-flight results are
        discarded), but the request counts as finished by "stop": it is in
        ``request_success_total`` and the latency histograms (its end-to-end latency is taken at
        the last token it received), and only its first ``num_tokens`` generated tokens (those
        the client returns: up to the one that completed the stop string) stay in
        ``handle.tokens`` and ``generation_tokens_total``. Its handle finishes with
        ``finish_reason`` "stop" (callback called with no new tokens).
        """
        if not _is_int(request_id):
            raise TypeError(f"request_id must be an int, got {request_id!r}")
        if not _is_int(num_tokens) or num_tokens < 1:
            raise ValueError(f"num_tokens must be an int >= 1, got {num_tokens!r}")
        self._aborts.put((int(request_id), int(num_tokens)))
        self._wake.set()

    def generate(self, prompts, params: RequestParams | None = None) -> list:
        """Submits every prompt and runs until all finish; returns their token lists."""
        handles = [self.submit(p, params) for p in prompts]
        if not self.serving:
            self.run()
        return [h.result() for h in handles]

    # ------------------------------------------------------------------------- the loop
    @property
    def serving(self) -> bool:
        return self._thread is not None

    def has_work(self) -> bool:
        s = self.scheduler
        return bool(s.waiting or s.running or self._inflight or self._outbox
                    or not self._submitted.empty() or not self._aborts.empty())

    def step(self) -> bool:
        """One iteration: plan + dispatch the next step, read back an earlier one, stream.

        Returns whether work remains.
        """
        t0 = time.perf_counter()
        blocked = 0.0
        self._drain_submissions()
        self._drain_aborts()
        plan = self.scheduler.schedule(t0)
        t_planned = time.perf_counter()
        # constrained rows need every matcher advanced by the previous step: no overlap
        if self.schedule == "sync" or grammar.is_structured(plan):
            while self._inflight:
                blocked += self._retire(self._inflight.popleft())
            if plan is not None:
                plan.rows = [r for r in plan.rows if r.req.state != FINISHED]
                if not plan.rows:
                    plan = None
        if plan is not None:
            self._dispatch(plan, t0, t_planned)
        if self.schedule == "async":
            while len(self._inflight) > (1 if plan is not None else 0):
                blocked += self._retire(self._inflight.popleft())
        self._deliver()
        elapsed = time.perf_counter() - t0
        self.blocked_time_s += blocked
        self.host_time_s += elapsed - blocked
        return self.has_work()

    def run(self, max_steps: int | None = None) -> None:
        """Steps until no work remains (or max_steps)."""
        for i in itertools.count():
            if max_steps is not None and i >= max_steps:
                return
            if not self.step():
                return

    def start(self) -> None:
        """Serves from a background thread (submit from any thread; handles block on tokens)."""
        if self._thread is not None:
            return
        self._stop_flag = False
        self._thread = threading.Thread(target=self._serve, name="specjax-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stops the background thread after its current step (queued requests stay queued)."""
        if self._thread is None:
            return
        self._stop_flag = True
        self._wake.set()
        self._thread.join()
        self._thread = None
        self._raise_if_failed()

    def _serve(self) -> None:
        try:
            while not self._stop_flag:
                if self.has_work():
                    self.step()
                else:
                    self._wake.wait(0.05)
                    self._wake.clear()
        except BaseException as e:  # surfaced to waiting handles and stop()
            self._failure = e

    @property
    def failure(self) -> BaseException | None:
        """The exception that stopped the background loop, or None."""
        return self._failure

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise RuntimeError("the engine loop failed") from self._failure

    # ------------------------------------------------------------------------- internals
    def _drain_submissions(self) -> None:
        while True:
            try:
                req = self._submitted.get_nowait()
            except queue.Empty:
                return
            if self.metrics.first_arrival is None:
                self.metrics.first_arrival = req.arrival
            self.metrics.prompt_tokens_total += len(req.prompt)
            self._live[req.id] = req
            self.scheduler.add(req)

    def _drain_aborts(self) -> None:
        while True:
            try:
                rid, keep = self._aborts.get_nowait()
            except queue.Empty:
                return
            req = self._live.pop(rid, None)
            if req is None:
                if keep is not None:
                    self._restate_stopped(self._recent.pop(rid, None), keep)
                continue  # already finished (or never submitted)
            reason = "abort" if keep is None else "stop"
            if req.state == WAITING:
                self.scheduler.waiting.remove(req)
                req.state, req.finish_reason = FINISHED, reason
            else:  # prefill / decode: slot and pages go back; in-flight results are discarded
                self.scheduler.finish(req, reason)
            m = self.metrics
            m.request_finished_by_reason[reason] += 1
            if keep is not None:  # a stop string: a success, counting only the returned tokens
                extra = max(0, len(req.output) - keep)
                m.generation_tokens_total -= extra
                del req.output[keep:]
                req.handle.tokens[keep:] = []
                m.request_success_total += 1
                self._observe_finish(req, req.last_token_at or time.perf_counter())
            self._outbox.append((req, [], reason))

    def _restate_stopped(self, req: Request | None, keep: int) -> None:
        """A stop string ended ``req`` at ``keep`` tokens after the engine had finished it by
        length or a stop token (the engine ran ahead of the server's detokenizer): it counts as
        finished by "stop" with only the returned tokens, as if finish_stopped had come first."""
        if req is None or keep >= len(req.output):
            return
        m = self.metrics
        m.request_finished_by_reason[req.finish_reason] -= 1
        m.request_finished_by_reason["stop"] += 1
        m.generation_tokens_total -= len(req.output) - keep
        del req.output[keep:]
        req.handle.tokens[keep:] = []
        req.finish_reason = req.handle.finish_reason = "stop"

    def _row_dict(self, row) -> dict:
        r = row.req
        d = {"kind": row.kind, "slot": r.slot, "seed": r.seed, "temperature": r.temperature,
             "top_k": r.top_k, "top_p": r.top_p, "pages": r.pages, "window_pages": r.window_pages}
        if row.kind == steps.KIND_PREFILL:
            d.update(start=row.start, tokens=row.tokens, final=row.final, next_token=row.next_token)
        return d

    def _cost(self, batch: int):
        """The adaptive cost model at this batch bucket (measured once, then cached)."""
        if batch not in self._costs:
            from specjax import cost_model  # noqa: PLC0415
            costs = cost_model.measure_costs(
                self._target_params, self.target.config, self._draft_params, self._draft_cfg,
                method=self.config.spec.method, kmax=self.k_eff, batch=batch,
                context=min(self.config.max_model_len // 2, 256), dtype=self.target.dtype,
                page_size=self.config.spec.page_size, attn_impl=self.config.spec.attn_impl)
            self._costs[batch] = jax.device_put(np.asarray(costs, np.float32))
        return self._costs[batch]

    def _call(self, kind: str, meta, k: int = 0):
        if kind == "spec":
            extra = (self._cost(meta.shape[0]),) if self.config.spec.adaptive else ()
            out = steps.spec_decode_step(self._target_params, self._draft_params, self._state, meta,
                                         *extra, target_cfg=self.target.config,
                                         draft_cfg=self._draft_cfg, sc=self._spec_sc.get(k, self.sc))
            self._state = out[0]
            return out[1:]
        out = steps.extend_step(self._target_params, self._draft_params, self._state, meta,
                                target_cfg=self.target.config, draft_cfg=self._draft_cfg, sc=self.sc)
        self._state = out[0]
        return out[1:]

    def _call_structured(self, kind: str, meta, k: int, rows):
        """A step with grammar masks (specjax.engine.grammar.constrained_step)."""
        sc = self._spec_sc.get(k, self.sc) if kind == "spec" else self.sc
        self._state, out, (t_mask, t_sync) = grammar.constrained_step(
            self._target_params, self._draft_params, self._state, meta, rows, kind=kind,
            target_cfg=self.target.config, draft_cfg=self._draft_cfg, sc=sc)
        self.structured_steps += 1
        self.grammar_mask_time_s += t_mask
        self.grammar_sync_time_s += t_sync
        return out

    def _seed_histories(self, plan) -> None:
        """n-gram drafting: a request whose prefix came from the prefix cache gets that
        prefix's tokens in its slot's history before its first prefill chunk runs."""
        for row in plan.rows:
            r = row.req
            if row.kind != steps.KIND_PREFILL or not r.cached_prefix or row.start != r.cached_prefix:
                continue
            width = self._state.history.shape[1]
            t = min(1 << (r.cached_prefix - 1).bit_length(), width)  # a few compiled widths
            toks = np.zeros(t, np.int32)
            toks[:r.cached_prefix] = r.seq[:r.cached_prefix]
            self._state = dataclasses.replace(self._state, history=steps.seed_history(
                self._state.history, np.int32(r.slot), toks))
            r.cached_prefix = 0

    def _dispatch(self, plan, t0: float, t_planned: float) -> None:
        if self._state.history is not None:
            self._seed_histories(plan)
        b = bucket(len(plan.rows), self.batch_buckets)
        meta = steps.pack([self._row_dict(r) for r in plan.rows], self.sc, b, plan.t)
        if grammar.is_structured(plan):
            outputs = self._call_structured(plan.kind, jax.device_put(meta), plan.k, plan.rows)
        else:
            outputs = self._call(plan.kind, jax.device_put(meta), plan.k)
        for row in plan.rows:
            row.req.inflight_growth += row.growth
        now = time.perf_counter()
        self.metrics.steps["spec" if plan.kind == "spec" else
                           ("decode" if plan.t == 1 else "extend")] += 1
        self._inflight.append(_InFlight(plan, outputs, now, self.num_steps))
        if self.config.record_timeline:  # busy_after_dispatch: the call returned before the step ran
            self.timeline.append({"step": self.num_steps, "kind": plan.kind, "t": plan.t,
                                  "rows": len(plan.rows), "batch": b, "plan_start": t0,
                                  "plan_end": t_planned, "dispatched": now,
                                  "busy_after_dispatch": not outputs[0].is_ready()})
        self.num_steps += 1

    def _retire(self, inf: _InFlight) -> float:
        """Blocks on a step's results and applies them; returns the seconds spent blocked."""
        t = time.perf_counter()
        ready = all(o.is_ready() for o in inf.outputs)
        host = jax.device_get(inf.outputs)
        now = time.perf_counter()
        if self.config.record_timeline:
            self.timeline[inf.index].update(
                wait_start=t, results=now, ready_at_wait=ready)
        plan = inf.plan
        for i, row in enumerate(plan.rows):
            req = row.req
            if req.epoch != row.epoch or req.state == FINISHED:
                continue  # preempted (recomputed later) or already finished: discard
            req.inflight_growth -= row.growth
            if plan.kind == "spec":
                count = int(host[1][i])
                start = len(req.output)
                kept = self._append(req, host[0][i, :count].tolist(), now)
                # count only what reached the request (its stop / max_tokens may cut drafts)
                self.metrics.observe_spec(min(count - 1, kept), kept, int(host[2][i]))
                req.spec_steps.append((start, count - 1, int(host[2][i])))
            elif row.commit:
                self._append(req, [int(host[0][i])], now)
        return now - t

    def _append(self, req: Request, tokens: list, now: float) -> int:
        """Appends tokens up to the request's stop / max_tokens; returns how many it kept."""
        new, reason = [], None
        for tok in tokens:
            ended = grammar.advance(req, tok)  # structured outputs: None without a constraint
            if ended == "abort":  # a token the grammar rejects: a bug, but only this request's
                warnings.warn(f"request {req.id}: token {tok} violates its grammar", stacklevel=2)
                reason = "abort"
                break
            req.output.append(tok)
            new.append(tok)
            if ended is not None or tok in req.stop:
                reason = "stop"
                break
            if len(req.output) >= req.max_tokens:
                reason = "length"
                break
        m = self.metrics
        m.generation_tokens_total += len(new)
        if req.first_token_at is None:
            req.first_token_at = now
            m.observe("time_to_first_token_seconds", now - req.arrival)
            m.observe("request_queue_time_seconds", req.admitted_at - req.arrival)
        else:
            m.observe("inter_token_latency_seconds", now - req.last_token_at)
        req.last_token_at = now
        m.last_token_time = now
        if reason is not None:
            self.scheduler.finish(req, reason)
            self._live.pop(req.id, None)
            self._recent[req.id] = req
            if len(self._recent) > 1024:
                self._recent.popitem(last=False)
            m.request_finished_by_reason[reason] += 1
            if reason != "abort":
                m.request_success_total += 1
                self._observe_finish(req, now)
        self._outbox.append((req, new, reason))
        return len(new)

    def _observe_finish(self, req: Request, now: float) -> None:
        """End-of-request latency samples of a successful request that finished at ``now``."""
        m = self.metrics
        m.observe("e2e_request_latency_seconds", now - req.arrival)
        if len(req.output) > 1 and req.first_token_at is not None:
            m.observe("time_per_output_token_seconds",
                      (now - req.first_token_at) / (len(req.output) - 1))

    def _deliver(self) -> None:
        outbox, self._outbox = self._outbox, []
        for req, new, reason in outbox:
            req.handle._push(new, reason)
            cb = req.callback
            if cb is not None:
                try:
                    cb(req.handle, new)
                except Exception as e:  # a client's bug must not stop the other requests
                    req.handle.callback_error = e
                    warnings.warn(f"callback of request {req.id} raised {e!r}", stacklevel=2)

    # ------------------------------------------------------------------------- tooling
    def variants(self) -> list:
        """Every (kind, batch, T) step shape the scheduler can produce (T = k for "spec")."""
        out = [("extend", b, t) for b in self.batch_buckets for t in self.token_buckets]
        for n in range(1, self.config.max_slots + 1):
            b = bucket(n, self.batch_buckets)
            k = self.scheduler.k_for(n)
            v = ("spec", b, k) if self.scheduler._speculates(n) else ("extend", b, 1)
            if v not in out:
                out.append(v)
        return out

    def warmup(self, structured: bool = False) -> int:
        """Compiles (and runs once, on padding rows that write nothing) every step variant,
        and with ``structured`` also their masked twins (structured outputs).

        Returns the number of variants. Call before serving so no request pays a compilation.
        """
        if self._inflight:
            raise RuntimeError("warmup() must run before any request is dispatched")
        vs = self.variants()
        for kind, b, t in vs:
            k, t = (t, 0) if kind == "spec" else (0, t)
            outs = self._call(kind, jax.device_put(steps.pack([], self.sc, b, t)), k)
            jax.block_until_ready(outs)
            if structured:
                jax.block_until_ready(self._call_structured(
                    kind, jax.device_put(steps.pack([], self.sc, b, t)), k, []))
        self.structured_steps, self.grammar_mask_time_s, self.grammar_sync_time_s = 0, 0.0, 0.0
        return len(vs)

    def occupancy(self) -> dict:
        """Current load, readable from any thread: requests running (holding a slot) and
        waiting (queued or not yet drained), KV pages in use and in the pool (with window page
        release also the sliding layers' pool: ``kv_window_pages_*``)."""
        occ = {"num_requests_running": len(self.scheduler.running),
               "num_requests_waiting": len(self.scheduler.waiting) + self._submitted.qsize(),
               "kv_pages_in_use": self.allocator.num_used,
               "kv_pages_total": self.allocator.num_pages}
        if self.window is not None:
            occ.update(kv_window_pages_in_use=self.window.alloc.num_used,
                       kv_window_pages_total=self.window.num_pages)
        return occ

    def stats(self) -> dict:
        """Metrics snapshot (see specjax.engine.metrics) plus the engine's own counters."""
        occ = self.occupancy()
        s = self.metrics.snapshot(running=occ["num_requests_running"],
                                  waiting=occ["num_requests_waiting"], usage=self.allocator.usage)
        if self._state.k_hist is not None:  # adaptive: speculative steps per chosen k
            s["k_histogram"] = [int(c) for c in jax.device_get(self._state.k_hist)]
        s.update(method=self.config.spec.method, schedule=self.schedule, num_draft_tokens=self.k_eff,
                 engine_steps=self.num_steps, host_time_s=self.host_time_s,
                 blocked_time_s=self.blocked_time_s, num_preemptions_total=self.scheduler.num_preemptions,
                 prefix_cache_queries=self.scheduler.prefix_cache_queries,
                 prefix_cache_hits=self.scheduler.prefix_cache_hits,
                 kv_pages_cached=self.allocator.num_cached,
                 prefix_cache_evictions=self.allocator.num_evictions,
                 structured_steps=self.structured_steps,
                 grammar_mask_time_s=self.grammar_mask_time_s,
                 grammar_sync_time_s=self.grammar_sync_time_s)
        return s
