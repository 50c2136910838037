"""Draft-target speculative decoding: lossless greedy, self-draft, exact distribution, no syncs."""

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
from tests.conftest import count_host_reads, tiny_model

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2]]
ALPHA = 1e-3  # significance of every distribution test in this file


@pytest.fixture(scope="module")
def plain(tiny_pair):
    target, _ = tiny_pair
    return sj.generate(target, PROMPTS, max_new_tokens=40, eos_token_id=[]).tokens


def _eos_for_staggered_stops(tokens):
    """A token whose first occurrence differs across rows, so rows stop at different steps."""
    best = None
    for tok in range(64):
        firsts = {row.index(tok) if tok in row else None for row in tokens}
        if len(firsts) >= 3 and (best is None or len(firsts) > best[1]):
            best = (tok, len(firsts))
    assert best is not None
    return best[0]


@pytest.mark.parametrize("k", [1, 2, 4, 7])
def test_greedy_lossless(tiny_pair, plain, k):
    target, draft = tiny_pair
    out = sj.generate(target, PROMPTS, max_new_tokens=40, draft=draft, method="draft",
                      num_draft_tokens=k, eos_token_id=[])
    assert out.tokens == plain
    assert 1.0 <= out.stats["mean_accepted_length"] <= k + 1


@pytest.mark.parametrize("k", [2, 7])
def test_greedy_lossless_with_eos_at_different_steps(tiny_pair, plain, k):
    target, draft = tiny_pair
    eos = _eos_for_staggered_stops(plain)
    want = [row[: row.index(eos) + 1] if eos in row else row for row in plain]
    base = sj.generate(target, PROMPTS, max_new_tokens=40, eos_token_id=eos)
    spec = sj.generate(target, PROMPTS, max_new_tokens=40, draft=draft, method="draft",
                       num_draft_tokens=k, eos_token_id=eos)
    assert base.tokens == want
    assert spec.tokens == want
    assert len({len(r) for r in want}) >= 3


def test_greedy_lossless_against_hf(tiny_pair, tmp_path):
    """Speculative output equals HF transformers' greedy generate on the same weights."""
    from transformers import LlamaForCausalLM
    target, draft = tiny_pair
    save_hf_dir(target.params, target.config, str(tmp_path))
    hf = LlamaForCausalLM.from_pretrained(str(tmp_path)).eval()
    out = sj.generate(target, PROMPTS, max_new_tokens=30, draft=draft, method="draft",
                      num_draft_tokens=4, eos_token_id=[])
    for prompt, got in zip(PROMPTS, out.tokens):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=30, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == ref


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("draft_sampling", [False, True])
def test_self_draft_accepts_everything(tiny_pair, k, draft_sampling):
    """Target as its own draft: every draft accepted, for greedy rows and (when drafts are sampled
    from q = p) for sampled rows too. Point-mass drafts of sampled rows are accepted only with
    probability p(argmax), so that path is checked on greedy rows."""
    target, _ = tiny_pair
    temps = [0.0, 1.0, 0.7, 0.0] if draft_sampling else 0.0
    out = sj.generate(target, PROMPTS, max_new_tokens=33, draft=target, method="draft",
                      num_draft_tokens=k, eos_token_id=[], temperature=temps,
                      top_p=0.9, draft_sampling=draft_sampling)
    assert out.stats["mean_accepted_length"] == k + 1
    assert out.stats["per_position_acceptance"] == [1.0] * k
    assert all(len(t) == 33 for t in out.tokens)


def test_no_host_sync_inside_generation(tiny_pair, monkeypatch):
    """Device->host reads (every path through ArrayImpl._value) do not grow with length."""
    target, draft = tiny_pair

    def reads(n):
        count, out = count_host_reads(monkeypatch, lambda: sj.generate(
            target, PROMPTS, max_new_tokens=n, draft=draft, method="draft", num_draft_tokens=3,
            eos_token_id=[]))
        assert all(len(t) == n for t in out.tokens)
        return count, out.stats["host_syncs"]

    r32, r128 = reads(32), reads(128)
    assert r32 == r128
    assert r32[1] == 1
    assert r32[0] <= 8


# --------------------------------------------------------------------------- distribution tests

V = 6
N_ROWS = 20_000
PROMPT = [3, 1, 4]


@pytest.fixture(scope="module")
def dist_pair():
    target = tiny_model(11, vocab=V, hidden=16, layers=2, heads=2, kv_heads=1, scale=1.0)
    draft = tiny_model(12, vocab=V, hidden=16, layers=1, heads=2, kv_heads=1, scale=1.0)
    return target, draft


def _exact_joint(target, temperature, top_k, top_p):
    """P(x1, x2, x3) of the target's own sampler, by enumeration over V^2 continuations."""
    seqs = np.array([PROMPT + [a, b] for a, b in itertools.product(range(V), repeat=2)])
    logits = np.stack([sj.logits(target, s.tolist()) for s in seqs])  # [V^2, T, V]
    n = len(seqs)
    probs = np.asarray(sampling.process_logits(
        jnp.asarray(logits[:, -3:]), jnp.full((n,), temperature, jnp.float32),
        jnp.full((n,), top_k, jnp.int32), jnp.full((n,), top_p, jnp.float32)))
    joint = np.zeros((V, V, V))
    for i, (a, b) in enumerate(itertools.product(range(V), repeat=2)):
        joint[a, b, :] = probs[i, 0, a] * probs[i, 1, b] * probs[i, 2]
    return joint.reshape(-1)


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


def _first3(target, draft, *, temperature, top_k, top_p, draft_sampling, seed=0, k=2):
    out = sj.generate(target, [PROMPT] * N_ROWS, max_new_tokens=3, draft=draft, method="draft",
                      num_draft_tokens=k, temperature=temperature, top_k=top_k, top_p=top_p,
                      seed=seed, eos_token_id=[], draft_sampling=draft_sampling)
    toks = np.array(out.tokens)
    return toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2], out


SETTINGS = [dict(temperature=1.0, top_k=0, top_p=1.0), dict(temperature=0.7, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("setting", SETTINGS, ids=["t1", "t0.7_topk4_topp0.9"])
@pytest.mark.parametrize("draft_sampling", [False, True], ids=["point_mass", "sampled_q"])
def test_distribution_matches_target(dist_pair, setting, draft_sampling):
    target, draft = dist_pair
    exact = _exact_joint(target, **setting)
    cells, out = _first3(target, draft, draft_sampling=draft_sampling, **setting)
    p = _chi2_pvalue(cells, exact)
    assert 0.05 < out.stats["acceptance_rate"] < 0.95  # both accept and residual paths exercised
    assert p > ALPHA, p


def test_distribution_mixed_greedy_and_sampled_rows(dist_pair):
    target, draft = dist_pair
    temps = [0.0 if i % 2 else 1.0 for i in range(2 * N_ROWS)]
    out = sj.generate(target, [PROMPT] * (2 * N_ROWS), max_new_tokens=3, draft=draft,
                      method="draft", num_draft_tokens=2, temperature=temps, eos_token_id=[])
    greedy = sj.generate(target, [PROMPT], max_new_tokens=3, eos_token_id=[]).tokens[0]
    toks = np.array(out.tokens)
    assert (toks[1::2] == greedy).all()
    cells = toks[0::2, 0] * V * V + toks[0::2, 1] * V + toks[0::2, 2]
    assert _chi2_pvalue(cells, _exact_joint(target, 1.0, 0, 1.0)) > ALPHA


_TRUE_ACCEPT_CHAIN = acceptance.accept_chain


def _biased_accept_chain(keys, draft_tokens, target_probs, draft_probs=None):
    """A classic bug: at a rejection resample from p itself instead of the residual."""
    a, y = _TRUE_ACCEPT_CHAIN(keys, draft_tokens, target_probs, draft_probs)
    k = draft_tokens.shape[1]
    at = jnp.take_along_axis(target_probs, jnp.minimum(a, k)[:, None, None], axis=1)[:, 0]
    resample = sampling.sample(jax.vmap(lambda kk: jax.random.fold_in(kk, 99))(keys), at)
    return a, jnp.where(a < k, resample, y)


def test_biased_rule_fails_distribution_test(dist_pair, monkeypatch):
    """The same test has power: a subtly wrong residual is rejected."""
    target, draft = dist_pair
    monkeypatch.setattr(acceptance, "accept_chain", _biased_accept_chain)
    jax.clear_caches()
    try:
        cells, _ = _first3(target, draft, temperature=1.0, top_k=0, top_p=1.0, draft_sampling=True)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert _chi2_pvalue(cells, _exact_joint(target, 1.0, 0, 1.0)) < ALPHA


def test_rows_are_independent_streams(dist_pair):
    target, draft = dist_pair
    out = sj.generate(target, [PROMPT] * 64, max_new_tokens=6, draft=draft, method="draft",
                      num_draft_tokens=2, temperature=1.0, seed=5, eos_token_id=[])
    assert len({tuple(t) for t in out.tokens}) > 32
    again = sj.generate(target, [PROMPT] * 64, max_new_tokens=6, draft=draft, method="draft",
                        num_draft_tokens=2, temperature=1.0, seed=5, eos_token_id=[])
    assert again.tokens == out.tokens
