"""Tests for specjax.acceptance: speculative acceptance must be lossless.

Distribution tests run many independent rows whose target distribution is the same at every
position (p_i = p), so the emitted token sequence must be iid ~ p; the first token and the joint of
the first two or three emitted tokens are checked with a chi-square goodness-of-fit test at
significance ALPHA = 1e-3 (fixed seeds: deterministic). Deliberately biased acceptance rules must
fail the same test, which shows it has power.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from specjax.acceptance import accept_chain, accept_greedy, emitted_tokens
from specjax.sampling import categorical, process_logits, sample

ALPHA = 1e-3  # chi-square significance level
N = 40_000  # independent rows per distribution test

# Target p (token 4 impossible) and per-position drafts q_1..q_3, with mass where p has none and
# none where p has some.
P = np.array([0.35, 0.25, 0.2, 0.2, 0.0], np.float32)
Q = np.array([[0.1, 0.5, 0.0, 0.1, 0.3],
              [0.4, 0.0, 0.3, 0.1, 0.2],
              [0.2, 0.2, 0.2, 0.2, 0.2]], np.float32)
V = P.size


def chi2_pvalue(counts, probs):
    """Goodness-of-fit p-value of counts against probs; 0.0 if an impossible outcome occurred."""
    counts, probs = np.asarray(counts, np.float64).ravel(), np.asarray(probs, np.float64).ravel()
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = counts.sum() * probs[support] / probs[support].sum()
    assert expected.min() >= 5, "test design: expected counts too small for chi-square"
    stat = np.sum((counts[support] - expected) ** 2 / expected)
    return stats.chi2.sf(stat, df=support.sum() - 1)


def biased_accept_chain(keys, draft_tokens, target_probs, draft_probs, mode):
    """Deliberately WRONG acceptance rules (same RNG layout as accept_chain), to show test power."""

    def row(key, d, p, q):
        k = d.shape[0]
        u = jax.random.uniform(jax.random.fold_in(key, 0), (k,))
        p_d = jnp.take_along_axis(p[:k], d[:, None], -1)[:, 0]
        q_d = 1.0 if q is None else jnp.take_along_axis(q, d[:, None], -1)[:, 0]
        accept = jnp.ones(k, bool) if mode == "always_accept" else u * q_d < p_d
        n = jnp.sum(jnp.cumprod(accept.astype(jnp.int32)))
        weights = p[n]  # "residual_is_p": resample from p itself after a rejection
        if mode == "bonus_from_residual":  # correct residual, but the bonus also subtracts q_K
            q_j = q[jnp.minimum(n, k - 1)]
            residual = jnp.maximum(p[n] - q_j, 0.0)
            weights = jnp.where(jnp.sum(residual) > 0, residual, p[n])
        return n, categorical(jax.random.fold_in(key, 1), weights)

    if draft_probs is None:
        return jax.vmap(lambda a, b, c: row(a, b, c, None))(keys, draft_tokens, target_probs)
    return jax.vmap(row)(keys, draft_tokens, target_probs, draft_probs)


def first_tokens(accept_fn, k, drafting, num_tokens, seed):
    """First `num_tokens` emitted tokens of N independent rows: [N, num_tokens] int32.

    Each step every row drafts k tokens, the target distribution is P at every position, and steps
    repeat until every row has emitted num_tokens tokens. drafting: "sampled" (d_j ~ Q[j], kept
    probabilities), or point-mass drafts "argmax" (argmax Q[j], the production default) or
    "random" (uniform per row, independent of the acceptance keys).
    """
    point_mass = drafting != "sampled"
    rng = np.random.default_rng(seed)
    target = jnp.broadcast_to(jnp.asarray(P), (N, k + 1, V))
    q = jnp.broadcast_to(jnp.asarray(Q[:k]), (N, k, V))
    outs = []
    for step in range(num_tokens):  # each step emits >= 1 token
        if drafting == "argmax":
            drafts = np.broadcast_to(Q[:k].argmax(-1), (N, k))
        elif drafting == "random":
            drafts = rng.integers(0, V, size=(N, k))
        else:
            drafts = np.stack([rng.choice(V, size=N, p=Q[j] / Q[j].sum()) for j in range(k)], 1)
        drafts = jnp.asarray(drafts, jnp.int32)
        keys = jax.random.split(jax.random.key(seed * 1000 + step), N)
        n, nxt = accept_fn(keys, drafts, target, None if point_mass else q)
        assert n.dtype == jnp.int32 and nxt.dtype == jnp.int32
        assert n.shape == nxt.shape == (N,)
        outs.append(np.asarray(emitted_tokens(drafts, n, nxt)))
    out = np.concatenate(outs, axis=1)  # [N, steps * (k+1)], -1 after each step's tokens
    order = np.argsort(out == -1, axis=1, kind="stable")  # emitted tokens first, in order
    return np.take_along_axis(out, order, axis=1)[:, :num_tokens]


def joint_pvalues(tokens):
    """Chi-square p-values of the first token, and of the joint of all columns, against iid P."""
    first = chi2_pvalue(np.bincount(tokens[:, 0], minlength=V), P)
    m = tokens.shape[1]
    joint_p = functools.reduce(np.multiply.outer, [P] * m)  # [V] * m
    flat = np.ravel_multi_index(tokens.T, (V,) * m)
    joint = chi2_pvalue(np.bincount(flat, minlength=V ** m), joint_p)
    return first, joint


# ---------------------------------------------------------------------------------------------
# Losslessness


@pytest.mark.parametrize("drafting", ["sampled", "argmax", "random"])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_emitted_tokens_are_distributed_as_target(k, drafting):
    tokens = first_tokens(accept_chain, k, drafting, num_tokens=min(k + 1, 3), seed=k)
    first, joint = joint_pvalues(tokens)
    assert first > ALPHA, f"first token p-value {first:.2e}"
    assert joint > ALPHA, f"joint of first {tokens.shape[1]} tokens p-value {joint:.2e}"


@pytest.mark.parametrize("k", [1, 3])
def test_acceptance_rate_matches_theory(k):
    # P(accept d_1) = sum_x min(p(x), q_1(x)) for sampled drafts.
    keys = jax.random.split(jax.random.key(7), N)
    drafts = np.random.default_rng(7).choice(V, size=(N, k), p=Q[0])
    n, _ = accept_chain(keys, jnp.asarray(drafts, jnp.int32),
                        jnp.broadcast_to(jnp.asarray(P), (N, k + 1, V)),
                        jnp.broadcast_to(jnp.asarray(Q[0]), (N, k, V)))
    accepted = int(np.sum(np.asarray(n) >= 1))
    assert stats.binomtest(accepted, N, float(np.minimum(P, Q[0]).sum())).pvalue > ALPHA


@pytest.mark.parametrize("mode,k,drafting,which", [
    ("residual_is_p", 2, "sampled", "first"),
    ("always_accept", 2, "sampled", "first"),
    ("residual_is_p", 2, "argmax", "first"),
    ("bonus_from_residual", 1, "sampled", "joint"),  # only the token after the bonus is biased
])
def test_biased_acceptance_fails_the_same_test(mode, k, drafting, which):
    fn = functools.partial(biased_accept_chain, mode=mode)
    first, joint = joint_pvalues(first_tokens(fn, k, drafting, num_tokens=2, seed=k))
    assert {"first": first, "joint": joint}[which] < ALPHA, (first, joint)
    if which == "joint":
        assert first > ALPHA  # the first token alone cannot see this bug; the joint test does


def test_mixed_batch_greedy_and_sampled_rows():
    rng = np.random.default_rng(11)
    b, k = 20_000, 3
    target_logits = np.tile(np.log(np.array([0.3, 0.3, 0.15, 0.1, 0.1, 0.05], np.float32)),
                            (b, k + 1, 1))
    draft_logits = rng.normal(size=(b, k, 6)).astype(np.float32)
    greedy = np.arange(b) % 2 == 0
    temp = np.where(greedy, 0.0, 1.0).astype(np.float32)
    top_k = np.where(greedy, 0, 4).astype(np.int32)  # sampled rows: top-4 of the target
    p = process_logits(jnp.asarray(target_logits), jnp.asarray(temp), jnp.asarray(top_k),
                       jnp.ones(b))
    q = process_logits(jnp.asarray(draft_logits), jnp.asarray(temp * 0.8), jnp.zeros(b, jnp.int32),
                       jnp.ones(b))
    keys = jax.random.split(jax.random.key(12), 2 * b)
    drafts = sample(keys[b:], q)  # greedy rows: one-hot q -> exact argmax drafts
    np.testing.assert_array_equal(np.asarray(drafts)[greedy], draft_logits[greedy].argmax(-1))
    n, nxt = accept_chain(keys[:b], drafts, p, q)
    n_g, nxt_g = accept_greedy(drafts, jnp.asarray(target_logits))
    np.testing.assert_array_equal(np.asarray(n)[greedy], np.asarray(n_g)[greedy])
    np.testing.assert_array_equal(np.asarray(nxt)[greedy], np.asarray(nxt_g)[greedy])
    # Sampled rows: first emitted token ~ processed target (top-4 renormalized).
    first = np.where(np.asarray(n) > 0, np.asarray(drafts)[:, 0], np.asarray(nxt))[~greedy]
    assert chi2_pvalue(np.bincount(first, minlength=6), np.asarray(p[1, 0])) > ALPHA


# ---------------------------------------------------------------------------------------------
# Exact properties


def self_draft_inputs(b, k, v, seed):
    rng = np.random.default_rng(seed)
    logits = jnp.asarray(rng.normal(size=(b, k + 1, v)).astype(np.float32) * 2)
    temp = jnp.asarray(rng.choice([0.5, 1.0, 1.5], b).astype(np.float32))
    top_k = jnp.asarray(rng.choice([0, 5, 50], b).astype(np.int32))
    top_p = jnp.asarray(rng.choice([1.0, 0.9], b).astype(np.float32))
    return process_logits(logits, temp, top_k, top_p)  # [B, K+1, V]


@pytest.mark.parametrize("k", [1, 5])
def test_self_draft_accepts_everything(k):
    b, v = 512, 97
    p = self_draft_inputs(b, k, v, seed=k)
    keys = jax.random.split(jax.random.key(k), 2 * b)
    drafts = sample(keys[b:], p[:, :k])  # q == p
    n, nxt = accept_chain(keys[:b], drafts, p, p[:, :k])
    np.testing.assert_array_equal(n, k)
    assert np.all(np.take_along_axis(np.asarray(p[:, k]), np.asarray(nxt)[:, None], 1) > 0)


def greedy_reference(draft_tokens, target_logits):
    """Plain numpy loop: accept while target argmax == draft, then the target argmax."""
    argmax = np.asarray(target_logits).argmax(-1)
    n = np.zeros(len(draft_tokens), np.int32)
    nxt = np.zeros(len(draft_tokens), np.int32)
    for i, d in enumerate(np.asarray(draft_tokens)):
        while n[i] < len(d) and d[n[i]] == argmax[i, n[i]]:
            n[i] += 1
        nxt[i] = argmax[i, n[i]]
    return n, nxt


@pytest.mark.parametrize("k", [1, 4])
def test_greedy_rows_reduce_to_argmax_comparison(k):
    rng = np.random.default_rng(20 + k)
    b, v = 256, 11
    target_logits = np.round(rng.normal(size=(b, k + 1, v)) * 2).astype(np.float32)  # with ties
    argmax = target_logits.argmax(-1)
    # Drafts that follow the target argmax for a random prefix, then random tokens.
    prefix = rng.integers(0, k + 1, size=b)
    drafts = np.where(np.arange(k)[None] < prefix[:, None], argmax[:, :k],
                      rng.integers(0, v, size=(b, k))).astype(np.int32)
    want_n, want_next = greedy_reference(drafts, target_logits)
    assert len(set(want_n)) == k + 1  # every accept length occurs

    zeros = jnp.zeros(b)
    p = process_logits(jnp.asarray(target_logits), zeros, jnp.zeros(b, jnp.int32), jnp.ones(b))
    keys = jax.random.split(jax.random.key(k), b)
    one_hot_q = jax.nn.one_hot(drafts, v)  # a greedy draft
    soft_q = jax.nn.softmax(jnp.asarray(rng.normal(size=(b, k, v)).astype(np.float32)), -1)
    for name, q in [("point_mass", None), ("one_hot_q", one_hot_q), ("soft_q", soft_q)]:
        n, nxt = accept_chain(keys, jnp.asarray(drafts), p, q)
        np.testing.assert_array_equal(n, want_n, err_msg=name)
        np.testing.assert_array_equal(nxt, want_next, err_msg=name)
    n, nxt = accept_greedy(jnp.asarray(drafts), jnp.asarray(target_logits))
    np.testing.assert_array_equal(n, want_n)
    np.testing.assert_array_equal(nxt, want_next)


def test_rows_independent_of_batch_composition():
    b, k, v = 64, 3, 13
    p = self_draft_inputs(b, k, v, seed=3)
    q = self_draft_inputs(b, k, v, seed=4)[:, :k]  # same shape as p: one compilation
    keys = jax.random.split(jax.random.key(5), 2 * b)
    drafts = sample(keys[b:], q)
    for draft_probs in (q, None):
        n, nxt = accept_chain(keys[:b], drafts, p, draft_probs)
        idx = np.concatenate([np.random.default_rng(0).permutation(b)[:-3], [40, 40, 3]])  # same B
        sub = None if draft_probs is None else draft_probs[idx]
        n_i, nxt_i = accept_chain(keys[idx], drafts[idx], p[idx], sub)
        np.testing.assert_array_equal(n_i, np.asarray(n)[idx])
        np.testing.assert_array_equal(nxt_i, np.asarray(nxt)[idx])


def test_zero_mass_residual_falls_back_to_target():
    # q == p at a rejected position can only happen with p(d) == 0 == q(d); the residual
    # max(0, p - q) is then all zeros and the next token must still come from p.
    p = jnp.asarray([[[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]]])  # [1, K+1=2, V=4]
    q = jnp.asarray([[[0.0, 0.5, 0.5, 0.0]]])
    drafts = jnp.asarray([[3]], jnp.int32)  # a zero-probability draft: always rejected
    keys = jax.random.split(jax.random.key(0), 2000)
    n, nxt = accept_chain(keys, jnp.tile(drafts, (2000, 1)), jnp.tile(p, (2000, 1, 1)),
                          jnp.tile(q, (2000, 1, 1)))
    np.testing.assert_array_equal(n, 0)
    assert set(np.unique(nxt)) == {1, 2}


def test_emitted_tokens_layout():
    drafts = jnp.asarray([[5, 6, 7], [5, 6, 7], [5, 6, 7]], jnp.int32)
    out = emitted_tokens(drafts, jnp.asarray([0, 2, 3]), jnp.asarray([9, 9, 9]))
    np.testing.assert_array_equal(out, [[9, -1, -1, -1], [5, 6, 9, -1], [5, 6, 7, 9]])


def test_rejects_bad_shapes():
    keys = jax.random.split(jax.random.key(0), 2)
    with pytest.raises(ValueError, match="target_probs"):
        accept_chain(keys, jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 3, 5)))
    with pytest.raises(ValueError, match="draft_probs"):
        accept_chain(keys, jnp.zeros((2, 3), jnp.int32), jnp.ones((2, 4, 5)), jnp.ones((2, 4, 5)))
