"""Prefix caching across requests, with speculation (EngineConfig.enable_prefix_caching).

Engines share test_engine's static configuration (tiny models, 8 slots, chunk width 8, page size
4), so each method's step variants compile once. Greedy outputs are compared with each request
run alone with plain decoding (sj.generate): a cached prefix must change no token, for every
drafter kind, also when pages are scarce (preemption and eviction) and requests are aborted.
"""

import numpy as np
import pytest

from specjax.engine import Engine, EngineConfig, PageAllocator, RequestParams
from specjax.engine.allocator import page_hashes
from tests.test_engine import BASE, alone, drafts, spec, target  # noqa: F401 (fixtures)

METHODS = ["none", "draft", "mtp", "eagle-tree", "ngram"]
PREFIX = [int(x) for x in np.random.default_rng(7).integers(3, 64, 21)]  # 21 tokens: 5 full pages


def make(target, drafts, method, **kw):  # noqa: F811
    d = None if method == "ngram" else drafts[method]
    return Engine(target, d, EngineConfig(spec(method), **{**BASE, "enable_prefix_caching": True,
                                                          **kw}))


def shared_prefix_requests(n, seed):
    rng = np.random.default_rng(seed)
    return [(PREFIX + rng.integers(0, 64, int(rng.integers(1, 4))).tolist(),
             int(rng.integers(4, 9))) for _ in range(n)]


# ------------------------------------------------------------------------------ allocator


def test_page_hashes_chain_over_contents():
    a = page_hashes(list(range(12)), 4)
    assert len(a) == 3 and len(set(a)) == 3
    b = page_hashes([0, 1, 2, 3, 9, 5, 6, 7, 8, 9, 10, 11], 4)
    assert b[0] == a[0] and b[1] != a[1] and b[2] != a[2]  # a change reaches every later page
    assert page_hashes(list(range(12)), 4, limit=11) == a[:2]  # a page ending after the limit
    assert len(page_hashes(list(range(12)), 4, lookahead=1)) == 2  # page 2 has no next token
    c = page_hashes(list(range(8)) + [99], 4, lookahead=1)
    assert c[0] == page_hashes(list(range(9)), 4, lookahead=1)[0]
    assert c[1] != page_hashes(list(range(9)), 4, lookahead=1)[1]  # the next token matters


def test_allocator_shares_counts_references_and_evicts_lru():
    alloc = PageAllocator(6, page_size=4)
    start = alloc.snapshot()
    a, b, c = object(), object(), object()
    toks = list(range(10))
    pa = alloc.allocate(3, a)
    assert alloc.lookup(toks, 9) == []
    assert alloc.register(pa, toks, 9, a) == 2  # two full pages end before token 9
    hit = alloc.lookup(toks, 9)
    assert hit == pa[:2] and alloc.num_evictable(hit) == 0
    alloc.acquire(hit, b)
    alloc.free(pa, a)
    assert alloc.num_free == 4  # pa[2] is free, the shared pages are still b's
    with pytest.raises(ValueError, match="not owned"):
        alloc.free(pa[:1], a)  # a's reference is gone
    alloc.free(hit, b)
    assert alloc.num_free == 6 and alloc.num_cached == 2 and alloc.snapshot() == start
    assert alloc.num_evictable(alloc.lookup(toks, 9)) == 2
    alloc.allocate(4, c)  # the never-cached pages first: nothing evicted
    assert alloc.num_evictions == 0 and alloc.lookup(toks, 9) == pa[:2]
    alloc.allocate(1, c)  # the least recently freed cached page goes: hit[1] (freed first)
    assert alloc.num_evictions == 1 and alloc.lookup(toks, 9) == pa[:1]


# ------------------------------------------------------------------------------ engine


@pytest.mark.parametrize("method", METHODS)
def test_repeated_prefix_hits_and_outputs_are_unchanged(target, drafts, method):  # noqa: F811
    engine = make(target, drafts, method, num_pages=80)  # no preemption: exact counters
    start = engine.allocator.snapshot()
    reqs = shared_prefix_requests(10, seed=1)
    want = [alone(target, p, m) for p, m in reqs]
    first = engine.submit(reqs[0][0], RequestParams(max_tokens=reqs[0][1], stop_token_ids=()))
    engine.run()
    assert first.result() == want[0]
    s = engine.stats()
    assert s["prefix_cache_hits"] == 0 and s["prefix_cache_queries"] == len(reqs[0][0])
    handles = []
    for i, (p, m) in enumerate(reqs[1:]):
        handles.append(engine.submit(p, RequestParams(max_tokens=m, stop_token_ids=())))
        if i % 3 == 0:
            engine.step()
    engine.run()
    got = [h.result() for h in handles]
    bad = [i for i, (g, w) in enumerate(zip(got, want[1:])) if g != w]
    assert not bad, f"{method}: request {bad[0] + 1}: {got[bad[0]]} != {want[bad[0] + 1]}"
    s = engine.stats()
    # each later request finds the 5 full pages of the shared prefix (20 tokens)
    assert s["prefix_cache_hits"] == 9 * 20
    assert s["prefix_cache_queries"] == sum(len(p) for p, _ in reqs)
    assert engine.allocator.snapshot() == start and engine.allocator.num_used == 0


@pytest.mark.parametrize("method", ["draft", "mtp"])
def test_aborted_and_finished_requests_return_their_pages(target, drafts, method):  # noqa: F811
    engine = make(target, drafts, method)
    start = engine.allocator.snapshot()
    reqs = shared_prefix_requests(12, seed=2)
    hs = [engine.submit(p, RequestParams(max_tokens=m, stop_token_ids=())) for p, m in reqs]
    for _ in range(3):
        engine.step()
    for h in hs[::3]:
        engine.abort(h.id)
    engine.run()
    assert all(h.finished for h in hs)
    assert [h.finish_reason for h in hs[::3]] == ["abort"] * 4
    for h, (p, m) in zip(hs, reqs):
        if h.finish_reason != "abort":
            assert h.result() == alone(target, p, m)
    assert engine.stats()["prefix_cache_hits"] > 0
    assert engine.allocator.snapshot() == start and engine.allocator.num_used == 0
    assert sorted(engine.scheduler.free_slots) == list(range(8))


@pytest.mark.parametrize("method", ["draft", "eagle-tree"])
def test_eviction_under_a_small_page_budget_loses_no_request(target, drafts, method):  # noqa: F811
    """Room for little more than one full-length sequence: requests wait, get preempted, and
    cached pages are evicted; every request still finishes with its exact output."""
    engine = make(target, drafts, method, num_pages=12)
    start = engine.allocator.snapshot()
    rng = np.random.default_rng(3)
    prefixes = [rng.integers(0, 64, 17).tolist() for _ in range(4)]
    reqs = [(prefixes[i % 4] + rng.integers(0, 64, 2).tolist(), int(rng.integers(4, 10)))
            for i in range(16)]
    hs = []
    for i, (p, m) in enumerate(reqs):
        hs.append(engine.submit(p, RequestParams(max_tokens=m, stop_token_ids=())))
        if i % 2:
            engine.step()
    engine.run()
    for h, (p, m) in zip(hs, reqs):
        assert h.finish_reason == "length" and h.result() == alone(target, p, m)
    s = engine.stats()
    assert engine.allocator.num_evictions > 0 and s["prefix_cache_hits"] > 0
    assert engine.allocator.snapshot() == start and engine.allocator.num_used == 0


def test_prefix_cache_counters_on_metrics(target, drafts):  # noqa: F811
    from prometheus_client import generate_latest  # noqa: PLC0415
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    from specjax.serve.metrics import make_registry  # noqa: PLC0415

    engine = make(target, drafts, "none")
    p = PREFIX + [1]
    engine.generate([p, p], RequestParams(max_tokens=2, stop_token_ids=()))
    engine.generate([p], RequestParams(max_tokens=2, stop_token_ids=()))
    text = generate_latest(make_registry(engine, "m")).decode()
    got = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert got["vllm:prefix_cache_queries_total"] == 3 * len(p)
    assert got["vllm:prefix_cache_hits_total"] == 20  # the two first ones were admitted together


def prompt_kv(engine, pages, n):
    """[layers, 2, Hkv, n, D] target and draft KV of positions 0..n-1 through ``pages``."""
    out = []
    for kv in (engine._state.target_kv, engine._state.draft_kv):
        if kv is None:
            continue
        for pool in (kv.k, kv.v):
            for a in pool:  # [Hkv, P, S, D]
                a = np.asarray(a)[:, pages]
                out.append(a.reshape(a.shape[0], -1, a.shape[-1])[:, :n])
    return out


@pytest.mark.parametrize("method", ["draft", "mtp", "eagle-tree"])
def test_drafter_state_of_a_cached_prefix_is_exact(target, drafts, method):  # noqa: F811
    """Outputs cannot show a wrong drafter state (verification is lossless), the pools can:
    requests run one at a time must see the same target and draft / head KV at every prompt
    position, and get the same drafts accepted, with and without the cache. The second family of
    prompts diverges right at a page boundary (token 20), where a head's KV of the cached page's
    last position would have consumed the wrong next token."""
    rng = np.random.default_rng(5)
    prompts = [PREFIX + rng.integers(0, 64, 2).tolist() for _ in range(3)]
    prompts += [PREFIX[:20] + rng.integers(0, 64, 3).tolist() for _ in range(3)]
    runs = {}
    for cached in (False, True):
        engine = make(target, drafts, method, num_pages=80, enable_prefix_caching=cached)
        out = []
        for p in prompts:
            h = engine.submit(p, RequestParams(max_tokens=8, stop_token_ids=()))
            while not h.tokens:  # the prefill ran and its first token was read back
                engine.step()
            kv = prompt_kv(engine, list(h._req.pages), len(p) - 1)
            engine.run()
            out.append((h.result(), h.spec_stats(), kv))
        runs[cached] = out, engine.stats()["prefix_cache_hits"]
    (plain, _), (cached, hits) = runs[False], runs[True]
    for i, ((tp, sp, kp), (tc, sc, kc)) in enumerate(zip(plain, cached)):
        assert tc == tp == alone(target, prompts[i], 8)
        for a, b in zip(kp, kc):
            np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=f"{method}: prompt {i}")
        assert sc == sp, f"{method}: prompt {i}: drafts differ with the cache: {sc} != {sp}"
    # a head's page 4 is keyed with token 20 too: the second family finds only pages 0..3
    assert hits == (5 * 20 if method == "draft" else 2 * 20 + 3 * 16)


def test_ngram_history_of_a_cached_prefix_is_the_prompt(target, drafts):  # noqa: F811
    """n-gram drafting reads the slot's token history: with the cache a request's history must
    still hold its whole prompt (the cached pages' tokens seeded before its first chunk), and
    its drafts match the uncached run's. The prompts repeat a run of the cached prefix at their
    end, so the n-gram match (and the drafts) come from cached positions; the last two run
    together, so one of them is in a slot that never held the prefix."""
    a = PREFIX[:10]
    prefix = a + a  # 20 tokens: 5 full pages of the first request, then cached
    rng = np.random.default_rng(9)
    prompts = [prefix + rng.integers(0, 64, 2).tolist() + a[:3] for _ in range(3)]
    runs = {}
    for cached in (False, True):
        engine = make(target, drafts, "ngram", num_pages=80, enable_prefix_caching=cached)
        out = []
        for group in (prompts[:1], prompts[1:]):
            hs = [engine.submit(p, RequestParams(max_tokens=6, stop_token_ids=())) for p in group]
            while not all(h.tokens for h in hs):
                engine.step()
            hist = [np.asarray(engine._state.history)[h._req.slot, :len(p)].tolist()
                    for h, p in zip(hs, group)]
            engine.run()
            out += [(h.result(), h.spec_stats(), x) for h, x in zip(hs, hist)]
        runs[cached] = out, engine.stats()["prefix_cache_hits"]
    (plain, _), (cached, hits) = runs[False], runs[True]
    assert hits == 2 * 20
    for i, ((tp, sp, hp), (tc, sc, hc)) in enumerate(zip(plain, cached)):
        assert hc == hp == prompts[i], f"prompt {i}: history {hc} != {prompts[i]}"
        assert tc == tp == alone(target, prompts[i], 6)
        assert sc == sp, f"prompt {i}: drafts differ with the cache: {sc} != {sp}"
