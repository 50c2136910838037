"""The Drafter interface: what every drafter kind does in a step.

A drafter is a frozen, hashable static description (a jit static argument) whose methods are
pure functions of the params (``Models``) and the state. The steps in specjax.speculate.steps
call these methods and never ask which kind of drafter they hold (vLLM V1's proposer split:
one ``propose`` per kind behind one interface). A new drafter kind is a new subclass; it plugs
into ``sj.generate`` and the engine as ``draft=Custom(drafter, params)`` with
``SpecConfig(method="custom")``, or as a built-in through ``drafters.resolve``.

The drafter owns two things in ``DecodeState``: ``draft_kv`` (a page pool sharing the target's
page table, or None) and ``carry`` (a dict of per-row arrays, leading dim B: e.g. the logits it
carries for the next first draft). Its invariant (after ``extend`` or ``absorb``): it has
absorbed every committed token it needs to propose the tokens at positions n, n+1, ...

Methods (B rows, K drafts, T span tokens):
  * ``init(rows, num_pages, page_size, dtype) -> (draft_kv, carry)``: empty pool and zeroed carry.
  * ``aux_layers``: target layers whose entering hidden states the drafter reads (features).
  * ``extend(models, draft_kv, span) -> (draft_kv, carry)``: absorb a span the target just processed
    (a prompt, a prefill chunk, a one-token decode step): ``Span`` below.
  * ``propose(models, state, rp, k, keys, sampled) -> Drafts``: a chain of k drafts (with q when
    ``SpecConfig.draft_sampling``); may run k forwards or one (block drafters).
  * ``absorb(models, state, drafts, verified) -> (draft_kv, carry)``: after acceptance
    (catch-up, the MTP shift, nothing at all for a per-position cache).
  * Trees (optional, ``supports_tree``): ``propose_tree(models, state, tc)`` and
    ``absorb`` with the accepted path.
  * Lazy upkeep over adaptive plain steps (optional, ``upkeep``): ``lag_feature(models,
    hidden, aux) -> [B, E]``, ``catch_up(models, kv, page_table, tokens [B, W], feats, pos,
    start, num) -> (kv, hidden [B, W, E])``, ``refresh(models, last [B, E]) -> carry``
    (see specjax.speculate.steps).
  * Confidence-adaptive drafting (optional, ``autoregressive``): ``first_logits(carry)`` and
    ``advance(models, state, kv, step_carry, d, i) -> (kv, step_carry, logits)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import struct
import jax.numpy as jnp

from specjax.speculate.state import Drafts, pick_draft


@struct.dataclass
class Span:
    """A span the target has just processed, for ``Drafter.extend``."""

    tokens: jax.Array  # [B, T] int32, row b's valid part tokens[b, :num_new[b]]
    hidden: jax.Array  # [B, T, E] the target's final hidden states over it
    aux: jax.Array | None  # [B, T, A*E] the states entering the drafter's aux layers
    start: jax.Array  # [B] int32 position of tokens[:, 0]
    num_new: jax.Array  # [B] int32 valid tokens per row
    after: jax.Array  # [B] int32 the token following the span (just sampled / next chunk's)
    page_table: jax.Array  # [B, Pmax] int32


class Drafter:
    """Base class of every drafter kind (subclass as a frozen dataclass)."""

    aux_layers: tuple = ()
    supports_tree = False
    autoregressive = False  # has first_logits / advance (confidence-adaptive drafting)
    upkeep = False  # has lag_feature / catch_up / refresh (lazy upkeep over plain steps)
    lag_feature_size = 0  # E of lag_feature (0: none)
    lag_offset = 0  # pending positions end this many before ``lengths`` (heads: 1)

    def init(self, rows: int, num_pages: int, page_size: int, dtype):
        return None, {}

    def extend(self, models, kv, span: Span):
        raise NotImplementedError

    def propose(self, models, state, rp, k: int, keys, sampled: bool) -> Drafts:
        raise NotImplementedError

    def absorb(self, models, state, drafts: Drafts, verified):
        raise NotImplementedError

    slots_ahead = 0  # cache slots a step writes from n-1 on, beyond k+1 (block drafters)
    uses_history = False  # needs DecodeState.history (n-gram lookups)
    may_skip = False  # has any_proposal(state): a step where no row proposes is a plain step

    def ngram_rows(self, state, k):
        """(proposal [B, K], from_ngram [B]) for hybrid drafting, or None (Hybrid overrides)."""
        return None

    def check(self, lc) -> None:
        """Raises ValueError when this drafter cannot run ``lc`` (called before tracing)."""


class Autoregressive(Drafter):
    """A drafter that drafts one token per forward from carried logits (``carry["logits"]``):
    ``propose`` is the shared rollout over ``advance``."""

    autoregressive = True
    upkeep = True

    def first_logits(self, carry):
        return carry["logits"]

    def step_carry(self, carry):
        """What ``advance`` threads between drafts besides the pool (a head: its own output)."""
        return jnp.zeros((carry["logits"].shape[0], 1), jnp.float32)

    def advance(self, models, state, kv, step_carry, d, i):
        """Drafts after d_{i+1}: -> (kv, step_carry, logits [B, V] for draft i+2)."""
        raise NotImplementedError

    def propose(self, models, state, rp, k, keys, sampled) -> Drafts:
        """k drafts from the carried logits and k-1 one-token drafter forwards."""

        def body(carry, i):
            kv, logits, sc = carry
            d, q = pick_draft(logits, i, keys, rp, sampled)
            kv, sc, new_logits = self.advance(models, state, kv, sc, d, i)
            return (kv, new_logits, sc), (d, q)

        init = (state.draft_kv, self.first_logits(state.carry), self.step_carry(state.carry))
        (kv, last_logits, _), (ds, qs) = jax.lax.scan(body, init, jnp.arange(k - 1, dtype=jnp.int32))
        d_k, q_k = pick_draft(last_logits, k - 1, keys, rp, sampled)
        tokens = jnp.concatenate([ds.T, d_k[:, None]], axis=1)  # [B, K]
        probs = None
        if sampled:
            probs = jnp.concatenate([qs.transpose(1, 0, 2), q_k[:, None]], axis=1)  # [B, K, V]
        b = tokens.shape[0]
        return Drafts(tokens=tokens, probs=probs, draft_kv=kv, carry=state.carry,
                      proposing=jnp.ones((b,), bool))


@dataclasses.dataclass(frozen=True)
class NoDrafter(Drafter):
    """Plain decoding: nothing drafts, nothing is carried."""

    def extend(self, models, kv, span):
        return kv, {}

    def absorb(self, models, state, drafts, verified):
        return state.draft_kv, state.carry


@dataclasses.dataclass(frozen=True)
class Custom:
    """A user-defined drafter and its params, passed as ``sj.generate(..., draft=Custom(...),
    spec=SpecConfig(method="custom"))`` or ``sj.Engine(target, Custom(...), ...)``."""

    config: Any  # a Drafter instance (static)
    params: Any = None  # its params pytree

    def __post_init__(self):
        if not isinstance(self.config, Drafter):
            raise TypeError(f"Custom.config must be a specjax.speculate.Drafter, got "
                            f"{type(self.config).__name__}")
