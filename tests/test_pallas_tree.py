"""Tree attention (unmasked prefix + ancestor mask among N draft nodes) equals its jnp reference
over random trees, and equals ordinary causal attention run separately on every root-to-leaf
branch; the doubling ancestor mask equals the walked one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import paged_attention as pa
from pallas_kernels import tree_attention as ta
from specjax import kv_cache, tree
from tests.test_pallas_paged import (LENGTHS, check, exact, poisoned_case, random_case,
                                     random_parents)

reference = exact(ta.tree_attention_reference)


class TestTreeAttentionInterpret:
    INTERPRET = True
    HEAD_DIM = 8

    def _tree(self, n, prefixes, hkv, g, page_size, dtype, seed=0, num_nodes=None, **sizes):
        rng = np.random.default_rng(seed)
        q, k, v, pt, start, nnew = poisoned_case(seed, prefixes, n, hkv, g, page_size, dtype,
                                                 num_new=num_nodes, d=self.HEAD_DIM)
        parents = jnp.asarray(random_parents(rng, len(prefixes), n, roots=2))
        got = ta.tree_attention(q, k, v, pt, start, parents, nnew, interpret=self.INTERPRET,
                                block_sizes=ta.BlockSizes(**sizes))
        check(got, reference(q, k, v, pt, start, parents, nnew), dtype)

    @pytest.mark.parametrize("n,hkv,g,page_size,dtype,num_nodes", [
        (16, 2, 3, 16, jnp.float32, None),
        (40, 1, 8, 8, jnp.bfloat16, (40, 9, 1, 33)),  # two mask words; padding nodes
    ])
    def test_matches_reference(self, n, hkv, g, page_size, dtype, num_nodes):
        """Random forests (two roots) after prefixes 1, 3, 513, 1023, NaN in every unreadable
        slot (padding nodes' too); auto split-K."""
        self._tree(n, LENGTHS, hkv, g, page_size, dtype, num_nodes=num_nodes)

    @pytest.mark.slow
    @pytest.mark.parametrize("num_splits", [1, 4])
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
    @pytest.mark.parametrize("n", [16, 64])
    def test_matches_reference_sizes(self, n, dtype, num_splits):
        self._tree(n, LENGTHS, 2, 3, 16, dtype, num_splits=num_splits)

    def test_equals_causal_attention_on_each_branch(self):
        """Every node's output equals ordinary causal attention over its root-to-leaf branch laid
        out as a chain after the same prefix (each branch run as its own sequence)."""
        n, hkv, g, s, prefix, d = 16, 2, 3, 8, 37, self.HEAD_DIM
        rng = np.random.default_rng(5)
        q, k, v, pt, start, nnew = random_case(5, (prefix,), n, hkv, g, s, jnp.float32, d=d)
        parents = random_parents(rng, 1, n)
        tree_out = np.asarray(ta.tree_attention(q, k, v, pt, start, jnp.asarray(parents), nnew,
                                                interpret=self.INTERPRET))
        # Branch chains: the prefix then the path's K/V, one sequence per branch.
        paths = tree.root_to_leaf_paths(parents[0, 1:])  # node 0 is the root
        t = max(len(p) for p in paths)
        keys = np.asarray(kv_cache.gather_layer(k, pt))[0]  # [Hkv, N_slots, D]
        vals = np.asarray(kv_cache.gather_layer(v, pt))[0]
        per_seq = kv_cache.pages_needed(prefix + t, s)
        kb = np.zeros((hkv, len(paths) * per_seq * s, d), np.float32)
        vb = np.zeros_like(kb)
        qb = np.zeros((len(paths), t, hkv * g, d), np.float32)
        for i, path in enumerate(paths):
            slots = list(range(prefix)) + [prefix + node for node in path]
            base = i * per_seq * s
            kb[:, base:base + len(slots)] = keys[:, slots]
            vb[:, base:base + len(slots)] = vals[:, slots]
            qb[i, :len(path)] = np.asarray(q)[0, path]
        kb = jnp.asarray(kb.reshape(hkv, -1, s, d))
        vb = jnp.asarray(vb.reshape(hkv, -1, s, d))
        ptb = kv_cache.contiguous_page_table(len(paths), per_seq)
        chain = pa.paged_attention(jnp.asarray(qb), kb, vb, ptb,
                                   jnp.full((len(paths),), prefix, jnp.int32),
                                   jnp.asarray([len(p) for p in paths], jnp.int32),
                                   interpret=self.INTERPRET)
        chain = np.asarray(chain)
        assert len(paths) >= 3
        for i, path in enumerate(paths):
            np.testing.assert_allclose(chain[i, :len(path)], tree_out[0, path], atol=1e-5,
                                       rtol=1e-5)

    def test_rejects_bad_inputs(self):
        q, k, v, pt, start, nnew = random_case(4, (3,), 4, 1, 2, 8, jnp.float32)
        parents = jnp.asarray(random_parents(np.random.default_rng(0), 1, 4))
        with pytest.raises(ValueError, match="parents"):
            ta.tree_attention(q, k, v, pt, start, parents[:, :3], interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="parents"):
            ta.tree_attention(q, k, v, pt, start, parents.astype(jnp.float32),
                              interpret=self.INTERPRET)
        with pytest.raises(ValueError, match="num_nodes"):
            ta.tree_attention(q, k, v, pt, start, parents, nnew[:0], interpret=self.INTERPRET)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton lowering)")
class TestTreeAttentionGPU(TestTreeAttentionInterpret):
    INTERPRET = False
    HEAD_DIM = 64


@pytest.mark.parametrize("n", [1, 23])
def test_ancestor_mask(n):
    """Doubling mask == walked mask == numpy (``tree.static_structure``), for topological and
    shuffled node orders."""
    rng = np.random.default_rng(n)
    parents = random_parents(rng, 3, n, roots=1)  # node 0 is the root, parents[j] < j
    perm = rng.permutation(n)  # relabel nodes: parents need not precede children
    inv = np.argsort(perm)
    shuffled = np.where(parents[:, perm] >= 0, inv[np.maximum(parents[:, perm], 0)], -1)
    want = np.stack([tree.static_structure(p[1:])[3] for p in parents])  # [B, N, N]
    for par, w in ((parents, want), (shuffled.astype(np.int32), want[:, perm][:, :, perm])):
        for fn in (ta.ancestor_mask, ta.ancestor_mask_reference):
            np.testing.assert_array_equal(np.asarray(jax.jit(fn)(jnp.asarray(par))), w)
