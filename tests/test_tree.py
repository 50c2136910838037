"""Draft trees: ancestor masks, tree attention, dynamic-tree structure, lossless tree acceptance,
greedy losslessness and the exact distribution through the fused loop, and KV compaction."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import heads, kv_cache, sampling, speculate, tree
from specjax.config import SpecConfig
from specjax.model import forward
from specjax.sampling import categorical
from specjax.tree import TreeConfig
from tests.conftest import accept_length_counts, mimic_head, predictable_target, random_head, tiny_model
from tests.test_speculative import (ALPHA, N_ROWS, PROMPT, PROMPTS, V, _chi2_pvalue, _exact_joint,
                                    cells_of, check_stats_agree)


_head = random_head


def _random_parents(rng, n):
    """A random topologically ordered tree of n nodes below the root."""
    return tuple(int(rng.integers(0, j)) for j in range(1, n + 1))


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def predictable():
    """A target a one-token head can mostly predict (see conftest.predictable_target)."""
    return predictable_target(0, context=0.05)


@pytest.fixture(scope="module")
def plain(target):
    return sj.generate(target, PROMPTS, max_new_tokens=30, eos_token_id=[]).tokens


@pytest.fixture(scope="module")
def plain_predictable(predictable):
    return sj.generate(predictable, PROMPTS, max_new_tokens=30, eos_token_id=[]).tokens


# ----------------------------------------------------------------------------- structure

def test_static_structure_and_paths():
    parents = (0, 0, 1, 1, 2, 4)
    depth, rank, par, anc = tree.static_structure(parents)
    assert depth.tolist() == [0, 1, 1, 2, 2, 2, 3]
    assert rank.tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert par.tolist() == [-1, 0, 0, 1, 1, 2, 4]
    assert tree.root_to_leaf_paths(parents) == [[0, 1, 3], [0, 2, 5], [0, 1, 4, 6]]
    assert anc[6].tolist() == [True, True, False, False, True, False, True]
    assert TreeConfig(kind="static", parents=parents).max_depth == 3


def test_ancestor_mask_matches_static_structure():
    rng = np.random.default_rng(0)
    trees = [_random_parents(rng, 12) for _ in range(5)]
    par = jnp.asarray(np.stack([tree.static_structure(p)[2] for p in trees]))
    mask = np.asarray(tree.ancestor_mask(par))
    for i, p in enumerate(trees):
        np.testing.assert_array_equal(mask[i], tree.static_structure(p)[3])


@pytest.mark.parametrize("bad", [dict(kind="bushy"), dict(depth=0), dict(top_k=0),
                                 dict(num_nodes=0), dict(num_nodes=100, depth=2, top_k=3),
                                 dict(kind="static"), dict(kind="static", parents=(0, 2)),
                                 dict(kind="static", parents=(0, -1)), dict(parents=(0,))])
def test_tree_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        TreeConfig(**bad)


# ----------------------------------------------------------------------------- tree attention

@pytest.mark.parametrize("prefix_len", [1, 5, pytest.param(17, marks=pytest.mark.slow), 40])
def test_tree_attention_equals_causal_attention_per_branch(target, prefix_len):
    """The target's logits at every tree node equal those of an ordinary causal forward over the
    node's root-to-node branch appended to the prefix (random tree, awkward prefix lengths)."""
    rng = np.random.default_rng(prefix_len)
    parents = _random_parents(rng, 11)
    depth, _, par, anc = tree.static_structure(parents)
    v = target.config.vocab_size
    prefix = rng.integers(0, v, prefix_len).tolist()
    nodes = rng.integers(0, v, len(par)).tolist()  # node 0 is the root (last prefix token)
    nodes[0] = prefix[-1]
    n = prefix_len  # committed tokens; the root sits at slot n - 1
    ps = 8
    kv, pt = kv_cache.init_contiguous(target.config, 1, n + len(par) + 8, ps)
    _, _, kv = forward(target.params, target.config, jnp.asarray([prefix[:-1] or [0]]),
                       jnp.arange(max(n - 1, 1))[None], kv, pt, jnp.zeros(1, jnp.int32),
                       jnp.asarray([n - 1], jnp.int32))
    logits, _, _ = forward(target.params, target.config, jnp.asarray([nodes]),
                           (n - 1 + jnp.asarray(depth))[None], kv, pt,
                           jnp.asarray([n - 1], jnp.int32), new_mask=jnp.asarray(anc)[None])
    for path in tree.root_to_leaf_paths(parents):
        branch = prefix[:-1] + [nodes[j] for j in path]
        want = sj.logits(target, branch)[-len(path):]
        np.testing.assert_allclose(logits[0, np.asarray(path)], want, rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------- dynamic tree

def test_dynamic_tree_structure():
    """Kept nodes are closed under ancestors, topologically ordered, at the right depth, and the
    depth-1 tokens are the root's top-k."""
    rng = np.random.default_rng(1)
    b, v, e = 3, 50, 8
    tc = TreeConfig(depth=4, top_k=3, num_nodes=12)
    w = jnp.asarray(rng.normal(size=(e, v)) * 3, jnp.float32)
    emb = jnp.asarray(rng.normal(size=(v, e)), jnp.float32)
    root_logits = jnp.asarray(rng.normal(size=(b, v)) * 3, jnp.float32)
    root_hidden = jnp.asarray(rng.normal(size=(b, e)), jnp.float32)
    calls = []

    def head_run(tokens, feats, positions, mask, num_new):  # a toy "head": masked mean + embed
        calls.append(int(num_new[0]))
        m = mask.astype(jnp.float32)
        mixed = jnp.einsum("bts,bse->bte", m, feats) / jnp.maximum(m.sum(-1, keepdims=True), 1)
        return jnp.tanh(mixed + emb[tokens])

    tokens, parents, depth = tree.draft_dynamic(tc, root_logits, root_hidden,
                                                jnp.full((b,), 10, jnp.int32), head_run,
                                                lambda h: h @ w)
    assert calls == [3, 6, 9]
    tokens, parents, depth = map(np.asarray, (tokens, parents, depth))
    top = np.argsort(-np.asarray(root_logits), axis=1)[:, :3]
    for i in range(b):
        assert parents[i, 0] == -1 and depth[i, 0] == 0
        for j in range(1, tc.n + 1):
            assert 0 <= parents[i, j] < j
            assert depth[i, j] == depth[i, parents[i, j]] + 1 <= tc.depth
            if depth[i, j] == 1:
                assert tokens[i, j - 1] in top[i]
        kids = {}
        for j in range(1, tc.n + 1):  # siblings are distinct tokens
            kids.setdefault(parents[i, j], []).append(tokens[i, j - 1])
        assert all(len(set(t)) == len(t) for t in kids.values())


# ----------------------------------------------------------------------------- acceptance

V_ACC = 6
ACC_PARENTS = (0, 0, 0, 1, 1, 2, 4, 4)  # root has 3 children, node 1 has 2, node 4 has 2


def _acceptance_problem(seed=0):
    rng = np.random.default_rng(seed)
    depth, _, par, _ = tree.static_structure(ACC_PARENTS)
    n = len(ACC_PARENTS)
    logits = rng.normal(size=(n + 1, V_ACC)) * 1.2
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    tokens = np.zeros(n, np.int32)
    for j in range(1, n + 1):  # siblings distinct; chosen independently of the randomness
        sib = [i for i in range(1, j) if par[i] == par[j]]
        tokens[j - 1] = [t for t in rng.permutation(V_ACC) if t not in tokens[np.array(sib, int) - 1]][0]
    return tokens, par, depth, probs


def _exact_two_token(tokens, par, probs):
    """Exact P(first, second) emitted by one tree step, second = V_ACC ("none") when the first
    token came from the root's residual (the step emits one token then)."""
    joint = np.zeros((V_ACC, V_ACC + 1))
    child_of_root = {tokens[j - 1]: j for j in range(1, len(par)) if par[j] == 0}
    for x in range(V_ACC):
        if x in child_of_root:
            joint[x, :V_ACC] = probs[0, x] * probs[child_of_root[x]]
        else:
            joint[x, V_ACC] = probs[0, x]
    return joint.reshape(-1)


def _biased_accept(keys, tokens, parents, depth, probs):
    """A plausible bug: rejected siblings are not removed from the residual."""
    def row(key, t, p, d, q):
        u = jax.random.uniform(jax.random.fold_in(key, 0), (t.shape[0] + 1,))

        def body(j, carry):
            node, path = carry
            acc = (p[j] == node) & (u[j] < q[node, t[j - 1]])
            return jnp.where(acc, j, node), jnp.where(acc, path.at[d[j]].set(j), path)

        node, path = jax.lax.fori_loop(1, t.shape[0] + 1, body, (jnp.int32(0), jnp.zeros(4, jnp.int32)))
        y = categorical(jax.random.fold_in(key, 1), q[node])
        return d[node], y, path
    return jax.vmap(row)(keys, tokens, parents, depth, probs)


def _two_token_cells(accept_fn, seed):
    tokens, par, depth, probs = _acceptance_problem()
    b = 2 * N_ROWS
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(b))
    bt = lambda x: jnp.broadcast_to(jnp.asarray(x), (b,) + np.shape(x))  # noqa: E731
    a, y, path = accept_fn(keys, bt(tokens), bt(par), bt(depth), bt(probs.astype(np.float32)))
    a, y, path = map(np.asarray, (a, y, path))
    tok_of = np.concatenate([[-1], tokens])
    first = np.where(a >= 1, tok_of[path[:, 1]], y)
    second = np.where(a >= 2, tok_of[path[:, 2]], np.where(a == 1, y, V_ACC))
    return first * (V_ACC + 1) + second, _exact_two_token(tokens, par, probs), a


def test_tree_acceptance_is_lossless():
    fn = functools.partial(tree.accept_tree, max_depth=3)
    cells, expected, a = _two_token_cells(lambda k, t, p, d, q: fn(k, t, p, d, q), seed=0)
    assert {0, 1, 2, 3} <= set(np.unique(a).tolist())  # every depth exercised, siblings tried
    assert _chi2_pvalue(cells, expected) > ALPHA


def test_biased_tree_acceptance_fails_the_same_test():
    cells, expected, _ = _two_token_cells(_biased_accept, seed=0)
    impossible = np.isin(cells, np.nonzero(expected == 0)[0]).sum()  # e.g. a rejected child re-drawn
    assert impossible > 0 or _chi2_pvalue(cells, expected) < ALPHA


def test_greedy_tree_acceptance_follows_argmax():
    tokens, par, depth, probs = _acceptance_problem(3)
    logits = np.log(probs)
    greedy = logits.argmax(-1)
    tokens = tokens.copy()
    tokens[1] = greedy[0]  # node 2 (second child of the root) matches
    tokens[5] = greedy[2]  # node 6 (child of node 2) matches
    keys = jax.random.split(jax.random.key(0), 1)
    a, y, path = tree.accept_tree(keys, jnp.asarray(tokens)[None], jnp.asarray(par)[None],
                                  jnp.asarray(depth)[None], None, jnp.asarray(logits)[None],
                                  max_depth=3)
    assert int(a[0]) == 2 and path[0, :3].tolist() == [0, 2, 6] and int(y[0]) == greedy[6]
    onehot = np.eye(V_ACC, dtype=np.float32)[greedy]  # the general rule on one-hot p agrees
    a2, y2, path2 = tree.accept_tree(keys, jnp.asarray(tokens)[None], jnp.asarray(par)[None],
                                     jnp.asarray(depth)[None], jnp.asarray(onehot)[None],
                                     max_depth=3)
    assert (int(a2[0]), int(y2[0]), path2.tolist()) == (2, int(y[0]), path.tolist())


# ----------------------------------------------------------------------------- fused loop

TREES = {
    "dynamic": TreeConfig(depth=3, top_k=3, num_nodes=8),
    "dynamic_deep": TreeConfig(depth=5, top_k=2, num_nodes=7),
    "static": TreeConfig(kind="static", parents=(0, 0, 0, 1, 1, 2, 4, 7)),
    "chain": TreeConfig(kind="static", parents=(0, 1, 2)),
}


FAST = {("eagle", "dynamic"), ("mtp", "dynamic_deep"), ("eagle", "static"), ("mtp", "chain")}


@pytest.mark.parametrize("kind,name", [
    pytest.param(kind, name, marks=() if (kind, name) in FAST else pytest.mark.slow)
    for kind in ("mtp", "eagle") for name in TREES])
def test_greedy_lossless(predictable, plain_predictable, kind, name):
    """Heads that mostly reproduce the target: paths of every depth 0..D are accepted (up to
    depth 3), so the K/V compaction and head re-run after partial paths are exercised."""
    tc = TREES[name]
    out = sj.generate(predictable, PROMPTS, max_new_tokens=30, draft=mimic_head(predictable, kind),
                      method="eagle-tree", tree=tc, eos_token_id=[])
    assert out.tokens == plain_predictable
    counts = accept_length_counts(out.stats)
    assert len(counts) == tc.max_depth + 1
    # every depth 0..3 is reached by some accepted path (a step may go on past it)
    assert all(sum(counts[j:]) > 0 for j in range(4)) and counts[0] > 0, counts
    check_stats_agree(out, len(PROMPTS))


@pytest.mark.slow  # default-run time (README: ~15 min on 2 cores); run with -m slow
def test_static_chain_tree_equals_chain_method(predictable):
    """A static chain tree accepts exactly what the k-chain accepts (same head, greedy)."""
    head = mimic_head(predictable, "eagle")
    t = sj.generate(predictable, PROMPTS, max_new_tokens=30, draft=head, method="eagle-tree",
                    tree=TREES["chain"], eos_token_id=[])
    c = sj.generate(predictable, PROMPTS, max_new_tokens=30, draft=head, method="eagle",
                    num_draft_tokens=3, eos_token_id=[])
    assert t.tokens == c.tokens
    assert t.stats["per_position_acceptance"] == pytest.approx(c.stats["per_position_acceptance"])
    assert c.stats["per_position_acceptance"][1] > 0  # multi-token paths were compared


@pytest.fixture(scope="module")
def small_vocab_target():
    return tiny_model(11, vocab=V, hidden=16, layers=2, heads=2, kv_heads=1, scale=1.0)


# Every token at depths 1 and 2 (V = 6): each step accepts exactly two drafts, so the path's
# K/V always moves from deep tree slots into cache order.
FULL_TREE = TreeConfig(kind="static", parents=tuple([0] * V + [1 + i // V for i in range(V * V)]))


@pytest.mark.parametrize("tc", [pytest.param(FULL_TREE, marks=pytest.mark.slow, id="full"),
                                pytest.param(TreeConfig(depth=3, top_k=3, num_nodes=9), id="dynamic")])
# temperature 0 runs under `slow`: a wrong greedy compaction also breaks test_greedy_lossless
@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.slow), 1.0])
def test_kv_compaction_matches_fresh_prefill(small_vocab_target, tc, temperature):
    """After several tree steps the target cache, continued by one more token, gives the same
    logits as a fresh forward over the committed tokens; the carried head state matches a
    teacher-forced head pass."""
    target = small_vocab_target
    head = _head(target, "mtp", seed=5, scale=1.0)
    b = len(PROMPTS)
    toks = np.zeros((b, 32), np.int32)
    for i, p in enumerate(PROMPTS):
        toks[i, :len(p)] = np.asarray(p) % V
    lc = SpecConfig(method="eagle-tree", tree=tc)
    rp = speculate.RowParams(temperature=jnp.full(b, temperature), top_k=jnp.zeros(b, jnp.int32),
                             top_p=jnp.ones(b), max_new=jnp.full((b,), 10_000, jnp.int32),
                             eos_ids=jnp.asarray([-1], jnp.int32))
    lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    state = speculate.prefill(target.params, target.config, head.params, head.config,
                              jnp.asarray(toks), lens, rp, jnp.asarray(0), lc, 12, 128)
    step = jax.jit(speculate.spec_step, static_argnums=(1, 3, 6))
    for _ in range(5):
        state = step(target.params, target.config, head.params, head.config, state, rp, lc)
    if tc is FULL_TREE:
        assert int(state.accepted_per_pos[1]) == 5 * b  # depth 2 accepted every step
    n = state.lengths
    logits, _, _ = forward(target.params, target.config, state.last_token[:, None],
                           (n - 1)[:, None], state.target_kv, state.page_table, n - 1)
    # fresh, batched teacher forcing over the committed tokens (right-padded)
    seqs = [(np.asarray(PROMPTS[i]) % V).tolist()
            + np.asarray(state.out_tokens[i, :int(state.num_out[i])]).tolist() for i in range(b)]
    assert [len(s) for s in seqs] == np.asarray(n).tolist()
    t = max(len(s) for s in seqs)
    padded = jnp.asarray([s + [0] * (t - len(s)) for s in seqs])
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    zeros = jnp.zeros(b, jnp.int32)
    kv, pt = kv_cache.init_contiguous(target.config, b, t + 8)
    want, hidden, _ = forward(target.params, target.config, padded, pos, kv, pt, zeros, n)
    shifted = jnp.concatenate([padded[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
    feats = heads.head_features(head.params, head.config, target.params, target.config, hidden)
    hkv, hpt = kv_cache.init_contiguous(head.config.layer, b, t + 8)
    hh, _ = heads.head_forward(head.params, head.config, target.params, shifted,
                               feats, pos, hkv, hpt, zeros, n - 1)
    for i in range(b):
        np.testing.assert_allclose(logits[i, 0], want[i, n[i] - 1], rtol=1e-4, atol=1e-4)
        # float32 noise scales with the activations (|h| reaches ~200 with scale-1 weights)
        scale = float(jnp.max(jnp.abs(hh[i, n[i] - 2])))
        np.testing.assert_allclose(state.head_hidden[i], hh[i, n[i] - 2], rtol=1e-4,
                                   atol=1e-5 * max(scale, 10.0))


V4 = 4  # the depth-3 case samples 5 tokens: 4^5 cells keep the chi-square test dense
PROMPT4 = [3, 1, 2]


@pytest.fixture(scope="module")
def dist_targets():
    """Small-vocabulary targets that mimic heads predict often enough that full-depth paths, and
    so the bonus token, are sampled in thousands of rows (measured per-depth acceptance at
    temperature 0.8: [0.82, 0.53] for the depth-2 static tree, [0.54, 0.25, 0.09] for depth 3)."""
    kw = dict(context=0.2, hidden=16, layers=2, heads=2, kv_heads=1, scale=1.0)
    return predictable_target(11, vocab=V, **kw), predictable_target(13, vocab=V4, **kw)


DEPTH2 = TreeConfig(kind="static", parents=(0, 0, 0, 1, 1, 2))
DEPTH3 = TreeConfig(depth=3, top_k=2, num_nodes=6)


def _tree_tokens(target, tc, prompt):
    """depth + 2 tokens per row at temperature 0.8 / top-p 0.95: the bonus after a full-depth
    path is in the sample."""
    out = sj.generate(target, [prompt] * N_ROWS, max_new_tokens=tc.max_depth + 2,
                      draft=mimic_head(target, "mtp", gain=1.0), method="eagle-tree", tree=tc,
                      temperature=0.8, top_p=0.95, eos_token_id=[])
    return cells_of(out.tokens, target.config.vocab_size), out


@pytest.mark.parametrize("case", [pytest.param("static_depth2", marks=pytest.mark.slow), "dynamic_depth3"])
def test_distribution_matches_target(dist_targets, case):
    """Tokens from the fused tree loop are distributed as the target's own sampler (several
    children per node, chi-square at ALPHA), the bonus after full-depth paths included."""
    (target, tc, prompt) = {"static_depth2": (dist_targets[0], DEPTH2, PROMPT),
                            "dynamic_depth3": (dist_targets[1], DEPTH3, PROMPT4)}[case]
    cells, out = _tree_tokens(target, tc, prompt)
    assert 0.05 < out.stats["acceptance_rate"] < 0.95
    assert out.stats["per_position_acceptance"][-1] > 0.05  # full-depth paths, then the bonus
    expected = _exact_joint(target, 0.8, 0, 0.95, n=tc.max_depth + 2, prompt=prompt)
    assert _chi2_pvalue(cells, expected) > ALPHA


_TRUE_ACCEPT_TREE = tree.accept_tree


def _biased_tree_bonus(keys, tokens, parents, depth, target_probs=None, target_logits=None, *,
                       max_depth):
    """A bug on the point-mass path: after a full-depth path the bonus comes from the root's p."""
    a, y, path = _TRUE_ACCEPT_TREE(keys, tokens, parents, depth, target_probs, target_logits,
                                   max_depth=max_depth)
    if target_probs is None:
        return a, y, path
    wrong = sampling.sample(jax.vmap(lambda k: jax.random.fold_in(k, 99))(keys), target_probs[:, 0])
    return a, jnp.where(a == max_depth, wrong, y), path


def test_biased_tree_bonus_fails_distribution_test(dist_targets, monkeypatch):
    """The depth-3 test has power over the bonus token: a wrong bonus distribution is rejected."""
    target = dist_targets[1]
    monkeypatch.setattr(tree, "accept_tree", _biased_tree_bonus)
    jax.clear_caches()
    try:
        cells, _ = _tree_tokens(target, DEPTH3, PROMPT4)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    expected = _exact_joint(target, 0.8, 0, 0.95, n=5, prompt=PROMPT4)
    impossible = np.isin(cells, np.nonzero(expected == 0)[0]).sum()  # bonus outside top-p
    assert impossible > 0 or _chi2_pvalue(cells, expected) < ALPHA


def test_generate_rejects_bad_tree_arguments(target):
    head = _head(target)
    with pytest.raises(ValueError, match="tree"):
        sj.generate(target, PROMPTS, draft=head, method="eagle", tree=TreeConfig())
    with pytest.raises(TypeError, match="TreeConfig"):
        sj.generate(target, PROMPTS, draft=head, method="eagle-tree", tree=(0, 0, 1))
    with pytest.raises(ValueError, match="draft_sampling"):
        sj.generate(target, PROMPTS, draft=head, method="eagle-tree", draft_sampling=True)
    with pytest.raises(TypeError, match="head"):
        sj.generate(target, PROMPTS, draft=tiny_model(1, hidden=16, layers=1, heads=2, kv_heads=1),
                    method="eagle-tree")


def test_pallas_tree_attention_in_the_loop(target, plain):
    """The fused tree loop gives the same greedy tokens with the Pallas kernels (interpret mode on
    CPU): the ancestor mask travels through the kernel's new-token bitmask."""
    head = _head(target, "eagle")
    out = sj.generate(target, PROMPTS[:2], max_new_tokens=8, draft=head, method="eagle-tree",
                      tree=TreeConfig(depth=3, top_k=2, num_nodes=5), eos_token_id=[],
                      attn_impl="pallas")
    assert out.tokens == [row[:8] for row in plain[:2]]
