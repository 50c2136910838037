"""DFlash block drafter: the forward against an independent torch reference written from the
published semantics (z-lab/dflash), the incremental context cache, the training pass, and the
published layout's round trip and refusals."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specjax as sj
from specjax import dflash
from specjax.io import dflash_io
from tests import hf_families

L_TARGET = 4
IDS = (0, 2)  # outputs of target layers 0 and 2 (HF hidden_states[1], [3])
BLOCK = 4
MASK = 5


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    hf = hf_families.build("qwen3", str(root / "target"), seed=3, num_hidden_layers=L_TARGET)
    target = sj.load_model(str(root / "target"))
    tc = target.config
    cfg = dflash.DFlashConfig(num_layers=2, hidden_size=tc.hidden_size, num_heads=4, num_kv_heads=2,
                              head_dim=8, intermediate_size=40, block_size=BLOCK, mask_token_id=MASK,
                              target_layer_ids=IDS, target_hidden_size=tc.hidden_size,
                              vocab_size=tc.vocab_size, rope_theta=10000.0)
    params = dflash.init_params(cfg, jax.random.key(1), scale=0.2)
    rng = np.random.RandomState(0)
    params = jax.tree.map(lambda a: a + 0.2 * rng.randn(*a.shape).astype(np.float32)
                          if a.ndim == 1 else a, params)  # norms off 1 so every weight matters
    head = dflash.DFlashHead(params=params, config=cfg)
    dflash_io.save_dflash(head, str(root / "head"), num_target_layers=L_TARGET)
    return hf, target, head, str(root / "head")


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, pos, theta):  # x [T, heads, D], rotate-half
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rot * sin


def reference_block(hf, head_dir, ids):
    """Torch float64 DFlash forward from the published tensors and semantics: [B-1, V]."""
    from safetensors.torch import load_file
    w = {k: v.double() for k, v in load_file(os.path.join(head_dir, "model.safetensors")).items()}
    with open(os.path.join(head_dir, "config.json")) as f:
        c = json.load(f)
    dc, bs = c["dflash_config"], c["block_size"]
    nh, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    ids = torch.tensor(ids)
    n = len(ids) - 1
    with torch.no_grad():
        hs = hf.double()(ids[None, :n], output_hidden_states=True).hidden_states
        emb = hf.get_input_embeddings().weight.double().clone()
        out_w = hf.get_output_embeddings().weight.double().clone()
        hf.float()
    feats = torch.cat([hs[i + 1][0] for i in dc["target_layer_ids"]], -1)  # [n, A*E]
    ctx = _rms(feats @ w["fc.weight"].T, w["hidden_norm.weight"])
    x = emb[torch.tensor([int(ids[-1])] + [dc["mask_token_id"]] * (bs - 1))]  # [B, E]
    qpos, kpos = torch.arange(n, n + bs), torch.arange(n + bs)
    for i in range(c["num_hidden_layers"]):
        def p(s, i=i):
            return w[f"layers.{i}.{s}"]
        y = _rms(x, p("input_layernorm.weight"))
        q = _rms((y @ p("self_attn.q_proj.weight").T).view(bs, nh, d), p("self_attn.q_norm.weight"))
        kin = torch.cat([ctx, y], 0)  # context not input-normed
        k = _rms((kin @ p("self_attn.k_proj.weight").T).view(-1, nkv, d), p("self_attn.k_norm.weight"))
        v = (kin @ p("self_attn.v_proj.weight").T).view(-1, nkv, d)
        q, k = _rope(q, qpos, c["rope_theta"]), _rope(k, kpos, c["rope_theta"])
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d ** 0.5, -1)  # no mask at all
        o = torch.einsum("hqk,khd->qhd", att, v).reshape(bs, nh * d)
        x = x + o @ p("self_attn.o_proj.weight").T
        y = _rms(x, p("post_attention_layernorm.weight"))
        x = x + (torch.nn.functional.silu(y @ p("mlp.gate_proj.weight").T)
                 * (y @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
    return (_rms(x, w["norm.weight"]) @ out_w.T)[1:].numpy()


def test_block_logits_match_torch_reference(setup):
    hf, target, head, head_dir = setup
    ids = [7, 3, 11, 40, 2, 9, 17, 23, 60]
    got = dflash.block_logits(target, head, ids)
    want = reference_block(hf, head_dir, ids)
    assert got.shape == (BLOCK - 1, target.config.vocab_size)
    # float32 against a float64 reference: 1e-4 of the logits' scale
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
    # the anchor matters, and so does the context (a real property, not a constant output)
    other = dflash.block_logits(target, head, ids[:-1] + [61])
    assert np.abs(other - got).max() > 1e-3
    other = dflash.block_logits(target, head, [8] + ids[1:])
    assert np.abs(other - got).max() > 1e-3


def test_incremental_context_cache_matches_whole_context(setup):
    _, target, head, _ = setup
    cfg, tp, tcfg = head.config, target.params, target.config
    ids = np.array([7, 3, 11, 40, 2, 9, 17, 23, 60, 5, 31], np.int32)
    n = len(ids) - 1
    feats = dflash.target_features(tp, tcfg, cfg, jnp.asarray(ids[None, :n]))
    c = dflash.fuse(head.params, cfg, feats)  # [1, n, H]
    s, pmax = 4, 6
    table = jnp.asarray([[5, 2, 7, 0, 3, 1]], jnp.int32)  # scattered pages
    cache = dflash.init_cache(cfg, 8, s)
    start = 0
    for chunk in (3, 1, 1, 4, 1):  # context written in chunks and one token at a time
        cache = dflash.write_context(head.params, cfg, cache, c[:, start:start + chunk], table,
                                     jnp.asarray([start], jnp.int32))
        start += chunk
    assert start == n and pmax * s >= n + cfg.block_size
    got = dflash.draft_block(head.params, cfg, tp, tcfg, cache, table, jnp.asarray(ids[None, n]),
                             jnp.asarray([n], jnp.int32))
    want = dflash.block_logits(target, head, ids)
    np.testing.assert_allclose(np.asarray(got)[0], want, rtol=0, atol=1e-5 * np.abs(want).max())
    # a padded write (num_new) writes nothing past num_new: a poisoned tail changes nothing
    cache2 = dflash.init_cache(cfg, 8, s)
    pad = jnp.concatenate([c, jnp.full((1, 2, c.shape[2]), 1e3)], axis=1)
    cache2 = dflash.write_context(head.params, cfg, cache2, pad, table, jnp.zeros((1,), jnp.int32),
                                  num_new=jnp.asarray([n], jnp.int32))
    got2 = dflash.draft_block(head.params, cfg, tp, tcfg, cache2, table,
                              jnp.asarray(ids[None, n]), jnp.asarray([n], jnp.int32))
    np.testing.assert_allclose(np.asarray(got2)[0], want, rtol=0, atol=1e-5 * np.abs(want).max())


def test_training_pass_matches_block_drafts(setup):
    """train_logits' blocks (many anchors in one dense pass) = draft_block at each anchor."""
    _, target, head, _ = setup
    cfg, tp, tcfg = head.config, target.params, target.config
    ids = np.array([7, 3, 11, 40, 2, 9, 17, 23, 60, 5, 31, 44], np.int32)
    feats = dflash.target_features(tp, tcfg, cfg, jnp.asarray(ids[None]))
    anchors = np.array([[2, 9, 5]], np.int32)
    got = np.asarray(dflash.train_logits(head.params, cfg, tp, tcfg, jnp.asarray(ids[None]), feats,
                                         jnp.asarray(anchors)))
    assert got.shape == (1, 3, BLOCK - 1, tcfg.vocab_size)
    for j, a in enumerate(anchors[0]):
        want = dflash.block_logits(target, head, ids[:a + 1])
        np.testing.assert_allclose(got[0, j], want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_save_load_round_trip_exact(setup, tmp_path):
    _, target, head, head_dir = setup
    loaded = dflash_io.load_dflash(head_dir, target.config)
    assert loaded.config == head.config
    for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(loaded.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert jax.tree.structure(head.params) == jax.tree.structure(loaded.params)
    assert dflash_io.is_dflash_dir(head_dir) and not dflash_io.is_dflash_dir(str(tmp_path))
    dflash_io.save_dflash(loaded, str(tmp_path / "again"), num_target_layers=L_TARGET)
    with open(os.path.join(head_dir, "config.json")) as f1, \
            open(tmp_path / "again" / "config.json") as f2:
        assert json.load(f1) == json.load(f2)


def _rewrite(src, dst, tensors=None, config=None):
    from safetensors.numpy import load_file, save_file
    os.makedirs(dst, exist_ok=True)
    t = load_file(os.path.join(src, "model.safetensors"))
    t = tensors(t) if tensors else t
    save_file(t, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f:
        c = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config(c) if config else c, f)
    return dst


def test_mismatches_and_unsupported_heads_are_refused(setup, tmp_path):
    _, target, _, head_dir = setup
    tc = target.config

    def bad_k(t):
        t["layers.1.self_attn.k_proj.weight"] = t["layers.1.self_attn.k_proj.weight"][:8]
        return t
    with pytest.raises(ValueError, match=r"layers\.1\.self_attn\.k_proj\.weight.*\(8, 32\).*\(16, 32\)"):
        dflash_io.load_dflash(_rewrite(head_dir, tmp_path / "k", bad_k), tc)

    def bad_fc(t):
        t["fc.weight"] = np.concatenate([t["fc.weight"]] * 2, axis=1)[:, :96]
        return t
    with pytest.raises(ValueError, match=r"fc\.weight.*\(32, 96\).*\(32, 64\)"):
        dflash_io.load_dflash(_rewrite(head_dir, tmp_path / "fc", bad_fc), tc)

    def extra(t):
        t["candidate_selector.hidden_projection.weight"] = np.zeros((4, 32), np.float32)
        return t
    with pytest.raises(ValueError, match="candidate_selector.hidden_projection.weight"):
        dflash_io.load_dflash(_rewrite(head_dir, tmp_path / "x", extra), tc)

    def mask_out(c):
        c["dflash_config"]["mask_token_id"] = tc.vocab_size
        return c
    with pytest.raises(ValueError, match="mask_token_id"):
        dflash_io.load_dflash(_rewrite(head_dir, tmp_path / "m", config=mask_out), tc)

    def sliding(c):
        c["layer_types"] = ["sliding_attention", "full_attention"]
        return c
    with pytest.raises(ValueError, match="sliding_attention"):
        dflash_io.load_dflash(_rewrite(head_dir, tmp_path / "s", config=sliding), tc)

    def dflash2(c):
        c["architectures"] = ["DFlash2DraftModel"]
        return c
    with pytest.raises(ValueError, match="DFlash2DraftModel"):
        dflash_io.load_dflash(_rewrite(head_dir, tmp_path / "d2", config=dflash2), tc)

    import dataclasses
    with pytest.raises(ValueError, match=r"fc\.weight.*hidden size 48"):  # another width
        dflash_io.load_dflash(head_dir, dataclasses.replace(tc, hidden_size=48))
    with pytest.raises(ValueError, match="num_target_layers"):
        dflash_io.load_dflash(head_dir, dataclasses.replace(tc, num_layers=6))


def test_optional_output_keys_are_honoured(setup):
    _, target, head, _ = setup
    import dataclasses
    ids = [7, 3, 11, 40, 2]
    base = dflash.block_logits(target, head, ids)
    cap = dataclasses.replace(head.config, output_multiplier=2.0, final_logit_softcapping=0.5)
    got = dflash.block_logits(target, dflash.DFlashHead(head.params, cap), ids)
    np.testing.assert_allclose(got, np.tanh(base * 2.0 / 0.5) * 0.5, rtol=1e-5, atol=1e-6)


def test_training_loss_learns_a_fixed_batch(setup):
    """The DFlash loss (random anchors among answer tokens, weighted CE) has finite gradients and
    a few Adam steps on one batch lower it; anchors never fall in the prompt."""
    import optax

    from specjax.train import dflash_train
    _, target, head, _ = setup
    cfg, tp, tcfg = head.config, target.params, target.config
    rng = np.random.RandomState(1)
    tokens = jnp.asarray(rng.randint(3, tcfg.vocab_size, (2, 24)), jnp.int32)
    lengths, plens = jnp.asarray([24, 20], jnp.int32), jnp.asarray([6, 4], jnp.int32)
    feats = dflash.target_features(tp, tcfg, cfg, tokens)
    hidden = jnp.concatenate([jnp.zeros(feats.shape[:2] + (tcfg.hidden_size,)), feats], -1)
    anc, ok = dflash_train.sample_anchors(jax.random.key(0), lengths, plens, 24, 8)
    a = np.asarray(anc)[np.asarray(ok)].reshape(2, -1)
    assert (a >= np.asarray(plens)[:, None]).all() and (a + 1 < np.asarray(lengths)[:, None]).all()

    def loss(p):
        return dflash_train.dflash_loss(p, tp, tokens, lengths, hidden, plens, cfg=cfg,
                                        target_cfg=tcfg, anchors=6, gamma=4.0, seed=0)[0]
    opt = optax.adam(3e-3)
    params, st = head.params, opt.init(head.params)
    @jax.jit
    def step(p, s):
        lv, g = jax.value_and_grad(loss)(p)
        return (lv, *opt.update(g, s, p))
    first = None
    for _ in range(15):
        lv, upd, st = step(params, st)
        params = optax.apply_updates(params, upd)
        first = float(lv) if first is None else first
    assert np.isfinite(first) and float(loss(params)) < first - 0.5


def _write_corpus(root, rows: int = 8, seed: int = 2):
    """A tiny distilled corpus (train / held shards of random answers) under root."""
    import gzip
    rng = np.random.RandomState(seed)
    for split in ("train", "held"):
        os.makedirs(root / split)
        with gzip.open(root / split / "answers-00000.jsonl.gz", "wt") as f:
            for _ in range(rows):
                n = int(rng.randint(20, 40))
                f.write(json.dumps({"ids": rng.randint(3, 97, n).tolist(), "prompt_len": 6,
                                    "domain": "chat", "source": "t", "temperature": 0.0}) + "\n")


def test_train_entry_point_resumes_and_exports(setup, tmp_path):
    """``python -m specjax.train.dflash_train`` on a tiny corpus: trains, resumes from its orbax
    state with more steps, and exports a drafter the published-layout loader reads back."""
    from specjax.train import dflash_train
    hf, target, _, _ = setup
    _write_corpus(tmp_path)
    hf.save_pretrained(tmp_path / "target")
    argv = ["--out", str(tmp_path / "run"), "--model", str(tmp_path / "target"),
            "--corpus", str(tmp_path / "train"), "--held-out-corpus", str(tmp_path / "held"),
            "--shards", "1", "--layers", "1", "--block-size", "4", "--target-layer-ids", "0,2",
            "--mask-token-id", "5", "--anchors", "4", "--batch-size", "2", "--seq-len", "48",
            "--save-every", "3", "--eval-batches", "2"]
    assert dflash_train.main(argv + ["--steps", "3"]) == 0
    with open(tmp_path / "run" / "log.jsonl") as f:
        assert [json.loads(x)["step"] for x in f] == [1]
    assert dflash_train.main(argv + ["--steps", "6", "--export", str(tmp_path / "out")]) == 0
    with open(tmp_path / "run" / "log.jsonl") as f:
        steps = [json.loads(x)["step"] for x in f]
    assert steps == [1, 4], steps  # the second run resumed at step 3
    head = dflash_io.load_dflash(tmp_path / "out", target.config)
    assert head.config.block_size == 4 and head.config.target_layer_ids == (0, 2)
    with open(tmp_path / "run" / "held_out.json") as f:
        assert np.isfinite(json.load(f)["loss"])


def test_train_head_cli_trains_block_drafters(setup, tmp_path, capsys):
    """``specjax train-head --kind dflash|peagle``: the CLI runs the block drafters' trainers
    (features under --work, the run under --work/run-KIND, the drafter written to --out, read
    back by load_draft); flags the other kind or the MTP / EAGLE heads read are refused by name
    before any work."""
    from specjax import cli, peagle
    hf, target, _, _ = setup
    _write_corpus(tmp_path)
    hf.save_pretrained(tmp_path / "target")
    base = ["train-head", "--model", str(tmp_path / "target"), "--work", str(tmp_path / "w"),
            "--corpus", str(tmp_path / "train"), "--held-out-corpus", str(tmp_path / "held"),
            "--shards", "1", "--mask-token-id", "5", "--anchors", "3", "--batch-size", "2",
            "--seq-len", "40", "--steps", "2", "--save-every", "2"]
    assert cli.main(base + ["--kind", "dflash", "--out", str(tmp_path / "d"), "--block-size", "4",
                            "--target-layer-ids", "0,2"]) == 0
    head = sj.load_draft(str(tmp_path / "d"), target=target)
    assert isinstance(head, dflash.DFlashHead) and head.config.block_size == 4
    assert os.path.exists(tmp_path / "w" / "run-dflash" / "log.jsonl")
    assert cli.main(base + ["--kind", "peagle", "--out", str(tmp_path / "p"), "--depths", "3"]) == 0
    head = sj.load_draft(str(tmp_path / "p"), target=target)
    assert isinstance(head, peagle.PEagleHead) and head.config.num_depths == 3
    capsys.readouterr()
    for kind, bad, msg in [("dflash", ["--rollout", "2"], "--rollout not read by --kind dflash"),
                           ("dflash", ["--depths", "3"], "--depths not read by --kind dflash"),
                           ("peagle", ["--block-size", "16"], "--block-size not read by --kind peagle"),
                           ("peagle", ["--corpus", "x"], "--corpus needs --held-out-corpus"),
                           ("mtp", ["--block-size", "16"], "only read by --kind dflash / peagle")]:
        argv = ["train-head", "--model", "unused", "--out", "unused", "--kind", kind, *bad]
        assert cli.main(argv) == 2
        assert msg in capsys.readouterr().err


def test_drafter_config_for_a_deepseek_target():
    """train.dflash_train.drafter_config read the target's head_dim, which a DeepSeek (MLA)
    config lacks (AttributeError); it now takes the Llama widths of heads.llama_block_config,
    unchanged for a Llama target."""
    from specjax.deepseek import DeepseekConfig  # noqa: PLC0415
    from specjax.train.dflash_train import drafter_config  # noqa: PLC0415

    ds = DeepseekConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                        moe_intermediate_size=16, num_layers=6, num_heads=4, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4)
    dc = drafter_config(ds, block_size=4, mask_token_id=3)
    dc.check_target(ds)
    assert (dc.hidden_size, dc.num_heads, dc.head_dim) == (32, 4, 8)
    llama = sj.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=6,
                           num_heads=4, num_kv_heads=2, head_dim=16)
    dc = drafter_config(llama, block_size=4, mask_token_id=3)
    assert (dc.num_kv_heads, dc.head_dim, dc.intermediate_size) == (2, 16, 48)
