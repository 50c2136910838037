"""N-gram (prompt lookup) drafting, the hybrid drafter and adaptive k (by recent acceptance and
by the drafts' confidence): search parity with a plain-Python reference, greedy losslessness
(ragged rows, EOS at different steps), the carried draft state after hybrid / plain steps, exact
sampled distributions, the no-match fallback and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import acceptance, adaptive, cost_model, ngram, speculate
from specjax.heads import Head, HeadConfig, init_head
from tests.test_speculative import (ALPHA, N_ROWS, PROMPT, PROMPTS, V, _biased_residual,
                                    _chi2_pvalue, _eos_for_staggered_stops, _exact_joint, cells_of)

K = 3


@pytest.fixture(scope="module")
def plain(tiny_pair):
    target, _ = tiny_pair
    return sj.generate(target, PROMPTS, max_new_tokens=40, eos_token_id=[]).tokens


@pytest.fixture()
def fixed_costs(monkeypatch):
    """A cost model that favours speculating first, so the adaptive loop visits several k."""
    def costs(*args, kmax, **kw):
        return [1.0] + [1.2 + 0.1 * k for k in range(1, kmax + 1)]
    monkeypatch.setattr(cost_model, "measure_costs", costs)


def _mtp_head(target):
    cfg = HeadConfig.for_target(target.config, "mtp")
    return Head(init_head(cfg, jax.random.key(3), scale=0.3), cfg)


# ------------------------------------------------------------------------------ the search

@pytest.mark.parametrize("lo,hi", [(1, 3), (2, 4), (1, 1), (3, 3)])
def test_search_matches_reference(lo, hi):
    """Longest match in [lo, hi], ties to the most recent occurrence, continuation proposals."""
    rng = np.random.default_rng(lo * 10 + hi)
    width, b = 24, 64
    rows = [rng.integers(0, int(rng.integers(2, 5)), int(rng.integers(1, width + 1))).tolist()
            for _ in range(b)]
    hist = np.full((b, width), 7, np.int32)  # stale slots hold a token the rows never use
    for i, r in enumerate(rows):
        hist[i, :len(r)] = r
    lens = jnp.asarray([len(r) for r in rows], jnp.int32)
    m, end = ngram.search(jnp.asarray(hist), lens, lo, hi)
    toks, m2 = ngram.propose(jnp.asarray(hist), lens, 5, lo, hi)
    for i, r in enumerate(rows):
        want_m, want_end = ngram.search_reference(r, lo, hi)
        assert int(m[i]) == want_m and int(m2[i]) == want_m, (r, lo, hi)
        if want_m:
            assert int(end[i]) == want_end, (r, lo, hi)
        assert np.asarray(toks[i]).tolist() == ngram.propose_reference(r, 5, lo, hi)[0]
    assert 0 < int(jnp.sum(m > 0)) < b  # both matched and unmatched rows were exercised


def test_search_reference_examples():
    assert ngram.search_reference([1, 2, 3, 1, 2], 1, 3) == (2, 1)  # "1 2" at 0..1
    assert ngram.search_reference([5, 1, 2, 9, 1, 2, 3, 1, 2], 1, 3) == (2, 5)  # most recent
    assert ngram.search_reference([1, 2, 3], 1, 3) == (0, -1)
    assert ngram.propose_reference([4, 4, 4], 3, 1, 3) == ([4, 4, 4], 2)
    assert ngram.propose_reference([1, 2, 3, 1], 4, 1, 3) == ([2, 3, 1, 2], 1)  # periodic


# ----------------------------------------------------------------------------- losslessness

def test_ngram_greedy_lossless_eos_at_different_steps(tiny_pair, plain):
    target, _ = tiny_pair
    eos = _eos_for_staggered_stops(plain)
    want = [row[: row.index(eos) + 1] if eos in row else row for row in plain]
    out = sj.generate(target, PROMPTS, max_new_tokens=40, method="ngram", num_draft_tokens=K,
                      eos_token_id=eos)
    assert out.tokens == want
    assert len({len(r) for r in want}) >= 3


def test_ngram_drafts_are_accepted(tiny_pair, plain):
    """Repetitive rows (the all-4 prompt makes the model repeat itself) accept n-gram drafts."""
    target, _ = tiny_pair
    out = sj.generate(target, PROMPTS, max_new_tokens=40, method="ngram", num_draft_tokens=K,
                      eos_token_id=[])
    assert out.tokens == plain
    assert out.stats["mean_accepted_length"] > 1.05
    assert 0 < out.stats["drafted_tokens"] < out.stats["row_steps"] * K  # some rows had no match


def test_hybrid_draft_lossless(tiny_pair, plain):
    target, draft = tiny_pair
    out = sj.generate(target, PROMPTS, max_new_tokens=40, draft=draft, method="draft",
                      num_draft_tokens=K, hybrid_min=1, eos_token_id=[])
    assert out.tokens == plain


@pytest.mark.parametrize("method", ["draft", pytest.param("ngram", marks=pytest.mark.slow)])
def test_adaptive_greedy_lossless(tiny_pair, plain, fixed_costs, method):
    target, draft = tiny_pair
    eos = _eos_for_staggered_stops(plain)
    want = [row[: row.index(eos) + 1] if eos in row else row for row in plain]
    out = sj.generate(target, PROMPTS, max_new_tokens=40, draft=draft if method == "draft" else None,
                      method=method, num_draft_tokens=K, adaptive=True, eos_token_id=eos)
    assert out.tokens == want
    hist = out.stats["k_histogram"]
    assert len(hist) == K + 1 and sum(hist) == out.stats["steps"]
    assert sum(c > 0 for c in hist) >= 2, hist  # the device switched between k-variants


@pytest.mark.slow
def test_adaptive_mtp_greedy_lossless(tiny_pair, plain, fixed_costs):
    target, _ = tiny_pair
    out = sj.generate(target, PROMPTS, max_new_tokens=40, draft=_mtp_head(target), method="mtp",
                      num_draft_tokens=K, adaptive=True, hybrid_min=2, eos_token_id=[])
    assert out.tokens == plain
    assert sum(c > 0 for c in out.stats["k_histogram"]) >= 2


@pytest.mark.parametrize("where", ["loop", pytest.param("engine", marks=pytest.mark.slow)])
def test_adaptive_self_draft_accepts_everything_after_plain_streaks(tiny_pair, fixed_costs,
                                                                    monkeypatch, where):
    """The target as its own draft LLM accepts every draft it proposes, even right after plain
    (k = 0) streaks longer than the lazy-upkeep window: the catch-up leaves the drafter exactly
    where eager upkeep would (a wrong catch-up shows as rejected drafts, not as wrong tokens)."""
    target, _ = tiny_pair
    # A fixed schedule instead of the estimate: 20 plain steps, then K, repeated (> LAG_WINDOW).
    monkeypatch.setattr(adaptive, "choose_k", lambda hits, obs, cost, plain_run, lagging=False:
                        jnp.where(plain_run >= 20, K, 0).astype(jnp.int32))
    prompts = PROMPTS[:2]
    want = sj.generate(target, prompts, max_new_tokens=60, eos_token_id=[]).tokens
    if where == "loop":
        out = sj.generate(target, prompts, max_new_tokens=60, draft=target, method="draft",
                          num_draft_tokens=K, adaptive=True, eos_token_id=[], ngram_max=5)
        assert out.tokens == want
        hist, s = out.stats["k_histogram"], out.stats
        assert hist[0] > speculate.LAG_WINDOW and hist[K] > 0, hist
        drafted = s["drafted_tokens"]
        accepted = s["accepted_tokens"]
        assert s["mean_accepted_length"] == pytest.approx(1 + accepted / s["speculative_steps"])
    else:
        from specjax.engine import Engine, EngineConfig, RequestParams
        engine = Engine(target, target, EngineConfig(
            sj.SpecConfig(method="draft", num_draft_tokens=K, page_size=4, adaptive=True,
                          ngram_max=5),
            max_slots=2, batch_buckets=(2,), token_buckets=(8,), max_model_len=128))
        handles = [engine.submit(p, RequestParams(max_tokens=60, stop_token_ids=())) for p in prompts]
        engine.run()
        assert [h.result() for h in handles] == want
        s = engine.stats()
        assert s["k_histogram"][0] > speculate.LAG_WINDOW and s["k_histogram"][K] > 0
        drafted, accepted = s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]
    assert drafted > 0
    # Every proposed draft accepted, except those cut by max_new_tokens at each row's end.
    assert accepted >= drafted - K * len(prompts), (accepted, drafted)


# ----------------------------------------------------------------- carried drafter state

def _run_steps(target, draft, lc, steps, cost=None, lag_window=speculate.LAG_WINDOW):
    """Prefill + `steps` fused steps (rows never finish); returns the state."""
    b, tp = len(PROMPTS), 32
    toks = np.zeros((b, tp), np.int32)
    for i, p in enumerate(PROMPTS):
        toks[i, :len(p)] = p
    rp = speculate.RowParams(temperature=jnp.zeros(b), top_k=jnp.zeros(b, jnp.int32),
                             top_p=jnp.ones(b), max_new=jnp.full((b,), 10_000, jnp.int32),
                             eos_ids=jnp.asarray([-1], jnp.int32))
    prefill = jax.jit(functools.partial(speculate.prefill, lag_window=lag_window),
                      static_argnums=(1, 3, 8, 9, 10))
    state = prefill(target.params, target.config, draft.params, draft.config, jnp.asarray(toks),
                    jnp.asarray([len(p) for p in PROMPTS], jnp.int32), rp, jnp.asarray(0), lc, 12,
                    128, cost=cost)
    step = jax.jit(speculate.spec_step, static_argnums=(1, 3, 6))
    for _ in range(steps):
        state = step(target.params, target.config, draft.params, draft.config, state, rp, lc)
    return state


@pytest.mark.parametrize("mode", ["hybrid", pytest.param("adaptive", marks=pytest.mark.slow),
                                  pytest.param("adaptive-window", marks=pytest.mark.slow),
                                  "adaptive-mtp-window"])
def test_carried_draft_state_equals_teacher_forcing(tiny_pair, mode):
    """After hybrid steps (n-gram rows' accepted drafts written by the catch-up) or adaptive
    plain steps (the drafter left behind, then caught up lazily; "-window": a 3-slot window that
    fills, so the in-loop catch-up of all but the newest position runs too), the carried draft
    logits equal a fresh teacher-forced draft (or head) pass over the committed tokens, and the
    history buffer holds them."""
    target, draft = tiny_pair
    if mode == "hybrid":
        lc = sj.SpecConfig(method="draft", num_draft_tokens=K, hybrid_min=1)
        state = _run_steps(target, draft, lc, 8)
    else:
        method = "mtp" if "mtp" in mode else "draft"
        draft = _mtp_head(target) if method == "mtp" else draft
        lc = sj.SpecConfig(method=method, num_draft_tokens=K, adaptive=True)
        cost = jnp.asarray([1.0, 1.2, 1.3, 1.4])  # k=3 first, then plain steps and probes
        window = 3 if "window" in mode else speculate.LAG_WINDOW
        state = _run_steps(target, draft, lc, 12 if "window" in mode else 8, cost, window)
        assert int(state.k_hist[0]) > 0 and int(state.k_hist[1:].sum()) > 0
        if "window" in mode:
            assert int(state.k_hist[0]) > window  # a plain streak longer than the window
        # The last steps were plain: the drafter lags; the lazy catch-up must restore it.
        assert int(jnp.max(state.lag)) > 0
        assert int(jnp.max(state.lag)) <= window
        state = speculate._catch_up_state(target.params, target.config, draft.params, draft.config,
                                          state, lc, keep=0)
        assert int(jnp.max(state.lag)) == 0
    for i, p in enumerate(PROMPTS):
        seq = p + np.asarray(state.out_tokens[i, :int(state.num_out[i])]).tolist()
        assert len(seq) == int(state.lengths[i])
        if state.history is not None:
            assert np.asarray(state.history[i, :len(seq)]).tolist() == seq
        want = (sj.draft_logits(target, draft, seq)[-1] if lc.uses_head
                else sj.logits(draft, seq)[-1])
        np.testing.assert_allclose(state.draft_logits[i], want, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the no-match fallback

def test_plain_step_taken_when_nothing_matches(tiny_pair, monkeypatch):
    """With no match in any row the loop runs the one-token step, not the (k+1)-token verify."""
    target, _ = tiny_pair
    calls = {"plain": 0, "chain": 0}
    for name, key in (("plain_step", "plain"), ("chain_step", "chain")):
        orig = getattr(speculate.steps, name)

        def wrapped(*args, _orig=orig, _key=key, **kw):
            out = _orig(*args, **kw)
            jax.debug.callback(lambda: calls.__setitem__(_key, calls[_key] + 1))
            return out
        monkeypatch.setattr(speculate.steps, name, wrapped)
    # Distinct-token prompts: one whose first generated token is new (nothing can match), one
    # whose first generated token repeats a prompt token (a match). ngram_max=4 is used by no
    # other test, so nothing compiled before the patch is reused.
    prompts = {}
    for start in range(0, 60, 6):
        prompt = list(range(start, start + 6))
        first = sj.generate(target, [prompt], max_new_tokens=1, eos_token_id=[]).tokens[0][0]
        prompts.setdefault(first in prompt, prompt)
        if len(prompts) == 2:
            break
    calls.update(plain=0, chain=0)
    out = sj.generate(target, [prompts[False]], max_new_tokens=2, method="ngram",
                      num_draft_tokens=K, eos_token_id=[], ngram_max=4)
    assert calls == {"plain": 1, "chain": 0}
    assert out.stats["drafted_tokens"] == 0
    calls.update(plain=0, chain=0)
    out = sj.generate(target, [prompts[True]], max_new_tokens=2, method="ngram",
                      num_draft_tokens=K, eos_token_id=[], ngram_max=4)
    assert calls == {"plain": 0, "chain": 1}
    assert out.stats["drafted_tokens"] == K


# ----------------------------------------------------------------------- distributions

@pytest.fixture(scope="module")
def dist_pair():
    from tests.conftest import tiny_model
    target = tiny_model(11, vocab=V, hidden=16, layers=2, heads=2, kv_heads=1, scale=1.0)
    draft = tiny_model(12, vocab=V, hidden=16, layers=1, heads=2, kv_heads=1, scale=1.0)
    return target, draft


def _first3(target, **kw):
    """k + 2 = 4 tokens per row (first token, a fully accepted step, its bonus)."""
    out = sj.generate(target, [PROMPT] * N_ROWS, max_new_tokens=4, num_draft_tokens=2,
                      temperature=1.0, eos_token_id=[], **kw)
    return cells_of(out.tokens, V), out


def test_ngram_distribution_matches_target(dist_pair):
    target, _ = dist_pair
    cells, out = _first3(target, method="ngram")
    assert 0.05 < out.stats["acceptance_rate"] < 0.95
    assert out.stats["per_position_acceptance"][-1] > 0.01  # bonus after full acceptance sampled
    assert _chi2_pvalue(cells, _exact_joint(target, 1.0, 0, 1.0, n=4)) > ALPHA


@pytest.mark.slow  # test_speculative's negative control covers the same rule on the default run
def test_ngram_biased_rule_fails_distribution_test(dist_pair, monkeypatch):
    """Negative control: resampling from p (not the residual) at a rejection is detected."""
    target, _ = dist_pair
    monkeypatch.setattr(acceptance, "accept_chain", _biased_residual)
    jax.clear_caches()
    try:
        cells, _ = _first3(target, method="ngram")
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert _chi2_pvalue(cells, _exact_joint(target, 1.0, 0, 1.0, n=4)) < ALPHA


@pytest.mark.parametrize("by", ["history", "confidence"])
def test_adaptive_distribution_matches_target(dist_pair, fixed_costs, by):
    target, draft = dist_pair
    cells, out = _first3(target, method="draft", draft=draft, adaptive=True, draft_sampling=True,
                         hybrid_min=1, adaptive_by=by)
    assert out.stats["k_histogram"][2] > 0
    assert out.stats["per_position_acceptance"][-1] > 0.01  # bonus after full acceptance sampled
    assert _chi2_pvalue(cells, _exact_joint(target, 1.0, 0, 1.0, n=4)) > ALPHA


# ----------------------------------------------------------------------- adaptive choice

def test_choose_k_follows_acceptance_and_cost():
    cost = jnp.asarray([1.0, 1.3, 1.45, 1.6])
    sure = jnp.full((3,), 50.0)
    run0 = jnp.zeros((), jnp.int32)
    assert int(adaptive.choose_k(sure, sure, cost, run0)) == 3  # everything accepted: longest k
    none = jnp.zeros((3,))
    assert int(adaptive.choose_k(none, sure, cost, run0)) == 0  # nothing accepted: plain steps
    assert int(adaptive.choose_k(sure, sure, jnp.asarray([1.0, 9.0, 9.0, 9.0]), run0)) == 0
    hits, obs, run = adaptive.update(none, none, run0, jnp.asarray([0, 2, 1]), jnp.asarray(2),
                                     jnp.asarray([True, True, False]))
    np.testing.assert_allclose(hits, [0.5, 0.5, 0.0])  # row 1 accepted positions 1 and 2
    np.testing.assert_allclose(obs, [1.0, 0.5, 0.0])  # row 0 never reached position 2
    assert int(run) == 0


def test_plain_steps_keep_the_estimate_and_probe_on_schedule():
    cost = jnp.asarray([1.0, 1.3, 1.45, 1.6])
    hits, obs = jnp.asarray([0.2, 0.0, 0.0]), jnp.asarray([9.0, 0.2, 0.0])
    run = jnp.zeros((), jnp.int32)
    for step in range(adaptive.PROBE_EVERY):
        assert int(adaptive.choose_k(hits, obs, cost, run)) == 0, step  # a losing draft
        new_hits, new_obs, run = adaptive.update(hits, obs, run, jnp.zeros((2,), jnp.int32),
                                                 jnp.asarray(0), jnp.ones((2,), bool))
        np.testing.assert_array_equal(new_hits, hits)  # a plain step observes nothing
        np.testing.assert_array_equal(new_obs, obs)
    assert int(run) == adaptive.PROBE_EVERY
    assert int(adaptive.choose_k(hits, obs, cost, run)) == 1  # the probe: best k >= 1
    _, _, run = adaptive.update(hits, obs, run, jnp.zeros((2,), jnp.int32), jnp.asarray(1),
                                jnp.ones((2,), bool))
    assert int(run) == 0  # a drafting step restarts the count
    # a lagging drafter's catch-up (cost[K+1]) is charged to k >= 1: entering speculation costs
    # more than staying in it (alpha ~0.35 pays at k = 1 when level, not when a catch-up is due)
    hits35, obs1 = jnp.asarray([3.5, 0.0, 0.0]), jnp.asarray([10.0, 3.5, 0.0])
    with_entry = jnp.asarray([1.0, 1.2, 1.45, 1.6, 0.3])
    assert int(adaptive.choose_k(hits35, obs1, with_entry, jnp.asarray(0), False)) == 1
    assert int(adaptive.choose_k(hits35, obs1, with_entry, jnp.asarray(0), True)) == 0
    assert int(adaptive.choose_k(hits35, obs1, with_entry[:4], jnp.asarray(0), True)) == 1
    # k values whose cost is infinite never run, not even as a probe
    inf = jnp.inf
    assert int(adaptive.choose_k(hits, obs, jnp.asarray([1.0, inf, 1.45, inf]), jnp.asarray(
        adaptive.PROBE_EVERY))) == 2
    assert int(adaptive.choose_k(hits, obs, jnp.asarray([1.0, inf, inf, inf]), jnp.asarray(
        adaptive.PROBE_EVERY))) == 0


@jax.jit
def _sim_step(carry, u, alpha, cost):
    """One step of adaptive k against a draft whose every position is accepted w.p. alpha."""
    hits, obs, run = carry
    k = adaptive.choose_k(hits, obs, cost, run)
    pos = jnp.arange(hits.shape[0])
    accepted = jnp.sum(jnp.cumprod((u < alpha) & (pos < k)))  # leading accepted drafts
    hits, obs, run = adaptive.update(hits, obs, run, accepted[None].astype(jnp.int32), k,
                                     jnp.ones((1,), bool))
    return (hits, obs, run), k, accepted


def _simulate(alpha, steps=400, seed=0):
    cost = jnp.asarray([1.0, 1.22, 1.49, 1.67])  # the MTP head's measured k-step costs (CPU)
    carry = (jnp.zeros((3,)), jnp.zeros((3,)), jnp.zeros((), jnp.int32))
    rng = np.random.default_rng(seed)
    tokens = cost_total = 0.0
    ks = []
    for _ in range(steps):
        carry, k, a = _sim_step(carry, jnp.asarray(rng.random(3)), alpha, cost)
        ks.append(int(k))
        tokens += 1 + int(a)
        cost_total += float(cost[int(k)])
    return np.asarray(ks), tokens / cost_total


def test_mediocre_draft_survives_a_run_of_rejections():
    # alpha 0.33 pays at k = 1 (1.33 / 1.22 = 1.09 tokens per unit cost) but a few rejections in
    # a row push a forgetful estimate below break-even (0.22), and plain steps never bring it
    # back: the rule must keep drafting on nearly every step and earn what k = 1 earns.
    ks, rate = _simulate(0.33)
    assert np.mean(ks >= 1) > 0.9, np.bincount(ks)
    assert rate > 0.97 * (1.33 / 1.22), rate


def test_adaptive_probes_a_losing_draft_on_schedule():
    ks, rate = _simulate(0.0, steps=330)
    drafting = np.flatnonzero(ks >= 1)
    # a handful of steps to learn, then one probe per PROBE_EVERY + 1 steps, never more
    assert len(drafting) <= 6 + 330 // (adaptive.PROBE_EVERY + 1), drafting
    assert len(drafting) >= 330 // (adaptive.PROBE_EVERY + 1) - 1, drafting  # probes happen
    assert np.all(np.diff(drafting[-4:]) == adaptive.PROBE_EVERY + 1), drafting
    assert rate > 0.97, rate


# ------------------------------------------------------------------ adaptive by confidence

COSTS = jnp.asarray([1.0, 1.1, 1.2, 1.3, 0.05, 0.02])  # k = 0..3, catch-up, one draft step


def test_choose_confident_follows_the_drafts_confidence():
    run0 = jnp.zeros((), jnp.int32)
    one = jnp.ones((1,), bool)
    sure, lost = jnp.full((1, 3), 0.99), jnp.full((1, 3), 0.01)
    assert int(adaptive.choose_confident(sure, one, 3, COSTS, run0)) == 3
    assert int(adaptive.choose_confident(sure, one, 2, COSTS, run0)) == 2  # only 2 drafted
    assert int(adaptive.choose_confident(lost, one, 3, COSTS, run0)) == 0  # plain step
    # sure of the first draft only: k = 1
    assert int(adaptive.choose_confident(jnp.asarray([[0.95, 0.01, 0.01]]), one, 3, COSTS, run0)) == 1
    # a probe is due: draft even when lost
    due = jnp.asarray(adaptive.PROBE_EVERY, jnp.int32)
    assert int(adaptive.choose_confident(lost, one, 3, COSTS, due)) >= 1
    # rows that are done do not count: a lost active row next to a sure finished one
    two = jnp.asarray([True, False])
    assert int(adaptive.choose_confident(jnp.concatenate([lost, sure]), two, 3, COSTS, run0)) == 0


def test_extend_stops_drafting_when_more_cannot_pay():
    k = 3
    nb = adaptive.NUM_BINS + 1
    good = jnp.full((k, nb), 50.0)  # every reached draft was accepted
    bad = jnp.zeros((k, nb))
    obs = jnp.full((k, nb), 50.0)
    one, no = jnp.ones((1,), bool), jnp.zeros((1,), bool)
    sure = jnp.full((1, k), 0.99)
    assert bool(adaptive.extend(good, obs, sure, 1, one, no, COSTS))
    assert not bool(adaptive.extend(bad, obs, sure, 1, one, no, COSTS))  # later drafts never pass
    assert not bool(adaptive.extend(good, obs, jnp.full((1, k), 0.01), 1, one, no, COSTS))
    assert not bool(adaptive.extend(good, obs, sure, k, one, no, COSTS))  # K drafted: done
    # an n-gram row's next draft is known: its own estimate decides, not the pooled table
    assert bool(adaptive.extend(bad, obs, sure, 1, one, jnp.ones((1,), bool), COSTS))


def test_calibration_table_learns_acceptance_per_bin():
    k, nb = 2, adaptive.NUM_BINS + 1
    hits, obs = jnp.zeros((k, nb)), jnp.zeros((k, nb))
    run = jnp.zeros((), jnp.int32)
    conf = jnp.asarray([[0.95, 0.95], [0.15, 0.15]])  # a confident row, an unsure one
    bins = adaptive.confidence_bins(conf)
    np.testing.assert_array_equal(bins, [[9, 9], [1, 1]])
    np.testing.assert_allclose(adaptive.calibrated(hits, obs, bins), [[0.95, 0.95], [0.15, 0.15]])
    for _ in range(200):  # the confident row accepts nothing, the unsure one everything
        hits, obs, run = adaptive.update_table(hits, obs, run, bins, jnp.asarray([0, 2]),
                                               jnp.asarray(2), jnp.ones((2,), bool))
    alpha = np.asarray(adaptive.calibrated(hits, obs, bins))
    assert alpha[0, 0] < 0.1 and alpha[1, 0] > 0.9 and alpha[1, 1] > 0.9, alpha
    assert float(obs[1, 9]) == 0.0  # the confident row never reached its second draft
    ngram_bins = adaptive.confidence_bins(conf, jnp.asarray([True, False]))
    assert int(ngram_bins[0, 0]) == adaptive.NUM_BINS and int(ngram_bins[1, 0]) == 1


@pytest.mark.parametrize("method", ["draft", pytest.param("mtp", marks=pytest.mark.slow)])
def test_confident_greedy_lossless(tiny_pair, plain, fixed_costs, method):
    """k chosen per step from the drafts' confidence: every output equals plain greedy (rows
    stop at different steps), and the steps cover several k."""
    target, draft = tiny_pair
    eos = _eos_for_staggered_stops(plain)
    want = [row[: row.index(eos) + 1] if eos in row else row for row in plain]
    draft = _mtp_head(target) if method == "mtp" else draft
    out = sj.generate(target, PROMPTS, max_new_tokens=40, draft=draft, method=method,
                      num_draft_tokens=K, adaptive=True, adaptive_by="confidence",
                      hybrid_min=2 if method == "mtp" else 0, eos_token_id=eos)
    assert out.tokens == want
    hist = out.stats["k_histogram"]
    assert len(hist) == K + 1 and sum(hist) == out.stats["steps"]
    assert sum(c > 0 for c in hist) >= 2, hist
    table = np.asarray(out.stats["calibration"]["reached"])
    assert table.shape == (K, adaptive.NUM_BINS + 1) and table.sum() > 0


@pytest.mark.parametrize("where", ["loop", pytest.param("engine", marks=pytest.mark.slow)])
def test_confident_self_draft_accepts_everything(tiny_pair, fixed_costs, where):
    """The target as its own draft: every draft it verifies is accepted, the table learns that,
    and the steps move to the longest chain."""
    target, _ = tiny_pair
    prompts = PROMPTS[:2]
    want = sj.generate(target, prompts, max_new_tokens=60, eos_token_id=[]).tokens
    spec = sj.SpecConfig(method="draft", num_draft_tokens=K, page_size=4, adaptive=True,
                         adaptive_by="confidence")
    if where == "loop":
        out = sj.generate(target, prompts, max_new_tokens=60, draft=target, spec=spec,
                          eos_token_id=[])
        assert out.tokens == want
        s = out.stats
        hist, drafted = s["k_histogram"], s["drafted_tokens"]
        accepted = s["accepted_tokens"]
        assert s["mean_accepted_length"] == pytest.approx(1 + accepted / s["speculative_steps"])
    else:
        from specjax.engine import Engine, EngineConfig, RequestParams
        engine = Engine(target, target, EngineConfig(spec, max_slots=2, batch_buckets=(2,),
                                                     token_buckets=(8,), max_model_len=128))
        handles = [engine.submit(p, RequestParams(max_tokens=60, stop_token_ids=())) for p in prompts]
        engine.run()
        assert [h.result() for h in handles] == want
        s = engine.stats()
        hist = s["k_histogram"]
        drafted, accepted = s["spec_decode_num_draft_tokens"], s["spec_decode_num_accepted_tokens"]
    assert drafted > 0 and hist[K] > hist[1] + hist[2], hist
    assert accepted >= drafted - K * len(prompts), (accepted, drafted)


def test_cost_model_times_the_fused_steps(tiny_pair, monkeypatch, tmp_path):
    """The measured cost vector: a plain step is the unit, one entry per k, then the catch-up and
    one draft step; cached in memory and on disk under SPECJAX_CACHE_DIR."""
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cost_model, "_COSTS", {})
    target, draft = tiny_pair
    kw = dict(method="draft", kmax=2, batch=1, context=8, dtype=jnp.float32)
    costs = cost_model.measure_costs(target.params, target.config, draft.params, draft.config, **kw)
    assert len(costs) == 2 + 3 and costs[0] == 1.0
    assert all(np.isfinite(c) and c > 0 for c in costs), costs
    assert (tmp_path / "cost_model.json").exists()
    monkeypatch.setattr(cost_model, "_step_times", None)  # a second call must not re-measure
    assert cost_model.measure_costs(target.params, target.config, draft.params, draft.config,
                                    **kw) == costs
    # a noisy first timing (k = 2 cheaper than k = 1) is timed again, and kept monotone in k
    monkeypatch.setattr(cost_model, "_COSTS", {})
    monkeypatch.setenv("SPECJAX_CACHE_DIR", str(tmp_path / "other"))
    calls = []

    def times(*args, reps=25, **kw):
        calls.append(reps)
        return [1.0, 1.3, 1.2] if len(calls) == 1 else [1.0, 1.25, 1.22]
    monkeypatch.setattr(cost_model, "_step_times", times)
    costs = cost_model.measure_costs(target.params, target.config, draft.params, draft.config, **kw)
    assert calls == [25, 50] and costs[:3] == [1.0, 1.25, 1.25]


# ----------------------------------------------------------------------------- bad input

@pytest.mark.parametrize("kw,match", [
    (dict(method="ngram", ngram_min=0), "ngram_min"),
    (dict(method="ngram", ngram_min=3, ngram_max=2), "ngram_max"),
    (dict(method="ngram", ngram_max=-1), "ngram_max"),
    (dict(method="ngram", hybrid_min=2), "hybrid_min"),
    (dict(method="draft", hybrid_min=-1), "hybrid_min"),
    (dict(method="draft", hybrid_min=5), "hybrid_min"),
    (dict(method="none", adaptive=True), "adaptive"),
    (dict(method="eagle-tree", adaptive=True), "adaptive"),
    (dict(method="draft", adaptive=True, adaptive_by="recent"), "adaptive_by"),
    (dict(method="draft", adaptive_by="confidence"), "adaptive_by"),
    (dict(method="ngram", adaptive=True, adaptive_by="confidence"), "adaptive_by"),
])
def test_bad_settings_raise(tiny_pair, kw, match):
    target, draft = tiny_pair
    with pytest.raises(ValueError, match=match):
        sj.generate(target, [[1, 2]], draft=draft if kw["method"] == "draft" else None, **kw)
    with pytest.raises(TypeError, match="adaptive"):
        sj.generate(target, [[1, 2]], method="ngram", adaptive=1)


def test_ngram_rejects_a_draft(tiny_pair):
    target, draft = tiny_pair
    with pytest.raises(ValueError, match="needs no draft"):
        sj.generate(target, [[1, 2]], draft=draft, method="ngram")


# ------------------------------------------------------------------------------ the engine

@pytest.mark.parametrize("kw", [dict(method="ngram"),
                                pytest.param(dict(method="draft", adaptive=True, hybrid_min=1),
                                             marks=pytest.mark.slow)],
                         ids=["ngram", "draft-adaptive-hybrid"])
def test_engine_ngram_and_adaptive_are_exact(tiny_pair, fixed_costs, kw):
    """Continuous batching with n-gram drafting / adaptive k: every greedy request equals plain
    decoding of it alone (slots are reused, so the per-slot history and stale flags are reset)."""
    from specjax.engine import Engine, EngineConfig, RequestParams
    target, draft = tiny_pair
    rng = np.random.default_rng(5)
    reqs = [(rng.integers(0, 8, int(rng.integers(2, 12))).tolist(), int(rng.integers(4, 17)))
            for _ in range(12)]
    engine = Engine(target, draft if kw["method"] == "draft" else None,
                    EngineConfig(sj.SpecConfig(num_draft_tokens=K, page_size=4, **kw), max_slots=4,
                                 batch_buckets=(4,), token_buckets=(8,), max_model_len=32))
    handles = [engine.submit(p, RequestParams(max_tokens=m, stop_token_ids=())) for p, m in reqs]
    engine.run()
    for (p, m), h in zip(reqs, handles):
        assert h.result() == sj.generate(target, [p], max_new_tokens=m, eos_token_id=[]).tokens[0]
    s = engine.stats()
    assert s["steps"]["spec"] > 0
    if kw.get("adaptive"):
        assert sum(c > 0 for c in s["k_histogram"]) >= 2
