"""EAGLE-3 heads end to end: reference-layout checkpoints for a transformers Llama target, parity of
``sj.draft_logits`` with a torch implementation of the reference forward written here, lossless
greedy chains / trees / engine, the chi-square distribution test, save -> load round trips and
clear errors for checkpoints that do not fit the target.

The target is a tiny transformers ``LlamaForCausalLM`` (8 layers, GQA) whose layers 1..7 only nudge
the residual stream, and the "accepting" head copies the target's layer 0 into its midlayer (with
small random feature weights on top): its drafts agree with the target often but not always, so
the losslessness tests see every accept length, not just rejections.
"""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax.engine import Engine, EngineConfig, RequestParams
from specjax.heads import Head, HeadConfig, init_head
from specjax.io import heads_io
from specjax.tree import TreeConfig
from tests.conftest import tiny_model
from tests.test_api import _HOST_OPS, _lowered_generate
from tests.test_speculative import ALPHA, N_ROWS, PROMPT, V, _chi2_pvalue, _exact_joint, cells_of

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 32, 8, 4, 2, 8, 64
DRAFT_VOCAB = 48
PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12], [4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 2]]
NEW = 24


# ------------------------------------------------------------------------ target and checkpoints

@pytest.fixture(scope="module")
def hf_target(tmp_path_factory):
    """(transformers model, its directory): 8 layers, 4 heads / 2 KV heads, untied lm_head."""
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256,
        tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 2:
                p.normal_(0.0, 0.3)
            else:
                p.uniform_(0.8, 1.2)
        for layer in model.model.layers[1:]:  # later layers nudge the stream (see docstring)
            layer.self_attn.o_proj.weight.mul_(0.15)
            layer.mlp.down_proj.weight.mul_(0.15)
    path = tmp_path_factory.mktemp("llama8")
    model.save_pretrained(path, safe_serialization=True)
    return model, str(path)


@pytest.fixture(scope="module")
def target(hf_target):
    return sj.load_model(hf_target[1])


def _draft_vocab(seed=0):
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(VOCAB, DRAFT_VOCAB, replace=False)).astype(np.int64)


def _reference_state_dict(hf_model, *, accepting: bool, seed: int, vocab=None,
                          with_embed: bool = False):
    """An EAGLE-3 state dict in the reference layout (torch Linear weights [out, in]).

    accepting=False: every weight random. accepting=True: the midlayer copies the target's layer
    0 on the embedding half of its [2E] attention input, small random weights elsewhere.
    """
    g = torch.Generator().manual_seed(seed)
    e, hd, hkvd = HIDDEN, HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    vocab = _draft_vocab(seed) if vocab is None else vocab

    def rnd(*shape, scale=0.3):
        return torch.randn(*shape, generator=g) * scale

    def norm_w():
        return 1.0 + 0.2 * torch.rand(e, generator=g)

    sd = {"fc.weight": rnd(e, 3 * e, scale=0.2), "midlayer.hidden_norm.weight": norm_w(),
          "midlayer.input_layernorm.weight": norm_w(),
          "midlayer.post_attention_layernorm.weight": norm_w(),
          "midlayer.self_attn.q_proj.weight": rnd(hd, 2 * e),
          "midlayer.self_attn.k_proj.weight": rnd(hkvd, 2 * e),
          "midlayer.self_attn.v_proj.weight": rnd(hkvd, 2 * e),
          "midlayer.self_attn.o_proj.weight": rnd(e, hd),
          "midlayer.mlp.gate_proj.weight": rnd(FFN, e), "midlayer.mlp.up_proj.weight": rnd(FFN, e),
          "midlayer.mlp.down_proj.weight": rnd(e, FFN), "norm.weight": norm_w(),
          "lm_head.weight": rnd(len(vocab), e)}
    if accepting:
        with torch.no_grad():
            l0, m = hf_model.model.layers[0], hf_model.model
            sd["fc.weight"] *= 0.05
            sd["midlayer.input_layernorm.weight"] = l0.input_layernorm.weight.clone()
            for n in "qkv":
                w = sd[f"midlayer.self_attn.{n}_proj.weight"] * 0.02
                w[:, :e] = getattr(l0.self_attn, f"{n}_proj").weight
                sd[f"midlayer.self_attn.{n}_proj.weight"] = w
            sd["midlayer.self_attn.o_proj.weight"] = l0.self_attn.o_proj.weight.clone()
            sd["midlayer.post_attention_layernorm.weight"] = l0.post_attention_layernorm.weight.clone()
            for n in ("gate", "up", "down"):
                sd[f"midlayer.mlp.{n}_proj.weight"] = getattr(l0.mlp, f"{n}_proj").weight.clone()
            sd["norm.weight"] = m.norm.weight.clone()
            sd["lm_head.weight"] = hf_model.lm_head.weight[torch.as_tensor(vocab)].clone()
    sd["d2t"] = torch.as_tensor(vocab - np.arange(len(vocab)), dtype=torch.int64)
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[torch.as_tensor(vocab)] = True
    sd["t2d"] = t2d
    if with_embed:
        sd["embed_tokens.weight"] = hf_model.model.embed_tokens.weight.detach().clone()
    return {k: v.detach().contiguous() for k, v in sd.items()}


def _reference_config(layer_ids=None, draft_vocab=DRAFT_VOCAB):
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
           "head_dim": HEAD_DIM, "intermediate_size": FFN, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 256, "num_hidden_layers": 1,
           "vocab_size": VOCAB, "draft_vocab_size": draft_vocab, "target_hidden_size": HIDDEN,
           "hidden_act": "silu", "tie_word_embeddings": False}
    if layer_ids is not None:
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(layer_ids)}
    return cfg


def _write(path, sd, cfg, fmt="safetensors"):
    path.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        save_file(sd, str(path / "model.safetensors"))
    else:
        torch.save(sd, str(path / "pytorch_model.bin"))
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def accepting(hf_target, target, tmp_path_factory):
    """The accepting head loaded from its reference directory: (head, dir)."""
    sd = _reference_state_dict(hf_target[0], accepting=True, seed=1)
    path = _write(tmp_path_factory.mktemp("e3acc"), sd, _reference_config())
    return sj.load_draft(path, target=target), path


@pytest.fixture(scope="module")
def plain(target):
    return sj.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).tokens


# ------------------------------------------------------------------- torch reference forward

def _rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, theta=10000.0):
    """Rotate-half RoPE at positions 0..T-1. x: [T, H, D]."""
    t, _, d = x.shape
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.arange(t, dtype=torch.float64)[:, None] * inv[None]
    ang = torch.cat([ang, ang], -1).float()[:, None, :]
    rot = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * ang.cos() + rot * ang.sin()


def reference_draft_logits(sd, cfg, hf_model, ids):
    """The reference EAGLE-3 forward (SafeAILab/EAGLE ``cnets`` / SpecForge), teacher-forced:
    row j from the target's hidden states at j (``hidden_states[i]`` for the fused layers, ids
    +1 as SpecForge/SGLang capture them) and token j+1 -> [T-1, V] (-inf off the draft vocab)."""
    with torch.no_grad():
        out = hf_model(torch.tensor([ids]), output_hidden_states=True)
        hs = [h[0].float() for h in out.hidden_states]
        n = hf_model.config.num_hidden_layers
        layer_ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        taps = [2, n // 2, n - 3] if layer_ids is None else [i + 1 for i in layer_ids]
        h = torch.cat([hs[i] for i in taps], -1) @ sd["fc.weight"].T  # [T, E]
        emb = sd.get("embed_tokens.weight", hf_model.model.embed_tokens.weight)
        x = h[:-1]
        tokens = emb[torch.tensor(ids[1:])]
        eps = cfg["rms_norm_eps"]
        t, hh, hkv, d = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        inp = torch.cat([_rms(tokens, sd["midlayer.input_layernorm.weight"], eps),
                         _rms(x, sd["midlayer.hidden_norm.weight"], eps)], -1)  # embedding first
        q = _rope((inp @ sd["midlayer.self_attn.q_proj.weight"].T).view(t, hh, d))
        k = _rope((inp @ sd["midlayer.self_attn.k_proj.weight"].T).view(t, hkv, d))
        v = (inp @ sd["midlayer.self_attn.v_proj.weight"].T).view(t, hkv, d)
        k, v = k.repeat_interleave(hh // hkv, 1), v.repeat_interleave(hh // hkv, 1)
        s = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
        s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        o = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(t, hh * d)
        x = x + o @ sd["midlayer.self_attn.o_proj.weight"].T
        y = _rms(x, sd["midlayer.post_attention_layernorm.weight"], eps)
        y = torch.nn.functional.silu(y @ sd["midlayer.mlp.gate_proj.weight"].T) * (
            y @ sd["midlayer.mlp.up_proj.weight"].T)
        x = x + y @ sd["midlayer.mlp.down_proj.weight"].T
        compact = _rms(x, sd["norm.weight"], eps) @ sd["lm_head.weight"].T  # [T-1, Vd]
        full = torch.full((t, cfg["vocab_size"]), float("-inf"))
        full[:, torch.arange(compact.shape[1]) + sd["d2t"]] = compact
    return full.numpy()


def _assert_parity(got, want, vocab):
    on = np.asarray(vocab)
    rel = np.abs(got[:, on] - want[:, on]).max() / np.abs(want[:, on]).max()
    assert rel <= 1e-4, rel
    off = np.setdiff1d(np.arange(VOCAB), on)
    assert np.all(got[:, off] <= -1e9)


# ------------------------------------------------------------------------------- parity, I/O

IDS = [3, 17, 42, 8, 8, 61, 0, 25, 33, 12, 5, 49, 7]


@pytest.mark.parametrize("fmt,layer_ids,with_embed", [
    ("safetensors", None, False), ("bin", [1, 3, 4], True)])
def test_draft_logits_match_the_torch_reference(hf_target, target, tmp_path, fmt, layer_ids,
                                                with_embed):
    """Random head, reduced draft vocabulary, default and explicit fused layers (SpecForge ids
    [1, 3, 4] = hidden_states [2, 4, 5]), safetensors and pytorch_model.bin, own embedding."""
    sd = _reference_state_dict(hf_target[0], accepting=False, seed=7, with_embed=with_embed)
    cfg = _reference_config(layer_ids)
    head = sj.load_draft(_write(tmp_path / "h", sd, cfg, fmt), target=target)
    assert head.config.kind == "eagle3" and head.config.aux_layers == (2, 4, 5)
    assert head.config.draft_vocab_size == DRAFT_VOCAB
    assert "embed" not in head.params  # equal to the target's: shared, not copied
    got = sj.draft_logits(target, head, IDS)
    assert got.shape == (len(IDS) - 1, VOCAB) and got.dtype == np.float32
    _assert_parity(got, reference_draft_logits(sd, cfg, hf_target[0], IDS), _draft_vocab(7))


def test_explicit_layer_ids_follow_the_specforge_convention(hf_target, target, tmp_path):
    """ids [2, 4, 5] name layer outputs: hidden_states [3, 5, 6], not the default taps."""
    sd = _reference_state_dict(hf_target[0], accepting=False, seed=7)
    cfg = _reference_config([2, 4, 5])
    head = sj.load_draft(_write(tmp_path / "h", sd, cfg), target=target)
    assert head.config.aux_layers == (3, 5, 6)
    got = sj.draft_logits(target, head, IDS)
    _assert_parity(got, reference_draft_logits(sd, cfg, hf_target[0], IDS), _draft_vocab(7))
    default = sj.draft_logits(target, sj.load_draft(_write(tmp_path / "d", sd, _reference_config()),
                                                    target=target), IDS)
    assert np.abs(default - got).max() > 1e-3  # the offset matters


def test_save_load_round_trip_and_torch_reference_reads_ours(hf_target, target, accepting,
                                                             tmp_path):
    head, _ = accepting
    heads_io.save_eagle3(head, str(tmp_path / "out"))
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]
    assert cfg["draft_vocab_size"] == DRAFT_VOCAB
    back = sj.load_draft(str(tmp_path / "out"), target=target)
    assert back.config == head.config
    flat, tree = jax.tree.flatten(head.params)
    flat2, tree2 = jax.tree.flatten(back.params)
    assert tree == tree2
    for a, b in zip(flat, flat2):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    sd = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    _assert_parity(sj.draft_logits(target, head, IDS),
                   reference_draft_logits(sd, cfg, hf_target[0], IDS), _draft_vocab(1))
    # the CLI: a reference directory -> a specjax head checkpoint -> the reference layout again
    from specjax import cli
    assert cli.main(["convert", accepting[1], str(tmp_path / "ck"), "--target", hf_target[1],
                     "--no-progress"]) == 0
    assert cli.main(["convert", str(tmp_path / "ck"), str(tmp_path / "hf"), "--to", "hf",
                     "--target", hf_target[1], "--no-progress"]) == 0
    for name in ("fc.weight", "lm_head.weight", "d2t", "t2d"):
        assert torch.equal(load_file(str(tmp_path / "hf" / "model.safetensors"))[name], sd[name])
    # float16 on disk (half the size): the same head up to float16 rounding
    heads_io.save_eagle3(head, str(tmp_path / "half"), dtype="float16")
    assert load_file(str(tmp_path / "half" / "model.safetensors"))["fc.weight"].dtype == torch.float16
    half = sj.load_draft(str(tmp_path / "half"), target=target)
    np.testing.assert_allclose(sj.draft_logits(target, half, IDS), sj.draft_logits(target, head, IDS),
                               atol=2e-2)
    with pytest.raises(ValueError, match="dtype"):
        heads_io.save_eagle3(head, str(tmp_path / "bad"), dtype="int8")
    # our own format too
    heads_io.save_head(head, str(tmp_path / "ours"))
    ours = sj.load_draft(str(tmp_path / "ours"), target=target)
    assert ours.config == head.config
    np.testing.assert_array_equal(sj.draft_logits(target, ours, IDS),
                                  sj.draft_logits(target, head, IDS))


def test_bad_checkpoints_name_the_tensor(hf_target, target, tmp_path):
    base = _reference_state_dict(hf_target[0], accepting=False, seed=7)

    def load(sd=None, cfg=None, name="h"):
        return sj.load_draft(_write(tmp_path / name, base if sd is None else sd,
                                    cfg or _reference_config()), target=target)

    with pytest.raises(ValueError, match=r"'fc.weight' has shape \(32, 90\), expected \(32, 96\)"):
        load(dict(base, **{"fc.weight": base["fc.weight"][:, :90].contiguous()}), name="a")
    with pytest.raises(ValueError, match=r"missing tensors \['midlayer.hidden_norm.weight'\]"):
        load({k: v for k, v in base.items() if k != "midlayer.hidden_norm.weight"}, name="b")
    bad = base["d2t"].clone()
    bad[-1] = VOCAB
    with pytest.raises(ValueError, match="d2t maps draft id 47 to target id"):
        load(dict(base, d2t=bad), name="c")
    with pytest.raises(ValueError, match=r"'d2t' has shape \(48,\), expected \(40,\)"):
        load(cfg=_reference_config(draft_vocab=40), name="d")
    with pytest.raises(ValueError, match="vocab_size 65 != the target's vocab_size 64"):
        load(cfg=dict(_reference_config(), vocab_size=65), name="e")
    with pytest.raises(ValueError, match="target_hidden_size 48 != the target's hidden_size 32"):
        load(cfg=dict(_reference_config(), target_hidden_size=48), name="f")
    with pytest.raises(ValueError, match=r"'lm_head.weight' has shape \(48, 16\), expected \(48, 32\)"):
        load(dict(base, **{"lm_head.weight": base["lm_head.weight"][:, :16].contiguous()}),
             name="g")
    with pytest.raises(ValueError, match=r"fused layers \(2, 4, 9\)"):
        load(cfg=_reference_config([1, 3, 8]), name="i")


# ------------------------------------------------------------------------------ losslessness

@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 3,
                               pytest.param(5, marks=pytest.mark.slow)])
def test_greedy_eagle3_chain_equals_plain(target, plain, accepting, k):
    out = sj.generate(target, PROMPTS, max_new_tokens=NEW, draft=accepting[0], method="eagle3",
                      num_draft_tokens=k, eos_token_id=[])
    assert out.tokens == plain
    per_pos = out.stats["per_position_acceptance"]
    assert 0.3 < per_pos[0] < 1.0  # drafts accepted often, rejected sometimes
    if k > 1:
        assert per_pos[1] > 0.0  # an accept length beyond 1 occurred


@pytest.mark.parametrize("tc", [TreeConfig(depth=3, top_k=2, num_nodes=6),
                                pytest.param(TreeConfig(kind="static", parents=(0, 0, 1, 1, 2, 3)),
                                             marks=pytest.mark.slow)],
                         ids=["dynamic", "static"])
def test_greedy_eagle3_tree_equals_plain(target, plain, accepting, tc):
    out = sj.generate(target, PROMPTS, max_new_tokens=NEW, draft=accepting[0], method="eagle-tree",
                      tree=tc, eos_token_id=[])
    assert out.tokens == plain
    assert out.stats["per_position_acceptance"][1] > 0.0


def test_no_host_sync_inside_the_loop(monkeypatch, target, accepting):
    """The whole eagle3 generation lowers to one program with no host callback, outfeed or
    send/recv in it (tests/test_api.py's check; a stray jax.debug.print fails it)."""
    text = _lowered_generate(monkeypatch, target, draft=accepting[0], method="eagle3",
                             num_draft_tokens=3)
    assert not _HOST_OPS.findall(text)


def test_engine_with_an_eagle3_head_equals_plain(target, plain, accepting):
    engine = Engine(target, accepting[0], EngineConfig(
        sj.SpecConfig(method="eagle3", num_draft_tokens=3, page_size=4), max_slots=4,
        batch_buckets=(4,), token_buckets=(8,), max_model_len=48))
    handles = [engine.submit(p, RequestParams(max_tokens=NEW, stop_token_ids=())) for p in PROMPTS]
    engine.run()
    assert [h.result() for h in handles] == plain
    assert engine.stats()["acceptance_rate"] > 0.1


def test_method_checks(target, accepting):
    mtp = HeadConfig.for_target(target.config, "mtp")
    with pytest.raises(ValueError, match="got a 'mtp' head"):
        sj.generate(target, [[1]], draft=Head(init_head(mtp, jax.random.key(0)), mtp),
                    method="eagle3")
    with pytest.raises(ValueError, match="got a 'eagle3' head"):
        sj.generate(target, [[1]], draft=accepting[0], method="mtp")
    with pytest.raises(ValueError, match="aux_layers must be given exactly for kind 'eagle3'"):
        dataclasses.replace(accepting[0].config, aux_layers=())
    with pytest.raises(ValueError, match="at least 2 tokens"):
        sj.draft_logits(target, accepting[0], [1])


# ----------------------------------------------------------------- distribution (chi-square)

@pytest.fixture(scope="module")
def dist_head():
    """A 2-layer V=6 target and a random EAGLE-3 head fusing hidden_states (0, 1, 2), drafting
    from 4 of the 6 tokens."""
    target = tiny_model(11, vocab=V, hidden=16, layers=2, heads=2, kv_heads=1, scale=1.0)
    cfg = dataclasses.replace(HeadConfig.for_target(target.config, "eagle3", aux_layers=(0, 1, 2)),
                              draft_vocab_size=4)
    params = init_head(cfg, jax.random.key(5), scale=1.0)
    params["draft_vocab"] = jnp.asarray([0, 1, 3, 4], jnp.int32)
    return target, Head(params, cfg)


def _first3(target, head, **kw):
    """k + 2 = 4 tokens per row (first token, a fully accepted step, its bonus)."""
    out = sj.generate(target, [PROMPT] * N_ROWS, max_new_tokens=4, draft=head, method="eagle3",
                      num_draft_tokens=2, temperature=1.0, eos_token_id=[], **kw)
    return cells_of(out.tokens, V), out


def test_sampled_eagle3_follows_the_target_distribution(dist_head):
    target, head = dist_head
    cells, out = _first3(target, head, draft_sampling=True)
    assert 0.01 < out.stats["acceptance_rate"] < 0.99
    assert out.stats["per_position_acceptance"][-1] > 0.01  # bonus after full acceptance sampled
    assert _chi2_pvalue(cells, _exact_joint(target, 1.0, 0, 1.0, n=4)) > ALPHA


@pytest.mark.slow
def test_biased_acceptance_fails_with_an_eagle3_head(dist_head, monkeypatch):
    """Negative control: the same test rejects a subtly wrong residual."""
    from specjax import acceptance
    from tests.test_speculative import _biased_residual

    target, head = dist_head
    monkeypatch.setattr(acceptance, "accept_chain", _biased_residual)
    jax.clear_caches()
    try:
        cells, _ = _first3(target, head, draft_sampling=True)
    finally:
        monkeypatch.undo()
        jax.clear_caches()
    assert _chi2_pvalue(cells, _exact_joint(target, 1.0, 0, 1.0, n=4)) < ALPHA


def _deepseek_and_gemma_targets():
    from specjax import registry  # noqa: PLC0415
    from specjax.deepseek import DeepseekConfig  # noqa: PLC0415
    from specjax.gemma import Gemma3Config  # noqa: PLC0415

    ds = DeepseekConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                        moe_intermediate_size=16, num_layers=4, num_heads=4, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4)
    gm = Gemma3Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=4,
                      num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=512,
                      sliding_window=4, layer_types=("sliding_attention",) * 3 + ("full_attention",))
    return [sj.Model(registry.init_params(c, jax.random.key(1), scale=0.3), c) for c in (ds, gm)]


def test_new_eagle3_head_for_a_deepseek_or_gemma_target_is_a_llama_midlayer():
    """HeadConfig.for_target(kind="eagle3") for a DeepSeek target used to copy the target's MLA
    block config, and init_head then died with AttributeError (no head_dim); a Gemma 3 target
    gave a Gemma block that the midlayer (a Llama layer, as load_eagle3 reads) does not run.
    Now the midlayer is a ModelConfig of the target's sizes (P-EAGLE's too)."""
    from specjax import peagle  # noqa: PLC0415

    for target in _deepseek_and_gemma_targets():
        cfg = HeadConfig.for_target(target.config, "eagle3")
        assert type(cfg.layer) is sj.ModelConfig and cfg.layer.num_layers == 1
        assert cfg.layer.hidden_size == target.config.hidden_size
        head = Head(init_head(cfg, jax.random.key(0)), cfg)
        ph = peagle.from_eagle3(head, mask_token_id=3, num_depths=3, key=jax.random.key(2))
        assert type(ph.config.layer) is sj.ModelConfig


@pytest.mark.slow
def test_new_eagle3_head_drafts_losslessly_for_deepseek():
    ds, _ = _deepseek_and_gemma_targets()
    cfg = HeadConfig.for_target(ds.config, "eagle3")
    head = Head(init_head(cfg, jax.random.key(0), scale=0.3), cfg)
    prompts = [[5, 9, 13, 5, 9], [7, 3, 3, 8]]
    plain = sj.generate(ds, prompts, max_new_tokens=6, eos_token_id=[]).tokens
    out = sj.generate(ds, prompts, max_new_tokens=6, draft=head, method="eagle3",
                      num_draft_tokens=2, eos_token_id=[])
    assert out.tokens == plain and out.stats["drafted_tokens"] > 0
