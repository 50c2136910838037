"""8-bit-activation integer dots over GGUF blocks (specjax.native_q8, specjax/csrc/q8_dot.cc).

The kernel equals its numpy twin (``q8_matmul_reference``: exact integer block dots, float
scales) to float32 rounding on awkward shapes, for every block type (the 256-weight K-quant
super-blocks too); the twin's weights are ``native_q8.integer_weights``, which reproduce gguf's
dequantization bit for bit (tests/test_quant.py ``test_reference_twin_equals_gguf``), and its
input quantization is gguf's Q8_0 (an independent implementation of the format); a row's result does not depend on the other
rows; the layout keeps the file's bytes; on the real model, speculative decoding reproduces
plain decoding token for token in this arithmetic, and perplexity stays within a stated
tolerance of the exact path's.
"""

import math

import jax.numpy as jnp
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

import specjax as sj
from specjax import api, native, native_q8
from tests.conftest import random_kquant_blocks

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="native kernel not built (no C++ compiler or not CPU)")

QTYPES = list(native_q8.Q8TARGETS)
KQUANTS = ("Q4_K", "Q6_K")  # 256-weight super-blocks (gguf's python package cannot quantize them)


def _blocks(qtype, n, k, seed):
    """Random GGUF blocks [n, k / per * bytes] of ``qtype``: gguf's own quantizer (row 0 all
    zeros: scale 0), random super-blocks for the K-quants."""
    if qtype in KQUANTS:
        return random_kquant_blocks(qtype, n, k, seed)[0]
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    w[0] = 0.0
    return quantize(w, GGMLQuantizationType[qtype])


def _kernel(x, q, qtype):
    return np.asarray(native_q8.q8_matmul(jnp.asarray(x), jnp.asarray(native_q8.q8_layout(q, qtype)),
                                          qtype))


SHAPES = [(1, 32, 1), (1, 576, 197), (3, 96, 33), (8, 160, 7), (9, 1536, 31), (23, 64, 2)]
KSHAPES = [(1, 256, 1), (1, 512, 197), (3, 768, 33), (8, 1024, 7), (9, 2048, 31), (23, 256, 2)]


@pytest.mark.parametrize("qtype,m,k,n", [(q, *s) for q in QTYPES
                                         for s in (KSHAPES if q in KQUANTS else SHAPES)])
def test_kernel_equals_reference_twin(qtype, m, k, n):
    """Groups of 4 blocks with tails of 1..3 blocks (k = 32, 96, 160), 1..8 super-blocks, row
    groups of 8 with tails, odd output counts; an all-zero input block and large inputs."""
    q = _blocks(qtype, n, k, seed=m * 1000 + k + n)
    x = np.random.default_rng(k).standard_normal((m, k)).astype(np.float32) * 3
    x[0, :32] = 0.0
    if m > 1:
        x[1, -32:] *= 1000
    got, ref = _kernel(x, q, qtype), native_q8.q8_matmul_reference(x, q, qtype)
    scale = np.abs(x) @ np.abs(native.dequantize_reference(q, qtype)) + 1e-6
    assert np.all(np.abs(got - ref) <= 2e-6 * scale), np.abs(got - ref).max()


@pytest.mark.parametrize("qtype", QTYPES)
def test_activation_rounding_is_what_it_claims(qtype):
    """Close to the exact product (within the rounding of 8-bit inputs: half a level of each
    block's max per value), but not equal to it: the test can tell the two arithmetics apart."""
    k, n = 768, 64
    q = _blocks(qtype, n, k, seed=3)
    x = np.random.default_rng(4).standard_normal((2, k)).astype(np.float32)
    w = native.dequantize_reference(q, qtype)
    exact, got = x @ w, _kernel(x, q, qtype)
    _, dx = native_q8.quantize_rows(x)  # [2, k / 32]
    bound = (np.repeat(dx, 32, axis=1) / 2) @ np.abs(w)  # sum_k |dx_k / 2| |w_k|
    assert np.all(np.abs(got - exact) <= bound * 1.0001 + 1e-6)
    assert not np.allclose(got, exact, rtol=1e-5, atol=0)


def test_input_quantization_is_gguf_q8_0():
    """quantize_rows' levels and scales reproduce gguf's Q8_0 quantizer (an independent
    implementation of the format) except on exact .5 ties, which random inputs never hit."""
    x = np.random.default_rng(5).standard_normal((7, 256)).astype(np.float32)
    qs, d = native_q8.quantize_rows(x)
    ref = dequantize(quantize(x, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    ours = (qs.astype(np.float32) * d.astype(np.float16).astype(np.float32)[..., None]).reshape(7, 256)
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("qtype", QTYPES)
def test_rows_do_not_depend_on_each_other(qtype):
    """Decode (1 row) and verify (k + 1 rows) give a row bit-identical results."""
    q = _blocks(qtype, 45, 768, seed=6)
    x = np.random.default_rng(7).standard_normal((12, 768)).astype(np.float32)
    full = _kernel(x, q, qtype)
    for i in (0, 5, 8, 11):
        assert np.array_equal(_kernel(x[i:i + 1], q, qtype)[0], full[i])
    assert np.array_equal(_kernel(x[8:], q, qtype), full[8:])


@pytest.mark.parametrize("qtype", QTYPES)
def test_layout_keeps_the_bytes(qtype):
    k = 768
    q = _blocks(qtype, 5, k, seed=8)
    lay = native_q8.q8_layout(q, qtype)
    assert lay.shape == q.shape and lay.dtype == np.uint8
    if qtype in KQUANTS:  # the super-blocks as they are
        assert np.array_equal(lay, q)
        return
    nb, nblk = native_q8.Q8TARGETS[qtype][2], k // 32
    head = {"Q4_1": 4, "Q5_0": 6}.get(qtype, 2)
    blocks = q.reshape(5, nblk, nb)
    parts = [blocks[..., head:], blocks[..., :2]] + ([blocks[..., 2:head]] if head > 2 else [])
    assert np.array_equal(lay, np.concatenate([p.reshape(5, -1) for p in parts], axis=1))


def test_bad_arguments():
    with pytest.raises(ValueError, match="qtype"):
        native_q8.q8_layout(np.zeros((2, 84), np.uint8), "Q2_K")
    with pytest.raises(ValueError, match=r"K % 256"):
        native_q8.q8_matmul(jnp.zeros((1, 128)), jnp.zeros((3, 72), jnp.uint8), "Q4_K")
    with pytest.raises(ValueError, match=r"q8 \[N"):
        native_q8.q8_matmul(jnp.zeros((1, 64)), jnp.zeros((3, 18), jnp.uint8), "Q4_0")
    with pytest.raises(TypeError, match="float32"):
        native_q8.q8_matmul(jnp.zeros((1, 32), jnp.bfloat16), jnp.zeros((3, 18), jnp.uint8), "Q4_0")
    with pytest.raises(ValueError, match="activations"):
        sj.load_model("smollm2-135m", activations="int4")
    with pytest.raises(ValueError, match="needs weights='quantized'"):
        sj.load_model("smollm2-135m", weights="float32", activations="int8")
    with pytest.raises(ValueError, match="needs a GGUF target"):
        sj.load_model("/some/transformers/dir", activations="int8")


# ----------------------------------------------------------------------------- the real model

@pytest.fixture(scope="module")
def models():
    return sj.load_model("smollm2-135m"), sj.load_model("smollm2-135m", activations="int8")


@pytest.fixture(scope="module")
def tok():
    return sj.load_tokenizer("smollm2-135m")


def test_real_model_runs_int8_dots(models):
    _, q8 = models
    packed = native.inference_params(q8)
    assert isinstance(packed["lm_head_packed"], native.Q8Weight)
    assert packed["lm_head_packed"].qtype == "Q8_0"
    assert all(isinstance(lp[k], native.Q8Weight) and lp[k].qtype == "Q4_1"
               for lp in packed["layers"] for k in ("wq+wk+wv", "wo", "w_gate+w_up", "w_down"))


def test_speculation_is_lossless_in_int8_arithmetic(models, tok):
    """Greedy n-gram and early-exit speculation == greedy plain decoding of the same int8 model,
    token for token (verify rows see the decode row's arithmetic)."""
    _, q8 = models
    draft = sj.early_exit_draft(q8, 20)
    accepted = {"ngram": 0, "draft": 0}
    questions = ["Repeat after me: the cat sat on the mat, the cat sat on the mat.",
                 "Name three primary colors."]
    for qn in questions:
        p = tok.apply_chat_template([{"role": "user", "content": qn}])
        plain = sj.generate(q8, [p], max_new_tokens=24, eos_token_id=[]).tokens[0]
        ng = sj.generate(q8, [p], max_new_tokens=24, method="ngram", num_draft_tokens=3,
                         eos_token_id=[])
        ee = sj.generate(q8, [p], max_new_tokens=24, draft=draft, method="draft", num_draft_tokens=3,
                         eos_token_id=[])
        assert ng.tokens[0] == plain and ee.tokens[0] == plain
        accepted["ngram"] += ng.stats["accepted_tokens"]
        accepted["draft"] += ee.stats["accepted_tokens"]
        assert ee.stats["acceptance_rate"] < 1  # rejections too: both branches of the rule ran
    assert min(accepted.values()) > 0, accepted  # the drafts really were accepted


def test_perplexity_close_to_exact_path(models, tok):
    """Teacher-forced perplexity (128-token windows: every product in the kernel) within 1% of
    the exact quantized path's (8-bit inputs move the logits slightly; a broken kernel moves
    the perplexity by far more)."""
    from specjax.train.corpora import wiki_entries

    exact, q8 = models
    nll = {"e": 0.0, "q": 0.0}
    count = 0
    for e in wiki_entries("held_out")[:8]:
        ids = tok.encode(e["extract"])[:native.MAX_ROWS]
        padded = jnp.asarray(np.array([ids + [0] * (native.MAX_ROWS - len(ids))], np.int32))
        n = jnp.asarray(len(ids), jnp.int32)
        for key, m in (("e", exact), ("q", q8)):
            logp = np.asarray(api._logits_jit(native.inference_params(m), m.config, padded, n))
            logp = logp[:len(ids)] - np.logaddexp.reduce(logp[:len(ids)], axis=-1, keepdims=True)
            nll[key] -= logp[np.arange(len(ids) - 1), ids[1:]].sum()
        count += len(ids) - 1
    ppl_e, ppl_q = math.exp(nll["e"] / count), math.exp(nll["q"] / count)
    print(f"perplexity exact {ppl_e:.3f} int8 activations {ppl_q:.3f}")
    assert ppl_q == pytest.approx(ppl_e, rel=0.01) and ppl_q != ppl_e


_OTHER_PATH = """
import numpy as np, jax.numpy as jnp
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from specjax import native, native_q8
assert native.available()
rng = np.random.default_rng(0)
def blocks(qtype, n, k):
    if qtype in ("Q4_K", "Q6_K"):  # random super-blocks, finite f16 scales
        nb = native_q8.Q8TARGETS[qtype][2]
        q = rng.integers(0, 256, (n, k // 256, nb), dtype=np.uint8)
        for off in ((0, 2) if qtype == "Q4_K" else (208,)):
            q[..., off:off + 2] = (rng.standard_normal((n, k // 256, 1)) * 1e-2).astype(np.float16).view(np.uint8)
        return q.reshape(n, -1)
    return quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType[qtype])
for qtype in native_q8.Q8TARGETS:
    for m, k, n in ((1, 256, 5), (9, 768, 33)) if qtype in ("Q4_K", "Q6_K") else ((1, 96, 5), (9, 576, 33)):
        q = blocks(qtype, n, k)
        x = rng.standard_normal((m, k)).astype(np.float32)
        got = np.asarray(native_q8.q8_matmul(jnp.asarray(x), jnp.asarray(native_q8.q8_layout(q, qtype)), qtype))
        ref = native_q8.q8_matmul_reference(x, q, qtype)
        scale = np.abs(x) @ np.abs(native.dequantize_reference(q, qtype)) + 1e-6
        assert np.all(np.abs(got - ref) <= 2e-6 * scale), (qtype, np.abs(got - ref).max())
        one = np.asarray(native_q8.q8_matmul(jnp.asarray(x[-1:]), jnp.asarray(native_q8.q8_layout(q, qtype)), qtype))
        assert np.array_equal(one[0], got[-1])
print("ok")
"""


@pytest.mark.slow  # two builds of the library (~15 s each) in subprocesses
@pytest.mark.parametrize("cflags", ["-march=haswell", "-DSPECJAX_Q8_PORTABLE"])  # AVX2; plain C++
def test_other_code_paths(cflags, tmp_path):
    import os
    import subprocess
    import sys

    if os.uname().machine != "x86_64":
        pytest.skip("x86 -march targets")
    env = dict(os.environ, SPECJAX_NATIVE_CFLAGS=cflags, SPECJAX_CACHE=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", _OTHER_PATH], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-3000:]
