"""A separate small LLM as the drafter (method "draft"; SPEC section 2).

Its cache holds K/V for x_0..x_{n-1} (one more than the target's) and ``carry["logits"]`` are
its logits for position n, carried (not sampled) into the next step's first draft.
Rollout: d_1 from the carried logits, d_2..d_k from k-1 one-token forwards (which write
d_1..d_{k-1}). Absorb (catch-up): one two-token forward over [x_{n+a-1}, y] whose last logits
are carried (it also writes d_k's K/V when every draft was accepted); a hybrid step whose row
took the n-gram proposal re-runs over every emitted token instead (the LLM never saw them).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import registry
from specjax.model import lm_head
from specjax.speculate.drafters.base import Autoregressive, Span


def _set_at(rows, idx, value):
    """rows [B, T] with rows[b, idx[b]] = value[b]."""
    return jax.vmap(lambda row, i, v: row.at[i].set(v))(rows, idx, value)


@dataclasses.dataclass(frozen=True)
class DraftLLM(Autoregressive):
    """A draft language model of a registry family sharing the target's tokenizer."""

    cfg: Any  # the draft's model config
    attn_impl: Any = "reference"

    def init(self, rows, num_pages, page_size, dtype):
        return (registry.init_cache(self.cfg, num_pages, page_size, dtype),
                {"logits": jnp.zeros((rows, self.cfg.vocab_size), jnp.float32)})

    def _forward(self, models, tokens, positions, kv, page_table, start, num=None, **kw):
        return registry.forward(models.draft, self.cfg, tokens, positions, kv, page_table, start,
                                num, attn_impl=self.attn_impl, **kw)

    def extend(self, models, kv, span: Span):
        # The draft sees the span plus the token after it; its last logits are carried.
        b, t = span.tokens.shape
        ext = _set_at(jnp.concatenate([span.tokens, jnp.zeros((b, 1), jnp.int32)], axis=1),
                      span.num_new, span.after)
        pos = span.start[:, None] + jnp.arange(t + 1, dtype=jnp.int32)[None, :]
        return self._run(models, ext, pos, kv, span.page_table, span.start,
                         span.num_new + 1, span.num_new)

    def _run(self, models, tokens, pos, kv, page_table, start, num, pick):
        _, dh, kv = self._forward(models, tokens, pos, kv, page_table, start, num,
                                  return_logits=False)
        last = jnp.take_along_axis(dh, pick[:, None, None], axis=1)[:, 0]  # [B, E]
        return kv, {"logits": lm_head(models.draft, self.cfg, last)}

    def advance(self, models, state, kv, step_carry, d, i):
        pos = state.lengths + i
        logits, _, kv = self._forward(models, d[:, None], pos[:, None], kv, state.page_table, pos)
        return kv, step_carry, logits[:, 0]

    def absorb(self, models, state, drafts, v):
        b = v.a.shape[0]
        n = state.lengths
        if drafts.from_ngram is None:
            # [x_{n+a-1}, y]: writes y (and d_k if all were accepted); the rollout wrote the rest.
            prev = jnp.take_along_axis(v.tokens, v.a[:, None], axis=1)[:, 0]
            toks, start, num, pick = (jnp.stack([prev, v.y], axis=1), n + v.a - 1,
                                      jnp.full((b,), 2, jnp.int32), jnp.ones_like(v.a))
        else:  # hybrid: re-run over every emitted token x_n..x_{n+a} (a + 1 valid)
            toks, start, num, pick = v.emitted, n, v.a + 1, v.a
        pos = start[:, None] + jnp.arange(toks.shape[1], dtype=jnp.int32)[None, :]
        return self._run(models, toks, pos, drafts.draft_kv, state.page_table, start, num, pick)

    # lazy upkeep: position p consumes x_p, read from the window at p % W
    def catch_up(self, models, kv, page_table, tokens, feats, pos, start, num):
        _, hh, kv = self._forward(models, tokens, pos, kv, page_table, start, num,
                                  return_logits=False)
        return kv, hh

    def refresh(self, models, last):
        return {"logits": lm_head(models.draft, self.cfg, last)}
