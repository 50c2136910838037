"""Structured outputs in the engine: the host side of a constrained step.

A step whose batch holds a constrained request (``RequestParams.constraint``; its
``specjax.structured.Matcher`` rides on the engine's Request) runs synchronously — the previous
step's tokens have advanced every matcher before the masks are built — and, when it speculates,
in two device calls (``steps.spec_propose_step`` then ``steps.spec_verify_step``):

1. propose: the drafter drafts on the device; the host reads the drafts (one extra sync);
2. masks: per constrained row, the grammar's bitmask at every verify position (chain: positions
   0..K after the valid draft prefix; tree: each node after its root-to-node path); rows without
   a constraint get all-ones masks, so their logits, and tokens, are unchanged;
3. verify: the target's logits are masked (-inf outside) before temperature, top-k / top-p and
   the acceptance rule (specjax.structured explains why this is lossless for the constrained
   distribution and why it cuts a chain at its first draft the grammar rejects);
4. retire: the emitted tokens advance the matcher (``advance``); a terminated grammar ends the
   request ("stop").

An ordinary step (prefill's final chunk, one-token decode rows) masks the one sampled position.
"""

from __future__ import annotations

import time

import jax
import numpy as np

from specjax.engine import steps
from specjax.structured import all_allowed


def words_for(vocab_size: int) -> int:
    """W int32 words of a V-token bitmask (xgrammar's layout)."""
    return (vocab_size + 31) // 32


def is_structured(plan) -> bool:
    """Whether a planned step holds a constrained row."""
    return plan is not None and any(r.req.matcher is not None for r in plan.rows)


def extend_masks(plan_rows, batch: int, words: int) -> np.ndarray:
    """[batch, W] masks of an ordinary step: a constrained row that samples (a decode row or a
    final prefill chunk) gets its grammar's current mask; every other row all-ones."""
    masks = all_allowed(batch, words)
    for i, row in enumerate(plan_rows):
        m = row.req.matcher
        if m is not None and (row.kind == steps.KIND_DECODE or row.final):
            m.mask(masks, i)
    return masks


def spec_masks(plan_rows, proposal, tree: bool, batch: int, width: int,
               words: int) -> np.ndarray:
    """[batch, width, W] masks of a verify pass (width = K+1 chain positions or N+1 tree nodes).

    proposal: host arrays, the drafts [B, K] (chain) or (tokens [B, N], parents [B, N+1]) (tree).
    """
    masks = np.full((batch, width, words), -1, np.int32)
    for i, row in enumerate(plan_rows):
        m = row.req.matcher
        if m is None:
            continue
        if tree:
            m.tree_masks(proposal[0][i], proposal[1][i], masks[i])
        else:
            m.chain_masks(proposal[i], masks[i])
    return masks


def advance(req, token: int) -> str | None:
    """Advances a constrained request's grammar over one emitted token: None to go on, "stop"
    when the grammar has ended, "abort" if it rejects the token (never for tokens sampled
    under the masks)."""
    m = req.matcher
    if m is None:
        return None
    if m.accept((token,)) != 1:
        return "abort"
    return "stop" if m.is_terminated() else None


def constrained_step(target_params, draft_params, state, meta, rows, *, kind: str, target_cfg,
                     draft_cfg, sc: steps.StepConfig):
    """One engine step with grammar masks: a speculative one proposes, reads the drafts back,
    builds each row's masks and verifies; an ordinary one masks its sampled position.
    Returns (state, the step's outputs, (mask-building seconds, seconds blocked reading drafts))."""
    b = meta.shape[0]
    words = words_for(target_cfg.vocab_size)
    cfgs = dict(target_cfg=target_cfg, draft_cfg=draft_cfg, sc=sc)
    if kind != "spec":
        t = time.perf_counter()
        masks = extend_masks(rows, b, words)
        t_mask = time.perf_counter() - t
        out = steps.extend_step(target_params, draft_params, state, meta, jax.device_put(masks),
                                **cfgs)
        return out[0], out[1:], (t_mask, 0.0)
    state, proposal = steps.spec_propose_step(target_params, draft_params, state, meta, **cfgs)
    tree = sc.lc.tree is not None
    t = time.perf_counter()
    host = jax.device_get(proposal[:2] if tree else proposal.tokens)  # [B, K] (tree: + parents)
    t_read = time.perf_counter()
    width = (host[0].shape[1] if tree else host.shape[1]) + 1
    masks = spec_masks(rows, host, tree, b, width, words)
    t_mask = time.perf_counter() - t_read
    out = steps.spec_verify_step(target_params, draft_params, state, meta, proposal,
                                 jax.device_put(masks), **cfgs)
    return out[0], out[1:], (t_mask, t_read - t)
