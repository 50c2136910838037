"""The native few-row CPU matmul (specjax.native): kernel vs its jnp twin, packing, the model."""

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


@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 16, 17])
@pytest.mark.parametrize("k,n", [(3, 1), (64, 31), (64, 32), (577, 33), (130, 1000)])
def test_kernel_matches_reference(m, k, n):
    x, w = _rand((m, k), 0), _rand((k, n), 1)
    panels = native.pack(w)
    got = jax.jit(native.skinny_matmul, static_argnums=2)(x, panels, n)
    np.testing.assert_allclose(got, native.skinny_matmul_reference(x, panels, n), **TOL)
    np.testing.assert_allclose(got, np.asarray(x) @ np.asarray(w), **TOL)


def test_rows_do_not_depend_on_each_other():
    """A row's product is bit-identical alone or among 2..16 rows (decode vs verify)."""
    x, w = _rand((16, 576), 2), _rand((576, 200), 3)
    panels = native.pack(w)
    full = native.skinny_matmul(x, panels, 200)
    for m in (1, 2, 5, 8, 9):
        part = native.skinny_matmul(x[:m], panels, 200)
        assert np.array_equal(np.asarray(part), np.asarray(full[:m]))


def test_packed_weight_matmul_both_paths():
    w = _rand((40, 70), 4)
    pw = native.pack_weight(w)
    for shape in [(1, 40), (2, 3, 40), (4, 4, 40), (3, 7, 40)]:  # 1, 6, 16 rows: kernel; 21: XLA
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
