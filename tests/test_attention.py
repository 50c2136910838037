"""specjax.attention's plain-XLA path (``paged_attention_blockwise``, what impl="reference" runs)
equals the one-shot twin ``paged_attention_reference``: ragged prefix lengths, page sizes, GQA
groups, several new tokens, tree masks, NaN-poisoned stale slots, block sizes from one page to
more than the table, rows with nothing new, bf16; columns past the live length never leak (a much
wider table pointing at NaN pages changes nothing), and its gradients equal the twin's (heads train through it)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import attention
from tests.test_pallas_paged import TOLERANCE, check, poisoned_case, random_parents, reference, tree_mask

CASES = [  # (page_size, Hkv, G, T, dtype, block_pages)
    (8, 1, 1, 1, jnp.float32, None),
    (16, 2, 3, 5, jnp.bfloat16, 1),
    (32, 8, 8, 8, jnp.float32, 3),
    (16, 3, 3, 4, jnp.float32, 1000),
]


def blockwise(*args, **kw):
    with jax.default_matmul_precision("highest"):
        return jax.jit(attention.paged_attention_blockwise,
                       static_argnames=("scale", "block_pages"))(*args, **kw)


@pytest.mark.parametrize("page_size,hkv,g,t,dtype,block_pages", CASES)
def test_blockwise_matches_reference(page_size, hkv, g, t, dtype, block_pages):
    args = poisoned_case(0, (1, 3, 513, 1023), t, hkv, g, page_size, dtype)
    check(blockwise(*args, block_pages=block_pages), reference(*args), dtype)


def test_blockwise_tree_mask_and_ragged_new_tokens():
    rng = np.random.default_rng(3)
    t = 6
    nnew = np.asarray([6, 2, 0, 5])  # row 2: nothing new (prefix only)
    q, k, v, pt, start, nnew = poisoned_case(1, (0, 7, 40, 300), t, 2, 2, 16, jnp.float32,
                                             num_new=nnew)
    mask = tree_mask(random_parents(rng, 4, t))
    for bp in (1, 2, None):
        check(blockwise(q, k, v, pt, start, nnew, mask, block_pages=bp),
              reference(q, k, v, pt, start, nnew, mask), jnp.float32)


def test_columns_past_the_live_length_never_leak():
    """A page table made much wider with columns that point at an all-NaN page gives the same
    output (the blocks past the live length are skipped; a partly live block masks them)."""
    q, k, v, pt, start, nnew = poisoned_case(2, (5, 20), 2, 2, 2, 8, jnp.float32)
    want = reference(q, k, v, pt, start, nnew)
    nan_page = jnp.full(k[:, :1].shape, jnp.nan, k.dtype)
    k_nan, v_nan = (jnp.concatenate([x, nan_page], axis=1) for x in (k, v))
    wide = jnp.concatenate([pt, jnp.full((pt.shape[0], 32), k.shape[1], jnp.int32)], axis=1)
    got = blockwise(q, k_nan, v_nan, wide, start, nnew, block_pages=2)
    check(got, want, jnp.float32)


def test_gradients_match_reference():
    q, k, v, pt, start, nnew = poisoned_case(4, (3, 17), 3, 1, 2, 8, jnp.float32)
    k = jnp.nan_to_num(k)  # gradients flow into every slot: keep the pools finite here
    v = jnp.nan_to_num(v)

    def loss(fn, q, k, v):
        return jnp.sum(jnp.sin(fn(q, k, v, pt, start, nnew)))

    with jax.default_matmul_precision("highest"):
        want = jax.grad(lambda *a: loss(attention.paged_attention_reference, *a), (0, 1, 2))(q, k, v)
        got = jax.grad(lambda *a: loss(
            lambda *b: attention.paged_attention_blockwise(*b, block_pages=1), *a), (0, 1, 2))(q, k, v)
    for g_, w_ in zip(got, want):
        np.testing.assert_allclose(np.asarray(g_), np.asarray(w_), **TOLERANCE[jnp.float32])


def test_dispatch_runs_blockwise_and_rejects_unknown_impl():
    args = poisoned_case(5, (4, 9), 1, 1, 2, 8, jnp.float32)
    check(attention.paged_attention(*args, impl="reference"), reference(*args), jnp.float32)
    with pytest.raises(ValueError, match="impl"):
        attention.paged_attention(*args, impl="nope")
