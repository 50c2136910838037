"""DFlash block drafting (method "dflash"; the model is specjax.dflash).

The drafter's cache holds the *context* K/V of every committed position whose target features
are known: positions < n-1 (x_{n-1} is pending in the target too). It depends only on the
target's features, so it is written once per position and needs no catch-up pass:

  * ``extend``: the span's fused features go into the context at its positions;
  * ``propose``: one forward over the block [x_{n-1}, mask x (B-1)] at positions n-1..n+B-2
    (it attends to the context and, bidirectionally, to itself); rows 1..k of its B-1 drafts are
    the chain (argmax, or samples from q with the chain's keys). The block's own K/V are written
    at slots n-1.. as stale entries (overwritten before they are read as context);
  * ``absorb``: the verify pass's features of the committed tokens x_{n-1}, d_1..d_a (positions
    n-1..n+a-1) go into the context. The drafter carries nothing per row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from specjax import dflash
from specjax.speculate.drafters.base import Drafter, Span
from specjax.speculate.state import Drafts, pick_draft


@dataclasses.dataclass(frozen=True)
class BlockDrafter(Drafter):
    """A DFlash head (``specjax.dflash.DFlashConfig``) drafting up to B-1 tokens in one pass."""

    cfg: Any  # dflash.DFlashConfig
    target_cfg: Any
    attn_impl: Any = "reference"

    @property
    def aux_layers(self):
        return self.cfg.aux_layers

    @property
    def slots_ahead(self) -> int:
        """Cache slots a step writes from n-1 on: the whole block."""
        return self.cfg.block_size

    def check(self, lc) -> None:
        if lc.k_eff > self.cfg.block_size - 1:
            raise ValueError(f"num_draft_tokens={lc.k_eff} exceeds the DFlash block's "
                             f"{self.cfg.block_size - 1} drafts (block_size {self.cfg.block_size})")
        if lc.adaptive:
            raise ValueError('SpecConfig.adaptive=True is not supported with method="dflash" yet '
                             "(plain steps would have to write the skipped context)")

    def init(self, rows, num_pages, page_size, dtype):
        return dflash.init_cache(self.cfg, num_pages, page_size, dtype), {}

    def _write(self, models, kv, aux, page_table, start, num):
        c = dflash.fuse(models.draft, self.cfg, aux)
        return dflash.write_context(models.draft, self.cfg, kv, c, page_table, start, num)

    def extend(self, models, kv, span: Span):
        return self._write(models, kv, span.aux, span.page_table, span.start, span.num_new), {}

    def propose(self, models, state, rp, k, keys, sampled):
        logits, kv = dflash.draft_block(models.draft, self.cfg, models.target, self.target_cfg,
                                        state.draft_kv, state.page_table, state.last_token,
                                        state.lengths - 1, attn_impl=self.attn_impl,
                                        return_cache=True)  # [B, B-1, V]
        picks = [pick_draft(logits[:, i], i, keys, rp, sampled) for i in range(k)]
        tokens = jnp.stack([d for d, _ in picks], axis=1)  # [B, K]
        probs = jnp.stack([q for _, q in picks], axis=1) if sampled else None  # [B, K, V]
        return Drafts(tokens=tokens, probs=probs, draft_kv=kv, carry=state.carry,
                      proposing=jnp.ones(tokens.shape[:1], bool))

    def absorb(self, models, state, drafts, v):
        kv = self._write(models, drafts.draft_kv, v.aux, state.page_table, state.lengths - 1,
                         v.a + 1)
        return kv, state.carry
