"""method="dflash": the DFlash block drafter in the fused step, the loop and the engine —
greedy output equals plain decoding token for token (k = 1, 3, B-1; a batch; EOS inside the
block), with drafts that really accept, and sampled rows keep the target's distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import specjax as sj
from specjax import acceptance, dflash
from specjax.config import SpecConfig
from specjax.engine import Engine, EngineConfig, RequestParams
from specjax.train import dflash_train
from tests.conftest import accept_length_counts, tiny_model
from tests.test_speculative import (ALPHA, K_DIST, N_DIST, N_ROWS, PROMPT, V, _biased_bonus,
                                    _chi2_pvalue, _exact_joint, cells_of)

BLOCK = 8
PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12], [4, 4, 4, 4, 4, 2]]


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def plain(target):
    return sj.generate(target, PROMPTS, max_new_tokens=32, eos_token_id=[]).tokens


@pytest.fixture(scope="module")
def head(target, plain):
    """A tiny DFlash drafter fitted for 150 Adam steps to the target's own greedy continuations
    of half the prompts (so its drafts accept often on those rows, rarely on the others)."""
    tc = target.config
    cfg = dflash.DFlashConfig(num_layers=1, hidden_size=tc.hidden_size, num_heads=4,
                              num_kv_heads=2, head_dim=8, intermediate_size=64, block_size=BLOCK,
                              mask_token_id=63, target_layer_ids=(0,),
                              target_hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                              rope_theta=tc.rope_theta)
    params = dflash.init_params(cfg, jax.random.key(1), scale=0.2)
    seqs = [p + o for p, o in zip(PROMPTS, plain)][::2]
    t = max(map(len, seqs))
    tokens = jnp.asarray([s + [0] * (t - len(s)) for s in seqs], jnp.int32)
    lengths = jnp.asarray([len(s) for s in seqs], jnp.int32)
    plens = jnp.asarray([len(p) for p in PROMPTS][::2], jnp.int32)
    feats = dflash.target_features(target.params, tc, cfg, tokens)
    hidden = jnp.concatenate([jnp.zeros(feats.shape[:2] + (tc.hidden_size,)), feats], -1)
    opt = optax.adam(1e-2)

    @jax.jit
    def step(p, s, seed):
        lv, g = jax.value_and_grad(lambda q: dflash_train.dflash_loss(
            q, target.params, tokens, lengths, hidden, plens, cfg=cfg, target_cfg=tc, anchors=12,
            gamma=4.0, seed=seed)[0])(p)
        upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, lv

    st = opt.init(params)
    for i in range(150):
        params, st, _ = step(params, st, i)
    return dflash.DFlashHead(params=params, config=cfg)


@pytest.mark.parametrize("k", [1, 3, BLOCK - 1])
def test_greedy_equals_plain(target, plain, head, k):
    out = sj.generate(target, PROMPTS, max_new_tokens=32, draft=head, eos_token_id=[],
                      spec=SpecConfig(method="dflash", num_draft_tokens=k))
    assert out.tokens == plain
    counts = accept_length_counts(out.stats)
    assert counts[0] > 0 and sum(counts[1:]) > 0, counts  # rejections and acceptances
    assert out.stats["drafted_tokens"] == out.stats["row_steps"] * k


def test_eos_inside_the_block(target, plain, head):
    eos = plain[0][5]
    want = [row[: row.index(eos) + 1] if eos in row else row for row in plain]
    out = sj.generate(target, PROMPTS, max_new_tokens=32, draft=head, eos_token_id=eos,
                      spec=SpecConfig(method="dflash", num_draft_tokens=BLOCK - 1))
    assert out.tokens == want


def test_k_beyond_the_block_is_refused(target, head):
    with pytest.raises(ValueError, match="block"):
        sj.generate(target, PROMPTS, draft=head, spec=SpecConfig(method="dflash",
                                                                 num_draft_tokens=BLOCK))


def test_engine_greedy_equals_plain(target, plain, head):
    engine = Engine(target, head, EngineConfig(SpecConfig(method="dflash", num_draft_tokens=3,
                                                          page_size=4),
                                               max_slots=4, batch_buckets=(4,), token_buckets=(8,),
                                               max_model_len=48))
    assert engine.generate(PROMPTS, RequestParams(max_tokens=32, stop_token_ids=())) == plain


@pytest.fixture(scope="module")
def dist_setup():
    """V = 6 (exact enumeration) and a random DFlash drafter: it accepts often enough that a
    k = 2 step is fully accepted and its bonus token sampled."""
    target = tiny_model(11, vocab=V, hidden=16, layers=2, heads=2, kv_heads=1, scale=1.0)
    tc = target.config
    cfg = dflash.DFlashConfig(num_layers=1, hidden_size=16, num_heads=2, num_kv_heads=1,
                              head_dim=8, intermediate_size=32, block_size=4, mask_token_id=5,
                              target_layer_ids=(0,), target_hidden_size=16, vocab_size=V,
                              rope_theta=tc.rope_theta)
    return target, dflash.DFlashHead(dflash.init_params(cfg, jax.random.key(2), scale=0.5), cfg)


def _sample(target, head, seed=0):
    out = sj.generate(target, [PROMPT] * N_ROWS, max_new_tokens=N_DIST, draft=head,
                      temperature=0.9, top_p=0.95, seed=seed, eos_token_id=[],
                      spec=SpecConfig(method="dflash", num_draft_tokens=K_DIST))
    return cells_of(out.tokens, V), out


def test_sampled_rows_keep_the_target_distribution(dist_setup):
    """k + 2 tokens per row (the bonus after a fully accepted step is in the sample):
    chi-square against the exact target distribution, significance ALPHA."""
    target, head = dist_setup
    cells, out = _sample(target, head)
    assert 0.05 < out.stats["acceptance_rate"] < 0.95
    assert out.stats["per_position_acceptance"][-1] > 0.01  # bonus after full acceptance sampled
    assert _chi2_pvalue(cells, _exact_joint(target, 0.9, 0, 0.95, n=N_DIST)) > ALPHA


def test_biased_bonus_fails_the_same_test(dist_setup, monkeypatch):
    """Negative control: an off-by-one bonus rule is rejected by the test above."""
    target, head = dist_setup
    monkeypatch.setattr(acceptance, "accept_chain", _biased_bonus)
    jax.clear_caches()
    try:
        cells, _ = _sample(target, head)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert _chi2_pvalue(cells, _exact_joint(target, 0.9, 0, 0.95, n=N_DIST)) < ALPHA
