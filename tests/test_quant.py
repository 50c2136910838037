"""GGUF block-quantized weights streamed by the native kernel (specjax.native.quant_matmul).

Every weight the kernel dequantizes equals ``gguf.quants.dequantize``'s float32 value (x = the
identity reads the weights back exactly), its products equal the float32 matmul over the
dequantized weights to float32 rounding, and the real model's greedy outputs and perplexity with
quantized streaming equal the float32 path's.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

import specjax as sj
from specjax import api, native
from specjax.io import gguf as gguf_io
from tests.conftest import random_kquant_blocks

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="native kernel not built (no C++ compiler or not CPU)")

QTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q8_0"]
KQUANTS = ["Q4_K", "Q6_K"]  # 256-weight super-blocks (gguf has no quantizer for them)

def _assert_close(got, x, w):
    """``got`` equals x @ w to float32 rounding: within 1e-5 of sum_k |x_k w_k| per element (a
    k-order FMA sum vs numpy's pairwise one; a wrong weight misses by ~|x_k w_k|)."""
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    err = np.abs(np.asarray(got, np.float64) - x @ w)
    assert np.all(err <= 1e-5 * (np.abs(x) @ np.abs(w)) + 1e-6), err.max()


def _blocks(qtype, n, k, seed):
    """Random GGUF blocks [n, k / 32 * bytes] of ``qtype`` (gguf's own quantizer) and gguf's
    dequantization of them as the [k, n] weight."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[0] = 0.0  # an all-zero row (scale 0)
    q = quantize(w, GGMLQuantizationType[qtype])
    return q, dequantize(q, GGMLQuantizationType[qtype]).astype(np.float32).T


@pytest.mark.parametrize("qtype", QTYPES + KQUANTS)
def test_reference_twin_equals_gguf(qtype):
    """The plain-numpy twin (llama.cpp's loops) dequantizes exactly as gguf does."""
    make = random_kquant_blocks if qtype in KQUANTS else _blocks
    for n, k in [(1, 256), (13, 768)]:
        q, w = make(qtype, n, k, seed=n)
        assert np.array_equal(native.dequantize_reference(q, qtype), w)


@pytest.mark.parametrize("qtype", KQUANTS)
@pytest.mark.parametrize("k,n", [(256, 1), (512, 3), (768, 33), (1024, 17)])
def test_kquant_kernel_dequantizes_exactly_like_gguf(qtype, k, n):
    q, w = random_kquant_blocks(qtype, n, k, seed=k + n)
    got = np.asarray(native.quant_matmul(jnp.eye(k, dtype=jnp.float32), jnp.asarray(q), qtype))
    assert np.array_equal(got, w)  # bit for bit (x = I reads every weight back)


@pytest.mark.parametrize("qtype", KQUANTS)
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 23, native.MAX_ROWS])
@pytest.mark.parametrize("k,n", [(256, 31), (768, 197)])
def test_kquant_matmul_matches_float32(qtype, m, k, n):
    q, w = random_kquant_blocks(qtype, n, k, seed=3 * m + n)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.float32)
    got = jax.jit(native.quant_matmul, static_argnums=2)(x, jnp.asarray(q), qtype)
    _assert_close(got, x, w)
    _assert_close(native.quant_matmul_reference(x, q, qtype), x, w)
    full = native.quant_matmul(jnp.tile(x, (2, 1)), jnp.asarray(q), qtype)  # rows independent
    assert np.array_equal(np.asarray(full[:m]), np.asarray(got))


def test_realrandom_kquant_blocks_of_the_gemma_gguf():
    """Q4_K / Q6_K / Q5_0 matrices of the Gemma 3 270M GGUF, read by the kernel, equal gguf's
    dequantization bit for bit."""
    try:
        path = gguf_io.builtin_gguf_path("gemma3-270m")
    except FileNotFoundError as e:
        pytest.skip(str(e))
    seen = set()
    for t in gguf_io.open_gguf(path).tensors:
        qtype = t.tensor_type.name
        if qtype not in ("Q4_K", "Q6_K", "Q5_0") or qtype in seen or not t.name.startswith("blk"):
            continue
        seen.add(qtype)
        q = np.array(t.data, np.uint8).reshape(int(t.shape[-1]), -1)[:40]  # 40 output rows
        want = dequantize(q, t.tensor_type).astype(np.float32).T
        k = want.shape[0]
        got = native.quant_matmul(jnp.eye(k, dtype=jnp.float32), jnp.asarray(q), qtype)
        assert np.array_equal(np.asarray(got), want), t.name
        assert np.array_equal(native.dequantize_reference(q, qtype), want), t.name
    assert seen == {"Q4_K", "Q6_K", "Q5_0"}


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("k,n", [(32, 1), (64, 3), (96, 33), (576, 17)])
def test_kernel_dequantizes_exactly_like_gguf(qtype, k, n):
    q, w = _blocks(qtype, n, k, seed=k + n)
    got = np.asarray(native.quant_matmul(jnp.eye(k, dtype=jnp.float32), jnp.asarray(q), qtype))
    assert got.shape == (k, n)
    assert np.array_equal(got, w)  # bit for bit (x = I reads every weight back)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 17])
@pytest.mark.parametrize("k,n", [(64, 31), (160, 1), (576, 197)])
def test_quant_matmul_matches_float32(qtype, m, k, n):
    q, w = _blocks(qtype, n, k, seed=7 * m + n)
    x = jnp.asarray(np.random.default_rng(m).standard_normal((m, k)), jnp.float32)
    got = jax.jit(native.quant_matmul, static_argnums=2)(x, jnp.asarray(q), qtype)
    _assert_close(got, x, w)


def test_rows_do_not_depend_on_each_other():
    q, _ = _blocks("Q4_1", 70, 192, seed=3)
    x = jnp.asarray(np.random.default_rng(4).standard_normal((20, 192)), jnp.float32)
    full = native.quant_matmul(x, jnp.asarray(q), "Q4_1")
    for m in (1, 2, 7, 8, 9, 13):
        assert np.array_equal(np.asarray(native.quant_matmul(x[:m], jnp.asarray(q), "Q4_1")),
                              np.asarray(full[:m]))


def test_quant_weight_both_paths_and_fusion():
    (qa, wa), (qb, wb) = _blocks("Q8_0", 40, 64, 5), _blocks("Q8_0", 24, 64, 6)
    qw = native.quant_weight([jnp.asarray(wa), jnp.asarray(wb)], [("Q8_0", qa), ("Q8_0", qb)])
    assert isinstance(qw, native.QuantWeight) and qw.parts == (40, 24) and qw.shape == (64, 64)
    want = np.concatenate([wa, wb], axis=1)
    for shape in [(1, 64), (2, 3, 64), (native.MAX_ROWS + 1, 64)]:  # kernel, kernel, XLA
        x = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.float32)
        got = jax.jit(lambda a, b: a @ b)(x, qw)
        assert got.shape == shape[:-1] + (64,)
        _assert_close(got.reshape(-1, 64), x.reshape(-1, 64), want)
    mixed = native.quant_weight([jnp.asarray(wa), jnp.asarray(wb)], [("Q8_0", qa), None])
    assert isinstance(mixed, native.PackedWeight)  # falls back to float32 panels


def test_bad_arguments():
    q, _ = _blocks("Q4_0", 4, 64, 0)
    with pytest.raises(ValueError, match="qtype"):
        native.quant_matmul(jnp.zeros((1, 64)), jnp.asarray(q), "Q5_1")
    with pytest.raises(ValueError, match="K"):
        native.quant_matmul(jnp.zeros((1, 96)), jnp.asarray(q), "Q4_0")
    with pytest.raises(ValueError, match="256"):  # K-quants need K % 256 == 0
        native.quant_matmul(jnp.zeros((1, 64)), jnp.zeros((4, 36), jnp.uint8), "Q4_K")
    with pytest.raises(TypeError):
        native.quant_matmul(jnp.zeros((1, 64), jnp.bfloat16), jnp.asarray(q), "Q4_0")
    with pytest.raises(ValueError, match="weights"):
        sj.load_model("smollm2-135m", weights="int4")


# ----------------------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def models():
    return sj.load_model("smollm2-135m"), sj.load_model("smollm2-135m", weights="float32")


@pytest.fixture(scope="module")
def tok():
    return sj.load_tokenizer("smollm2-135m")


def test_real_blocks_dequantize_to_the_loaded_weights(models):
    """Every quantized matrix of the shipped GGUF, as the kernel reads it, equals load_gguf's
    float32 weight (Q/K un-permuted, fused q|k|v and gate|up, the tied Q8_0 head)."""
    quant, _ = models
    packed = native.inference_params(quant)
    assert isinstance(packed["lm_head_packed"], native.QuantWeight)
    assert packed["lm_head_packed"].qtype == "Q8_0"
    for i in (0, len(packed["layers"]) - 1):
        lp, ref = packed["layers"][i], quant.params["layers"][i]
        for fused, names in (("wq+wk+wv", ("wq", "wk", "wv")), ("w_gate+w_up", ("w_gate", "w_up")),
                             ("wo", ("wo",)), ("w_down", ("w_down",))):
            qw = lp[fused]
            assert isinstance(qw, native.QuantWeight) and qw.qtype == "Q4_1"
            want = np.concatenate([np.asarray(ref[n]) for n in names], axis=1)
            k = want.shape[0]
            got = native.quant_matmul(jnp.eye(k, dtype=jnp.float32), qw.q, qw.qtype)
            assert np.array_equal(np.asarray(got), want), (i, fused)
    head = packed["lm_head_packed"]
    rows = native.quant_matmul(jnp.eye(576, dtype=jnp.float32)[:64 * 9:9], head.q, "Q8_0")
    assert np.array_equal(np.asarray(rows), np.asarray(quant.params["embed"]).T[:64 * 9:9])


def test_float32_weights_keep_panels(models):
    _, f32 = models
    packed = native.inference_params(f32)
    assert isinstance(packed["lm_head_packed"], native.PackedWeight)
    assert isinstance(packed["layers"][0]["wo"], native.PackedWeight)


def test_greedy_outputs_equal_float32_path(models, tok):
    quant, f32 = models
    questions = ["What is the capital of France?", "Name three primary colors.",
                 "Write a haiku about the sea.", "What is 12 times 7?"]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in questions]
    for p in prompts:
        a = sj.generate(quant, [p], max_new_tokens=16).tokens[0]
        b = sj.generate(f32, [p], max_new_tokens=16).tokens[0]
        assert a == b and len(a) > 0


def test_perplexity_unchanged(models, tok):
    """Teacher-forced logits through the quantized kernel (128-token windows: every product
    runs in the kernel) give the float32 path's perplexity, and the pinned figure stands."""
    from specjax.train.corpora import wiki_entries

    quant, f32 = models
    nll = {"q": 0.0, "f": 0.0}
    count = 0
    for e in wiki_entries("held_out")[:8]:
        ids = tok.encode(e["extract"])[:native.MAX_ROWS]
        padded = jnp.asarray(np.array([ids + [0] * (native.MAX_ROWS - len(ids))], np.int32))
        n = jnp.asarray(len(ids), jnp.int32)
        for key, params in (("q", native.inference_params(quant)), ("f", f32.params)):
            logp = np.asarray(api._logits_jit(params, quant.config, padded, n))[:len(ids)]
            logp = logp - np.logaddexp.reduce(logp, axis=-1, keepdims=True)
            nll[key] -= logp[np.arange(len(ids) - 1), ids[1:]].sum()
        count += len(ids) - 1
    ppl_q, ppl_f = math.exp(nll["q"] / count), math.exp(nll["f"] / count)
    assert ppl_q == pytest.approx(ppl_f, rel=1e-4), (ppl_q, ppl_f)


def test_load_gguf_blocks_layout():
    cfg, params = gguf_io.load_gguf(gguf_io.smollm2_gguf_path())
    blocks = gguf_io.load_gguf_blocks(gguf_io.smollm2_gguf_path(), cfg)
    qtype, q = blocks["layers"][3]["wk"]
    assert qtype == "Q4_1" and q.shape == (192, 576 // 32 * 20) and q.dtype == np.uint8
    w = dequantize(q, GGMLQuantizationType.Q4_1).astype(np.float32).T
    assert np.array_equal(w, params["layers"][3]["wk"])
