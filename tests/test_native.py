"""The native few-row CPU matmul (specjax.native): kernel vs its jnp twin, packing, the model."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import model as model_lib
from specjax import native
from specjax.config import ModelConfig

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="native kernel not built (no C++ compiler or not CPU)")

TOL = dict(rtol=2e-5, atol=2e-5)  # float32: the kernel's k-order FMA sum vs XLA's dot


def _rand(shape, seed):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32))


@pytest.mark.parametrize("m", [1, 2, 3, 5, 6, 7, 13, 17])
@pytest.mark.parametrize("k,n", [(3, 1), (64, 31), (64, 32), (577, 33), (130, 1000)])
def test_kernel_matches_reference(m, k, n):
    x, w = _rand((m, k), 0), _rand((k, n), 1)
    panels = native.pack(w)
    got = jax.jit(native.skinny_matmul, static_argnums=2)(x, panels, n)
    np.testing.assert_allclose(got, native.skinny_matmul_reference(x, panels, n), **TOL)
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(w), **TOL)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("m", [1, 6, 7, 17])
@pytest.mark.parametrize("k,n", [(64, 31), (577, 33), (130, 1000)])
def test_half_panels_match_float32_panels(dtype, m, k, n):
    """A weight exact in bf16 / fp16 packs into panels of that type (half the bytes) whose
    products are bit-identical to float32 panels of the same values."""
    x = _rand((m, k), 10)
    w = _rand((k, n), 11).astype(dtype).astype(jnp.float32)
    pw = native.pack_weight(w)
    assert pw.panels.dtype == (jnp.bfloat16 if dtype == jnp.bfloat16 else jnp.float16) or (
        dtype == jnp.float16 and pw.panels.dtype == jnp.bfloat16)  # fp16 values that bf16 holds
    got = jax.jit(lambda a, b: a @ b)(x, pw)
    want = native.skinny_matmul(x, native.pack(w), n)  # float32 panels
    assert np.array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_allclose(got, native.skinny_matmul_reference(x, pw.panels, n), **TOL)


def test_panel_dtype_is_exact():
    w = _rand((16, 40), 12)
    assert native.panel_dtype(w) == jnp.float32                              # full float32 values
    assert native.panel_dtype(w.astype(jnp.bfloat16).astype(jnp.float32)) == jnp.bfloat16
    h = w.astype(jnp.float16).astype(jnp.float32)
    assert native.panel_dtype(h) == jnp.float16                              # 11-bit mantissas
    assert native.panel_dtype(h.at[0, 0].set(1e-30)) == jnp.float32          # below fp16, not bf16-exact
    assert native.panel_dtype(jnp.zeros((3, 3)).at[0, 0].set(2.0 ** 17)) == jnp.bfloat16  # > fp16 max
    big = h.at[0, 0].set(1e5 + 1.0)                                           # not exact in either
    assert native.panel_dtype(big) == jnp.float32


def test_rows_do_not_depend_on_each_other():
    """A row's product is bit-identical alone or among up to 20 rows (decode vs verify)."""
    x, w = _rand((20, 576), 2), _rand((576, 200), 3)
    panels = native.pack(w)
    full = native.skinny_matmul(x, panels, 200)
    for m in (1, 2, 5, 6, 7, 8, 13, 19):
        part = native.skinny_matmul(x[:m], panels, 200)
        assert np.array_equal(np.asarray(part), np.asarray(full[:m]))


def test_packed_weight_matmul_both_paths():
    w = _rand((40, 70), 4)
    pw = native.pack_weight(w)
    big = native.MAX_ROWS + 1
    for shape in [(1, 40), (2, 3, 40), (4, 4, 40), (big, 40)]:  # kernel, kernel, kernel, XLA
        x = _rand(shape, 5)
        got = jax.jit(lambda a, b: a @ b)(x, pw)
        assert got.shape == shape[:-1] + (70,)
        np.testing.assert_allclose(got, x @ w, **TOL)
    fused = native.pack_weight(w[:, :30], w[:, 30:])
    assert fused.parts == (30, 40) and np.array_equal(fused.w, w)


def test_bad_input():
    x, panels = _rand((2, 8), 6), native.pack(_rand((8, 40), 7))
    with pytest.raises(ValueError, match="panels"):
        native.skinny_matmul(x, panels[:, :4], 40)
    with pytest.raises(ValueError, match="n=70"):
        native.skinny_matmul(x, panels, 70)
    with pytest.raises(TypeError, match="float32"):
        native.skinny_matmul(x.astype(jnp.bfloat16), panels, 40)
    with pytest.raises(TypeError, match="float32"):
        native.skinny_matmul(x, panels.astype(jnp.int8), 40)


@pytest.mark.parametrize("tie,bias,qk_norm", [(True, False, False), (False, True, True)])
def test_packed_params_forward_matches(tie, bias, qk_norm):
    """The model over packed params gives the canonical logits (decode, verify and prefill
    widths) and writes the same K/V."""
    from specjax import speculate  # noqa: PLC0415

    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, tie_word_embeddings=tie,
                      attention_bias=bias, mlp_bias=bias, qk_norm=qk_norm)
    params = model_lib.init_params(cfg, jax.random.PRNGKey(0), scale=0.1)
    packed = native.pack_params(params)
    assert "wq+wk+wv" in packed["layers"][0] and "lm_head_packed" in packed
    for t in (1, 4, 20):
        kv = speculate.init_cache(cfg, 4, 16, jnp.float32)
        args = (jnp.arange(2 * t, dtype=jnp.int32).reshape(2, t) % 97,
                jnp.tile(jnp.arange(t, dtype=jnp.int32), (2, 1)), kv,
                jnp.arange(4, dtype=jnp.int32).reshape(2, 2), jnp.zeros((2,), jnp.int32))
        fwd = jax.jit(lambda p, *a: model_lib.forward(p, cfg, *a))
        ref_logits, ref_h, ref_kv = fwd(params, *args)
        logits, h, kv_out = fwd(packed, *args)
        np.testing.assert_allclose(logits, ref_logits, **TOL)
        np.testing.assert_allclose(h, ref_h, **TOL)
        np.testing.assert_allclose(kv_out.k[1], ref_kv.k[1], **TOL)


def test_inference_params_is_cached_per_model():
    cfg = ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16)
    m = model_lib.Model(params=model_lib.init_params(cfg, jax.random.PRNGKey(1)), config=cfg)
    first = native.inference_params(m)
    assert native.inference_params(m) is first
    assert "wq" in m.params["layers"][0]  # the model's own params stay canonical
    assert native.inference_params(None) is None


@pytest.mark.parametrize("kind,vocab,half", [("mtp", 0, False), ("mtp", 20, False),
                                             pytest.param("eagle3", 24, False, marks=pytest.mark.slow),
                                             ("eagle3", 24, True)])
def test_packed_head_matches(kind, vocab, half):
    """A head packed by inference_params (block, eh_proj / fc, the precomputed output
    projection over its draft vocabulary) gives the canonical features, hidden states and
    logits, and greedy speculation with it equals plain decoding. ``half``: a head whose
    weights are float16 values (as EAGLE-3 checkpoints are stored) packs into fp16 panels."""
    import specjax as sj  # noqa: PLC0415
    from specjax import heads, kv_cache  # noqa: PLC0415
    from specjax.heads import Head, HeadConfig  # noqa: PLC0415

    cfg = ModelConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_layers=4,
                      num_heads=2, num_kv_heads=1, head_dim=16, tie_word_embeddings=True)
    target = model_lib.Model(params=model_lib.init_params(cfg, jax.random.PRNGKey(2), scale=0.3),
                             config=cfg)
    hcfg = HeadConfig.for_target(cfg, kind, aux_layers=(0, 1, 2) if kind == "eagle3" else None)
    hcfg = dataclasses.replace(hcfg, draft_vocab_size=vocab)
    hparams = heads.init_head(hcfg, jax.random.PRNGKey(3), scale=0.3)
    if half:
        hparams = jax.tree.map(lambda a: a.astype(jnp.float16).astype(jnp.float32)
                               if a.dtype == jnp.float32 else a, hparams)
    head = Head(params=hparams, config=hcfg)
    packed = native.inference_params(head, target)
    want_dtype = jnp.dtype(jnp.float16 if half else jnp.float32)
    assert {packed["layer"]["wo"].panels.dtype, packed["fc" if kind == "eagle3" else "eh_proj"]
            .panels.dtype, packed["lm_head_packed"].panels.dtype} <= {want_dtype,
                                                                     jnp.dtype(jnp.bfloat16)}
    assert packed["layer"]["w_down"].panels.dtype == want_dtype
    assert "lm_head_packed" in packed and "wq+wk+wv" in packed["layer"]
    assert native.inference_params(head, target) is packed
    b, t = 2, 3
    tokens = jnp.arange(b * t, dtype=jnp.int32).reshape(b, t) % 61
    pos = jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1))
    hidden = _rand((b, t, 32), 8)
    aux = _rand((b, t, 96), 9) if kind == "eagle3" else None

    def run(hp):
        feats = heads.head_features(hp, hcfg, target.params, cfg, hidden, aux)
        kv, pt = kv_cache.init_contiguous(hcfg.layer, b, t + 4)
        h, _ = heads.head_forward(hp, hcfg, target.params, tokens, feats, pos, kv, pt,
                                  jnp.zeros((b,), jnp.int32))
        return feats, h, heads.head_logits(hp, hcfg, target.params, cfg, h)

    for got, want in zip(jax.jit(run)(packed), jax.jit(run)(head.params)):  # float32 noise
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-5 * max(1.0, float(
            jnp.max(jnp.abs(want)))))
    prompts = [[1, 5, 9, 2], [7, 3]]
    plain = sj.generate(target, prompts, max_new_tokens=12, eos_token_id=[])
    spec = sj.generate(target, prompts, max_new_tokens=12, eos_token_id=[], draft=head,
                       method=kind, num_draft_tokens=2)
    assert spec.tokens == plain.tokens
