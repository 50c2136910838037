"""DeepSeek-V2/V3 targets (MLA over a latent paged cache + MoE) and the V3 MTP layer.

HF parity on tiny random transformers models built here (fp32); the MTP layer's logits against
a hand computation from the HF weights with HF's own block (transformers does not run MTP);
greedy losslessness and the exact output distribution for method="mtp"; the latent cache's bytes
per token; the two-half micro-batched verify.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm

import specjax as sj
from specjax import deepseek, heads, kv_cache
from specjax.io import deepseek_hf
from specjax.model import Model
from tests.hf_families import perturb
from tests.test_speculative import ALPHA, N_ROWS, PROMPT, PROMPTS, V, _chi2_pvalue, _exact_joint

ATOL = {jnp.float32: 2e-4}  # fp32 logits vs torch (different summation orders)

V3_KW = dict(hidden_size=48, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
             n_shared_experts=1, num_experts_per_tok=2, n_group=4, topk_group=2,
             first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
             max_position_embeddings=256, initializer_range=0.1, eos_token_id=None,
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                  original_max_position_embeddings=64, mscale=1.0,
                                  mscale_all_dim=0.707, beta_fast=32, beta_slow=1))


def _perturb(module, seed):
    return perturb(module, seed, scale=0.1)


def build_v3(seed=0, vocab=96, **kw):
    """A tiny DeepseekV3ForCausalLM plus its MTP module in the HF layout.

    Returns (hf_model, state_dict with model.layers.{L}.* MTP tensors, mtp torch modules).
    """
    hc = DeepseekV3Config(vocab_size=vocab, **{**V3_KW, **kw})
    hc._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = DeepseekV3ForCausalLM(hc).eval()
    _perturb(m, seed)
    n, e = hc.num_hidden_layers, hc.hidden_size
    block = DeepseekV3DecoderLayer(hc, layer_idx=n).eval()  # layer N >= first_k_dense_replace: MoE
    with torch.no_grad():
        for name, p in block.named_parameters():
            torch.nn.init.normal_(p, std=0.1) if "norm" not in name else torch.nn.init.ones_(p)
    mtp = dict(block=block, enorm=DeepseekV3RMSNorm(e, hc.rms_norm_eps),
               hnorm=DeepseekV3RMSNorm(e, hc.rms_norm_eps),
               final_norm=DeepseekV3RMSNorm(e, hc.rms_norm_eps),
               eh_proj=torch.nn.Linear(2 * e, e, bias=False))
    for i, mod in enumerate(mtp.values()):
        _perturb(mod, seed + 1 + i)
    sd = dict(m.state_dict())
    p = f"model.layers.{n}."
    sd.update({p + k: v for k, v in block.state_dict().items()})
    sd.update({p + "enorm.weight": mtp["enorm"].weight, p + "hnorm.weight": mtp["hnorm"].weight,
               p + "eh_proj.weight": mtp["eh_proj"].weight,
               p + "shared_head.norm.weight": mtp["final_norm"].weight,
               p + "shared_head.head.weight": m.lm_head.weight,
               p + "embed_tokens.weight": m.model.embed_tokens.weight})
    return m, sd, mtp


def _ours(m, sd, **overrides):
    cfg = deepseek.DeepseekConfig.from_hf_config(m.config, **overrides)
    target = Model(deepseek_hf.params_from_hf(sd, cfg), cfg)
    return target, deepseek_hf.mtp_head_from_hf(sd, cfg, target.params)


@pytest.fixture(scope="module")
def v3():
    m, sd, mtp = build_v3(0)
    target, head = _ours(m, sd)
    return m, mtp, target, head


_forward = jax.jit(deepseek.forward, static_argnums=1)


def _run(params, cfg, ids, chunks=(None,)):
    """Our forward over ids [B, T] in consecutive chunks through one paged latent cache."""
    b, t = ids.shape
    kv, pt = deepseek.init_cache(cfg, b * 4, 8), kv_cache.contiguous_page_table(b, 4)
    bounds = [0] + [c for c in chunks if c is not None] + [t]
    outs = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        pos = jnp.broadcast_to(jnp.arange(lo, hi, dtype=jnp.int32), (b, hi - lo))
        logits, hidden, kv = _forward(params, cfg, jnp.asarray(ids[:, lo:hi]), pos, kv, pt,
                                      jnp.full((b,), lo, jnp.int32))
        outs.append((np.asarray(logits), np.asarray(hidden)))
    return np.concatenate([o[0] for o in outs], 1), np.concatenate([o[1] for o in outs], 1)


def _hf_prenorm_hidden(m, ids):
    captured = {}
    hook = m.model.norm.register_forward_hook(lambda mod, inp, out: captured.update(h=inp[0]))
    with torch.no_grad():
        logits = m(torch.as_tensor(ids).long()).logits.numpy()
    hook.remove()
    return logits, captured["h"]


@pytest.mark.parametrize("chunks", [(None,), (6,), (3, 7)], ids=["prefill", "two_chunks", "three_chunks"])
def test_v3_parity_with_hf(v3, chunks):
    """Logits equal DeepseekV3ForCausalLM's, whether the prompt runs at once or in chunks that
    read earlier tokens back from the latent cache (YaRN + mscale, q_lora, grouped routing)."""
    m, _, target, _ = v3
    ids = np.random.default_rng(0).integers(0, target.config.vocab_size, (2, 11)).astype(np.int32)
    ref, ref_h = _hf_prenorm_hidden(m, ids)
    logits, hidden = _run(target.params, target.config, ids, chunks)
    np.testing.assert_allclose(logits, ref, atol=ATOL[jnp.float32], rtol=1e-4)
    np.testing.assert_allclose(hidden, ref_h.numpy(), atol=ATOL[jnp.float32], rtol=1e-4)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_v2_lite_parity_with_hf(topk_method):
    """V2-Lite shape: no q_lora (plain q_proj), softmax routing, default RoPE, dense first layer."""
    hc = DeepseekV2Config(vocab_size=80, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                          num_hidden_layers=2, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=16,
                          qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=6,
                          n_shared_experts=2, num_experts_per_tok=2, n_group=3, topk_group=2,
                          topk_method=topk_method, first_k_dense_replace=1, routed_scaling_factor=1.0,
                          max_position_embeddings=128, initializer_range=0.1)
    hc._attn_implementation = "eager"
    torch.manual_seed(1)
    m = DeepseekV2ForCausalLM(hc).eval()
    _perturb(m, 1)
    model = deepseek_hf.model_from_hf(m)
    assert model.config.q_lora_rank is None and model.config.scoring == "softmax"
    ids = np.random.default_rng(1).integers(0, 80, (2, 9)).astype(np.int32)
    with torch.no_grad():
        ref = m(torch.as_tensor(ids).long()).logits.numpy()
    logits, _ = _run(model.params, model.config, ids, (5,))
    np.testing.assert_allclose(logits, ref, atol=ATOL[jnp.float32], rtol=1e-4)


def test_absorbed_attention_equals_expanded(v3):
    """The absorbed latent path equals the slow twin with expanded per-head K/V."""
    _, _, target, _ = v3
    cfg, lp = target.config, target.params["layers"][1]
    y = jax.random.normal(jax.random.key(0), (2, 7, cfg.hidden_size))
    pos = jnp.broadcast_to(jnp.arange(7), (2, 7))
    pool = deepseek.init_cache(cfg, 4, 8).k[0]
    out, _ = deepseek.mla_attention(lp, cfg, y, pos, pool, kv_cache.contiguous_page_table(2, 2),
                                    jnp.zeros(2, jnp.int32), jnp.ones((2, 7), bool), None, "reference")
    np.testing.assert_allclose(out, deepseek.mla_attention_expanded(lp, cfg, y, pos), atol=1e-5)


def test_mtp_logits_match_hand_computation(v3):
    """The loaded MTP head equals enorm/hnorm/eh_proj -> HF DeepseekV3DecoderLayer (index L) ->
    shared_head.norm -> shared_head.head, computed in torch from the HF weights."""
    m, mtp, target, head = v3
    ids = np.random.default_rng(2).integers(0, target.config.vocab_size, (2, 10)).astype(np.int32)
    _, h = _hf_prenorm_hidden(m, ids)
    t = ids.shape[1] - 1  # head position j sees (x_{j+1}, h_j)
    with torch.no_grad():
        emb = m.model.embed_tokens(torch.as_tensor(ids[:, 1:]).long())
        x = mtp["eh_proj"](torch.cat([mtp["enorm"](emb), mtp["hnorm"](h[:, :t])], dim=-1))
        pos = torch.arange(t)[None].expand(2, t)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = mtp["block"](x, attention_mask=mask, position_ids=pos,
                           position_embeddings=m.model.rotary_emb(x, pos))
        ref = m.lm_head(mtp["final_norm"](out)).numpy()
    cfg = head.config.layer
    kv, pt = deepseek.init_cache(cfg, 8, 8), kv_cache.contiguous_page_table(2, 4)
    feats = jnp.asarray(h[:, :t].numpy())
    hh, _ = heads.head_forward(head.params, head.config, target.params, jnp.asarray(ids[:, 1:]),
                               feats, jnp.broadcast_to(jnp.arange(t), (2, t)),
                               kv, pt, jnp.zeros(2, jnp.int32))
    logits = heads.head_logits(head.params, head.config, target.params, target.config, hh)
    assert "router" in head.params["layer"] and "lm_head" not in head.params  # MoE block, shared head
    np.testing.assert_allclose(logits, ref, atol=ATOL[jnp.float32], rtol=1e-4)


@pytest.fixture(scope="module")
def plain(v3):
    return sj.generate(v3[2], PROMPTS, max_new_tokens=24, eos_token_id=[]).tokens


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_mtp_greedy_lossless(v3, plain, k):
    _, _, target, head = v3
    out = sj.generate(target, PROMPTS, max_new_tokens=24, draft=head, method="mtp",
                      num_draft_tokens=k, eos_token_id=[])
    assert out.tokens == plain


def test_latent_cache_bytes_per_token(v3):
    """The pools hold (R + Dr) floats per token per layer, not 2·H·head_dims of expanded K/V."""
    _, _, target, _ = v3
    cfg = target.config
    kv = deepseek.init_cache(cfg, 6, 16)
    latent = deepseek.cache_bytes_per_token(kv)
    expanded = deepseek.expanded_bytes_per_token(cfg)
    assert latent == cfg.num_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4 == 3 * 24 * 4
    assert expanded == cfg.num_layers * cfg.num_heads * (16 + 12) * 4
    assert expanded / latent == pytest.approx(4 * 28 / 24)
    # DeepSeek-V3's own sizes: 576 vs 128 * (192 + 128) floats per token per layer (~71x).
    full = deepseek.DeepseekConfig(vocab_size=8, hidden_size=8, intermediate_size=8,
                                   moe_intermediate_size=8, num_layers=1, num_heads=128,
                                   kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                                   v_head_dim=128, n_routed_experts=8, n_group=1, topk_group=1)
    shapes = jax.eval_shape(lambda: deepseek.init_cache(full, 2, 4))
    assert [s.shape for s in shapes.k] == [(1, 2, 4, 576)] and shapes.v == ()
    assert deepseek.expanded_bytes_per_token(full) / (576 * 4) == pytest.approx(128 * 320 / 576)


@pytest.mark.slow
def test_micro_batched_verify_matches_single_batch(v3, plain):
    """moe_micro_batches=2: the 2·D-token verify (and every forward) runs the MoE as two halves;
    outputs equal the single batch."""
    _, _, target, head = v3
    cfg2 = dataclasses.replace(target.config, moe_micro_batches=2)
    ids = np.random.default_rng(3).integers(0, cfg2.vocab_size, (4, 2)).astype(np.int32)  # D=4 rows x 2
    ctx = np.random.default_rng(4).integers(0, cfg2.vocab_size, (4, 5)).astype(np.int32)
    full = np.concatenate([ctx, ids], 1)
    one, _ = _run(target.params, target.config, full, (5,))
    two, _ = _run(target.params, cfg2, full, (5,))
    np.testing.assert_allclose(two, one, atol=1e-6, rtol=0)
    head2 = heads.Head(head.params, dataclasses.replace(
        head.config, layer=dataclasses.replace(head.config.layer, moe_micro_batches=2)))
    out = sj.generate(Model(target.params, cfg2), PROMPTS, max_new_tokens=24, draft=head2,
                      method="mtp", num_draft_tokens=1, eos_token_id=[])
    assert out.tokens == plain


@pytest.fixture(scope="module")
def dist_v3():
    kw = dict(hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=2, q_lora_rank=8, kv_lora_rank=8,
              qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4, n_routed_experts=4,
              n_group=2, topk_group=1, initializer_range=0.5)
    m, sd, _ = build_v3(5, vocab=V, **kw)
    return _ours(m, sd)


def test_mtp_distribution_matches_target(dist_v3):
    """method="mtp" sampling reproduces the target's own joint over 3 tokens (chi-square)."""
    target, head = dist_v3
    out = sj.generate(target, [PROMPT] * N_ROWS, max_new_tokens=3, draft=head, method="mtp",
                      num_draft_tokens=1, temperature=0.8, top_p=0.95, eos_token_id=[])
    toks = np.array(out.tokens)
    cells = toks[:, 0] * V * V + toks[:, 1] * V + toks[:, 2]
    assert 0.01 < out.stats["acceptance_rate"] < 0.99
    assert _chi2_pvalue(cells, _exact_joint(target, 0.8, 0, 0.95)) > ALPHA
