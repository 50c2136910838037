"""Serving engine: exact greedy outputs under a continuous load, no leaks, no recompiles, overlap.

Every engine here shares one static configuration per method (tiny models, 8 slots, chunk width
8, page size 4) so the jit caches are shared across tests and each step variant compiles once.
"""

import threading
import time

import jax
import numpy as np
import pytest

import specjax as sj
from specjax.config import SpecConfig
from specjax.engine import Engine, EngineConfig, PageAllocator, RequestParams, steps
from specjax.engine.scheduler import Scheduler
from specjax.heads import Head, HeadConfig, init_head
from specjax.tree import TreeConfig
from tests.conftest import tiny_model

K = 3
MAX_PROMPT, MAX_TOKENS = 16, 16
# num_pages = 3 full-length sequences for 8 slots: admissions wait and requests get preempted.
BASE = dict(max_slots=8, batch_buckets=(8,), token_buckets=(8,),
            max_model_len=MAX_PROMPT + MAX_TOKENS, num_pages=30)


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def drafts(target):
    """Method -> draft: an early-exit draft (accepts ~30% of first drafts), random heads."""
    def head(kind):
        cfg = HeadConfig.for_target(target.config, kind)
        return Head(init_head(cfg, jax.random.key(3), scale=1.0), cfg)

    return {"none": None, "draft": sj.early_exit_draft(target, 1), "mtp": head("mtp"),
            "eagle-tree": head("eagle")}


def spec(method, **kw):
    """The tests' speculation config for ``method`` (k = K, page size 4, a small tree)."""
    if method == "eagle-tree":
        kw.setdefault("tree", TreeConfig(depth=3, top_k=2, num_nodes=6))
    return SpecConfig(method=method, num_draft_tokens=K, page_size=4, **kw)


def make_engine(target, drafts, method, **kw):
    return Engine(target, drafts[method], EngineConfig(spec(method), **{**BASE, **kw}))


def random_requests(n, seed):
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 64, int(rng.integers(1, MAX_PROMPT + 1))).tolist(),
             int(rng.integers(1, MAX_TOKENS + 1))) for _ in range(n)]


_ALONE = {}


def alone(target, prompt, max_tokens):
    """The request's greedy output run alone with plain decoding (sj.generate, no EOS)."""
    key = (tuple(prompt), max_tokens)
    if key not in _ALONE:
        _ALONE[key] = sj.generate(target, [prompt], max_new_tokens=max_tokens,
                                  eos_token_id=[]).tokens[0]
    return _ALONE[key]


def with_stops(reqs, target, seed):
    """Gives about a third of the requests a stop token taken from their own expected output;
    returns (params list, expected outputs)."""
    rng = np.random.default_rng(seed)
    params, want = [], []
    for prompt, m in reqs:
        ref = alone(target, prompt, m)
        stop = ()
        if rng.random() < 0.35:
            stop = (ref[int(rng.integers(0, len(ref)))],)
            ref = ref[:ref.index(stop[0]) + 1]
        params.append(RequestParams(max_tokens=m, stop_token_ids=stop))
        want.append(ref)
    return params, want


def drive(engine, reqs, params, seed, max_arrivals=3):
    """Submits requests a few at a time between engine steps (arrivals while others run)."""
    rng = np.random.default_rng(seed)
    handles, i = [], 0
    while i < len(reqs) or engine.has_work():
        for _ in range(int(rng.integers(0, max_arrivals + 1))):
            if i < len(reqs):
                handles.append(engine.submit(reqs[i][0], params[i]))
                i += 1
        engine.step()
    return handles


class CompileCounter:
    """Counts XLA backend compilations process-wide (jax.monitoring duration events)."""

    def __init__(self):
        self.count = 0
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            self.count += 1


COMPILES = CompileCounter()


# ------------------------------------------------------------------------------ allocator


def test_allocator_owns_and_returns_pages():
    alloc = PageAllocator(6, page_size=4)
    start = alloc.snapshot()
    a, b = object(), object()
    pa = alloc.allocate(4, a)
    assert alloc.num_free == 2 and alloc.usage == pytest.approx(4 / 6)
    with pytest.raises(sj.engine.OutOfPages):
        alloc.allocate(3, b)
    assert alloc.num_free == 2  # a failed allocation takes nothing
    pb = alloc.allocate(2, b)
    assert not set(pa) & set(pb)
    with pytest.raises(ValueError, match="not owned"):
        alloc.free(pa[:1], b)
    alloc.free(pa, a)
    alloc.free(pb, b)
    with pytest.raises(ValueError, match="not owned"):
        alloc.free(pb, b)  # double free
    assert alloc.snapshot() == start
    assert alloc.pages_for(0) == 0 and alloc.pages_for(4) == 1 and alloc.pages_for(5) == 2


def test_scheduler_plans_chunks_and_allocates_ahead():
    from specjax.engine.scheduler import Request
    alloc = PageAllocator(20, page_size=4)
    s = Scheduler(alloc, num_slots=2, token_buckets=(4, 8), k_eff=3, write_ahead=4, speculative=True,
                  spec_max_batch=None, pages_per_seq=10, max_prefill_tokens=None)
    reqs = [Request(i, list(range(1, 12)), 4, 0.0, 0, 1.0, 0, frozenset(), 0.0) for i in range(3)]
    for r in reqs:
        s.add(r)
    plan = s.schedule(0.0)
    assert plan.kind == "extend" and plan.t == 8 and len(plan.rows) == 2  # two slots
    assert [r.tokens for r in plan.rows] == [list(range(1, 9))] * 2  # first 8-token chunks
    assert all(len(r.pages) == alloc.pages_for(8 + 4) for r in reqs[:2])  # chunk + k + 1
    plan = s.schedule(0.0)
    assert plan.t == 4 and all(r.final and r.tokens == [9, 10, 11] for r in plan.rows)
    for row in plan.rows:  # pretend the step ran: one token each, none in flight
        row.req.output.append(5)
        row.req.inflight_growth = 0
    plan = s.schedule(0.0)
    assert plan.kind == "spec" and all(r.growth == 4 for r in plan.rows)
    assert all(len(r.pages) == alloc.pages_for(12 + 4) for r in reqs[:2])  # n + k + 1
    assert list(s.waiting) == [reqs[2]]


def test_engine_config_is_validated(target, drafts):
    bad = [(dict(max_slots=0), "max_slots"),
           (dict(batch_buckets=(2, 4)), "end at max_slots"),
           (dict(token_buckets=(0,)), "token_buckets"),
           (dict(num_pages=2), "num_pages"),
           (dict(max_model_len=10_000), "max_model_len"),
           (dict(schedule="eager"), "schedule"),
           (dict(spec_max_batch=-1), "spec_max_batch")]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            Engine(target, None, EngineConfig(**kw))
    with pytest.raises(TypeError, match="EngineConfig.spec must be a specjax.SpecConfig"):
        Engine(target, None, EngineConfig(spec="draft"))
    with pytest.raises(ValueError, match="needs a draft"):
        Engine(target, None, EngineConfig(SpecConfig(method="draft")))
    with pytest.raises(ValueError, match='draft was given with method="none"'):
        Engine(target, drafts["draft"], EngineConfig())
    with pytest.raises(TypeError, match="needs a draft head"):
        Engine(target, drafts["draft"], EngineConfig(SpecConfig(method="mtp")))
    assert Engine(target, None, EngineConfig(max_slots=6)).batch_buckets == (1, 2, 4, 6)
    assert Engine(target, drafts["draft"], EngineConfig(SpecConfig(method="draft"))).schedule == "sync"
    assert Engine(target, drafts["mtp"], EngineConfig(SpecConfig(method="mtp"))).schedule == "async"


@pytest.mark.parametrize("kw, exc, match", [
    (dict(max_slots=2, batch_buckets=(1.5, 2)), TypeError, "batch_buckets must be a tuple of ints"),
    (dict(max_slots=2, batch_buckets=(True, 2)), TypeError, "batch_buckets"),
    (dict(max_slots=2, batch_buckets=(2.0,)), TypeError, "batch_buckets"),
    (dict(batch_buckets=8), TypeError, "batch_buckets"),
    (dict(token_buckets=16), TypeError, "token_buckets must be a tuple of ints"),
    (dict(token_buckets=(16, "a")), TypeError, "token_buckets"),
    (dict(token_buckets=(-4, 16)), ValueError, "token_buckets"),
    (dict(seed=-1), ValueError, "EngineConfig.seed"),
    (dict(seed="a"), ValueError, "EngineConfig.seed"),
    (dict(seed=1.5), ValueError, "EngineConfig.seed"),
    (dict(record_timeline="yes"), TypeError, "record_timeline"),
])
def test_engine_config_types_are_checked_up_front(target, kw, exc, match):
    """Bucket lists, the seed and flags of the wrong type name the field (they used to pass,
    or fail inside numpy / sorted with a message naming nothing)."""
    with pytest.raises(exc, match=match):
        Engine(target, None, EngineConfig(**kw))
    assert Engine(target, None, EngineConfig(max_slots=2, batch_buckets=[2, 1, 2],
                                             token_buckets=[16])).batch_buckets == (1, 2)


# --------------------------------------------------------------------- the loaded-engine test


LOAD = [("none", "async"), ("draft", "sync"), ("draft", "async"), ("mtp", "async"),
        ("mtp", "sync"),
        pytest.param("eagle-tree", "async", marks=pytest.mark.slow, id="eagle-tree-async")]


@pytest.mark.parametrize("method,schedule", LOAD)
def test_continuous_load_is_exact_leak_free_and_compiles_nothing(target, drafts, method, schedule):
    """>= 200 requests with random prompt/output lengths (and some stop tokens) arrive while others
    run, with pages scarce enough that requests wait and get preempted. Each greedy output equals
    the request run alone with plain decoding; every page comes back; nothing recompiles."""
    reqs = random_requests(210, seed=1)
    params, want = with_stops(reqs, target, seed=2)
    engine = make_engine(target, drafts, method, schedule=schedule)
    assert engine.warmup() == 2
    before = COMPILES.count
    start = engine.allocator.snapshot()

    handles = drive(engine, reqs, params, seed=3)

    got = [h.result() for h in handles]
    bad = [i for i, (g, w) in enumerate(zip(got, want)) if g != w]
    assert not bad, f"{len(bad)} requests differ, first {bad[0]}: {got[bad[0]]} != {want[bad[0]]}"
    assert all(h.finished for h in handles)
    assert engine.allocator.snapshot() == start  # no page leaked
    assert engine.scheduler.free_slots and sorted(engine.scheduler.free_slots) == list(range(8))
    assert COMPILES.count == before  # no recompilation (XLA's compile events, jax.monitoring)
    stats = engine.stats()
    assert stats["request_success_total"] == len(reqs)
    assert stats["generation_tokens_total"] == sum(map(len, want))
    assert stats["num_preemptions_total"] > 0  # the scarce pool forced recomputation
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    if method == "draft":
        assert stats["mean_accepted_length"] > 1.2  # multi-token steps were exercised
    if method != "none":
        assert stats["steps"]["spec"] > 0 and stats["steps"]["extend"] > 0


def test_schedules_place_the_host_sync_as_specified(target, drafts):
    """sync: plan t+1 before reading t, dispatch t+1 after; async: dispatch t+1 before reading t."""
    reqs = random_requests(24, seed=4)
    for schedule in ("sync", "async"):
        engine = make_engine(target, drafts, "mtp", schedule=schedule, record_timeline=True)
        for p, m in reqs:  # all at once: the engine never idles until the end
            engine.submit(p, RequestParams(max_tokens=m, stop_token_ids=()))
        engine.run()
        pairs = list(zip(engine.timeline[:-1], engine.timeline[1:]))
        assert len(pairs) > 20
        if schedule == "sync":
            assert all(b["plan_start"] < a["results"] <= b["dispatched"] for a, b in pairs)
        else:
            assert all(b["dispatched"] < a["wait_start"] for a, b in pairs)


# ------------------------------------------------------------------- requests and parameters


def test_bad_requests_are_rejected_while_others_run(target, drafts):
    engine = make_engine(target, drafts, "draft")
    good = random_requests(12, seed=6)
    handles = [engine.submit(p, RequestParams(max_tokens=m, stop_token_ids=())) for p, m in good]
    engine.step()
    engine.step()
    bad = [
        ([], {}, "empty"),
        ([1, 64], {}, "outside the vocabulary"),
        ([-1], {}, "outside the vocabulary"),
        ([1] * 30, dict(max_tokens=5), "exceeds max_model_len"),
        ([1], dict(max_tokens=0), "max_tokens"),
        ([1], dict(temperature=-1.0), "temperature"),
        ([1], dict(temperature=float("nan")), "temperature"),
        ([1], dict(top_p=0.0), "top_p"),
        ([1], dict(top_k=-2), "top_k"),
        ([1], dict(seed=2**40), "seed"),
        ([1], dict(stop_token_ids=(70,)), "stop_token_ids 70 is outside the vocabulary"),
    ]
    for prompt, kw, match in bad:
        with pytest.raises(ValueError, match=match):
            engine.submit(prompt, RequestParams(**kw))
        engine.step()
    with pytest.raises(TypeError):
        engine.submit("not tokens")
    engine.run()
    assert [h.result() for h in handles] == [alone(target, p, m) for p, m in good]
    assert engine.stats()["request_success_total"] == len(good)


def test_abort_frees_pages_and_leaves_the_others_exact(target, drafts):
    """Aborting waiting, prefilling and decoding requests (and a finished / unknown id) frees
    their slots and pages; the other requests' greedy outputs are unchanged."""
    engine = make_engine(target, drafts, "draft")
    start = engine.allocator.snapshot()
    reqs = random_requests(12, seed=15)
    handles = [engine.submit(p, RequestParams(max_tokens=m, stop_token_ids=())) for p, m in reqs]
    engine.step()
    engine.step()
    victims = {handles[0].id, handles[3].id, handles[11].id}  # running, running, waiting
    for rid in victims:
        engine.abort(rid)
    engine.abort(10_000)  # unknown: ignored
    engine.step()
    assert engine.stats()["request_finished_by_reason"]["abort"] == 3
    engine.run()
    engine.abort(handles[1].id)  # finished: ignored
    engine.run()
    for h, (p, m) in zip(handles, reqs):
        if h.id in victims:
            assert h.finished and h.finish_reason == "abort" and len(h.tokens) < m
        else:
            assert h.result() == alone(target, p, m)
    assert engine.allocator.snapshot() == start
    s = engine.stats()
    assert s["request_success_total"] == 9 and s["request_finished_by_reason"]["abort"] == 3
    assert s["num_requests_running"] == s["num_requests_waiting"] == 0


def test_per_request_sampling_in_one_batch(target, drafts):
    """Greedy, top-k=1 (= greedy) and seeded sampled requests share batches; sampled streams
    are reproducible per seed and, with plain decoding, independent of the batch around them."""
    prompt = [3, 1, 4, 1, 5]
    greedy = alone(target, prompt, 12)
    for method in ("none", "draft"):
        engine = make_engine(target, drafts, method)
        hs = [engine.submit(prompt, RequestParams(max_tokens=12, temperature=t, top_k=k, top_p=p,
                                                  seed=s, stop_token_ids=()))
              for t, k, p, s in [(0.0, 0, 1.0, 0), (1.0, 1, 1.0, 1), (1.5, 0, 1.0, 7),
                                 (1.5, 0, 1.0, 7), (1.5, 0, 0.9, 8), (1.5, 0, 1.0, 9)]]
        engine.run()
        out = [h.result() for h in hs]
        assert out[0] == greedy and out[1] == greedy
        assert out[2] == out[3]  # same seed, same prompt, same steps
        assert len({tuple(o) for o in out[2:]}) >= 3  # different seeds differ
        if method == "none":
            crowd = make_engine(target, drafts, "none")
            noise = [crowd.submit(p, RequestParams(max_tokens=m, temperature=1.0))
                     for p, m in random_requests(7, seed=8)]
            h = crowd.submit(prompt, RequestParams(max_tokens=12, temperature=1.5, seed=7,
                                                   stop_token_ids=()))
            crowd.run()
            assert h.result() == out[2] and all(n.finished for n in noise)


def test_streaming_iterator_and_callbacks(target, drafts):
    engine = make_engine(target, drafts, "draft")
    seen, chunks = {}, []

    def callback(handle, new):
        seen.setdefault(handle.id, []).extend(new)
        chunks.append(len(new))

    reqs = random_requests(6, seed=9)
    handles = [engine.submit(p, RequestParams(max_tokens=m, stop_token_ids=()), callback=callback)
               for p, m in reqs]
    first = list(handles[0])  # iterating drives the engine until this request finishes
    assert first == alone(target, *reqs[0]) and handles[0].finished
    engine.run()
    for h, (p, m) in zip(handles, reqs):
        assert seen[h.id] == h.result() == alone(target, p, m)
    assert max(chunks) > 1  # speculative steps stream several tokens at once


def test_background_serving_with_concurrent_submitters(target, drafts):
    engine = make_engine(target, drafts, "mtp")
    engine.warmup()
    engine.start()
    try:
        results = {}

        def client(seed):
            for p, m in random_requests(5, seed=seed):
                h = engine.submit(p, RequestParams(max_tokens=m, stop_token_ids=()))
                results[(tuple(p), m)] = list(h)  # streamed while the engine thread runs

        threads = [threading.Thread(target=client, args=(s,)) for s in (10, 11, 12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        engine.stop()
    assert len(results) == 15
    for (p, m), toks in results.items():
        assert toks == alone(target, list(p), m)


def test_speculation_turns_off_above_batch_size(target, drafts):
    """spec_max_batch=2: crowded decode batches decode plainly, small ones speculate; exact."""
    engine = make_engine(target, drafts, "draft", spec_max_batch=2)
    assert ("extend", 8, 1) in engine.variants() and ("spec", 8, K) in engine.variants()
    reqs = [(p, 16 if i == 0 else 3) for i, (p, _) in enumerate(random_requests(10, seed=13))]
    handles = [engine.submit(p, RequestParams(max_tokens=m, stop_token_ids=())) for p, m in reqs]
    engine.run()  # request 0 ends alone in the batch
    assert [h.result() for h in handles] == [alone(target, p, m) for p, m in reqs]
    steps_by_kind = engine.stats()["steps"]
    assert steps_by_kind["decode"] > 0 and steps_by_kind["spec"] > 0


def test_metrics_have_the_usual_names(target, drafts):
    engine = make_engine(target, drafts, "draft")
    reqs = random_requests(10, seed=14)
    for p, m in reqs:
        engine.submit(p, RequestParams(max_tokens=m, stop_token_ids=()))
    engine.step()
    mid = engine.stats()
    assert mid["num_requests_running"] == 8 and mid["num_requests_waiting"] == 2
    assert 0 < mid["kv_cache_usage_perc"] <= 1
    engine.run()
    s = engine.stats()
    drafts_, acc = s["spec_decode_num_drafts"], s["spec_decode_num_accepted_tokens"]
    assert s["spec_decode_num_draft_tokens"] == K * drafts_
    assert s["acceptance_rate"] == pytest.approx(acc / (K * drafts_))
    emitted = s["spec_decode_num_emitted_tokens"]  # what requests received from spec steps
    assert s["mean_accepted_length"] == pytest.approx(1 + acc / drafts_) == s["spec_accept_length"]
    assert acc <= emitted <= acc + drafts_  # drafts then one token, unless max_tokens cut the step
    per_pos = s["spec_decode_num_accepted_tokens_per_pos"]
    assert len(per_pos) == K and sum(per_pos) == acc and per_pos == sorted(per_pos, reverse=True)
    assert s["per_position_acceptance"] == pytest.approx([a / drafts_ for a in per_pos])
    for name in ("time_to_first_token_seconds", "inter_token_latency_seconds",
                 "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert s[name]["count"] > 0 and s[name]["p50"] > 0
    assert s["time_to_first_token_seconds"]["count"] == len(reqs)
    assert s["tokens_per_second"] > 0 and s["kv_cache_usage_perc"] == 0


# ----------------------------------------------------------------------------------- overlap


@pytest.mark.slow  # default-run time (README: ~15 min on 2 cores); run with -m slow
@pytest.mark.parametrize("schedule", ["sync", "async"])
def test_host_work_overlaps_device_steps(schedule, monkeypatch):
    """Host work runs while the device step runs.

    (1) The timeline: for most steps the dispatch call returned while the step was still
        running (and, load permitting, it had finished by the time the host, done with its
        other work, came to read it: reported as ran-during-host-work).
    (2) Wall time per step is well below the serial time per step (host work + device step,
        measured by the same workload with every dispatch forced to block), runs interleaved so
        that load drift hits both alike; on a shared, oversubscribed CPU a sleep can overshoot
        or the device step stall, so up to three interleaved rounds are tried.

    A mid-size model makes the device step long enough for JAX's CPU async dispatch to return
    before it finishes; a streaming callback sleeping about one device step stands in for host
    work (detokenisation, network). Serially a step costs host + device; overlapped, about the
    larger of the two.
    """
    target = tiny_model(20, vocab=2048, hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64)
    engine = Engine(target, sj.early_exit_draft(target, 1), EngineConfig(
        spec("draft"), max_slots=8, batch_buckets=(8,), token_buckets=(8,),
        max_model_len=64, schedule=schedule, record_timeline=True))
    engine.warmup()
    meta = jax.device_put(steps.pack([], engine.sc, 8, 0))
    times = []
    for _ in range(9):  # one full-batch speculative step, blocking
        t = time.perf_counter()
        jax.block_until_ready(engine._call("spec", meta))
        times.append(time.perf_counter() - t)
    device = float(np.median(times))
    overlapped_call = engine._call

    def serial_call(kind, meta, k=0):
        return jax.block_until_ready(overlapped_call(kind, meta, k))

    def per_step(serial):
        monkeypatch.setattr(engine, "_call", serial_call if serial else overlapped_call)
        n0, h0 = engine.num_steps, engine.host_time_s
        t0 = time.perf_counter()
        # Request 0 outlives the others and gets tokens at every step; its callback sleeps.
        hs = [engine.submit(p[:8], RequestParams(max_tokens=48 if i == 0 else 36,
                                                 stop_token_ids=()),
                            callback=(lambda h, new: time.sleep(device)) if i == 0 else None)
              for i, (p, _) in enumerate(random_requests(8, seed=15))]
        engine.run()
        assert all(h.finished for h in hs)
        n = engine.num_steps - n0
        tl = engine.timeline[n0:]
        busy = sum(e["busy_after_dispatch"] for e in tl) / n
        ran_during_host_work = sum(e["busy_after_dispatch"] and e["ready_at_wait"] for e in tl) / n
        return (time.perf_counter() - t0) / n, busy, ran_during_host_work

    rounds = []
    for _ in range(3):
        over, serial = per_step(False), per_step(True)
        rounds.append((over, serial))
        assert over[1] >= 0.8, over  # (1) control came back while the device step ran
        assert serial[1] == 0  # the serial baseline really blocked at every dispatch
        if over[0] < 0.8 * serial[0]:
            print(f"{schedule}: {1e3 * over[0]:.1f} ms/step overlapped vs {1e3 * serial[0]:.1f} "
                  f"serial (device step {1e3 * device:.1f} ms); busy after dispatch "
                  f"{over[1]:.2f}, ran during host work {over[2]:.2f}")
            break
    else:
        pytest.fail(f"no overlap measured in 3 rounds (per-step wall, busy, ran-during-host): "
                    f"{rounds}; device step {device:.4f} s")


# ------------------------------------------------------------------------------ slow variants


@pytest.mark.slow
@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_sampled_requests_follow_the_target_distribution(method):
    """20k seeded requests of one prompt at temperature 1 through the engine (prefill sampling +
    speculative steps): the joint law of their first 3 tokens is the target's (chi-square)."""
    from tests.test_speculative import ALPHA, N_ROWS, PROMPT, V, _chi2_pvalue, _exact_joint
    target = tiny_model(11, vocab=V, hidden=16, layers=2, heads=2, kv_heads=1, scale=1.0)
    if method == "draft":
        draft = tiny_model(12, vocab=V, hidden=16, layers=1, heads=2, kv_heads=1, scale=1.0)
    else:
        cfg = HeadConfig.for_target(target.config, "mtp")
        draft = Head(init_head(cfg, jax.random.key(5), scale=1.0), cfg)
    engine = Engine(target, draft, EngineConfig(
        SpecConfig(method=method, num_draft_tokens=2, page_size=4), max_slots=64,
        batch_buckets=(64,), token_buckets=(8,), max_model_len=16))
    params = [RequestParams(max_tokens=4, temperature=1.0, seed=i, stop_token_ids=())
              for i in range(N_ROWS)]  # 4 tokens: first, a fully accepted step, its bonus
    handles = [engine.submit(PROMPT, p) for p in params]
    engine.run()
    toks = np.array([h.result() for h in handles])
    cells = ((toks[:, 0] * V + toks[:, 1]) * V + toks[:, 2]) * V + toks[:, 3]
    stats = engine.stats()
    assert 0.01 < stats["acceptance_rate"] < 0.99  # accept and residual paths both exercised
    full = stats["spec_decode_num_accepted_tokens_per_pos"][-1]  # steps that accepted all k
    assert full >= 50, full  # the bonus after full acceptance is in the sample, many times
    assert _chi2_pvalue(cells, _exact_joint(target, 1.0, 0, 1.0, n=4)) > ALPHA
