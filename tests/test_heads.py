"""MTP and EAGLE heads in the fused step: lossless with partial acceptance of every length,
exact distribution (bonus included), carried state equal to teacher forcing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import heads, kv_cache, speculate
from specjax.config import SpecConfig
from specjax.model import forward
from tests.conftest import (accept_length_counts, mimic_head, noisy_copy, predictable_target,
                            random_head, tiny_model)
from tests.test_speculative import (ALPHA, N_ROWS, PROMPT, PROMPTS, V, _chi2_pvalue, _exact_joint,
                                    cells_of, check_stats_agree)

KINDS = ["mtp", "eagle"]


def _head(target, kind, seed=3, scale=0.3):
    return random_head(target, kind, seed=seed, scale=scale)


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def predictable():
    """A target a one-token head can mostly predict (see conftest.predictable_target)."""
    return predictable_target(0, context=0.05)


@pytest.fixture(scope="module")
def plain(predictable):
    return sj.generate(predictable, PROMPTS, max_new_tokens=30, eos_token_id=[]).tokens


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.slow), 4])
def test_greedy_lossless(predictable, plain, kind, k):
    """Heads that mostly reproduce the target: every accept length 0..k occurs (measured for k=4:
    MTP [52, 22, 4, 1, 1], EAGLE [58, 13, 4, 4, 1] row-steps), so the shift after 1..k-1
    accepted drafts is exercised, and the output is still plain greedy's."""
    out = sj.generate(predictable, PROMPTS, max_new_tokens=30, draft=mimic_head(predictable, kind),
                      method=kind, num_draft_tokens=k, eos_token_id=[])
    assert out.tokens == plain
    counts = accept_length_counts(out.stats)
    assert all(c > 0 for c in counts), counts
    check_stats_agree(out, len(PROMPTS))


def _run_steps(target, draft, method, k, steps):
    """Prefill + `steps` fused steps, returning the state (rows never finish)."""
    b = len(PROMPTS)
    tp = 32
    toks = np.zeros((b, tp), np.int32)
    for i, p in enumerate(PROMPTS):
        toks[i, :len(p)] = p
    lc = SpecConfig(method=method, num_draft_tokens=k)
    rp = speculate.RowParams(temperature=jnp.zeros(b), top_k=jnp.zeros(b, jnp.int32),
                             top_p=jnp.ones(b), max_new=jnp.full((b,), 10_000, jnp.int32),
                             eos_ids=jnp.asarray([-1], jnp.int32))
    state = speculate.prefill(target.params, target.config, draft.params, draft.config,
                              jnp.asarray(toks), jnp.asarray([len(p) for p in PROMPTS], jnp.int32),
                              rp, jnp.asarray(0), lc, 12, 128)
    step = jax.jit(speculate.spec_step, static_argnums=(1, 3, 6))
    for _ in range(steps):
        state = step(target.params, target.config, draft.params, draft.config, state, rp, lc)
    return state


def _committed(state, i):
    n_out = int(state.num_out[i])
    seq = PROMPTS[i] + np.asarray(state.out_tokens[i, :n_out]).tolist()
    assert len(seq) == int(state.lengths[i])
    return seq


def _teacher_forced(model, seq):
    t = len(seq)
    kv = kv_cache.init_cache(model.config, 8, 16)
    _, hidden, _ = forward(model.params, model.config, jnp.asarray([seq]),
                           jnp.arange(t)[None], kv, kv_cache.contiguous_page_table(1, 8),
                           jnp.zeros(1, jnp.int32), return_logits=False)
    return hidden


def _partial_steps(state, k):
    """Row-steps (so far) that accepted 1..k-1 drafts."""
    steps = int(state.row_steps)
    at_least = [steps] + [int(x) for x in state.accepted_per_pos] + [0]
    return sum(at_least[j] - at_least[j + 1] for j in range(1, k))


@pytest.mark.parametrize("kind", ["mtp", pytest.param("eagle", marks=pytest.mark.slow)])
@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3])  # k=3 covers 0..3 accepted
def test_carried_head_state_equals_teacher_forcing(predictable, kind, k):
    """After several steps, partial acceptances among them, the carried logits/hidden equal a
    fresh teacher-forced head pass over the committed tokens (catches any position or shift
    off-by-one, and stale KV reads)."""
    target = predictable
    head = mimic_head(target, kind)
    state = _run_steps(target, head, kind, k, steps=6)
    if k > 1:
        assert _partial_steps(state, k) > 0
    assert int(state.accepted_per_pos[k - 1]) > 0  # and full acceptance
    for i in range(len(PROMPTS)):
        seq = _committed(state, i)
        n = len(seq)
        hidden = _teacher_forced(target, seq[:-1])  # target features f_0..f_{n-2}
        feats = heads.head_features(head.params, head.config, target.params, target.config, hidden)
        kv = kv_cache.init_cache(head.config.layer, 8, 16)
        hh, _ = heads.head_forward(head.params, head.config, target.params, jnp.asarray([seq[1:]]),
                                   feats, jnp.arange(n - 1)[None], kv,
                                   kv_cache.contiguous_page_table(1, 8), jnp.zeros(1, jnp.int32))
        want = heads.head_logits(head.params, head.config, target.params, target.config, hh[0, -1])
        np.testing.assert_allclose(state.head_hidden[i], hh[0, -1], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(state.draft_logits[i], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3])  # k=3 covers 0..3 accepted
def test_carried_draft_logits_equal_teacher_forcing(target, k):
    """The same for a draft LLM (a noisy copy of the target: partial acceptance happens), whose
    catch-up forward after a steps carries its logits for the next position."""
    draft = noisy_copy(target, 0.02)
    state = _run_steps(target, draft, "draft", k, steps=6)
    if k > 1:
        assert _partial_steps(state, k) > 0
    assert int(state.accepted_per_pos[k - 1]) > 0
    for i in range(len(PROMPTS)):
        seq = _committed(state, i)
        logits = sj.logits(draft, seq)
        np.testing.assert_allclose(state.draft_logits[i], logits[-1], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def dist_target():
    """Small vocabulary (exact enumeration), context-dependent enough that mimic heads accept
    ~70% / ~33% of first / second drafts at temperature 0.8: full acceptance, then the bonus."""
    return predictable_target(11, context=0.2, vocab=V, hidden=16, layers=2, heads=2, kv_heads=1,
                              scale=1.0)


@pytest.mark.parametrize("kind", ["mtp", pytest.param("eagle", marks=pytest.mark.slow)])
@pytest.mark.parametrize("draft_sampling", [False, True], ids=["point_mass", "sampled_q"])
def test_distribution_matches_target(dist_target, kind, draft_sampling):
    """k + 2 = 4 tokens per row: the bonus after a fully accepted step is in the sample."""
    head = mimic_head(dist_target, kind, gain=1.0)
    out = sj.generate(dist_target, [PROMPT] * N_ROWS, max_new_tokens=4, draft=head, method=kind,
                      num_draft_tokens=2, temperature=0.8, top_p=0.95, eos_token_id=[],
                      draft_sampling=draft_sampling)
    assert 0.05 < out.stats["acceptance_rate"] < 0.95  # accept and residual paths both exercised
    assert out.stats["per_position_acceptance"][-1] > 0.1  # bonus after full acceptance
    assert _chi2_pvalue(cells_of(out.tokens, V), _exact_joint(dist_target, 0.8, 0, 0.95, n=4)) > ALPHA


def test_head_method_mismatch(target):
    with pytest.raises(ValueError, match="got a 'eagle' head"):
        sj.generate(target, [[1]], draft=_head(target, "eagle"), method="mtp")
    with pytest.raises(TypeError, match="needs a draft head"):
        sj.generate(target, [[1]], draft=target, method="mtp")
