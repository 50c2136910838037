"""The Pallas paged-attention kernel (decode / verify, split-K) equals its plain-jnp reference:
awkward prefix lengths, page sizes, GQA groups, padded queries, tree masks, NaN-poisoned stale
slots; its Triton lowering; and the speculative loop through ``attn_impl="pallas"``.

``TestPagedAttentionInterpret`` runs on CPU through the Pallas interpreter; the GPU subclass runs
the same tests compiled through Triton (``-m gpu`` on the device machine). The full cross-product
of shapes is ``-m slow``; the default run takes a representative set covering every value.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels import tree_attention as ta
from specjax import kv_cache

TOLERANCE = {jnp.float32: dict(atol=1e-5, rtol=1e-5), jnp.bfloat16: dict(atol=2e-2, rtol=2e-2)}
LENGTHS = (1, 3, 513, 1023)  # prefix lengths, one sequence each, batched in one call
PAGE_SIZES = (8, 16, 32)
KV_GROUPS = tuple(itertools.product((1, 2, 8), (1, 3, 8)))  # (Hkv, G = H / Hkv)
QUERIES = (1, 5, 8)
DTYPES = (jnp.float32, jnp.bfloat16)
# Default run: every value of every axis at least once (the cross-product is -m slow).
REPRESENTATIVE = [  # (page_size, Hkv, G, T, dtype)
    (8, 1, 1, 1, jnp.float32),
    (16, 2, 3, 5, jnp.bfloat16),
    (32, 8, 8, 8, jnp.float32),
]


def random_case(seed, prefixes, t, hkv, g, page_size, dtype, num_new=None, spare_pages=3, d=8):
    """Random (never zero) q and pools, scrambled page tables, -1 beyond each sequence's pages.

    Returns (q [B, T, Hkv*G, d], k, v [Hkv, P, S, d], page_table [B, Pmax], cache_start [B],
    num_new [B]).
    """
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

    q = nonzero(b, t, hkv * g, d)
    k = nonzero(hkv, num_pages, page_size, d)
    v = nonzero(hkv, num_pages, page_size, d)
    return (q, k, v, jnp.asarray(table), jnp.asarray(prefixes, jnp.int32),
            jnp.asarray(num_new, jnp.int32))


def poison(pages, page_table, lengths):
    """NaN into every slot no sequence may read (beyond lengths, unowned pages)."""
    hkv, num_pages, page_size, _ = pages.shape
    readable = np.zeros((num_pages, page_size), bool)
    table = np.asarray(page_table)
    for b, n in enumerate(np.asarray(lengths)):
        for slot in range(int(n)):
            readable[table[b, slot // page_size], slot % page_size] = True
    return jnp.where(jnp.asarray(readable)[None, :, :, None], pages, jnp.nan)


def poisoned_case(*args, **kw):
    """random_case with NaN in every unreadable slot of both pools."""
    q, k, v, pt, start, nnew = random_case(*args, **kw)
    return q, poison(k, pt, start + nnew), poison(v, pt, start + nnew), pt, start, nnew


def random_parents(rng, b, n, roots=1):
    """[B, N] int32 parent arrays of random trees (node i's parent is a random earlier node, the
    first ``roots`` nodes are roots)."""
    par = np.full((b, n), -1, np.int32)
    for i in range(b):
        for j in range(roots, n):
            par[i, j] = rng.integers(0, j)
    return par


def tree_mask(parents):
    """[B, N] parents -> [B, N, N] ancestor-or-self mask (the walked plain-jnp builder)."""
    return ta.ancestor_mask_reference(jnp.asarray(parents))


def check(got, want, dtype):
    assert got.dtype == want.dtype and got.shape == want.shape
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               **TOLERANCE[dtype])


def exact(fn):
    """fn jitted, run with full-float32 matmuls (XLA's GPU default for float32 is TF32, which
    the kernels do not use: their float32 dots are IEEE)."""
    jitted = jax.jit(fn, static_argnames=("scale",))

    def run(*args, **kw):
        with jax.default_matmul_precision("highest"):
            return jitted(*args, **kw)
    return run


reference = exact(pa.paged_attention_reference)


class TestPagedAttentionInterpret:
    INTERPRET = True
    HEAD_DIM = 8

    def _run(self, *args, **kw):
        return pa.paged_attention(*args, interpret=self.INTERPRET, **kw)

    def _case(self, *args, **kw):
        return poisoned_case(*args, d=self.HEAD_DIM, **kw)

    def _matches(self, page_size, hkv, g, t, dtype, **sizes):
        args = self._case(0, LENGTHS, t, hkv, g, page_size, dtype)
        check(self._run(*args, block_sizes=pa.BlockSizes(**sizes)), reference(*args), dtype)

    @pytest.mark.parametrize("page_size,hkv,g,t,dtype", REPRESENTATIVE)
    def test_matches_reference(self, page_size, hkv, g, t, dtype):
        """Lengths 1, 3, 513, 1023 in one batch, NaN beyond them, auto split-K."""
        self._matches(page_size, hkv, g, t, dtype)

    @pytest.mark.slow
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("t", QUERIES)
    @pytest.mark.parametrize("hkv,g", KV_GROUPS)
    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_matches_reference_all_shapes(self, page_size, hkv, g, t, dtype):
        self._matches(page_size, hkv, g, t, dtype)

    def test_split_k_matches_unsplit(self):
        """Split-K (3 splits: more than the short sequences have key blocks, so some splits are
        empty) equals the unsplit kernel and the reference; a tree mask and padded queries ride
        along."""
        t = 6
        q, k, v, pt, start, nnew = self._case(1, LENGTHS, t, 2, 3, 16, jnp.float32,
                                              num_new=(6, 1, 4, 6))
        mask = tree_mask(random_parents(np.random.default_rng(2), len(LENGTHS), t))
        want = reference(q, k, v, pt, start, nnew, mask)
        outs = [self._run(q, k, v, pt, start, nnew, mask,
                          block_sizes=pa.BlockSizes(num_splits=n, pages_per_block=2))
                for n in (1, 3)]
        for got in outs:
            check(got, want, jnp.float32)
        np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(outs[0]), atol=1e-6, rtol=1e-6)

    def test_split_merge_of_empty_splits(self):
        """merge_splits: empty splits (l = 0) drop out; all-empty rows give 0."""
        rng = np.random.default_rng(0)
        acc = jnp.asarray(rng.normal(size=(1, 1, 3, 2, 4)), jnp.float32)
        m = jnp.asarray([[[[0.5, pa.C.MASK_VALUE], [2.0, pa.C.MASK_VALUE],
                           [pa.C.MASK_VALUE, pa.C.MASK_VALUE]]]], jnp.float32)
        l = jnp.asarray([[[[1.5, 0.0], [0.7, 0.0], [0.0, 0.0]]]], jnp.float32)
        acc = acc.at[0, 0, 2].set(0.0).at[0, 0, :, 1].set(0.0)
        o = np.asarray(jax.jit(pa.merge_splits)(acc, m, l))
        w = np.exp(np.array([0.5, 2.0]) - 2.0)
        want = (w[:, None] * np.asarray(acc)[0, 0, :2, 0]).sum(0) / (w * [1.5, 0.7]).sum()
        np.testing.assert_allclose(o[0, 0, 0], want, rtol=1e-6)
        assert not o[0, 0, 1].any()

    def test_padded_queries_and_tree_mask_with_nan_pages(self):
        """num_new < T (padding queries), a tree mask, and NaN in every unreadable slot."""
        t, page_size, hkv, g = 6, 8, 1, 3
        q, k, v, pt, start, nnew = random_case(1, (1, 3, 13), t, hkv, g, page_size, jnp.float32,
                                               num_new=(6, 4, 1), d=self.HEAD_DIM)
        mask = tree_mask(random_parents(np.random.default_rng(2), 3, t))
        want = reference(q, k, v, pt, start, nnew, mask)
        lengths = start + nnew
        kn, vn = poison(k, pt, lengths), poison(v, pt, lengths)
        check(self._run(q, kn, vn, pt, start, nnew, mask), want, jnp.float32)
        # the reference agrees on the poisoned pools too
        check(reference(q, kn, vn, pt, start, nnew, mask), want, jnp.float32)

    def test_split_rows_multiword_mask_single_page_blocks(self):
        """T = 34 (two mask words), rows split over three programs, one page per loop step."""
        t = 34
        q, k, v, pt, start, nnew = self._case(6, (3, 13), t, 1, 1, 8, jnp.float32,
                                              num_new=(34, 33))
        mask = tree_mask(random_parents(np.random.default_rng(7), 2, t))
        sizes = pa.BlockSizes(pages_per_block=1, block_rows=16)
        got = self._run(q, k, v, pt, start, nnew, mask, block_sizes=sizes)
        check(got, reference(q, k, v, pt, start, nnew, mask), jnp.float32)

    def test_empty_rows_and_custom_scale(self):
        """A sequence with nothing to read gives zeros (as the reference); scale is honoured."""
        q, k, v, pt, _, _ = random_case(3, (0, 5), 2, 1, 3, 8, jnp.float32, d=self.HEAD_DIM)
        start, nnew = jnp.array([0, 5], jnp.int32), jnp.array([0, 2], jnp.int32)
        got = self._run(q, k, v, pt, start, nnew, scale=0.7)
        check(got, reference(q, k, v, pt, start, nnew, scale=0.7), jnp.float32)
        assert not np.asarray(got[0]).any()

    def test_rejects_bad_inputs(self):
        q, k, v, pt, start, nnew = random_case(5, (3,), 2, 2, 2, 8, jnp.float32)
        with pytest.raises(ValueError, match="multiple"):
            self._run(q[:, :, :3], k, v, pt, start, nnew)
        with pytest.raises(ValueError, match="head dim"):
            self._run(q[..., :4], k, v, pt, start, nnew)
        with pytest.raises(ValueError, match="cache_start"):
            self._run(q, k, v, pt, start.astype(jnp.float32), nnew)
        with pytest.raises(ValueError, match="num_new"):
            self._run(q, k, v, pt, start, nnew[:0])
        with pytest.raises(ValueError, match="page_table"):
            self._run(q, k, v, pt[0], start, nnew)
        with pytest.raises(ValueError, match="k_pages"):
            self._run(q, k, v.astype(jnp.bfloat16), pt, start, nnew)
        with pytest.raises(ValueError, match="new_mask"):
            self._run(q, k, v, pt, start, nnew, jnp.ones((1, 2, 3), bool))
        with pytest.raises(ValueError, match="pages_per_block"):
            pa.BlockSizes(pages_per_block=3)
        with pytest.raises(ValueError, match="num_splits"):
            pa.BlockSizes(num_splits=0)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton lowering)")
class TestPagedAttentionGPU(TestPagedAttentionInterpret):
    INTERPRET = False
    HEAD_DIM = 64


def test_auto_num_splits():
    assert pa.auto_num_splits(programs=512, max_keys=32768) == 1  # the grid is full already
    assert pa.auto_num_splits(programs=8, max_keys=32768) == 33  # long and a small grid
    assert pa.auto_num_splits(programs=8, max_keys=1024) == 2  # never under 512 keys a split
    assert pa.auto_num_splits(programs=1, max_keys=100) == 1


def test_lowers_to_triton():
    """Every kernel variant lowers through Pallas's Triton backend (checked on CPU: the lowering
    builds and verifies the Triton module; compiling it needs the GPU)."""
    from pallas_kernels import prefill_attention as pf
    from pallas_kernels import tree_attention as ta

    b, t, hkv, g, d, pages, s = 2, 5, 2, 4, 128, 64, 16
    q = jnp.zeros((b, t, hkv * g, d), jnp.bfloat16)
    kp = jnp.zeros((hkv, pages, s, d), jnp.bfloat16)
    pt = jnp.zeros((b, 32), jnp.int32)
    start = nnew = jnp.zeros((b,), jnp.int32)
    parents = jnp.zeros((b, t), jnp.int32)
    calls = [
        lambda q, kp: pa.paged_attention(q, kp, kp, pt, start, nnew, interpret=False,
                                         block_sizes=pa.BlockSizes(num_splits=1)),
        lambda q, kp: pa.paged_attention(q, kp, kp, pt, start, nnew, interpret=False,
                                         block_sizes=pa.BlockSizes(num_splits=4)),
        lambda q, kp: pf.prefill_attention(q, kp, kp, pt, start, nnew, interpret=False),
        lambda q, kp: ta.tree_attention(q, kp, kp, pt, start, parents, interpret=False),
    ]
    # bf16, fp32, and an fp32 model over a bf16 cache
    for q_dtype, kv_dtype in ((jnp.bfloat16,) * 2, (jnp.float32,) * 2,
                              (jnp.float32, jnp.bfloat16)):
        for fn in calls:
            lowered = jax.jit(fn).trace(q.astype(q_dtype), kp.astype(kv_dtype)).lower(
                lowering_platforms=("cuda",))
            assert "triton" in lowered.as_text()


def test_speculative_loop_pallas_equals_reference(tiny_pair):
    """The whole jitted speculative loop through a tiny GQA target and its draft (prefill kernel
    for the ragged prompts, paged kernel for draft decode, verification and catch-up, rejected
    drafts left stale in the cache) gives the same greedy tokens with ``attn_impl="pallas"``
    (interpreted) as with the reference: the model runs with either."""
    import specjax as sj

    # test_speculative's prompts and settings, so the reference compilation is shared in a run.
    prompts = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12], [4] * 16 + [2]]
    target, draft = tiny_pair
    kw = dict(max_new_tokens=40, draft=draft, method="draft", num_draft_tokens=4, eos_token_id=[])
    want = sj.generate(target, prompts, attn_impl="reference", **kw)
    got = sj.generate(target, prompts, attn_impl="pallas", **kw)
    assert got.tokens == want.tokens
    assert got.stats["mean_accepted_length"] == want.stats["mean_accepted_length"]
