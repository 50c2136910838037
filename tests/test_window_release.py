"""Window page release (specjax.engine.kv_groups): a tiny Gemma 3 (window 7, page size 4, layer
types sliding / full / sliding / sliding) generating several windows past its prompt in the
engine. The sliding layers' pages come from a pool of their own, far smaller than the global one,
and go back as requests advance; greedy outputs still equal plain decoding for plain steps, n-gram,
an early-exit draft (its sliding and full layers follow their groups' tables) and a head (its one
layer is sliding: it follows the sliding table with a lag). Releasing one page too early trips the
scheduler's check, and without the check changes the output (the test can fail)."""

import jax
import pytest

import specjax as sj
from specjax.config import SpecConfig
from specjax.engine import Engine, EngineConfig, RequestParams, kv_groups
from specjax.heads import Head, HeadConfig, init_head
from specjax.tree import TreeConfig
from tests.test_gemma3 import WINDOW
from tests.test_gemma3_engine import PROMPTS, gemma  # noqa: F401 - the module's fixture

N = 40  # generated tokens: the longest request ends 10 windows after position 0
PAGE = 4


_PLAIN: dict = {}  # (model id, prompt) -> plain greedy tokens (one model per module)


def plain(model, prompts):
    for p in prompts:
        if (id(model), tuple(p)) not in _PLAIN:
            _PLAIN[id(model), tuple(p)] = list(sj.generate(
                model, [p], max_new_tokens=N, method="none", eos_token_id=[]).tokens[0])
    return [_PLAIN[id(model), tuple(p)] for p in prompts]


def make(model, draft=None, method="none", spec_kw=None, **kw):
    spec = SpecConfig(method=method, num_draft_tokens=3, page_size=PAGE, **(spec_kw or {}))
    return Engine(model, draft, EngineConfig(spec, max_slots=4, batch_buckets=(4,),
                                             token_buckets=(8,), max_model_len=80, **kw))


def run(engine, prompts=PROMPTS):
    return [list(g) for g in engine.generate(prompts, RequestParams(max_tokens=N,
                                                                    stop_token_ids=()))]


@pytest.mark.parametrize("method", ["none", "ngram", "draft", "mtp", "eagle-tree", "eagle3"])
def test_release_keeps_greedy_output_and_bounds_pages(gemma, method):
    _, model = gemma
    draft, kw = None, {}
    if method == "draft":
        draft = sj.early_exit_draft(model, 2)  # a sliding and a full layer
    elif method in ("mtp", "eagle-tree", "eagle3"):
        kind = {"eagle-tree": "eagle"}.get(method, method)
        cfg = HeadConfig.for_target(model.config, kind)
        # the target's last layer is a sliding one; EAGLE-3's midlayer is a Llama layer (global)
        assert getattr(cfg.layer, "window", lambda i: None)(0) == (None if kind == "eagle3"
                                                                     else WINDOW)
        draft = Head(init_head(cfg, jax.random.key(3), scale=1.0), cfg)
        if method == "eagle-tree":  # tree nodes near the window edge
            kw["tree"] = TreeConfig(depth=3, top_k=2, num_nodes=6)
    engine = make(model, draft, method, spec_kw=kw)
    w = engine.window
    assert w is not None and engine.sc.groups == 2
    # the pools: sliding layers (0, 2, 3) hold the small pool, the full layer every page
    k = engine._state.target_kv.k
    assert [x.shape[1] for x in k] == [w.num_pages, engine.allocator.num_pages] + [w.num_pages] * 2
    if method == "draft":
        assert [x.shape[1] for x in engine._state.draft_kv.k] == [w.num_pages,
                                                                  engine.allocator.num_pages]
    if method in ("mtp", "eagle-tree", "eagle3"):
        head_pages = engine.allocator.num_pages if method == "eagle3" else w.num_pages
        assert engine._state.draft_kv.k[0].shape[1] == head_pages and w.margin == 1
    assert w.num_pages * 3 < engine.allocator.num_pages  # the point: a much smaller pool

    assert run(engine) == plain(model, PROMPTS), method
    assert w.num_released > 0
    assert 0 < w.max_live <= w.per_slot < engine.sc.pages_per_seq  # bounded far past the window
    assert w.alloc.num_used == 0 and engine.allocator.num_used == 0  # nothing leaked
    if method != "none":
        assert engine.stats()["spec_decode_num_drafts"] > 0


def test_release_one_page_too_early_is_caught(gemma, monkeypatch):
    """Negative control: a release rule off by one page trips the check of every planned row;
    with the check off the row reads a page another position overwrote, and outputs change."""
    _, model = gemma
    first_needed = kv_groups.WindowGroup.first_needed
    monkeypatch.setattr(kv_groups.WindowGroup, "first_needed",
                        lambda self, q: first_needed(self, q) + 1)
    with pytest.raises(RuntimeError, match="were released"):
        run(make(model))
    engine = make(model)
    engine.window.check_rows = False
    assert run(engine) != plain(model, PROMPTS)


def test_short_window_pool_waits_or_preempts_never_corrupts(gemma):
    """A sliding pool of one request's bound: admissions wait on it and decode growth preempts
    (the scheduler checks both pools), and outputs stay exact."""
    _, model = gemma
    per_slot = make(model).window.per_slot
    engine = make(model, num_window_pages=per_slot)
    assert engine.window.num_pages == per_slot
    max_running = []
    sched = engine.scheduler.schedule
    engine.scheduler.schedule = lambda now: (max_running.append(len(engine.scheduler.running)),
                                             sched(now))[1]
    assert run(engine) == plain(model, PROMPTS)
    assert engine.window.max_live <= per_slot and engine.window.alloc.num_used == 0
    assert engine.scheduler.num_preemptions > 0 and max(max_running) < 4  # of 4 slots


def test_release_rule_at_the_page_boundary():
    """A page goes back exactly when its last position is below the window of a query at
    q_min: with W = 8, S = 4 a query at 11 reads 4.., one at 12 reads 5.. (page 1 kept),
    one at 15 reads 8.. (page 1 gone); the margin moves the bound back."""
    w = kv_groups.WindowGroup(16, 4, window=8, margin=0, per_slot=5)
    assert [w.first_needed(q) for q in (0, 7, 10, 11, 12, 14, 15)] == [0, 0, 0, 1, 1, 1, 2]
    assert kv_groups.WindowGroup(16, 4, window=8, margin=1, per_slot=5).first_needed(15) == 1

    class Req:
        id, window_pages = 0, []

    r = Req()
    w.allocate(5, r)
    assert w.release(r, 11) == 1 and r.window_pages[0] == -1 and w.alloc.num_used == 4
    w.check(r, 11, 20)  # the window of a query at 11 starts on page 1: mapped
    with pytest.raises(RuntimeError):
        w.check(r, 10, 20)  # a query at 10 would read position 3 (page 0, released)
    assert w.release(r, 11) == 0  # idempotent
    w.free(r)
    assert w.alloc.num_used == 0 and r.window_pages == []


def test_prefix_hits_need_the_window_s_sliding_copies(gemma):
    """The prefix-cache rule: sliding pages are cached under the same hash chain as global ones
    and stay findable after release until evicted. A hit reuses the sliding copies its first
    query's window reads (-1 below them) and reproduces plain decoding; once those copies are
    evicted the same prefix is a miss (nothing else was cached), and output is still exact."""
    _, model = gemma
    engine = make(model, enable_prefix_caching=True)
    w = engine.window
    assert w is not None
    shared = PROMPTS[3][:24]  # 6 full pages
    prompts = [shared + [5, 6, 7], shared + [9, 10], shared + [11, 12, 13]]
    ref = plain(model, prompts)
    assert run(engine, prompts[:1]) == ref[:1]
    assert w.num_released > 0 and w.alloc.num_cached > 0  # released, yet still findable
    hits = engine.stats()["prefix_cache_hits"]
    seen = []
    w.acquire = lambda req, m, pages, f=w.acquire: (seen.append((m, list(pages))), f(req, m, pages))
    assert run(engine, prompts[1:2]) == ref[1:2]
    m, pages = seen[-1]  # the hit: 6 pages, sliding copies of pages 4, 5 only (window 7 at 24)
    assert m == 6 and len(pages) == m - w.first_needed(m * PAGE) == 2
    assert engine.stats()["prefix_cache_hits"] == hits + 24
    # evict every cached sliding page: the hit is cut to nothing (its window's copies are gone)
    class Dummy:
        pass

    d = Dummy()
    w.alloc.free(w.alloc.allocate(w.alloc.num_free, d), d)
    assert w.alloc.num_cached == 0 and engine.allocator.num_cached > 0
    hits = engine.stats()["prefix_cache_hits"]
    assert run(engine, prompts[2:]) == ref[2:]
    assert seen[-1] == (0, []) and engine.stats()["prefix_cache_hits"] == hits
    assert w.alloc.num_used == 0 and engine.allocator.num_used == 0


def test_one_group_without_sliding_layers(gemma):
    """Families without sliding layers (and release turned off) keep today's single table."""
    from tests.conftest import tiny_model  # noqa: PLC0415

    llama = Engine(tiny_model(0), None, EngineConfig(SpecConfig(page_size=4), max_slots=2,
                                                     max_model_len=32))
    assert llama.window is None and llama.sc.groups == 1 and "kv_window_pages_total" not in \
        llama.occupancy()
    _, model = gemma
    off = make(model, window_page_release=False)
    assert off.window is None and off.sc.groups == 1
    assert {x.shape[1] for x in off._state.target_kv.k} == {off.allocator.num_pages}


def test_tree_copy_follows_each_layer_s_group():
    """Tree verify's copy of the accepted path (tree.copy_slots) with a grouped table moves each
    layer's entries through its own group's pages: the same as one-group copies layer by layer."""
    import jax.numpy as jnp  # noqa: PLC0415

    from specjax import kv_cache, tree  # noqa: PLC0415

    keys = jax.random.split(jax.random.key(0), 4)
    pools = [jax.random.normal(k, (2, p, PAGE, 8)) for k, p in zip(keys, (10, 6, 10, 6))]
    kv = kv_cache.KVCache(k=(pools[0], pools[1]), v=(pools[2], pools[3]))  # global, sliding
    table = jnp.array([[[3, 1, 7, 2], [-1, 5, 0, 4]], [[0, 9, 4, 8], [-1, -1, 2, 3]]], jnp.int32)
    base, count = jnp.array([5, 9], jnp.int32), jnp.array([3, 2], jnp.int32)
    src = jnp.array([[0, 2, 4], [0, 3, 1]], jnp.int32)
    got = tree.copy_slots(kv, table, base, src, count, (None, 7))
    for layer, row in ((0, 0), (1, 1)):
        one = kv_cache.KVCache(k=(kv.k[layer],), v=(kv.v[layer],))
        want = tree.copy_slots(one, table[:, row], base, src, count)
        assert jnp.array_equal(got.k[layer], want.k[0]) and jnp.array_equal(got.v[layer], want.v[0])
    assert not jnp.array_equal(got.k[1], kv.k[1])  # something moved in the sliding pool
