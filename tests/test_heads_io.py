"""Draft-head checkpoint IO: EAGLE-1 (SafeAILab layout), DeepSeek-V3 MTP names, our orbax format.

Checkpoints are built here, for a tiny Llama target: the EAGLE-1 one from a torch module with the
layout of EAGLE's ``cnets1.Model`` (embed_tokens, fc with bias, one transformers LlamaDecoderLayer
whose input_layernorm is an Identity), which also serves as the reference forward.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from safetensors.numpy import load_file, save_file  # noqa: E402
from transformers import LlamaConfig  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaDecoderLayer,
    LlamaRotaryEmbedding,
)

from specjax import kv_cache  # noqa: E402
from specjax.heads import Head, HeadConfig, head_forward, head_logits, init_head  # noqa: E402
from specjax.io import heads_io  # noqa: E402
from specjax.io.checkpoint import save_checkpoint  # noqa: E402
from specjax.io.hf import save_hf_dir  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402

T = 7  # tokens in the forward comparison


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


def _hf_config(cfg):
    hf = LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                     intermediate_size=cfg.intermediate_size, num_hidden_layers=1,
                     num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                     head_dim=cfg.head_dim, rms_norm_eps=cfg.rms_norm_eps,
                     max_position_embeddings=cfg.max_position_embeddings)
    hf._attn_implementation = "eager"
    return hf


class _Eagle1(torch.nn.Module):
    """An EAGLE-1 head with cnets1's parameter names (its state dict is the checkpoint)."""

    def __init__(self, hf_cfg, embed, bias=True):
        super().__init__()
        e = hf_cfg.hidden_size
        self.embed_tokens = torch.nn.Embedding(hf_cfg.vocab_size, e)
        self.embed_tokens.weight.data = torch.tensor(np.asarray(embed))
        self.fc = torch.nn.Linear(2 * e, e, bias=bias)
        self.layers = torch.nn.ModuleList([LlamaDecoderLayer(hf_cfg, 0)])
        self.layers[0].input_layernorm = torch.nn.Identity()  # EAGLE-1: no input norm in layer 0
        g = torch.Generator().manual_seed(0)
        for name, p in self.named_parameters():
            if name != "embed_tokens.weight":
                p.data = (1.0 if "norm" in name else 0.0) + 0.3 * torch.randn(p.shape, generator=g)
        self._rope = [LlamaRotaryEmbedding(hf_cfg)]  # a list: keeps it out of the state dict

    def forward(self, tokens, features):
        x = self.fc(torch.cat((self.embed_tokens(tokens), features), dim=-1))  # EAGLE-1's order
        t = tokens.shape[1]
        pos = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        return self.layers[0](x, attention_mask=mask, position_ids=pos,
                              position_embeddings=self._rope[0](x, pos))


def _eagle_inputs(target):
    rng = np.random.default_rng(1)
    tokens = rng.integers(0, target.config.vocab_size, (1, T)).astype(np.int32)
    features = rng.standard_normal((1, T, target.config.hidden_size)).astype(np.float32)
    return tokens, features


def _run_head(head, target, tokens, features):
    kv = kv_cache.init_cache(head.config.layer, 4, 4)
    hidden, _ = head_forward(head.params, head.config, target.params, jnp.asarray(tokens),
                             jnp.asarray(features), jnp.arange(T)[None], kv,
                             kv_cache.contiguous_page_table(1, 4), jnp.zeros(1, jnp.int32))
    return hidden, head_logits(head.params, head.config, target.params, target.config, hidden)


@pytest.mark.parametrize("layout", ["bin+config", "safetensors", "dict", "nobias"])
def test_eagle1_forward_matches_reference(target, tmp_path, layout):
    hf_cfg = _hf_config(target.config)
    ref = _Eagle1(hf_cfg, target.params["embed"], bias=layout != "nobias").eval()
    sd = ref.state_dict()
    assert "embed_tokens.weight" in sd and "layers.0.input_layernorm.weight" not in sd
    if layout == "dict":
        src = {k: v.numpy() for k, v in sd.items()}
    else:
        src = str(tmp_path)
        if layout == "safetensors":
            save_file({k: v.numpy() for k, v in sd.items()}, os.path.join(src, "model.safetensors"))
        else:
            torch.save(sd, os.path.join(src, "pytorch_model.bin"))
            with open(os.path.join(src, "config.json"), "w") as f:
                json.dump(dict(hf_cfg.to_dict(), bias=layout != "nobias"), f)
    head = heads_io.load_eagle1(src, target.config)
    assert head.config.kind == "eagle" and not head.config.norms
    assert head.config.fc_bias == (layout != "nobias")
    assert "attn_norm" not in head.params["layer"] and "enorm" not in head.params
    np.testing.assert_array_equal(head.params["eh_proj"], sd["fc.weight"].numpy().T)

    tokens, features = _eagle_inputs(target)
    with torch.no_grad():
        want_h = ref(torch.tensor(tokens, dtype=torch.long), torch.tensor(features))
        want_logits = want_h @ torch.tensor(np.asarray(target.params["lm_head"]))  # no final norm
    hidden, logits = _run_head(head, target, tokens, features)
    np.testing.assert_allclose(np.asarray(hidden), want_h.numpy(), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(logits), want_logits.numpy(), atol=1e-4, rtol=1e-4)


def _eagle_sd(target):
    ref = _Eagle1(_hf_config(target.config), target.params["embed"])
    return {k: v.numpy() for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("edit, needle", [
    (lambda sd: sd.pop("layers.0.mlp.up_proj.weight"),
     "missing tensors ['layers.0.mlp.up_proj.weight']"),
    (lambda sd: sd.update({"layers.0.input_layernorm.weight": np.ones(32, np.float32)}),
     "unexpected tensors ['layers.0.input_layernorm.weight']"),
    (lambda sd: sd.update({"fc.weight": sd["fc.weight"].T.copy()}),
     "'fc.weight' has shape (64, 32)"),
    (lambda sd: sd.update({"embed_tokens.weight": np.zeros((10, 32), np.float32)}),
     "'embed_tokens.weight' has shape (10, 32)"),
])
def test_eagle1_bad_checkpoints(target, edit, needle):
    sd = _eagle_sd(target)
    edit(sd)
    with pytest.raises(ValueError) as e:
        heads_io.load_eagle1(sd, target.config)
    assert needle in str(e.value)


def test_eagle1_config_must_fit_target(target, tmp_path):
    hf = _hf_config(target.config).to_dict()
    torch.save({k: torch.tensor(v) for k, v in _eagle_sd(target).items()},
               tmp_path / "pytorch_model.bin")
    with open(tmp_path / "config.json", "w") as f:
        json.dump(dict(hf, intermediate_size=96), f)
    with pytest.raises(ValueError, match="intermediate_size 96 != 64"):
        heads_io.load_eagle1(str(tmp_path), target.config)


def _mtp_head(target, seed=5):
    cfg = HeadConfig.for_target(target.config, "mtp")
    params = init_head(cfg, jax.random.key(seed), scale=0.3)
    keys = iter(jax.random.split(jax.random.key(seed + 1), 8))
    for name in ("enorm", "hnorm", "final_norm"):  # not all ones: orientation/naming must matter
        params[name] = 1 + 0.1 * jax.random.normal(next(keys), params[name].shape)
    for name in ("attn_norm", "mlp_norm"):
        shape = (target.config.hidden_size,)
        params["layer"][name] = 1 + 0.1 * jax.random.normal(next(keys), shape)
    return Head(params, cfg)


def _assert_same_head(a, b):
    assert a.config == b.config
    la = jax.tree_util.tree_leaves_with_path(a.params)
    lb = jax.tree_util.tree_leaves_with_path(b.params)
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (p, x), (_, y) in zip(la, lb):
        assert x.dtype == y.dtype, p
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=str(p))


DEEPSEEK_NAMES = {f"model.layers.2.{n}" for n in [
    "enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
    "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight",
    "self_attn.v_proj.weight", "self_attn.o_proj.weight", "post_attention_layernorm.weight",
    "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]}


def test_mtp_deepseek_round_trip(target, tmp_path):
    head = _mtp_head(target)
    heads_io.save_mtp_deepseek(head, str(tmp_path), target.config.num_layers)
    tensors = load_file(tmp_path / "model.safetensors")
    assert set(tensors) == DEEPSEEK_NAMES
    e = target.config.hidden_size
    assert tensors["model.layers.2.eh_proj.weight"].shape == (e, 2 * e)  # torch [out, in]
    np.testing.assert_array_equal(tensors["model.layers.2.eh_proj.weight"],
                                  np.asarray(head.params["eh_proj"]).T)
    np.testing.assert_array_equal(tensors["model.layers.2.shared_head.norm.weight"],
                                  np.asarray(head.params["final_norm"]))
    with open(tmp_path / "config.json") as f:
        meta = json.load(f)
    assert meta["num_nextn_predict_layers"] == 1 and meta["num_hidden_layers"] == 2
    _assert_same_head(heads_io.load_mtp_deepseek(str(tmp_path), target.config), head)
    _assert_same_head(heads_io.load_mtp_deepseek(tensors, target.config, layer_index=2), head)
    one_file = str(tmp_path / "model.safetensors")
    _assert_same_head(heads_io.load_mtp_deepseek(one_file, target.config), head)


def test_mtp_deepseek_in_a_combined_checkpoint(target, tmp_path):
    """DeepSeek ships the MTP layer next to the target's own tensors (with copies of the shared
    embedding and head): those are recognised and skipped."""
    head = _mtp_head(target)
    save_hf_dir(target.params, target.config, str(tmp_path))
    heads_io.save_mtp_deepseek(head, str(tmp_path / "mtp.safetensors"), 2,
                               target_params=target.params)
    with open(tmp_path / "config.json") as f:
        assert "num_nextn_predict_layers" not in json.load(f)  # the target's config is untouched
    tensors = load_file(tmp_path / "mtp.safetensors")
    assert set(tensors) == DEEPSEEK_NAMES | {"model.layers.2.embed_tokens.weight",
                                             "model.layers.2.shared_head.head.weight"}
    np.testing.assert_array_equal(tensors["model.layers.2.shared_head.head.weight"],
                                  np.asarray(target.params["lm_head"]).T)
    _assert_same_head(heads_io.load_mtp_deepseek(str(tmp_path), target.config), head)


def test_mtp_deepseek_bad_checkpoints(target, tmp_path):
    head = _mtp_head(target)
    heads_io.save_mtp_deepseek(head, str(tmp_path / "full.safetensors"), 2)
    tensors = load_file(tmp_path / "full.safetensors")

    missing = dict(tensors)
    del missing["model.layers.2.hnorm.weight"]
    save_file(missing, tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors \['model\.layers\.2\.hnorm\.weight'\]"):
        heads_io.load_mtp_deepseek(str(tmp_path / "missing.safetensors"), target.config)

    moe = dict(tensors)
    moe["model.layers.2.mlp.experts.0.up_proj.weight"] = np.zeros((64, 32), np.float32)
    with pytest.raises(ValueError, match=r"unexpected tensors \['model\.layers\.2\.mlp\.experts"):
        heads_io.load_mtp_deepseek(moe, target.config)

    bad = dict(tensors)
    bad["model.layers.2.eh_proj.weight"] = tensors["model.layers.2.eh_proj.weight"].T.copy()
    with pytest.raises(ValueError,
                       match=r"'model\.layers\.2\.eh_proj\.weight' has shape \(64, 32\)"):
        heads_io.load_mtp_deepseek(bad, target.config)

    with pytest.raises(ValueError, match="no MTP layer"):
        heads_io.load_mtp_deepseek({}, target.config)
    two = dict(tensors, **{k.replace("layers.2.", "layers.3."): v for k, v in tensors.items()})
    with pytest.raises(ValueError, match=r"several MTP layers \[2, 3\]"):
        heads_io.load_mtp_deepseek(two, target.config)
    _assert_same_head(heads_io.load_mtp_deepseek(two, target.config, layer_index=2), head)

    eagle = Head(init_head(HeadConfig.for_target(target.config, "eagle"), jax.random.key(0)),
                 HeadConfig.for_target(target.config, "eagle"))
    with pytest.raises(ValueError, match="needs a head with norms"):
        heads_io.save_mtp_deepseek(eagle, str(tmp_path / "e.safetensors"), 2)


@pytest.mark.parametrize("kind", ["mtp", "eagle"])
def test_orbax_head_round_trip(target, tmp_path, kind):
    if kind == "mtp":
        head = _mtp_head(target)
    else:
        head = heads_io.load_eagle1(_eagle_sd(target), target.config)
    heads_io.save_head(head, str(tmp_path / "h"))
    with open(tmp_path / "h" / "specjax_config.json") as f:
        meta = json.load(f)
    assert meta["kind"] == "head" and meta["extra"]["head_config"] == head.config.to_dict()
    _assert_same_head(heads_io.load_head(str(tmp_path / "h")), head)
    bf16 = heads_io.load_head(str(tmp_path / "h"), dtype=jnp.bfloat16)
    assert bf16.params["eh_proj"].dtype == jnp.bfloat16


def test_load_head_rejects_a_model_checkpoint(target, tmp_path):
    save_checkpoint(str(tmp_path / "m"), target.params, target.config)
    with pytest.raises(ValueError, match="not a draft head"):
        heads_io.load_head(str(tmp_path / "m"))
