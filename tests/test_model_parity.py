"""Parity with HF transformers (PyTorch, fp32) on tiny LlamaForCausalLM models built here."""

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import specjax as sj

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CASES = {
    "mha_untied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False),
    "gqa_tied": dict(num_attention_heads=6, num_key_value_heads=2, tie_word_embeddings=True),
    "mqa": dict(num_attention_heads=4, num_key_value_heads=1),
    "llama3_rope": dict(num_attention_heads=4, num_key_value_heads=2, rope_scaling=LLAMA3_ROPE),
    "odd_head_dim_vocab": dict(num_attention_heads=3, num_key_value_heads=3, head_dim=10,
                               vocab_size=101),
    "biases": dict(num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True),
}


def _hf_model(tmp_path, **overrides):
    torch.manual_seed(0)
    kw = dict(vocab_size=97, hidden_size=48, intermediate_size=88, num_hidden_layers=3,
              max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    model = LlamaForCausalLM(LlamaConfig(**kw)).eval()
    with torch.no_grad():  # larger weights than the 0.02 init so logits are far from uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(8.0)
            else:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    return model


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf(tmp_path, case):
    hf = _hf_model(tmp_path, **CASES[case])
    model = sj.load_model(str(tmp_path))
    ids = np.random.RandomState(1).randint(0, model.config.vocab_size, size=40)
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None])).logits[0].numpy()
    ours = sj.logits(model, ids.tolist())
    assert ours.shape == ref.shape
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, rel


@pytest.mark.parametrize("case", ["gqa_tied", "llama3_rope", "odd_head_dim_vocab"])
def test_greedy_generation_matches_hf(tmp_path, case):
    hf = _hf_model(tmp_path, **CASES[case])
    model = sj.load_model(str(tmp_path))
    prompts = [[5, 9, 13], [7], [3, 4, 5, 6, 8, 10, 11]]
    out = sj.generate(model, prompts, max_new_tokens=24, eos_token_id=[])
    for prompt, got in zip(prompts, out.tokens):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert got == ref


def test_hf_roundtrip_save(tmp_path):
    _hf_model(tmp_path / "a", **CASES["llama3_rope"])
    model = sj.load_model(str(tmp_path / "a"))
    from specjax.io.hf import save_hf_dir
    save_hf_dir(model.params, model.config, str(tmp_path / "b"))
    hf2 = LlamaForCausalLM.from_pretrained(str(tmp_path / "b")).eval()
    ids = list(range(3, 30))
    with torch.no_grad():
        ref = hf2(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(sj.logits(model, ids), ref, rtol=1e-4, atol=1e-4)


def test_orbax_checkpoint_roundtrip(tmp_path):
    _hf_model(tmp_path / "hf", **CASES["gqa_tied"])
    model = sj.load_model(str(tmp_path / "hf"))
    from specjax.io.checkpoint import save_checkpoint
    save_checkpoint(str(tmp_path / "ckpt"), model.params, model.config)
    again = sj.load_model(str(tmp_path / "ckpt"))
    assert again.config == model.config
    ids = [4, 8, 15, 16, 23, 42]
    np.testing.assert_array_equal(sj.logits(again, ids), sj.logits(model, ids))


def test_bad_hf_dir(tmp_path):
    with pytest.raises(ValueError, match="load_model"):
        sj.load_model(str(tmp_path / "missing"))
