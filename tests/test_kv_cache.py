"""Paged KV cache: chunked decoding through awkward page sizes equals one full forward, and
entries beyond a sequence's length are provably never read."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax import kv_cache
from specjax.attention import paged_attention_reference
from specjax.model import forward
from tests.conftest import tiny_model

T = 23


def _full_logits(model, ids):
    b, t = ids.shape
    kv = kv_cache.init_cache(model.config, b * 2, 32)
    pt = kv_cache.contiguous_page_table(b, 2)
    pos = jnp.broadcast_to(jnp.arange(t), (b, t))
    logits, _, _ = forward(model.params, model.config, ids, pos, kv, pt, jnp.zeros(b, jnp.int32))
    return np.asarray(logits)


def _scrambled_page_table(b, per_seq, num_pages, seed):
    perm = np.random.RandomState(seed).permutation(num_pages)[: b * per_seq]
    return jnp.asarray(perm.reshape(b, per_seq), jnp.int32)


@pytest.mark.parametrize("page_size", [1, 3, 16])
@pytest.mark.parametrize("chunks", [(T,), (5, 1, 1, 7, 9), (1,) * T])
def test_chunked_paged_decode_equals_full_forward(page_size, chunks):
    model = tiny_model(3, kv_heads=1)
    b = 2
    ids = jnp.asarray(np.random.RandomState(0).randint(0, 64, size=(b, T)), jnp.int32)
    want = _full_logits(model, ids)
    per_seq = kv_cache.pages_needed(T, page_size)
    num_pages = b * per_seq + 5  # spare pages that nobody owns
    pt = _scrambled_page_table(b, per_seq, num_pages, page_size)  # non-contiguous pages
    kv = kv_cache.init_cache(model.config, num_pages, page_size)
    step = jax.jit(forward, static_argnames=("cfg",))
    got, start = [], 0
    for c in chunks:
        pos = jnp.broadcast_to(jnp.arange(start, start + c), (b, c))
        logits, _, kv = step(model.params, model.config, ids[:, start:start + c], pos, kv, pt,
                             jnp.full((b,), start, jnp.int32))
        got.append(np.asarray(logits))
        start += c
    np.testing.assert_allclose(np.concatenate(got, axis=1), want, rtol=1e-5, atol=1e-5)


def test_ragged_rows_and_padding_not_written():
    """Rows with different lengths in one call: padding is neither written nor attended to."""
    model = tiny_model(4)
    ids = np.random.RandomState(1).randint(0, 64, size=(2, 12))
    lens = jnp.asarray([12, 5], jnp.int32)
    kv = kv_cache.init_cache(model.config, 8, 4)
    pt = kv_cache.contiguous_page_table(2, 4)
    pos = jnp.broadcast_to(jnp.arange(12), (2, 12))
    logits, _, kv = forward(model.params, model.config, jnp.asarray(ids), pos, kv, pt,
                            jnp.zeros(2, jnp.int32), lens)
    short = _full_logits(model, jnp.asarray(ids[1:2, :5]))
    np.testing.assert_allclose(np.asarray(logits)[1, :5], short[0], rtol=1e-5, atol=1e-5)
    # row 1 owns pages 4..7; slots 5.. (page 5 offset 1 onwards) were never written
    k0 = np.asarray(kv.k[0])
    assert np.all(k0[:, 5, 1:] == 0) and np.all(k0[:, 6:8] == 0)


@pytest.mark.parametrize("page_size", [1, 3, pytest.param(16, marks=pytest.mark.slow)])
def test_poisoned_stale_entries_never_read(page_size):
    """NaN in every slot at or beyond a row's length (and in unowned pages) changes nothing."""
    model = tiny_model(5)
    b, prefix = 3, 11
    ids = jnp.asarray(np.random.RandomState(2).randint(0, 64, size=(b, prefix + 1)), jnp.int32)
    per_seq = kv_cache.pages_needed(prefix + 8, page_size)
    num_pages = b * per_seq + 2
    pt = _scrambled_page_table(b, per_seq, num_pages, 7)
    lens = jnp.asarray([11, 4, 9], jnp.int32)

    def run(poison):
        kv = kv_cache.init_cache(model.config, num_pages, page_size)
        if poison:
            kv = kv_cache.KVCache(k=tuple(jnp.full_like(a, jnp.nan) for a in kv.k),
                                  v=tuple(jnp.full_like(a, jnp.nan) for a in kv.v))
        pos = jnp.broadcast_to(jnp.arange(prefix), (b, prefix))
        _, _, kv = forward(model.params, model.config, ids[:, :prefix], pos, kv, pt,
                           jnp.zeros(b, jnp.int32), lens)
        # one decode token per row at its own length, then a 3-token verify-style chunk
        tok = jnp.take_along_axis(ids, lens[:, None], axis=1)
        l1, _, kv = forward(model.params, model.config, tok, lens[:, None], kv, pt, lens)
        chunk = ids[:, :3]
        pos3 = (lens + 1)[:, None] + jnp.arange(3)[None]
        l3, _, kv = forward(model.params, model.config, chunk, pos3, kv, pt, lens + 1)
        return np.asarray(l1), np.asarray(l3)

    clean, poisoned = run(False), run(True)
    for a, p in zip(clean, poisoned):
        assert np.isfinite(p).all()
        np.testing.assert_array_equal(a, p)


def test_tree_mask_among_new_tokens():
    """An explicit causal new_mask equals the default; a diagonal mask attends prefix + self."""
    rng = np.random.RandomState(3)
    hkv, p, s, d, b, t, h = 2, 6, 4, 8, 2, 3, 4
    kp = jnp.asarray(rng.randn(hkv, p, s, d), jnp.float32)
    vp = jnp.asarray(rng.randn(hkv, p, s, d), jnp.float32)
    q = jnp.asarray(rng.randn(b, t, h, d), jnp.float32)
    pt = jnp.asarray([[0, 1, 2], [3, 4, 5]], jnp.int32)
    start, n = jnp.asarray([5, 2], jnp.int32), jnp.asarray([3, 3], jnp.int32)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
    a = paged_attention_reference(q, kp, vp, pt, start, n)
    np.testing.assert_array_equal(a, paged_attention_reference(q, kp, vp, pt, start, n, causal))
    diag = jnp.broadcast_to(jnp.eye(t, dtype=bool), (b, t, t))
    got = np.asarray(paged_attention_reference(q, kp, vp, pt, start, n, diag))
    # brute force for row 0, query 2: prefix slots 0..4 plus its own slot 7
    keys = np.asarray(kp)[:, np.asarray(pt[0])].reshape(hkv, -1, d)
    vals = np.asarray(vp)[:, np.asarray(pt[0])].reshape(hkv, -1, d)
    slots = [0, 1, 2, 3, 4, 7]
    for hh in range(h):
        kh = hh // (h // hkv)
        sc = keys[kh, slots] @ np.asarray(q)[0, 2, hh] / np.sqrt(d)
        w = np.exp(sc - sc.max()); w /= w.sum()
        np.testing.assert_allclose(got[0, 2, hh], w @ vals[kh, slots], rtol=1e-5, atol=1e-5)
