"""Tiny transformers models of every registered family, built from configs and saved with
save_pretrained (no hub): the shared builders of the family parity tests."""

import torch
import transformers

BASE = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=1, eos_token_id=2,
            pad_token_id=0)
DEEPSEEK = dict(num_key_value_heads=4, moe_intermediate_size=16, kv_lora_rank=16,
                qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=8,
                n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1)

# model_type -> (config class, model class, config overrides)
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict()),  # q/k/v biases
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                  dict(num_hidden_layers=3, head_dim=16, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=16, norm_topk_prob=True, mlp_only_layers=[0],
                       decoder_sparse_step=1)),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM",
                    dict(DEEPSEEK, q_lora_rank=None, n_group=4, topk_group=2,
                         topk_method="group_limited_greedy")),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM",
                    dict(DEEPSEEK, q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=True,
                         routed_scaling_factor=2.5)),
}


def perturb(module, seed, scale=0.2):
    """Random norms (N(0, scale^2) added) and router bias (transformers initialises them to
    1 / 0), so every weight matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.add_(scale * torch.randn(p.shape, generator=g))
        for name, b in module.named_buffers():
            if "e_score_correction_bias" in name:
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def build(model_type, path=None, seed=0, **overrides):
    """A tiny random transformers model of ``model_type`` (eval mode, fp32), saved to ``path``."""
    cfg_name, model_name, kw = FAMILIES[model_type]
    hc = getattr(transformers, cfg_name)(**{**BASE, **kw, **overrides})
    hc._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = getattr(transformers, model_name)(hc).eval()
    perturb(m, seed)
    if path is not None:
        m.save_pretrained(path)
    return m
