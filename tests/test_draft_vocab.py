"""Reduced draft vocabularies (EAGLE-3): a head scoring only a subset of the tokens stays lossless
(greedy and sampled), saves and loads, and the subset is chosen from the training answers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import heads
from specjax.heads import HeadConfig, set_draft_vocab
from specjax.io.heads_io import save_head
from specjax.train import data as data_lib
from specjax.tree import TreeConfig
from tests.test_heads import _head, dist_target, target  # noqa: F401 (fixtures)
from tests.test_speculative import ALPHA, N_ROWS, PROMPT, PROMPTS, V, _chi2_pvalue, _exact_joint


@pytest.fixture(scope="module")
def plain(target):
    return sj.generate(target, PROMPTS, max_new_tokens=30, eos_token_id=[]).tokens


def _subset(target, size, seed=0):
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(target.config.vocab_size, size, replace=False)).astype(np.int32)


@pytest.mark.parametrize("kind", ["mtp", "eagle"])
def test_head_logits_on_the_subset_only(target, kind):
    head = _head(target, kind)
    vocab = _subset(target, 40)
    small = set_draft_vocab(head, vocab)
    h = jax.random.normal(jax.random.key(1), (2, 3, target.config.hidden_size))
    full = heads.head_logits(head.params, head.config, target.params, target.config, h)
    got = heads.head_logits(small.params, small.config, target.params, target.config, h)
    compact = heads.head_logits(small.params, small.config, target.params, target.config, h,
                                compact=True)
    assert got.shape == full.shape and compact.shape == (2, 3, 40)
    np.testing.assert_allclose(got[..., vocab], full[..., vocab], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(compact, full[..., vocab], rtol=1e-5, atol=1e-5)
    off = np.setdiff1d(np.arange(target.config.vocab_size), vocab)
    assert np.all(np.asarray(got[..., off]) == heads.NEG_LOGIT)
    assert np.all(np.asarray(jax.nn.softmax(got, -1))[..., off] == 0.0)


@pytest.mark.parametrize("kind,method,k", [
    pytest.param("mtp", "mtp", 1, marks=pytest.mark.slow), ("mtp", "mtp", 3),
    pytest.param("eagle", "eagle", 2, marks=pytest.mark.slow), ("eagle", "eagle-tree", None)])
def test_greedy_lossless_with_reduced_vocab(target, plain, kind, method, k):
    # half the vocabulary, chosen at random: many target tokens can never be drafted
    head = set_draft_vocab(_head(target, kind), _subset(target, target.config.vocab_size // 2))
    kw = (dict(tree=TreeConfig(depth=3, top_k=2, num_nodes=6)) if method == "eagle-tree"
          else dict(num_draft_tokens=k))
    out = sj.generate(target, PROMPTS, max_new_tokens=30, draft=head, method=method,
                      eos_token_id=[], **kw)
    assert out.tokens == plain


def test_self_consistent_subset_accepts_what_the_full_head_accepts(target, plain):
    """A subset holding every token the full head proposes changes nothing (greedy, k=3)."""
    head = _head(target, "mtp")
    full = sj.generate(target, PROMPTS, max_new_tokens=30, draft=head, method="mtp",
                       num_draft_tokens=3, eos_token_id=[])
    everything = set_draft_vocab(head, np.arange(target.config.vocab_size))
    same = sj.generate(target, PROMPTS, max_new_tokens=30, draft=everything, method="mtp",
                       num_draft_tokens=3, eos_token_id=[])
    assert same.tokens == plain
    assert same.stats["mean_accepted_length"] == pytest.approx(full.stats["mean_accepted_length"])


@pytest.mark.parametrize("draft_sampling", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["point_mass", "sampled_q"])
def test_distribution_matches_target_with_reduced_vocab(dist_target, draft_sampling):
    """Drafts come from 4 of the 6 tokens; the output is still distributed as the target's own
    sampler (chi-square at ALPHA over all 6^3 continuations)."""
    head = set_draft_vocab(_head(dist_target, "mtp", seed=5, scale=1.0), np.array([0, 1, 3, 4]))
    out = sj.generate(dist_target, [PROMPT] * N_ROWS, max_new_tokens=4, draft=head, method="mtp",
                      num_draft_tokens=2, temperature=0.8, top_p=0.95, eos_token_id=[],
                      draft_sampling=draft_sampling)  # 4 tokens: the bonus after 2 accepted
    toks = np.array(out.tokens)
    assert 0.01 < out.stats["acceptance_rate"] < 0.99
    assert out.stats["per_position_acceptance"][-1] > 0.01  # bonus after full acceptance sampled
    cells = ((toks[:, 0] * V + toks[:, 1]) * V + toks[:, 2]) * V + toks[:, 3]
    assert _chi2_pvalue(cells, _exact_joint(dist_target, 0.8, 0, 0.95, n=4)) > ALPHA


def test_save_load_keeps_the_vocab(target, tmp_path):
    vocab = _subset(target, 50, seed=3)
    head = set_draft_vocab(_head(target, "mtp"), vocab)
    save_head(head, str(tmp_path / "h"))
    loaded = sj.load_draft(str(tmp_path / "h"), target=target, dtype=jnp.bfloat16)
    assert loaded.config.draft_vocab_size == 50
    assert loaded.params["draft_vocab"].dtype == jnp.int32
    np.testing.assert_array_equal(loaded.params["draft_vocab"], vocab)
    assert loaded.params["eh_proj"].dtype == jnp.bfloat16
    a = sj.generate(target, PROMPTS, max_new_tokens=12, draft=head, method="mtp", eos_token_id=[])
    b = sj.generate(target, PROMPTS, max_new_tokens=12, draft=sj.load_draft(str(tmp_path / "h"), target),
                    method="mtp", eos_token_id=[])
    assert a.tokens == b.tokens and a.stats["mean_accepted_length"] == b.stats["mean_accepted_length"]


def test_bad_vocab_is_rejected(target):
    head = _head(target, "mtp")
    vsize = target.config.vocab_size
    for bad in ([], [[1, 2]], [0, 0, 1], [-1, 2], [vsize], np.array([0.5, 1.5])):
        with pytest.raises(ValueError, match="set_draft_vocab: vocab"):
            set_draft_vocab(head, np.asarray(bad))
    for bad in (-1, vsize + 1):
        with pytest.raises(ValueError, match="draft_vocab_size must be an int in"):
            HeadConfig(kind="mtp", layer=head.config.layer, draft_vocab_size=bad)


def test_vocab_from_answer_tokens():
    """The most frequent answer tokens (prompt positions and padding ignored) plus ``always``."""
    tokens = np.array([[9, 9, 9, 1, 1, 2, 0, 0],
                       [9, 9, 3, 1, 2, 2, 2, 7]], np.int32)
    data = {"tokens": tokens, "lengths": np.array([6, 7]), "prompt_lens": np.array([3, 2])}
    # answers: [1, 1, 2] and [3, 1, 2, 2, 2] -> counts 2: 4, 1: 3, 3: 1 (9 only in prompts, 7 padding)
    np.testing.assert_array_equal(data_lib.draft_vocab(data, 2, 10), [1, 2])
    np.testing.assert_array_equal(data_lib.draft_vocab(data, 3, 10), [1, 2, 3])
    np.testing.assert_array_equal(data_lib.draft_vocab(data, 3, 10, always=(8,)), [1, 2, 8])
    with pytest.raises(ValueError, match="draft vocabulary size"):
        data_lib.draft_vocab(data, 0, 10)
