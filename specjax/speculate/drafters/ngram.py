"""Prompt-lookup drafting (method "ngram"; specjax.ngram) and the n-gram hybrid combinator.

``NgramDrafter`` drafts without a model: each row's history x_0..x_{n-1} is kept on device
(``DecodeState.history``), the tokens that followed the longest earlier match of its suffix are
point-mass drafts, and rows without a match do not propose (the chain step gives them an
ordinary sample from p_0; when no row matches, the step is a plain one-token step).

``Hybrid(inner, ...)`` drafts with ``inner`` (a model drafter) but takes the n-gram proposal
for rows whose match is at least ``min_match`` long, in the same verify pass.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from specjax import ngram
from specjax.speculate.drafters.base import Drafter
from specjax.speculate.state import Drafts


@dataclasses.dataclass(frozen=True)
class NgramDrafter(Drafter):
    """Suffix-match lookup over the row's own history."""

    ngram_min: int = 1
    ngram_max: int = 3

    uses_history = True
    may_skip = True  # a step may find no match anywhere: then it is a plain step

    def extend(self, models, kv, span):
        return kv, {}

    def any_proposal(self, state):
        """[] bool: whether some active row has a match (else the step is a plain one)."""
        _, match_len = ngram.search(state.history, state.lengths, self.ngram_min, self.ngram_max)
        return jnp.any((match_len > 0) & ~state.done)

    def propose(self, models, state, rp, k, keys, sampled):
        tokens, match_len = ngram.propose(state.history, state.lengths, k, self.ngram_min,
                                          self.ngram_max)
        return Drafts(tokens=tokens, probs=None, draft_kv=state.draft_kv, carry=state.carry,
                      proposing=match_len > 0)

    def absorb(self, models, state, drafts, verified):
        return state.draft_kv, state.carry


@dataclasses.dataclass(frozen=True)
class Hybrid(Drafter):
    """``inner``'s drafts, replaced by the n-gram proposal on rows with a long enough match."""

    inner: Any  # an Autoregressive drafter
    ngram_min: int = 1
    ngram_max: int = 3
    min_match: int = 2

    uses_history = True

    def __getattr__(self, name):  # catch_up, refresh, advance, ...: the inner drafter's
        if name.startswith("__") or name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    # the inner drafter's static traits (class attributes, so __getattr__ would not see them)
    aux_layers = property(lambda self: self.inner.aux_layers)
    autoregressive = property(lambda self: self.inner.autoregressive)
    upkeep = property(lambda self: self.inner.upkeep)
    lag_feature_size = property(lambda self: self.inner.lag_feature_size)
    lag_offset = property(lambda self: self.inner.lag_offset)

    def init(self, *args):
        return self.inner.init(*args)

    def extend(self, models, kv, span):
        return self.inner.extend(models, kv, span)

    def ngram_rows(self, state, k):
        """(proposal [B, K], from_ngram [B] bool)."""
        ng, match_len = ngram.propose(state.history, state.lengths, k, self.ngram_min,
                                      self.ngram_max)
        return ng, match_len >= max(self.min_match, self.ngram_min)

    def merge(self, dr: Drafts, ng, from_ngram) -> Drafts:
        tokens = jnp.where(from_ngram[:, None], ng, dr.tokens)
        probs = dr.probs
        if probs is not None:  # point masses for the n-gram rows
            one_hot = jax.nn.one_hot(tokens, probs.shape[-1], dtype=probs.dtype)
            probs = jnp.where(from_ngram[:, None, None], one_hot, probs)
        return dataclasses.replace(dr, tokens=tokens, probs=probs, from_ngram=from_ngram)

    def propose(self, models, state, rp, k, keys, sampled):
        dr = self.inner.propose(models, state, rp, k, keys, sampled)
        return self.merge(dr, *self.ngram_rows(state, k))

    def absorb(self, models, state, drafts, verified):
        return self.inner.absorb(models, state, drafts, verified)
