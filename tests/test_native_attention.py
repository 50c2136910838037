"""The native CPU paged attention (specjax/csrc/paged_attention.cc) against its plain twin.

``paged_attention_reference`` (one-shot jnp over the whole page table) is the oracle: prefix +
new tokens, GQA / MQA / MHA, sliding windows, tree masks, unmapped pages below the window,
rows that may read nothing, several sequences. A row's output must not depend on the other rows
(decode vs verify), and gradients flow through the jnp path's VJP.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.paged_attention import paged_attention_reference
from specjax import attention, native_attention, native_build

pytestmark = pytest.mark.skipif(not native_build.available(),
                                reason="native kernels not built (no C++ compiler or not CPU)")


def _case(rng, b, t, h, hkv, d, p, s, pmax, tree=False):
    q = jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((hkv, p, s, d)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((hkv, p, s, d)), jnp.float32)
    table = jnp.asarray(rng.permutation(p)[:b * pmax].reshape(b, pmax), jnp.int32)
    start = jnp.asarray(rng.integers(0, pmax * s - t, b), jnp.int32)
    num_new = jnp.asarray(rng.integers(1, t + 1, b), jnp.int32)
    mask = None
    if tree:  # an ancestor-like mask: random lower-triangular with the diagonal
        m = np.tril(rng.random((b, t, t)) < 0.5) | np.eye(t, dtype=bool)[None]
        mask = jnp.asarray(m)
    return q, k, v, table, start, num_new, mask


@pytest.mark.parametrize("b,t,h,hkv,d,s,window,tree", [
    (1, 1, 9, 3, 64, 16, None, False),   # SmolLM2's decode shape
    (2, 4, 8, 2, 32, 4, None, False),    # verify, GQA
    (3, 5, 4, 1, 16, 4, 7, False),       # MQA, sliding window
    (2, 6, 4, 4, 8, 4, None, True),      # MHA, tree mask
    (2, 6, 4, 2, 24, 4, 5, True),        # window + tree, odd head dim
])
def test_equals_reference(b, t, h, hkv, d, s, window, tree):
    rng = np.random.default_rng(b * 100 + t)
    q, k, v, table, start, num_new, mask = _case(rng, b, t, h, hkv, d, 64, s, 10, tree)
    assert native_attention.applies(q, k, None)
    got = attention.paged_attention(q, k, v, table, start, num_new, mask, window=window, scale=0.3)
    ref = paged_attention_reference(q, k, v, table, start, num_new, mask, window=window, scale=0.3)
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), atol=2e-6, rtol=1e-5)


def test_released_pages_nothing_readable_and_nan_pools():
    """Unmapped (-1) pages below every query's window are never read, NaN-poisoned slots past
    the sequence never leak, and a row with nothing to read gives 0."""
    rng = np.random.default_rng(1)
    q, k, v, table, start, num_new, _ = _case(rng, 2, 2, 4, 2, 8, 40, 4, 8)
    start = jnp.asarray([20, 0], jnp.int32)
    num_new = jnp.asarray([2, 0], jnp.int32)  # row 1 reads nothing at all
    table = table.at[0, :3].set(-1)  # slots 0..11 released; window 6 from position 20
    k = k.at[:, table[0, 6]].set(jnp.nan)  # slots 24..27: past row 0's 22 live slots
    got = np.asarray(attention.paged_attention(q, k, v, table, start, num_new, window=6))
    ref = paged_attention_reference(q, k, v, jnp.maximum(table, 0), start, num_new, window=6)
    assert np.all(np.isfinite(got))
    np.testing.assert_allclose(got[0], np.asarray(ref)[0], atol=2e-6, rtol=1e-5)
    assert np.array_equal(got[1], np.zeros_like(got[1]))


def test_a_row_does_not_depend_on_the_others():
    """Decode (T = 1) and a verify whose first row is the same query give bit-identical rows."""
    rng = np.random.default_rng(2)
    q, k, v, table, start, _, _ = _case(rng, 1, 4, 9, 3, 64, 32, 16, 6)
    four = attention.paged_attention(q, k, v, table, start, jnp.asarray([4], jnp.int32))
    one = attention.paged_attention(q[:, :1], k, v, table, start, jnp.asarray([1], jnp.int32))
    assert np.array_equal(np.asarray(one[:, 0]), np.asarray(four[:, 0]))


def test_gradient_is_the_jnp_paths():
    rng = np.random.default_rng(3)
    q, k, v, table, start, num_new, _ = _case(rng, 1, 3, 4, 2, 8, 16, 4, 4)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, table, start, num_new)))

    got = jax.grad(lambda *a: loss(attention.paged_attention, *a), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(lambda *a: loss(attention.paged_attention_blockwise, *a),
                    argnums=(0, 1, 2))(q, k, v)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5)


def test_applies_only_to_few_float32_rows():
    q = jnp.zeros((1, 4, 8, 16), jnp.float32)
    k = jnp.zeros((2, 8, 4, 16), jnp.float32)
    assert native_attention.applies(q, k, None) and native_attention.applies(q, k, 0.5)
    assert not native_attention.applies(q.astype(jnp.bfloat16), k, None)
    assert not native_attention.applies(jnp.zeros((1, native_attention.MAX_ROWS + 1, 8, 16)), k, None)
    assert not native_attention.applies(q, k, jnp.float32(0.5))  # a traced / array scale
    assert not native_attention.applies(q, k, None, jnp.zeros((2, 8, 4, 8)))  # values' own D
