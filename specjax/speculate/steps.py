"""The step functions: prefill, a plain step, a chain step, a tree step (one jit each caller).

Every step is ``step(models, state, rp, plan) -> (state, a [B], verified [B])`` and calls the
plan's drafter (specjax.speculate.drafters) — it never asks which kind it is.

A chain step (k = plan.lc.k_eff), all on device:
  1. the drafter proposes d_1..d_k (``Drafter.propose``; lagging drafters are caught up first);
  2. verify: one target forward over [x_{n-1}, d_1..d_k] at positions n-1..n+k-1;
  3. acceptance (specjax.acceptance.accept_chain): a accepted drafts and the residual/bonus y;
     rows that did not propose (no n-gram match) take an ordinary sample from p_0;
  4. the drafter absorbs the result (``Drafter.absorb``: catch-up, the MTP shift, ...);
  5. n += a + 1, last_token = y; tokens go into the output buffer, stopping at EOS/max_new.
A tree step (plan.lc.tree) drafts a tree (``Drafter.propose_tree``), verifies its N + 1 tokens
(root x_{n-1} first) in one target forward with the ancestor mask among them (the prefix is
unmasked), accepts a root-to-node path (greedy, or lossless recursive rejection over siblings),
moves the path's target K/V into cache order and lets the drafter absorb the path.

Lazy upkeep (adaptive k = 0 steps with an ``upkeep`` drafter): a plain step does not run the
drafter; the new token (and the feature the drafter will consume with it, ``lag_feature``) goes
into a per-row window (``lag_tokens`` / ``lag_feats``, W slots indexed by position mod W) and
``lag`` counts the positions the drafter has not seen. ``catch_up_state`` runs the drafter once
over the whole backlog (one W-token forward instead of one per plain step) when the row next
speculates, or when the window fills (then the newest position stays pending, so no logits are
computed that would be stale again a step later).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from specjax import control, kv_cache, ngram, tree
from specjax.model import lm_head
from specjax.registry import init_cache
from specjax.speculate.drafters import Span
from specjax.structured import apply_bitmask
from specjax.speculate.state import (DecodeState, Drafts, Models, Plan, RowParams, Verified, accept,
                                     accept_tree, commit, emit, emitted_tokens, sample,
                                     step_keys, target_forward, where_rows)


def init_lag(drafter, rows: int, window: int, dtype) -> dict:
    """Zeroed lazy-upkeep fields (lag, lag_tokens, lag_feats) for ``rows`` rows ({} if the
    drafter keeps no upkeep)."""
    if not drafter.upkeep:
        return {}
    out = {"lag": jnp.zeros((rows,), jnp.int32), "lag_tokens": jnp.zeros((rows, window), jnp.int32)}
    if drafter.lag_feature_size:
        out["lag_feats"] = jnp.zeros((rows, window, drafter.lag_feature_size), dtype)
    return out


def init_state(models: Models, plan: Plan, tokens, prompt_lens, rp: RowParams, seed,
               num_pages_per_seq: int, out_len: int, kv_dtype=jnp.float32):
    """Fills the target cache and the drafter over the prompts and samples the first token.

    Args:
      tokens: [B, Tp] int32 right-padded prompts; prompt_lens: [B] int32 (>= 1).
      seed: [] int32; row b's stream is fold_in(key(seed), b).
    Returns:
      the initial DecodeState (the first generated token is already in out_tokens).
    """
    lc, drafter = plan.lc, plan.drafter
    b, tp = tokens.shape
    page_table = kv_cache.contiguous_page_table(b, num_pages_per_seq)
    num_pages = b * num_pages_per_seq
    row_keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(b))
    zeros = jnp.zeros((b,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (b, tp))

    target_kv = init_cache(plan.target_cfg, num_pages, lc.page_size, kv_dtype)
    _, hidden, target_kv, aux = target_forward(models.target, plan.target_cfg, tokens, positions,
                                               target_kv, page_table, zeros, prompt_lens,
                                               attn_impl=lc.attn_impl, return_logits=False,
                                               aux_layers=drafter.aux_layers)
    last_h = jnp.take_along_axis(hidden, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]  # [B, E]
    logits = lm_head(models.target, plan.target_cfg, last_h)  # [B, V]
    first = sample(step_keys(row_keys, 0, 0), logits, rp)  # [B]

    draft_kv, _ = drafter.init(b, num_pages, lc.page_size, kv_dtype)
    draft_kv, carry = drafter.extend(models, draft_kv, Span(tokens, hidden, aux, zeros,
                                                            prompt_lens, first, page_table))
    i0 = jnp.zeros((), jnp.int32)
    state = DecodeState(
        target_kv=target_kv, draft_kv=draft_kv, page_table=page_table, lengths=prompt_lens + 1,
        last_token=first, carry=carry, out_tokens=jnp.zeros((b, out_len), jnp.int32),
        num_out=zeros, done=jnp.zeros((b,), bool), step=jnp.ones((), jnp.int32),
        row_keys=row_keys, accepted_per_pos=jnp.zeros((max(lc.k_eff, 1),), jnp.int32),
        row_steps=i0, drafted=i0, spec_steps=i0)
    if drafter.uses_history:  # x_0..x_{n-1}: the prompt, then the first token at n - 1
        history = ngram.write(jnp.pad(tokens, ((0, 0), (0, out_len))), first[:, None], prompt_lens)
        state = dataclasses.replace(state, history=history)
    out, num_out, done = emit(state, first[:, None], jnp.ones((b,), jnp.int32), rp)
    return dataclasses.replace(state, out_tokens=out, num_out=num_out, done=done)


def catch_up(models, drafter, draft_kv, page_table, lengths, num, lag_tokens, lag_feats,
             keep: int = 0):
    """Runs the drafter over ``num`` pending positions, the oldest first, leaving the newest
    ``keep`` pending (one forward of W = lag_tokens.shape[1] slots), writing their K/V.

    Pending positions end ``drafter.lag_offset`` before ``lengths``; position p's token (and
    feature) are read from the window at slot p % W.

    Args:
      lengths: [B] int32 committed tokens n; num: [B] int32 in [0, W] positions to process
        (0 = row untouched).
    Returns:
      (draft_kv, hidden [B, E] the drafter's output at the last processed position, valid where
      num > 0).
    """
    w = lag_tokens.shape[1]
    start = lengths - drafter.lag_offset - keep - num
    pos = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]  # [B, W] (beyond num: unused)
    slots = pos % w
    tokens = jnp.take_along_axis(lag_tokens, slots, axis=1)
    feats = None if lag_feats is None else jnp.take_along_axis(lag_feats, slots[:, :, None], axis=1)
    draft_kv, hh = drafter.catch_up(models, draft_kv, page_table, tokens, feats, pos, start, num)
    last = jnp.take_along_axis(hh, jnp.maximum(num - 1, 0)[:, None, None], axis=1)[:, 0]
    return draft_kv, last


def catch_up_state(models: Models, plan: Plan, state: DecodeState, keep: int) -> DecodeState:
    """Catches active rows' drafters up to all but ``keep`` pending positions. keep = 0 also
    refreshes the carry; keep = 1 leaves the newest position pending (the carry stays stale
    and no logits are computed)."""
    drafter = plan.drafter
    num = jnp.where(~state.done, jnp.maximum(state.lag - keep, 0), 0)
    draft_kv, last = catch_up(models, drafter, state.draft_kv, state.page_table, state.lengths,
                              num, state.lag_tokens, state.lag_feats, keep)
    updates = {"draft_kv": draft_kv, "lag": state.lag - num}
    if keep == 0:
        updates["carry"] = where_rows(num > 0, drafter.refresh(models, last), state.carry)
    return dataclasses.replace(state, **updates)


def caught_up(models, plan, state):
    """The state with lagging drafters caught up (a no-op without lazy upkeep)."""
    if state.lag is None:
        return state
    return control.cond(jnp.any((state.lag > 0) & ~state.done),
                        lambda s: catch_up_state(models, plan, s, keep=0), state)


def plain_step(models: Models, state: DecodeState, rp: RowParams, plan: Plan):
    """A one-token target step. A drafter that must follow (adaptive k = 0) is not run: the new
    token (and its feature) goes into the lag window, caught up later (module docstring).

    Returns (state, a [B] zeros, verified [B] zeros).
    """
    drafter = plan.drafter
    b = state.lengths.shape[0]
    n = state.lengths
    active = ~state.done
    lazy = state.lag is not None
    logits, hidden, target_kv, aux = target_forward(
        models.target, plan.target_cfg, state.last_token[:, None], (n - 1)[:, None],
        state.target_kv, state.page_table, n - 1, attn_impl=plan.lc.attn_impl,
        aux_layers=drafter.aux_layers if lazy else ())
    y = sample(step_keys(state.row_keys, state.step, 2), logits[:, 0], rp)
    zeros = jnp.zeros((b,), jnp.int32)
    updates = {"target_kv": target_kv}
    if lazy:
        # The drafter's new pending position p = n - lag_offset consumes x_n = y (and f_{n-1}).
        rows = jnp.arange(b)
        slot = (n - drafter.lag_offset) % state.lag_tokens.shape[1]
        updates["lag_tokens"] = state.lag_tokens.at[rows, slot].set(
            jnp.where(active, y, state.lag_tokens[rows, slot]))
        if state.lag_feats is not None:
            feats = drafter.lag_feature(models, hidden, aux)  # [B, E]
            updates["lag_feats"] = state.lag_feats.at[rows, slot].set(
                jnp.where(active[:, None], feats.astype(state.lag_feats.dtype),
                          state.lag_feats[rows, slot]))
        updates["lag"] = state.lag + active.astype(jnp.int32)
    new = commit(state, rp, zeros, y, y[:, None], verified=zeros, **updates)
    if lazy:  # a full window: catch up all but the newest position
        new = control.cond(jnp.any((new.lag >= new.lag_tokens.shape[1]) & ~new.done),
                           lambda s: catch_up_state(models, plan, s, keep=1), new)
    return new, zeros, zeros


def chain_step(models: Models, state: DecodeState, rp: RowParams, plan: Plan, drafts=None,
               masks=None):
    """One chain step: propose (unless ``drafts`` holds this step's k drafts already), verify
    k+1 tokens, accept, absorb. ``masks`` [B, K+1, W] int32: token bitmasks of structured
    outputs (specjax.structured) applied to the target's logits at each verify position before
    sampling and acceptance (None: no constraint). Returns (state, a [B], verified [B])."""
    lc, drafter = plan.lc, plan.drafter
    n = state.lengths
    k = lc.k_eff
    active = ~state.done
    if drafts is None:
        state = caught_up(models, plan, state)
        drafts = drafter.propose(models, state, rp, k, step_keys(state.row_keys, state.step, 1),
                                 lc.draft_sampling)
    d = drafts.tokens
    verify_tokens = jnp.concatenate([state.last_token[:, None], d], axis=1)  # [B, K+1]
    positions = (n - 1)[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    logits, hidden, target_kv, aux = target_forward(
        models.target, plan.target_cfg, verify_tokens, positions, state.target_kv,
        state.page_table, n - 1, attn_impl=lc.attn_impl, aux_layers=drafter.aux_layers)
    if masks is not None:
        logits = apply_bitmask(logits, masks)
    a, y = accept(step_keys(state.row_keys, state.step, 2), d, logits, drafts.probs, rp)
    if drafter.may_skip:  # rows without a proposal take an ordinary sample from p_0 (lossless)
        y0 = sample(step_keys(state.row_keys, state.step, 3), logits[:, 0], rp)
        a = jnp.where(drafts.proposing, a, 0)
        y = jnp.where(drafts.proposing, y, y0)
    emitted = emitted_tokens(d, a, y)  # [B, K+1]
    draft_kv, carry = drafter.absorb(models, state, drafts, Verified(
        verify_tokens, emitted, positions, hidden, aux, a, y))
    updates = dict(target_kv=target_kv, draft_kv=draft_kv,
                   carry=where_rows(active, carry, state.carry))
    if state.lag is not None:  # drafting caught the drafter up: level again
        updates["lag"] = jnp.where(active, 0, state.lag)
    verified = jnp.where(drafts.proposing, k, 0).astype(jnp.int32)
    return commit(state, rp, a, y, emitted, verified=verified, **updates), a, verified


def tree_step(models: Models, state: DecodeState, rp: RowParams, plan: Plan, proposal=None,
              masks=None):
    """One tree step (module docstring). ``proposal``: this step's (tokens [B, N], parents
    [B, N+1], depth [B, N+1]) already drafted (the drafter's pool after proposing is
    ``state.draft_kv``); ``masks`` [B, N+1, W] int32: structured-output bitmasks per node (the
    grammar state after the root-to-node path). Returns (state, a [B], verified [B] = N nodes)."""
    lc, drafter = plan.lc, plan.drafter
    tc = lc.tree
    n = state.lengths
    active = ~state.done
    d_max = tc.max_depth
    if proposal is None:
        tokens, parents, depth, draft_kv = drafter.propose_tree(models, state, tc)  # [B,N], [B,N+1]
    else:
        (tokens, parents, depth), draft_kv = proposal, state.draft_kv
    verify_tokens = jnp.concatenate([state.last_token[:, None], tokens], axis=1)  # [B, N+1]
    logits, hidden, target_kv, aux = target_forward(
        models.target, plan.target_cfg, verify_tokens, (n - 1)[:, None] + depth, state.target_kv,
        state.page_table, n - 1, new_mask=tree.ancestor_mask(parents), attn_impl=lc.attn_impl,
        aux_layers=drafter.aux_layers)
    if masks is not None:
        logits = apply_bitmask(logits, masks)
    a, y, path = accept_tree(step_keys(state.row_keys, state.step, 2), tokens, parents, depth,
                             logits, rp, d_max)  # path [B, D+1]
    path_tokens = jnp.take_along_axis(verify_tokens, path, axis=1)  # [B, D+1] root first
    emitted = emitted_tokens(path_tokens[:, 1:], a, y)  # [B, D+1]
    # The accepted path's K/V into cache order (root already sits at n - 1).
    target_kv = tree.copy_slots(target_kv, state.page_table, n - 1, path,
                                jnp.where(active, a + 1, 0),
                                kv_cache.layer_windows(plan.target_cfg))

    def on_path(x):  # [B, N+1, .] -> [B, D+1, .] the accepted path's rows
        return None if x is None else jnp.take_along_axis(x, path[:, :, None], axis=1)

    positions = (n - 1)[:, None] + jnp.arange(d_max + 1, dtype=jnp.int32)[None, :]
    proposal = dataclasses.replace(_tree_drafts(tokens, state), draft_kv=draft_kv)
    draft_kv, carry = drafter.absorb(models, state, proposal, Verified(
        path_tokens, emitted, positions, on_path(hidden), on_path(aux), a, y))
    verified = jnp.full(n.shape, tokens.shape[1], jnp.int32)
    new = commit(state, rp, a, y, emitted, verified=verified, target_kv=target_kv,
                 draft_kv=draft_kv, carry=where_rows(active, carry, state.carry))
    return new, a, verified


def _tree_drafts(tokens, state):
    return Drafts(tokens=tokens, probs=None, draft_kv=state.draft_kv, carry=state.carry,
                  proposing=jnp.ones(tokens.shape[:1], bool))


def switch_steps(index, steps, state: DecodeState):
    """Runs ``steps[index](state)`` -> (state, a [B], verified [B]) without copying the KV pools
    (specjax.control: a lax.switch here would copy every pool on every step)."""
    zeros = jnp.zeros(state.lengths.shape, jnp.int32)
    return control.switch(index, [lambda op, f=f: f(op[0]) for f in steps], (state, zeros, zeros))


def fixed_step(models: Models, state: DecodeState, rp: RowParams, plan: Plan):
    """A step with the static draft length plan.lc.k_eff (0 = plain); a drafter that may find
    nothing to propose (n-gram) takes a plain step when no active row proposes."""
    if plan.lc.k_eff == 0:
        return plain_step(models, state, rp, plan)
    if plan.lc.tree is not None:
        return tree_step(models, state, rp, plan)
    if plan.drafter.may_skip:
        return switch_steps(plan.drafter.any_proposal(state).astype(jnp.int32),
                            [lambda s: plain_step(models, s, rp, plan),
                             lambda s: chain_step(models, s, rp, plan)], state)
    return chain_step(models, state, rp, plan)
