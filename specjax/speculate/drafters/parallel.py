"""P-EAGLE parallel drafting (method "peagle"; the model is specjax.peagle).

The head's cache, carry, extend and absorb are the EAGLE-3 chain head's (``HeadDrafter``): after
them the cache holds head positions <= n-2 written with the target's features, and the carried
logits (depth 0, head position n-2) give d_1. ``propose`` then runs ONE causal forward over k-1
placeholder slots (``mask_token_id``, ``fc(mask_hidden)``) at head positions n-1..n+k-3, whose
outputs give d_2..d_k, instead of k-1 one-token forwards fed the head's own outputs. The slots'
K/V land where the chain's drafts would (stale; absorb overwrites them with the target's
features). No trees, no confidence-adaptive drafting (the drafts come out of one pass).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from specjax import peagle
from specjax.speculate.drafters.head import HeadDrafter
from specjax.speculate.state import Drafts, pick_draft


@dataclasses.dataclass(frozen=True)
class ParallelHeadDrafter(HeadDrafter):
    """A P-EAGLE head (``specjax.peagle.PEagleConfig``) drafting k <= K tokens per pass."""

    pcfg: peagle.PEagleConfig | None = None

    supports_tree = False
    autoregressive = False

    def check(self, lc) -> None:
        if lc.k_eff > self.pcfg.num_depths:
            raise ValueError(f"num_draft_tokens={lc.k_eff} exceeds the P-EAGLE head's "
                             f"{self.pcfg.num_depths} parallel depths (num_depths)")

    def propose(self, models, state, rp, k, keys, sampled):
        picks = [pick_draft(state.carry["logits"], 0, keys, rp, sampled)]
        kv = state.draft_kv
        if k > 1:
            hh, kv = peagle.mask_block(models.draft, self.pcfg, models.target, self.target_cfg,
                                       kv, state.page_table, state.lengths - 1, k - 1,
                                       attn_impl=self.attn_impl)
            logits = self.logits(models, hh)  # [B, k-1, V]
            picks += [pick_draft(logits[:, i], i + 1, keys, rp, sampled) for i in range(k - 1)]
        tokens = jnp.stack([d for d, _ in picks], axis=1)  # [B, K]
        probs = jnp.stack([q for _, q in picks], axis=1) if sampled else None  # [B, K, V]
        return Drafts(tokens=tokens, probs=probs, draft_kv=kv, carry=state.carry,
                      proposing=jnp.ones(tokens.shape[:1], bool))
