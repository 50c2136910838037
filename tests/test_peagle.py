"""P-EAGLE parallel drafting: the jitted pass against an independent torch reference written
from the published semantics (speculators' PEagleDraftModel, vLLM's parallel_drafting), the
incremental head cache against recomputing the context, the dense training pass against the
pass, method="peagle" greedy == plain (k = 1, 3, K-1; a batch) in generate and the engine,
sampled rows against the exact target law with a negative control, and the training loss."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

import specjax as sj
from specjax import acceptance, heads, kv_cache, peagle
from specjax.config import SpecConfig
from specjax.engine import Engine, EngineConfig, RequestParams
from specjax.train import peagle_train
from tests import hf_families
from tests.conftest import accept_length_counts, tiny_model
from tests.test_dflash import _rms, _rope
from tests.test_speculative import (ALPHA, K_DIST, N_DIST, N_ROWS, PROMPT, V, _biased_residual,
                                    _chi2_pvalue, _exact_joint, cells_of)

AUX = (1, 2, 3)  # hidden states entering target layers 1..3 (HF hidden_states[1..3])
K = 4
MASK = 5


# ------------------------------------------------------------------ reference forward (torch)

@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("peagle")
    hf = hf_families.build("mistral", str(root / "target"), seed=3, num_hidden_layers=4)
    target = sj.load_model(str(root / "target"))
    hc = heads.HeadConfig.for_target(target.config, "eagle3", aux_layers=AUX)
    rng = np.random.RandomState(0)
    vocab = np.sort(rng.choice(target.config.vocab_size, 80, replace=False)).astype(np.int32)
    hc = dataclasses.replace(hc, draft_vocab_size=80)
    cfg = peagle.PEagleConfig(hc, mask_token_id=MASK, num_depths=K)
    params = peagle.init_params(cfg, jax.random.key(1), scale=0.3)
    params = jax.tree.map(lambda a: a + 0.2 * rng.randn(*a.shape).astype(np.float32)
                          if a.ndim == 1 and a.dtype == jnp.float32 and a.shape[0] < 40 else a,
                          params)  # norms off 1 so every weight matters
    params["draft_vocab"] = jnp.asarray(vocab)
    return hf, target, peagle.PEagleHead(params, cfg)


def reference_pass(hf, head: peagle.PEagleHead, ids, k):
    """Torch float64, from the semantics: one causal pass over head positions 0..t-1 fed
    (ids[j+1], fc(h_j)) and k-1 slots fed (mask_token_id, fc(mask_hidden)); EAGLE-3 midlayer
    (attention over [enorm(emb); hnorm(f)], residual f), final norm, own lm_head scattered into
    the target vocabulary. Returns [k, V] (rows from head position t-1 on)."""
    cfg = head.config
    lc = cfg.head.layer
    p = {n: torch.tensor(np.asarray(a), dtype=torch.float64) for n, a in head.params.items()
         if n != "layer"}
    lp = {n: torch.tensor(np.asarray(a), dtype=torch.float64)
          for n, a in head.params["layer"].items()}
    t = len(ids) - 1
    with torch.no_grad():
        hs = hf.double()(torch.tensor([ids[:t]]), output_hidden_states=True).hidden_states
        emb = hf.get_input_embeddings().weight.double().clone()
        hf.float()
    aux = torch.cat([hs[i][0] for i in AUX], -1)  # [t, 3E]
    f = torch.cat([aux @ p["fc"], (p["mask_hidden"] @ p["fc"])[None].repeat(k - 1, 1)], 0)
    toks = list(ids[1:]) + [cfg.mask_token_id] * (k - 1)
    s, eps = len(toks), lc.rms_norm_eps
    e = emb[torch.tensor(toks)]
    x = f
    inp = torch.cat([_rms(e, p["enorm"], eps), _rms(x, p["hnorm"], eps)], -1)
    nh, nkv, d = lc.num_heads, lc.num_kv_heads, lc.head_dim
    q = (inp @ lp["wq"]).view(s, nh, d)
    kk = (inp @ lp["wk"]).view(s, nkv, d)
    v = (inp @ lp["wv"]).view(s, nkv, d)
    pos = torch.arange(s)
    q, kk = _rope(q, pos, lc.rope_theta), _rope(kk, pos, lc.rope_theta)
    kk, v = kk.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    att = torch.einsum("qhd,khd->hqk", q, kk) / d ** 0.5
    att = att.masked_fill(~torch.tril(torch.ones(s, s, dtype=torch.bool)), float("-inf"))
    o = torch.einsum("hqk,khd->qhd", torch.softmax(att, -1), v).reshape(s, nh * d)
    x = x + o @ lp["wo"]
    y = _rms(x, lp["mlp_norm"], eps)
    x = x + (torch.nn.functional.silu(y @ lp["w_gate"]) * (y @ lp["w_up"])) @ lp["w_down"]
    logits = _rms(x, p["final_norm"], eps) @ p["lm_head"]  # [s, Vd]
    full = torch.full((s, lc.vocab_size), -1e9, dtype=torch.float64)
    full[:, torch.tensor(np.asarray(head.params["draft_vocab"]), dtype=torch.long)] = logits
    return full[t - 1:].numpy()


IDS = [7, 3, 11, 40, 2, 9, 17, 23, 60]


def test_pass_matches_torch_reference(setup):
    hf, target, head = setup
    got = sj.draft_logits(target, head, IDS)
    want = reference_pass(hf, head, IDS, K)
    assert got.shape == (K, target.config.vocab_size)
    vocab = np.asarray(head.params["draft_vocab"])
    scale = np.abs(want[:, vocab]).max()
    np.testing.assert_allclose(got[:, vocab], want[:, vocab], rtol=0, atol=1e-4 * scale)
    off = np.setdiff1d(np.arange(target.config.vocab_size), vocab)
    assert (got[:, off] <= -1e8).all()  # outside the draft vocabulary: probability 0
    # depth 0 is the EAGLE-3 head's own first draft; the slots depend on mask_hidden
    e3 = sj.draft_logits(target, head.eagle3, IDS)[-1]
    np.testing.assert_allclose(got[0, vocab], e3[vocab], rtol=0, atol=1e-5 * scale)
    other = peagle.PEagleHead(dict(head.params, mask_hidden=head.params["mask_hidden"] + 1.0),
                              head.config)
    moved = sj.draft_logits(target, other, IDS)
    assert np.abs(moved[0] - got[0]).max() < 1e-5 * scale
    assert np.abs(moved[1:, vocab] - got[1:, vocab]).max() > 1e-3 * scale


def test_incremental_cache_matches_whole_context(setup):
    """The head cache written in chunks (scattered pages), then one placeholder pass, equals the
    pass recomputed from the whole context."""
    _, target, head = setup
    cfg, tp, tcfg = head.config, target.params, target.config
    ids = np.array(IDS + [5, 31], np.int32)
    t = len(ids) - 1
    aux = peagle.target_features(tp, tcfg, cfg, jnp.asarray(ids[None, :t]))
    feats = heads.head_features(head.params, cfg.head, tp, tcfg, None, aux)
    table = jnp.asarray([[5, 2, 7, 0, 3, 1]], jnp.int32)
    kv = kv_cache.init_cache(cfg.head.layer, 8, 4)
    start, hh = 0, None
    for chunk in (3, 1, 1, 4, 1):
        pos = jnp.arange(start, start + chunk, dtype=jnp.int32)[None]
        hh, kv = heads.head_forward(head.params, cfg.head, tp, jnp.asarray(ids[None, start + 1:
                                    start + 1 + chunk]), feats[:, start:start + chunk], pos, kv,
                                    table, jnp.asarray([start], jnp.int32))
        start += chunk
    assert start == t
    rest, _ = peagle.mask_block(head.params, cfg, tp, tcfg, kv, table, jnp.asarray([t]), K - 1)
    got = heads.head_logits(head.params, cfg.head, tp, tcfg,
                            jnp.concatenate([hh[:, -1:], rest], axis=1))[0]
    want = peagle.block_logits(target, head, ids)
    vocab = np.asarray(head.params["draft_vocab"])
    np.testing.assert_allclose(np.asarray(got)[:, vocab], want[:, vocab], rtol=0,
                               atol=1e-5 * np.abs(want[:, vocab]).max())


def test_training_pass_matches_the_drafting_pass(setup):
    """train_logits (depth 0 everywhere + K-1 slots per anchor, one dense pass) = block_logits
    at each anchor."""
    _, target, head = setup
    cfg, tp, tcfg = head.config, target.params, target.config
    ids = np.array(IDS + [5, 31, 44], np.int32)
    aux = peagle.target_features(tp, tcfg, cfg, jnp.asarray(ids[None]))
    anchors = np.array([[1, 8]], np.int32)
    ctx, blk = peagle.train_logits(head.params, cfg, tp, tcfg, jnp.asarray(ids[None]), aux,
                                   jnp.asarray(anchors))
    ctx, blk = np.asarray(ctx), np.asarray(blk)
    assert ctx.shape == (1, len(ids) - 1, tcfg.vocab_size)
    assert blk.shape == (1, 2, K - 1, tcfg.vocab_size)
    vocab = np.asarray(head.params["draft_vocab"])
    for j, a in enumerate(anchors[0]):
        want = peagle.block_logits(target, head, ids[:a + 2])
        got = np.concatenate([ctx[0, a:a + 1], blk[0, j]], axis=0)
        np.testing.assert_allclose(got[:, vocab], want[:, vocab], rtol=0,
                                   atol=1e-4 * np.abs(want[:, vocab]).max())


# ------------------------------------------------------------------------ decoding (lossless)

DEPTHS = 6
PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12], [4, 4, 4, 4, 4, 2]]


@pytest.fixture(scope="module")
def small():
    return tiny_model(0, layers=4)


@pytest.fixture(scope="module")
def plain(small):
    return sj.generate(small, PROMPTS, max_new_tokens=32, eos_token_id=[]).tokens


@pytest.fixture(scope="module")
def fitted(small, plain):
    """A tiny P-EAGLE head fitted (peagle_loss, 120 Adam steps) to the target's own greedy
    continuations of half the prompts: its drafts accept often there, rarely elsewhere."""
    tc = small.config
    hc = heads.HeadConfig.for_target(tc, "eagle3", aux_layers=AUX)
    cfg = peagle.PEagleConfig(hc, mask_token_id=63, num_depths=DEPTHS)
    params = peagle.init_params(cfg, jax.random.key(1), scale=0.2)
    seqs = [p + o for p, o in zip(PROMPTS, plain)][::2]
    t = max(map(len, seqs))
    tokens = jnp.asarray([s + [0] * (t - len(s)) for s in seqs], jnp.int32)
    lengths = jnp.asarray([len(s) for s in seqs], jnp.int32)
    plens = jnp.asarray([len(p) for p in PROMPTS][::2], jnp.int32)
    aux = peagle.target_features(small.params, tc, cfg, tokens)
    hidden = jnp.concatenate([jnp.zeros(aux.shape[:2] + (tc.hidden_size,)), aux], -1)
    opt = optax.adam(1e-2)

    @jax.jit
    def step(p, s, seed):
        lv, g = jax.value_and_grad(lambda q: peagle_train.peagle_loss(
            q, small.params, tokens, lengths, hidden, plens, cfg=cfg, target_cfg=tc, anchors=10,
            gamma=4.0, seed=seed)[0])(p)
        upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, lv

    st = opt.init(params)
    for i in range(120):
        params, st, _ = step(params, st, i)
    return peagle.PEagleHead(params, cfg)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3, DEPTHS - 1])
def test_greedy_equals_plain(small, plain, fitted, k):
    out = sj.generate(small, PROMPTS, max_new_tokens=32, draft=fitted, eos_token_id=[],
                      spec=SpecConfig(method="peagle", num_draft_tokens=k))
    assert out.tokens == plain
    counts = accept_length_counts(out.stats)
    assert counts[0] > 0 and sum(counts[1:]) > 0, counts  # rejections and acceptances
    if k > 1:
        assert sum(counts[2:]) > 0, counts  # a placeholder slot's draft was accepted


def test_k_beyond_the_depths_is_refused(small, fitted):
    with pytest.raises(ValueError, match="num_depths"):
        sj.generate(small, PROMPTS, draft=fitted,
                    spec=SpecConfig(method="peagle", num_draft_tokens=DEPTHS + 1))
    with pytest.raises(TypeError, match="P-EAGLE head"):
        sj.generate(small, PROMPTS, draft=fitted.eagle3, spec=SpecConfig(method="peagle"))


def test_engine_greedy_equals_plain(small, plain, fitted):
    engine = Engine(small, fitted, EngineConfig(SpecConfig(method="peagle", num_draft_tokens=3,
                                                           page_size=4),
                                                max_slots=4, batch_buckets=(4,),
                                                token_buckets=(8,), max_model_len=48))
    assert engine.generate(PROMPTS, RequestParams(max_tokens=32, stop_token_ids=())) == plain


# ------------------------------------------------------------------------ sampled rows

@pytest.fixture(scope="module")
def dist_setup():
    """V = 6 (exact enumeration) and a random P-EAGLE head that accepts often enough that a
    k = K_DIST step is fully accepted and its bonus sampled."""
    target = tiny_model(11, vocab=V, hidden=16, layers=4, heads=2, kv_heads=1, scale=1.0)
    hc = heads.HeadConfig.for_target(target.config, "eagle3", aux_layers=AUX)
    cfg = peagle.PEagleConfig(hc, mask_token_id=5, num_depths=K_DIST)
    return target, peagle.PEagleHead(peagle.init_params(cfg, jax.random.key(2), scale=0.5), cfg)


def _sample(target, head, seed=0):
    out = sj.generate(target, [PROMPT] * N_ROWS, max_new_tokens=N_DIST, draft=head,
                      temperature=0.9, top_p=0.95, seed=seed, eos_token_id=[],
                      spec=SpecConfig(method="peagle", num_draft_tokens=K_DIST,
                                      draft_sampling=True))
    return cells_of(out.tokens, V), out


def test_sampled_rows_keep_the_target_distribution(dist_setup):
    """Drafts sampled from q (d_1 from depth 0, d_2 from a placeholder slot), min(1, p/q)
    acceptance: k + 2 tokens per row against the exact target distribution."""
    target, head = dist_setup
    cells, out = _sample(target, head)
    assert 0.05 < out.stats["acceptance_rate"] < 0.95
    assert out.stats["per_position_acceptance"][-1] > 0.01  # bonus after full acceptance sampled
    assert _chi2_pvalue(cells, _exact_joint(target, 0.9, 0, 0.95, n=N_DIST)) > ALPHA


def test_biased_residual_fails_the_same_test(dist_setup, monkeypatch):
    """Negative control: resampling from p instead of the residual at a rejection is rejected
    by the test above."""
    target, head = dist_setup
    monkeypatch.setattr(acceptance, "accept_chain", _biased_residual)
    jax.clear_caches()
    try:
        cells, _ = _sample(target, head)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert _chi2_pvalue(cells, _exact_joint(target, 0.9, 0, 0.95, n=N_DIST)) < ALPHA


# ------------------------------------------------------------------------ training

@pytest.mark.slow
def test_training_loss_learns_a_fixed_batch(setup):
    """peagle_loss has finite gradients, a few Adam steps on one batch lower it, and its
    per-depth metrics are present; targets outside the draft vocabulary are left out."""
    _, target, head = setup
    cfg, tp, tcfg = head.config, target.params, target.config
    rng = np.random.RandomState(1)
    tokens = jnp.asarray(rng.randint(3, tcfg.vocab_size, (2, 24)), jnp.int32)
    lengths, plens = jnp.asarray([24, 20], jnp.int32), jnp.asarray([6, 4], jnp.int32)
    aux = peagle.target_features(tp, tcfg, cfg, tokens)
    hidden = jnp.concatenate([jnp.zeros(aux.shape[:2] + (tcfg.hidden_size,)), aux], -1)
    vocab = head.params["draft_vocab"]
    trainable = {k: v for k, v in head.params.items() if k != "draft_vocab"}

    def loss(p):
        return peagle_train.peagle_loss(dict(p, draft_vocab=vocab), tp, tokens, lengths, hidden,
                                        plens, cfg=cfg, target_cfg=tcfg, anchors=6, gamma=4.0,
                                        seed=0)
    _, m = loss(trainable)
    assert set(m) >= {"loss", "acc0", "tau", *(f"acc_d{d}" for d in range(1, K))}
    opt = optax.adam(3e-3)
    st = opt.init(trainable)

    @jax.jit
    def step(p, s):
        (lv, _), g = jax.value_and_grad(loss, has_aux=True)(p)
        return (lv, *opt.update(g, s, p))
    first, params = None, trainable
    for _ in range(15):
        lv, upd, st = step(params, st)
        params = optax.apply_updates(params, upd)
        first = float(lv) if first is None else first
    assert np.isfinite(first) and float(loss(params)[0]) < first - 0.5


# ------------------------------------------------------------------------ speculators layout

def test_speculators_layout_round_trip_and_refusals(setup, tmp_path):
    import json

    from specjax.io import peagle_io
    _, target, head = setup
    peagle_io.save_peagle(head, str(tmp_path / "h"))
    assert peagle_io.is_peagle_dir(tmp_path / "h") and not peagle_io.is_peagle_dir(tmp_path)
    loaded = sj.load_draft(str(tmp_path / "h"), target=target)
    assert isinstance(loaded, peagle.PEagleHead) and loaded.config == head.config
    np.testing.assert_array_equal(sj.draft_logits(target, loaded, IDS),
                                  sj.draft_logits(target, head, IDS))
    with open(tmp_path / "h" / "config.json") as f:
        base = json.load(f)

    def refused(match, **changes):
        d = tmp_path / f"bad{len(list(tmp_path.iterdir()))}"
        d.mkdir()
        (d / "model.safetensors").write_bytes((tmp_path / "h" / "model.safetensors").read_bytes())
        cfg = {k: v for k, v in {**base, **changes}.items() if v is not None}
        (d / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ValueError, match=match):
            peagle_io.load_peagle(d, target.config)

    refused("num_hidden_layers 4", transformer_layer_config=dict(
        base["transformer_layer_config"], num_hidden_layers=4))
    refused("norm_before_residual", norm_before_residual=None)  # absent: speculators' True
    refused("norm_before_fc", norm_before_fc=True)
    refused("mask_token_id", mask_token_id=None)
    refused(r"'fc.weight' has shape", eagle_aux_hidden_state_layer_ids=[1, 2])


@pytest.mark.slow
def test_train_entry_point_resumes_and_exports(setup, tmp_path):
    """``python -m specjax.train.peagle_train`` on a tiny corpus, starting from an EAGLE-3 head
    (--init-from): trains, resumes from its orbax state, exports a head load_draft reads."""
    import gzip
    import json
    import os

    from specjax.io import heads_io
    hf, target, _ = setup
    rng = np.random.RandomState(2)
    for split in ("train", "held"):
        os.makedirs(tmp_path / split)
        with gzip.open(tmp_path / split / "answers-00000.jsonl.gz", "wt") as f:
            for _ in range(6):
                n = int(rng.randint(16, 30))
                f.write(json.dumps({"ids": rng.randint(3, 97, n).tolist(), "prompt_len": 5,
                                    "domain": "chat", "source": "t", "temperature": 0.0}) + "\n")
    hf.save_pretrained(tmp_path / "target")
    hc = heads.HeadConfig.for_target(target.config, "eagle3")  # default aux layers
    heads_io.save_eagle3(heads.Head(heads.init_head(hc, jax.random.key(4)), hc),
                         str(tmp_path / "e3"))
    argv = ["--out", str(tmp_path / "run"), "--model", str(tmp_path / "target"),
            "--corpus", str(tmp_path / "train"), "--held-out-corpus", str(tmp_path / "held"),
            "--shards", "1", "--init-from", str(tmp_path / "e3"), "--depths", "3",
            "--mask-token-id", "5", "--anchors", "3", "--batch-size", "2", "--seq-len", "32",
            "--save-every", "2", "--eval-batches", "1"]
    assert peagle_train.main(argv + ["--steps", "2"]) == 0
    assert peagle_train.main(argv + ["--steps", "4", "--export", str(tmp_path / "out")]) == 0
    with open(tmp_path / "run" / "log.jsonl") as f:
        assert [json.loads(x)["step"] for x in f] == [1, 3]  # the second run resumed at step 2
    head = sj.load_draft(str(tmp_path / "out"), target=target)
    assert isinstance(head, peagle.PEagleHead) and head.config.num_depths == 3
    with open(tmp_path / "run" / "held_out.json") as f:
        assert np.isfinite(json.load(f)["loss"])
