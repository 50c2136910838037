"""The Pallas prefill kernel (causal, flash-style, variable lengths, paged K/V) equals its jnp
reference: prompt lengths 1, 3, 513, 1023 in one batch, chunked prefill after a cached prefix,
page sizes, GQA groups, dtypes, NaN-poisoned stale slots; and dispatch picks it for prefill."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import dispatch
from pallas_kernels import prefill_attention as pf
from tests.test_pallas_paged import DTYPES, KV_GROUPS, PAGE_SIZES, check, exact, poisoned_case

reference = exact(pf.prefill_attention_reference)
REPRESENTATIVE = [  # (page_size, Hkv, G, dtype, block_rows, block_keys); with the chunked
    (16, 2, 3, jnp.float32, 64, 64),  # test below, every page size, Hkv, G and dtype appears
    (8, 1, 8, jnp.bfloat16, 128, 16),  # one page per key step
]


class TestPrefillAttentionInterpret:
    INTERPRET = True
    HEAD_DIM = 8
    # The cross-product's prompts. Interpreted, a 1023-token prompt costs up to ~100 s per shape;
    # 255 tokens still span several row blocks, key steps and pages of every size (the 1023-token
    # prompts run in test_matches_reference, and in the whole cross-product on the GPU).
    ALL_SHAPES_LENGTHS = (1, 3, 129, 255)

    def _run(self, *args, **kw):
        return pf.prefill_attention(*args, interpret=self.INTERPRET, **kw)

    def _prompts(self, page_size, hkv, g, dtype, lengths=(1, 3, 513, 1023), **sizes):
        """Fresh prompts of ``lengths`` tokens (default 1, 3, 513 and 1023) padded to the
        longest."""
        args = poisoned_case(0, (0,) * len(lengths), max(lengths), hkv, g, page_size, dtype,
                             num_new=lengths, d=self.HEAD_DIM)
        check(self._run(*args, block_sizes=pf.BlockSizes(**sizes)), reference(*args), dtype)

    @pytest.mark.parametrize("page_size,hkv,g,dtype,block_rows,block_keys", REPRESENTATIVE)
    def test_matches_reference(self, page_size, hkv, g, dtype, block_rows, block_keys):
        self._prompts(page_size, hkv, g, dtype, block_rows=block_rows, block_keys=block_keys)

    @pytest.mark.slow
    @pytest.mark.parametrize("dtype", DTYPES)
    @pytest.mark.parametrize("hkv,g", KV_GROUPS)
    @pytest.mark.parametrize("page_size", PAGE_SIZES)
    def test_matches_reference_all_shapes(self, page_size, hkv, g, dtype):
        self._prompts(page_size, hkv, g, dtype, self.ALL_SHAPES_LENGTHS)

    def test_chunked_prefill_after_cached_prefix(self):
        """Chunks of 40 (or fewer) tokens after cached prefixes of 0, 3, 513 and 1 tokens; the
        prefix tail shares a page with the chunk; a custom scale; a sequence with no tokens."""
        q, k, v, pt, start, nnew = poisoned_case(1, (0, 3, 513, 1, 0), 40, 8, 1, 32,
                                                 jnp.bfloat16, num_new=(40, 17, 40, 1, 0),
                                                 d=self.HEAD_DIM)
        sizes = pf.BlockSizes(block_rows=16, block_keys=32)
        got = self._run(q, k, v, pt, start, nnew, scale=0.3, block_sizes=sizes)
        check(got, reference(q, k, v, pt, start, nnew, scale=0.3), jnp.bfloat16)
        assert not np.asarray(got[4], np.float32).any()  # nothing to read: zeros

    def test_rejects_bad_inputs(self):
        q, k, v, pt, start, nnew = poisoned_case(3, (0,), 4, 2, 2, 8, jnp.float32)
        with pytest.raises(ValueError, match="multiple"):
            self._run(q[:, :, :3], k, v, pt, start, nnew)
        with pytest.raises(ValueError, match="num_new"):
            self._run(q, k, v, pt, start, nnew.astype(jnp.float32))
        with pytest.raises(ValueError, match="q must be"):
            self._run(q[0], k, v, pt, start, nnew)
        with pytest.raises(ValueError, match="block_keys"):
            pf.BlockSizes(block_keys=24)
        with pytest.raises(ValueError, match="block_rows"):
            pf.BlockSizes(block_rows=8)


@pytest.mark.gpu
@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (Triton lowering)")
class TestPrefillAttentionGPU(TestPrefillAttentionInterpret):
    INTERPRET = False
    HEAD_DIM = 64
    ALL_SHAPES_LENGTHS = (1, 3, 513, 1023)


def test_dispatch_rule(monkeypatch):
    """Causal with T >= PREFILL_MIN_TOKENS -> prefill kernel; short or masked -> paged kernel."""
    seen = []
    monkeypatch.setattr(dispatch._prefill, "prefill_attention",
                        lambda *a, **kw: seen.append("prefill"))
    monkeypatch.setattr(dispatch._paged, "paged_attention", lambda *a, **kw: seen.append("paged"))
    for t, masked in itertools.product((1, dispatch.PREFILL_MIN_TOKENS), (False, True)):
        q = jnp.zeros((1, t, 2, 8))
        mask = jnp.ones((1, t, t), bool) if masked else None
        dispatch.paged_attention(q, None, None, None, None, None, mask)
    assert seen == ["paged", "paged", "prefill", "paged"]
