"""Heads fed by the target's features: MTP, EAGLE-1, EAGLE-3 (specjax.heads), chains and trees.

Head position j consumes (x_{j+1}, f_j) and predicts x_{j+2}: its cache holds positions
j <= n-2 (as many entries as the target's), ``carry["logits"]`` come from position n-2 and
predict x_n, and ``carry["hidden"]`` is the head's own output there. Rollout: d_1 from the
carried logits, then d_i from the head at position n-2+i-1 fed its *own* previous output.
Absorb (the one-token MTP schedule, no host sync): the verified tokens shifted one left with y
inserted at a, re-run over all positions with the *target's* features — work on rejected
positions is wasted but keeps shapes static, and the re-run rewrites the head's K/V with the
accurate features. A tree's accepted path is absorbed the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from specjax import heads, registry, tree
from specjax.speculate.drafters.base import Autoregressive, Span
from specjax.speculate.drafters.llm import _set_at


@dataclasses.dataclass(frozen=True)
class HeadDrafter(Autoregressive):
    """A specjax.heads head (its HeadConfig) attached to the target."""

    cfg: Any  # heads.HeadConfig
    target_cfg: Any
    attn_impl: Any = "reference"

    supports_tree = True
    lag_offset = 1

    @property
    def aux_layers(self):
        return self.cfg.aux_layers

    @property
    def lag_feature_size(self):
        return self.cfg.layer.hidden_size

    def init(self, rows, num_pages, page_size, dtype):
        e = self.cfg.layer.hidden_size
        return (registry.init_cache(self.cfg.layer, num_pages, page_size, dtype),
                {"logits": jnp.zeros((rows, self.target_cfg.vocab_size), jnp.float32),
                 "hidden": jnp.zeros((rows, e), dtype)})

    def features(self, models, hidden, aux):
        """The target feature the head consumes: [B, T, E]."""
        return heads.head_features(models.draft, self.cfg, models.target, self.target_cfg,
                                   hidden, aux)

    def _block(self, models, tokens, feats, positions, kv, page_table, start, num=None, mask=None):
        return heads.head_forward(models.draft, self.cfg, models.target, tokens, feats, positions,
                                  kv, page_table, start, num, mask, attn_impl=self.attn_impl)

    def logits(self, models, hidden):
        return heads.head_logits(models.draft, self.cfg, models.target, self.target_cfg, hidden)

    def _rerun(self, models, tokens, feats, positions, kv, page_table, start, num):
        """Runs the head over a span and carries its output / logits at the span's last row."""
        hh, kv = self._block(models, tokens, feats, positions, kv, page_table, start, num)
        last = jnp.take_along_axis(hh, (num - 1)[:, None, None], axis=1)[:, 0]  # [B, E]
        return kv, self.refresh(models, last)

    def extend(self, models, kv, span: Span):
        # Head position j consumes (x_{j+1}, f_j): the span shifted left, `after` at its end.
        b, t = span.tokens.shape
        shifted = _set_at(jnp.concatenate([span.tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)],
                                          axis=1), span.num_new - 1, span.after)
        positions = span.start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
        return self._rerun(models, shifted, self.features(models, span.hidden, span.aux),
                           positions, kv, span.page_table, span.start, span.num_new)

    def step_carry(self, carry):
        return carry["hidden"]

    def advance(self, models, state, kv, feat, d, i):
        pos = state.lengths - 1 + i  # head position n-2+i+1 fed its own previous output
        hh, kv = self._block(models, d[:, None], feat[:, None], pos[:, None], kv,
                             state.page_table, pos)
        return kv, hh[:, 0], self.logits(models, hh[:, 0])

    def absorb(self, models, state, drafts, v):
        return self._rerun(models, v.emitted, self.features(models, v.hidden, v.aux),
                           v.positions, drafts.draft_kv, state.page_table, state.lengths - 1,
                           v.a + 1)

    def propose_tree(self, models, state, tc):
        """An EAGLE tree (specjax.tree): tokens [B, N], parents / depth [B, N+1], the pool."""
        n = state.lengths
        kv = [state.draft_kv]  # threaded through the level-by-level head runs

        def head_run(tokens, feats, positions, mask, num_new):
            hh, kv[0] = self._block(models, tokens, feats, positions, kv[0], state.page_table,
                                    n - 1, num_new, mask)
            return hh

        tokens, parents, depth = tree.draft_tree(tc, state.carry["logits"], state.carry["hidden"],
                                                 n, head_run, lambda h: self.logits(models, h))
        return tokens, parents, depth, kv[0]

    # lazy upkeep: head position p consumes (x_{p+1}, f_p), both read from the window at p % W
    def lag_feature(self, models, hidden, aux):
        return self.features(models, hidden, aux)[:, 0]

    def catch_up(self, models, kv, page_table, tokens, feats, pos, start, num):
        hh, kv = self._block(models, tokens, feats, pos, kv, page_table, start, num)
        return kv, hh

    def refresh(self, models, last):
        return {"logits": self.logits(models, last), "hidden": last}
