"""MTP and EAGLE heads in the fused step: lossless, exact distribution, consistent carried state."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import heads, kv_cache, speculate
from specjax.config import SpecConfig
from specjax.heads import Head, HeadConfig, init_head
from specjax.model import forward
from tests.conftest import count_host_reads, tiny_model
from tests.test_speculative import ALPHA, N_ROWS, PROMPT, PROMPTS, V, _chi2_pvalue, _exact_joint

KINDS = ["mtp", "eagle"]


def _head(target, kind, seed=3, scale=0.3):
    cfg = HeadConfig.for_target(target.config, kind)
    return Head(init_head(cfg, jax.random.key(seed), scale=scale), cfg)


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def plain(target):
    return sj.generate(target, PROMPTS, max_new_tokens=30, eos_token_id=[]).tokens


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_lossless(target, plain, kind, k):
    out = sj.generate(target, PROMPTS, max_new_tokens=30, draft=_head(target, kind), method=kind,
                      num_draft_tokens=k, eos_token_id=[])
    assert out.tokens == plain


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


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("k", [1, 3])
def test_carried_head_state_equals_teacher_forcing(target, kind, k):
    """After several steps the carried logits/hidden equal a fresh teacher-forced head pass over
    the committed tokens (catches any position or shift off-by-one, and stale KV reads)."""
    head = _head(target, kind)
    state = _run_steps(target, head, kind, k, steps=6)
    for i in range(len(PROMPTS)):
        seq = _committed(state, i)
        n = len(seq)
        hidden = _teacher_forced(target, seq[:-1])  # target features f_0..f_{n-2}
        feats = heads.head_features(target.params, target.config, hidden, head.config)
        kv = kv_cache.init_cache(head.config.layer, 8, 16)
        hh, _ = heads.head_forward(head.params, head.config, target.params, target.config,
                                   jnp.asarray([seq[1:]]), feats, jnp.arange(n - 1)[None], kv,
                                   kv_cache.contiguous_page_table(1, 8), jnp.zeros(1, jnp.int32))
        want = heads.head_logits(head.params, head.config, target.params, target.config, hh[0, -1])
        np.testing.assert_allclose(state.head_hidden[i], hh[0, -1], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(state.draft_logits[i], want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_carried_draft_logits_equal_teacher_forcing(target, k):
    draft = tiny_model(1, hidden=16, layers=1, heads=2, kv_heads=1)
    state = _run_steps(target, draft, "draft", k, steps=6)
    for i in range(len(PROMPTS)):
        seq = _committed(state, i)
        logits = sj.logits(draft, seq)
        np.testing.assert_allclose(state.draft_logits[i], logits[-1], rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def dist_target():
    return tiny_model(11, vocab=V, hidden=16, layers=2, heads=2, kv_heads=1, scale=1.0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("draft_sampling", [False, True], ids=["point_mass", "sampled_q"])
def test_distribution_matches_target(dist_target, kind, draft_sampling):
    head = _head(dist_target, kind, seed=5, scale=1.0)
    out = sj.generate(dist_target, [PROMPT] * N_ROWS, max_new_tokens=3, draft=head, method=kind,
                      num_draft_tokens=2, temperature=0.8, top_p=0.95, eos_token_id=[],
                      draft_sampling=draft_sampling)
    toks = np.array(out.tokens)
    cells = toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2]
    # random heads: >= 1% of 40k drafts accepted, so both accept and residual paths are exercised
    assert 0.01 < out.stats["acceptance_rate"] < 0.99
    assert _chi2_pvalue(cells, _exact_joint(dist_target, 0.8, 0, 0.95)) > ALPHA


def test_one_token_mtp_has_no_host_sync_after_acceptance(target, monkeypatch):
    """k=1 MTP: acceptance, the shift and the head re-run all stay on device (reads do not grow)."""
    head = _head(target, "mtp")

    def reads(n):
        kw = dict(max_new_tokens=n, draft=head, method="mtp", num_draft_tokens=1, eos_token_id=[])
        count, out = count_host_reads(monkeypatch, lambda: sj.generate(target, PROMPTS, **kw))
        return count, out.stats["host_syncs"], out.stats["steps"]

    (r32, s32, st32), (r128, s128, st128) = reads(32), reads(128)
    assert st128 > st32 >= 31
    assert (r32, s32) == (r128, s128) and s32 == 1


def test_head_method_mismatch(target):
    with pytest.raises(ValueError, match="got a 'eagle' head"):
        sj.generate(target, [[1]], draft=_head(target, "eagle"), method="mtp")
    with pytest.raises(TypeError, match="needs a draft head"):
        sj.generate(target, [[1]], draft=target, method="mtp")
