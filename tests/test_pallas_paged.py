"""The Pallas paged-attention kernel equals its plain-jnp reference: awkward prefix lengths, page
sizes, GQA groups, padded queries, tree masks, NaN-poisoned stale slots, and a model forward."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from specjax import kv_cache
from specjax.model import forward
from tests.conftest import tiny_model

TOLERANCE = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
PREFIXES = (1, 3, 13)  # one sequence per prefix length, batched in one call
D = 8


def _random_case(seed, prefixes, t, hkv, g, page_size, dtype, num_new=None, spare_pages=3):
    """Random (never zero) q and pools, scrambled page tables, -1 beyond each sequence's pages."""
    rng = np.random.default_rng(seed)
    b = len(prefixes)
    num_new = np.full(b, t) if num_new is None else np.asarray(num_new)
    lengths = np.asarray(prefixes) + num_new
    pmax = kv_cache.pages_needed(int(lengths.max()), page_size) + 1  # one unused column
    owned = [kv_cache.pages_needed(int(n), page_size) for n in lengths]
    num_pages = sum(owned) + spare_pages
    perm = rng.permutation(num_pages)
    table = np.full((b, pmax), -1, np.int32)
    used = 0
    for i, n in enumerate(owned):
        table[i, :n] = perm[used:used + n]
        used += n

    def nonzero(*shape):
        x = rng.uniform(0.5, 1.5, size=shape) * rng.choice([-1.0, 1.0], size=shape)
        return jnp.asarray(x, dtype)

    q = nonzero(b, t, hkv * g, D)
    k = nonzero(hkv, num_pages, page_size, D)
    v = nonzero(hkv, num_pages, page_size, D)
    return (q, k, v, jnp.asarray(table), jnp.asarray(prefixes, jnp.int32),
            jnp.asarray(num_new, jnp.int32))


def _poison(pages, page_table, lengths):
    """NaN into every slot no sequence may read (beyond lengths, unowned pages)."""
    hkv, num_pages, page_size, _ = pages.shape
    readable = np.zeros((num_pages, page_size), bool)
    table = np.asarray(page_table)
    for b, n in enumerate(np.asarray(lengths)):
        for slot in range(int(n)):
            readable[table[b, slot // page_size], slot % page_size] = True
    return jnp.where(jnp.asarray(readable)[None, :, :, None], pages, jnp.nan)


def _tree_mask(rng, b, t):
    """Ancestor-or-self masks of random trees (node i's parent is a random earlier node)."""
    mask = np.zeros((b, t, t), bool)
    for i in range(b):
        parent = [-1] + [int(rng.integers(0, n)) for n in range(1, t)]
        for n in range(t):
            a = n
            while a >= 0:
                mask[i, n, a] = True
                a = parent[a]
    return jnp.asarray(mask)


class TestPagedAttentionInterpret:
    INTERPRET = True

    def _run(self, *args, **kw):
        return pa.paged_attention(*args, interpret=self.INTERPRET, **kw)

    def _check(self, got, want, dtype):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.isfinite(np.asarray(got, np.float32)).all()
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   **TOLERANCE[dtype])

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("t", [1, 5])
    @pytest.mark.parametrize("hkv,g", [(1, 1), (2, 3)])
    @pytest.mark.parametrize("page_size", [8, 16])
    def test_matches_reference(self, page_size, hkv, g, t, dtype):
        args = _random_case(0, PREFIXES, t, hkv, g, page_size, dtype)
        self._check(self._run(*args), pa.paged_attention_reference(*args), dtype)

    @pytest.mark.parametrize("hkv,g", [(1, 3), (2, 1)])
    def test_padded_queries_and_tree_mask_with_nan_pages(self, hkv, g):
        """num_new < T (padding queries), a tree mask, and NaN in every unreadable slot."""
        t, page_size = 6, 8
        q, k, v, pt, start, nnew = _random_case(1, PREFIXES, t, hkv, g, page_size, jnp.float32,
                                                num_new=(6, 4, 1))
        mask = _tree_mask(np.random.default_rng(2), len(PREFIXES), t)
        want = pa.paged_attention_reference(q, k, v, pt, start, nnew, mask)
        lengths = start + nnew
        kn, vn = _poison(k, pt, lengths), _poison(v, pt, lengths)
        got = self._run(q, kn, vn, pt, start, nnew, mask)
        self._check(got, want, jnp.float32)
        # the reference agrees on the poisoned pools too
        self._check(pa.paged_attention_reference(q, kn, vn, pt, start, nnew, mask), want,
                    jnp.float32)

    def test_split_rows_multiword_mask_single_page_blocks(self):
        """T = 34 (two mask words), rows split over three programs, one page per loop step."""
        t = 34
        q, k, v, pt, start, nnew = _random_case(6, (3, 13), t, 1, 1, 8, jnp.float32,
                                                num_new=(34, 33))
        mask = _tree_mask(np.random.default_rng(7), 2, t)
        sizes = pa.BlockSizes(pages_per_block=1, block_rows=16)
        got = self._run(q, k, v, pt, start, nnew, mask, block_sizes=sizes)
        self._check(got, pa.paged_attention_reference(q, k, v, pt, start, nnew, mask), jnp.float32)

    def test_empty_rows_and_custom_scale(self):
        """A sequence with nothing to read gives zeros (as the reference); scale is honoured."""
        q, k, v, pt, _, _ = _random_case(3, (0, 5), 2, 1, 3, 8, jnp.float32)
        start, nnew = jnp.array([0, 5], jnp.int32), jnp.array([0, 2], jnp.int32)
        got = self._run(q, k, v, pt, start, nnew, scale=0.7)
        want = pa.paged_attention_reference(q, k, v, pt, start, nnew, scale=0.7)
        self._check(got, want, jnp.float32)
        assert not np.asarray(got[0]).any()

    @pytest.mark.slow
    def test_long_prefix(self):
        args = _random_case(4, (513, 2), 5, 2, 3, 16, jnp.float32)
        self._check(self._run(*args), pa.paged_attention_reference(*args), jnp.float32)

    def test_rejects_bad_inputs(self):
        q, k, v, pt, start, nnew = _random_case(5, (3,), 2, 2, 2, 8, jnp.float32)
        with pytest.raises(ValueError, match="multiple"):
            self._run(q[:, :, :3], k, v, pt, start, nnew)
        with pytest.raises(ValueError, match="head dim"):
            self._run(q[..., :4], k, v, pt, start, nnew)
        with pytest.raises(ValueError, match="cache_start"):
            self._run(q, k, v, pt, start.astype(jnp.float32), nnew)
        with pytest.raises(ValueError, match="new_mask"):
            self._run(q, k, v, pt, start, nnew, jnp.ones((1, 2, 3), bool))
        with pytest.raises(ValueError, match="pages_per_block"):
            pa.BlockSizes(pages_per_block=3)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton lowering)")
class TestPagedAttentionGPU(TestPagedAttentionInterpret):
    INTERPRET = False


def test_model_forward_pallas_equals_reference():
    """Prefill then a 3-token verify step through a tiny GQA model: same logits either way."""
    model = tiny_model(0)  # 4 heads over 2 KV heads, head_dim 8
    cfg, b, page_size = model.config, 2, 8
    rng = np.random.default_rng(0)
    pt = jnp.asarray(rng.permutation(8).reshape(b, 4), jnp.int32)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(b, 7)), jnp.int32)
    draft = jnp.asarray(rng.integers(0, cfg.vocab_size, size=(b, 3)), jnp.int32)
    logits = {}
    for impl in ("reference", "pallas"):
        kv = kv_cache.init_cache(cfg, 8, page_size)
        pos = jnp.broadcast_to(jnp.arange(7), (b, 7))
        zero = jnp.zeros(b, jnp.int32)
        l1, _, kv = forward(model.params, cfg, prompt, pos, kv, pt, zero,
                            jnp.array([7, 5], jnp.int32), attn_impl=impl)
        start = jnp.array([7, 5], jnp.int32)
        pos = start[:, None] + jnp.arange(3)[None, :]
        l2, _, _ = forward(model.params, cfg, draft, pos, kv, pt, start, attn_impl=impl)
        logits[impl] = (np.asarray(l1), np.asarray(l2))
    for got, want in zip(logits["pallas"], logits["reference"]):
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
