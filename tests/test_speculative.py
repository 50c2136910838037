"""Draft-target speculative decoding: lossless greedy with partial acceptance of every length,
self-draft, stats that agree with the tokens returned, exact distribution (bonus included)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats as sps

import specjax as sj
from specjax import acceptance, sampling
from specjax.io.hf import save_hf_dir
from tests.conftest import accept_length_counts, noisy_copy, tiny_model

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2]]
ALPHA = 1e-3  # significance of every distribution test in this file


@pytest.fixture(scope="module")
def plain(tiny_pair):
    target, _ = tiny_pair
    return sj.generate(target, PROMPTS, max_new_tokens=40, eos_token_id=[]).tokens


@pytest.fixture(scope="module")
def noisy_draft(tiny_pair):
    """The target plus small weight noise: steps accept 0..4 drafts (measured [38, 19, 11, 6, 5]
    row-steps for k=4), so partial acceptance and the catch-up after it are exercised."""
    return noisy_copy(tiny_pair[0], 0.02)


def check_stats_agree(out, num_prompts):
    """Acceptance stats agree with the tokens returned: tokens after each row's first (prefill)
    token are exactly tokens_per_row_step * row_steps; each row-step emits its accepted drafts
    plus one token, except a row's last step, which EOS / max_new may cut; mean_accepted_length
    is vLLM's 1 + accepted / speculative steps (stats.acceptance_summary)."""
    s = out.stats
    after_first = sum(len(t) for t in out.tokens) - num_prompts
    assert s["tokens_per_row_step"] * s["row_steps"] == pytest.approx(after_first)
    accepted = round(sum(s["per_position_acceptance"]) * s["speculative_steps"])
    assert accepted == s["accepted_tokens"]
    assert accepted + s["row_steps"] - num_prompts <= after_first <= accepted + s["row_steps"]
    assert s["mean_accepted_length"] == pytest.approx(1 + accepted / s["speculative_steps"])
    assert s["plain_steps"] + s["speculative_steps"] == s["row_steps"]


def _eos_for_staggered_stops(tokens):
    """A token whose first occurrence differs across rows, so rows stop at different steps."""
    best = None
    for tok in range(64):
        firsts = {row.index(tok) if tok in row else None for row in tokens}
        if len(firsts) >= 3 and (best is None or len(firsts) > best[1]):
            best = (tok, len(firsts))
    assert best is not None
    return best[0]


@pytest.mark.parametrize("k", [1, pytest.param(2, marks=pytest.mark.slow), 4, 7])
def test_greedy_lossless(tiny_pair, noisy_draft, plain, k):
    target, _ = tiny_pair
    out = sj.generate(target, PROMPTS, max_new_tokens=40, draft=noisy_draft, method="draft",
                      num_draft_tokens=k, eos_token_id=[])
    assert out.tokens == plain
    counts = accept_length_counts(out.stats)
    if k <= 4:  # every accept length 0..k occurred (partial acceptance, then the catch-up)
        assert all(c > 0 for c in counts), counts
    else:
        assert counts[0] > 0 and sum(counts[3:]) > 0, counts
    check_stats_agree(out, len(PROMPTS))


@pytest.mark.parametrize("k", [pytest.param(2, marks=pytest.mark.slow), 7])
def test_greedy_lossless_with_eos_at_different_steps(tiny_pair, noisy_draft, plain, k):
    target, _ = tiny_pair
    eos = _eos_for_staggered_stops(plain)
    want = [row[: row.index(eos) + 1] if eos in row else row for row in plain]
    base = sj.generate(target, PROMPTS, max_new_tokens=40, eos_token_id=eos)
    spec = sj.generate(target, PROMPTS, max_new_tokens=40, draft=noisy_draft, method="draft",
                       num_draft_tokens=k, eos_token_id=eos)
    assert base.tokens == want
    assert spec.tokens == want
    assert len({len(r) for r in want}) >= 3
    check_stats_agree(spec, len(PROMPTS))


def test_greedy_lossless_against_hf(tiny_pair, noisy_draft, tmp_path):
    """Speculative output equals HF transformers' greedy generate on the same weights."""
    from transformers import LlamaForCausalLM
    target, _ = tiny_pair
    save_hf_dir(target.params, target.config, str(tmp_path))
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    out = sj.generate(target, PROMPTS, max_new_tokens=30, draft=noisy_draft, method="draft",
                      num_draft_tokens=4, eos_token_id=[])
    for prompt, got in zip(PROMPTS, out.tokens):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == ref


@pytest.mark.parametrize("k", [1, 3, pytest.param(5, marks=pytest.mark.slow)])
@pytest.mark.parametrize("draft_sampling", [False, True])
def test_self_draft_accepts_everything(tiny_pair, k, draft_sampling):
    """Target as its own draft: every draft accepted, for greedy rows and (when drafts are sampled
    from q = p) for sampled rows too. Point-mass drafts of sampled rows are accepted only with
    probability p(argmax), so that path is checked on greedy rows. 33 tokens = 1 from prefill +
    32 from steps of k + 1: when k + 1 does not divide 32 the last step is cut by max_new, and its
    cut drafts are not counted as accepted."""
    target, _ = tiny_pair
    temps = [0.0, 1.0, 0.7, 0.0] if draft_sampling else 0.0
    out = sj.generate(target, PROMPTS, max_new_tokens=33, draft=target, method="draft",
                      num_draft_tokens=k, eos_token_id=[], temperature=temps,
                      top_p=0.9, draft_sampling=draft_sampling)
    full, rest = divmod(32, k + 1)
    steps = full + (rest > 0)
    assert out.stats["row_steps"] == steps * len(PROMPTS)
    assert out.stats["tokens_per_row_step"] == pytest.approx(32 / steps)
    assert out.stats["mean_accepted_length"] == pytest.approx(1 + (full * k + rest) / steps)
    assert out.stats["per_position_acceptance"] == pytest.approx(
        [(full + (i < rest)) / steps for i in range(k)])
    assert out.stats["accepted_tokens"] == (full * k + rest) * len(PROMPTS)
    assert all(len(t) == 33 for t in out.tokens)


# --------------------------------------------------------------------------- distribution tests

V = 6
N_ROWS = 20_000
PROMPT = [3, 1, 4]


@pytest.fixture(scope="module")
def dist_pair():
    target = tiny_model(11, vocab=V, hidden=16, layers=2, heads=2, kv_heads=1, scale=1.0)
    draft = tiny_model(12, vocab=V, hidden=16, layers=1, heads=2, kv_heads=1, scale=1.0)
    return target, draft


def _exact_joint(target, temperature, top_k, top_p, n=3, prompt=PROMPT):
    """P(x_1..x_n) of the target's own sampler after ``prompt``, by enumeration over V^(n-1)
    prefixes."""
    v = target.config.vocab_size
    prefixes = list(itertools.product(range(v), repeat=n - 1))
    logits = np.stack([sj.logits(target, prompt + list(p)) for p in prefixes])  # [M, T, V]
    m = len(prefixes)
    probs = np.asarray(sampling.process_logits(
        jnp.asarray(logits[:, -n:]), jnp.full((m,), temperature, jnp.float32),
        jnp.full((m,), top_k, jnp.int32), jnp.full((m,), top_p, jnp.float32)))  # [M, n, V]
    joint = np.zeros((m, v))
    for i, p in enumerate(prefixes):
        joint[i] = np.prod([probs[i, j, t] for j, t in enumerate(p)]) * probs[i, n - 1]
    return joint.reshape(-1)  # cell index = x_1 * V^(n-1) + ... + x_n


def cells_of(tokens, v):
    """[R, n] token rows -> [R] cell indices matching _exact_joint's order."""
    toks = np.asarray(tokens)
    return (toks * v ** np.arange(toks.shape[1] - 1, -1, -1)).sum(axis=1)


def _chi2_pvalue(samples, expected_p):
    counts = np.bincount(samples, minlength=len(expected_p)).astype(float)
    expected = expected_p * len(samples)
    assert counts[expected_p == 0].sum() == 0, "sampled a zero-probability sequence"
    big = expected >= 5  # pool small cells
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    exp = exp * obs.sum() / exp[keep].sum()  # float32 probabilities: renormalise exactly
    return sps.chisquare(obs[keep], exp[keep]).pvalue


K_DIST = 2
N_DIST = K_DIST + 2  # first token + a fully accepted step + its bonus token


def _first_tokens(target, draft, *, temperature, top_k, top_p, draft_sampling, seed=0):
    out = sj.generate(target, [PROMPT] * N_ROWS, max_new_tokens=N_DIST, draft=draft,
                      method="draft", num_draft_tokens=K_DIST, temperature=temperature,
                      top_k=top_k, top_p=top_p, seed=seed, eos_token_id=[],
                      draft_sampling=draft_sampling)
    return cells_of(out.tokens, V), out


SETTINGS = [dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("setting", SETTINGS, ids=["t1", "t0.7_topk4_topp0.9"])
@pytest.mark.parametrize("draft_sampling", [False, True], ids=["point_mass", "sampled_q"])
def test_distribution_matches_target(dist_pair, setting, draft_sampling):
    """k + 2 tokens per row: the bonus token after a fully accepted step is in the sample."""
    target, draft = dist_pair
    exact = _exact_joint(target, **setting, n=N_DIST)
    cells, out = _first_tokens(target, draft, draft_sampling=draft_sampling, **setting)
    p = _chi2_pvalue(cells, exact)
    assert 0.05 < out.stats["acceptance_rate"] < 0.95  # both accept and residual paths exercised
    assert out.stats["per_position_acceptance"][-1] > 0.01  # bonus after full acceptance sampled
    assert p > ALPHA, p


def test_distribution_mixed_greedy_and_sampled_rows(dist_pair):
    target, draft = dist_pair
    temps = [0.0 if i % 2 else 1.0 for i in range(2 * N_ROWS)]
    out = sj.generate(target, [PROMPT] * (2 * N_ROWS), max_new_tokens=3, draft=draft,
                      method="draft", num_draft_tokens=2, temperature=temps, eos_token_id=[])
    greedy = sj.generate(target, [PROMPT], max_new_tokens=3, eos_token_id=[]).tokens[0]
    toks = np.array(out.tokens)
    assert (toks[1::2] == greedy).all()
    cells = cells_of(toks[0::2], V)
    assert _chi2_pvalue(cells, _exact_joint(target, 1.0, 0, 1.0)) > ALPHA


_TRUE_ACCEPT_CHAIN = acceptance.accept_chain


def _biased_residual(keys, draft_tokens, target_probs, draft_probs=None):
    """A classic bug: at a rejection resample from p itself instead of the residual."""
    a, y = _TRUE_ACCEPT_CHAIN(keys, draft_tokens, target_probs, draft_probs)
    k = draft_tokens.shape[1]
    at = jnp.take_along_axis(target_probs, jnp.minimum(a, k)[:, None, None], axis=1)[:, 0]
    resample = sampling.sample(jax.vmap(lambda kk: jax.random.fold_in(kk, 99))(keys), at)
    return a, jnp.where(a < k, resample, y)


def _biased_bonus(keys, draft_tokens, target_probs, draft_probs=None):
    """An off-by-one on the point-mass path: after full acceptance the bonus is drawn from
    p_{K-1} instead of p_K (only visible when the bonus is among the tokens tested)."""
    a, y = _TRUE_ACCEPT_CHAIN(keys, draft_tokens, target_probs, draft_probs)
    k = draft_tokens.shape[1]
    wrong = sampling.sample(jax.vmap(lambda kk: jax.random.fold_in(kk, 99))(keys),
                            target_probs[:, k - 1])
    return a, jnp.where(a == k, wrong, y)


@pytest.mark.parametrize("rule,draft_sampling", [(_biased_residual, True), (_biased_bonus, False)],
                         ids=["residual_sampled_q", "bonus_point_mass"])
def test_biased_rule_fails_distribution_test(dist_pair, monkeypatch, rule, draft_sampling):
    """The same test has power: a subtly wrong residual or bonus is rejected."""
    target, draft = dist_pair
    monkeypatch.setattr(acceptance, "accept_chain", rule)
    jax.clear_caches()
    try:
        cells, _ = _first_tokens(target, draft, temperature=1.0, top_k=0, top_p=1.0,
                                 draft_sampling=draft_sampling)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert _chi2_pvalue(cells, _exact_joint(target, 1.0, 0, 1.0, n=N_DIST)) < ALPHA


def test_rows_are_independent_streams(dist_pair):
    target, draft = dist_pair
    out = sj.generate(target, [PROMPT] * 64, max_new_tokens=6, draft=draft, method="draft",
                      num_draft_tokens=2, temperature=1.0, seed=5, eos_token_id=[])
    assert len({tuple(t) for t in out.tokens}) > 32
    again = sj.generate(target, [PROMPT] * 64, max_new_tokens=6, draft=draft, method="draft",
                        num_draft_tokens=2, temperature=1.0, seed=5, eos_token_id=[])
    assert again.tokens == out.tokens
