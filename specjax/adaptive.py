"""Adaptive speculation: pick the draft length k in {0 (plain step), 1..K} on device, every step.

The device keeps decayed counts of per-position acceptance over recent *drafting* steps (one
estimate per batch): ``obs[i]`` (row-steps that reached draft position i+1, i.e. drafted it with
every earlier draft accepted) and ``hits[i]`` (those that accepted it), normalised per drafting
row and multiplied by ``DECAY`` on every step that drafts, so the estimate follows the last
~1/(1 - DECAY) steps that observed acceptance. Plain steps observe nothing and leave the
estimate alone: a mediocre draft whose estimate sits near break-even is not forgotten while the
loop takes plain steps. The conditional acceptance of position i is
(hits[i] + w * prior_i) / (obs[i] + w), w = PRIOR_WEIGHT pseudo-observations, with prior_0 =
PRIOR and prior_i = the estimate of position i-1 (positions never tried borrow from the one
before).

Expected tokens of a k-step: E(k) = 1 + sum_{i<k} prod_{j<=i} alpha_j. Its cost, relative to a
plain one-token step, is ``cost[k]`` = (verify(k+1) + drafting(k)) / decode(1), measured on the
actual device at warm-up (``specjax.cost_model.measure_costs``; cached per model, draft, dtype,
batch bucket, backend, method and K). The device picks argmax_k E(k) / cost[k]; k = 0 has E = 1
and cost 1, so speculation that does not pay is skipped. Plain steps leave the drafter behind
(``specjax.speculate``: lazy upkeep), and the first drafting step after them first catches it up
(one drafter forward over the lag window); ``cost[K+1]`` is that catch-up's cost, added to every
k >= 1 while the drafter lags. Entering speculation thus costs more than staying in it: a draft
near break-even keeps its current mode instead of paying a catch-up on every other step.

Since plain steps do not change the estimate, a draft written off stays written off unless it is
tried again: ``plain_run`` counts consecutive steps that drafted nothing, and after
``PROBE_EVERY`` of them the next step is forced to draft (the best k >= 1; a probe). A useless
draft then costs one probe per PROBE_EVERY + 1 steps; a draft whose acceptance has risen (the
text turned repetitive, a code block began) is picked up within PROBE_EVERY steps. A k whose
cost is infinite is never chosen, not even by a probe (all infinite: always plain steps).

**Confidence mode** (``SpecConfig.adaptive_by="confidence"``, model drafters): the step first
reads the drafter's own confidence c_i = max_v q_i(v) of each draft position (a property of the
draft distribution, not of the sampled token, so the choice of k never biases which tokens are
verified and the acceptance rule stays exact), and turns it into an acceptance estimate through a
calibration table: decayed hits / observations per (draft position, confidence bin)
(``NUM_BINS`` equal bins over [0, 1], plus one bin for n-gram hybrid drafts) with weight
``PRIOR_WEIGHT`` on a prior: a first draft's bin its own centre (n-gram: ``PRIOR``), a later
draft's bin the same bin's estimate one position earlier. Rows differ per step, so
E_b(k) = 1 + sum_{i<=k} prod_{j<=i} alpha_{b,j} and the batch picks argmax_k sum_b E_b(k) /
cost'(k), where cost'(k) excludes the rollout already spent (``cost[K+2]``, one draft step).
Drafting itself stops early (``extend``): one more draft step is taken only while the pooled
estimate of the next position says it could pay. This is EAGLE-2's observation (the draft's
confidence predicts acceptance) applied to a chain: long chains when the draft is sure, a plain
step when it is lost.

Shapes: K the largest draft length; NB = NUM_BINS + 1 table columns.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

DECAY = 0.98  # decay of the acceptance counts per drafting step
PRIOR = 0.5  # acceptance assumed for a position with no recent observation
PRIOR_WEIGHT = 3.0  # pseudo-observations the prior counts for
PROBE_EVERY = 32  # consecutive non-drafting steps after which one step must draft
NUM_BINS = 10  # confidence bins of the calibration table (confidence mode); column NUM_BINS: n-gram
TABLE_DECAY = 0.995  # decay of the calibration table per drafting step (more cells: longer memory)



def acceptance_estimate(hits: jax.Array, obs: jax.Array) -> jax.Array:
    """[K] conditional acceptance estimate per draft position (module docstring)."""
    est, prior = [], jnp.float32(PRIOR)
    for i in range(hits.shape[0]):  # static, small
        prior = (hits[i] + PRIOR_WEIGHT * prior) / (obs[i] + PRIOR_WEIGHT)
        est.append(prior)
    return jnp.stack(est)


def choose_k(hits: jax.Array, obs: jax.Array, cost: jax.Array, plain_run: jax.Array,
             lagging=False) -> jax.Array:
    """[] int32 k in [0, K] maximising expected tokens per unit cost; k >= 1 when a probe is due.

    cost: [K+1] float32 k-step costs, or [K+2] with the drafter's catch-up cost next (module
    docstring; a [K+3]'s last entry, one draft step, is not used here), charged to every k >= 1 when ``lagging`` ([] bool: plain steps left an active
    row's drafter behind); plain_run: [] int32 consecutive steps that drafted nothing.
    """
    kmax = hits.shape[0]
    step_cost = cost[:kmax + 1]
    if cost.shape[0] >= kmax + 2:
        step_cost = step_cost + jnp.where(
            lagging & (jnp.arange(kmax + 1) > 0), cost[kmax + 1], 0.0)
    alpha = acceptance_estimate(hits, obs)  # [K]
    expected = 1.0 + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(jnp.cumprod(alpha))])  # [K+1]
    value = expected / step_cost  # [K+1]
    probe = (plain_run >= PROBE_EVERY) & jnp.any(jnp.isfinite(step_cost[1:]))  # inf: never run
    value = jnp.where(probe & (jnp.arange(value.shape[0]) == 0), -jnp.inf, value)
    return jnp.argmax(value).astype(jnp.int32)


def update(hits, obs, plain_run, num_accepted, k_used, active):
    """Adds one step's observations; returns (hits, obs, plain_run).

    num_accepted: [B] int32 drafts accepted per row; k_used: [] int32 draft length of the step
    (0 = plain step, or no row drafted: nothing observed, the counts are kept as they are and
    plain_run grows); active: [B] bool rows that drafted.
    """
    kmax = hits.shape[0]
    pos = jnp.arange(kmax, dtype=jnp.int32)[None, :]  # position i+1 drafted at index i
    drafted = (pos < k_used) & active[:, None]
    reached = drafted & (pos <= num_accepted[:, None])  # every earlier draft accepted
    accepted = reached & (pos < num_accepted[:, None])
    rows = jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
    observed = (k_used > 0) & jnp.any(active)
    decay = jnp.where(observed, DECAY, 1.0)
    hits = decay * hits + jnp.sum(accepted, axis=0) / rows
    obs = decay * obs + jnp.sum(reached, axis=0) / rows
    plain_run = jnp.where(observed, 0, plain_run + 1).astype(jnp.int32)
    return hits, obs, plain_run


# ------------------------------------------------------------------------- confidence mode

def init_counts(kmax: int, by_confidence: bool) -> dict:
    """Zeroed adaptive state: acc_hits / acc_obs ([K] history mode, [K, NUM_BINS + 1] confidence
    mode), plain_run [] and k_hist [K+1]."""
    shape = (kmax, NUM_BINS + 1) if by_confidence else (kmax,)
    return dict(acc_hits=jnp.zeros(shape, jnp.float32), acc_obs=jnp.zeros(shape, jnp.float32),
                plain_run=jnp.zeros((), jnp.int32), k_hist=jnp.zeros((kmax + 1,), jnp.int32))


def max_prob(logits: jax.Array) -> jax.Array:
    """[..., V] logits -> [...] the largest probability of their softmax (a draft's confidence)."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    return 1.0 / jnp.sum(jnp.exp(logits - top), axis=-1)


def confidence_bins(conf: jax.Array, from_ngram: jax.Array | None = None) -> jax.Array:
    """[B, K] confidences in [0, 1] -> [B, K] int32 table columns (n-gram hybrid rows: NUM_BINS)."""
    bins = jnp.clip(jnp.floor(conf * NUM_BINS), 0, NUM_BINS - 1).astype(jnp.int32)
    if from_ngram is not None:
        bins = jnp.where(from_ngram[:, None], NUM_BINS, bins)
    return bins


def _bin_priors() -> jax.Array:
    """[NUM_BINS + 1] prior acceptance per column: each confidence bin's centre, then PRIOR."""
    return jnp.concatenate([(jnp.arange(NUM_BINS, dtype=jnp.float32) + 0.5) / NUM_BINS,
                            jnp.full((1,), PRIOR, jnp.float32)])


def calibration(hits: jax.Array, obs: jax.Array) -> jax.Array:
    """[K, NB] acceptance estimate per table cell: (hits + w * prior) / (obs + w), the prior of
    a position-1 cell its bin's centre (n-gram column: PRIOR), of a later cell the estimate of
    the same bin one position earlier (a cell never tried borrows from the one before)."""
    est, prior = [], _bin_priors()
    for i in range(hits.shape[0]):  # static, small
        prior = (hits[i] + PRIOR_WEIGHT * prior) / (obs[i] + PRIOR_WEIGHT)
        est.append(prior)
    return jnp.stack(est)


def calibrated(hits: jax.Array, obs: jax.Array, bins: jax.Array) -> jax.Array:
    """[B, K] acceptance estimate of each draft from its table cell (position, bin)."""
    return calibration(hits, obs)[jnp.arange(hits.shape[0])[None, :], bins]


def expected_tokens(alpha: jax.Array) -> jax.Array:
    """[B, K] conditional acceptance -> [B, K+1] expected tokens of a k-step, k = 0..K."""
    zero = jnp.zeros(alpha.shape[:-1] + (1,), alpha.dtype)
    return 1.0 + jnp.concatenate([zero, jnp.cumsum(jnp.cumprod(alpha, axis=-1), axis=-1)], axis=-1)


def _costs_after(cost: jax.Array, kmax: int, drafted) -> jax.Array:
    """[K+1] cost of a k-step once ``drafted`` draft steps are spent: cost[k] less the draft
    steps (one per draft after the first, ``cost[K+2]``; 0 if absent) already taken. A plain
    step (k = 0) is charged the catch-up it leaves to the next step (``cost[K+1]``; 0 if
    absent): confidence mode always catches the drafter up before it drafts."""
    h = cost[kmax + 2] if cost.shape[0] >= kmax + 3 else 0.0
    catch_up = cost[kmax + 1] if cost.shape[0] >= kmax + 2 else 0.0
    k = jnp.arange(kmax + 1)
    return (cost[:kmax + 1] - jnp.maximum(jnp.minimum(k, drafted) - 1, 0) * h
            + jnp.where(k == 0, catch_up, 0.0))


def extend(hits: jax.Array, obs: jax.Array, alpha: jax.Array, drafted, active: jax.Array,
           next_known: jax.Array, cost: jax.Array) -> jax.Array:
    """[] bool: whether drafting one more token (position ``drafted`` + 1) can pay.

    alpha: [B, K] estimates of the drafts so far (positions >= drafted unused), except rows with
    ``next_known`` [B] bool (n-gram hybrid rows: their whole proposal is known), whose entry at
    ``drafted`` is already their estimate. Other rows' next position is estimated by the pooled
    table of that position (all bins). Compares the best k <= drafted with k = drafted + 1.
    """
    kmax = hits.shape[0]
    idx = jnp.arange(kmax)[None, :]
    pooled = acceptance_estimate(hits.sum(-1), obs.sum(-1))  # [K]
    guess = jnp.where(next_known[:, None], alpha, pooled[None, :])
    a = jnp.where(idx < drafted, alpha, jnp.where(idx == drafted, guess, 0.0))
    tot = jnp.sum(jnp.where(active[:, None], expected_tokens(a), 0.0), axis=0)  # [K+1]
    value = tot / _costs_after(cost, kmax, drafted)
    k = jnp.arange(kmax + 1)
    best_now = jnp.max(jnp.where(k <= drafted, value, -jnp.inf))
    return (drafted < kmax) & (value[jnp.minimum(drafted + 1, kmax)] > best_now)


def choose_confident(alpha: jax.Array, active: jax.Array, drafted, cost: jax.Array,
                     plain_run: jax.Array) -> jax.Array:
    """[] int32 k in [0, drafted] maximising sum_b E_b(k) / cost'(k) over active rows (the
    rollout already spent is not charged); k >= 1 when a probe is due (PROBE_EVERY)."""
    kmax = alpha.shape[1]
    tot = jnp.sum(jnp.where(active[:, None], expected_tokens(alpha), 0.0), axis=0)  # [K+1]
    step_cost = _costs_after(cost, kmax, drafted)
    value = tot / step_cost
    k = jnp.arange(kmax + 1)
    value = jnp.where((k > drafted) | ~jnp.isfinite(step_cost), -jnp.inf, value)
    probe = (plain_run >= PROBE_EVERY) & jnp.any(jnp.isfinite(step_cost[1:]))
    value = jnp.where(probe & (k == 0), -jnp.inf, value)
    return jnp.argmax(value).astype(jnp.int32)


def update_table(hits, obs, plain_run, bins, num_accepted, k_used, active):
    """Adds one step's observations to the calibration table; returns (hits, obs, plain_run).

    bins: [B, K] int32 table column of each row's drafts; num_accepted, k_used, active: as in
    ``update``.
    """
    kmax, nb = hits.shape
    pos = jnp.arange(kmax, dtype=jnp.int32)[None, :]
    drafted = (pos < k_used) & active[:, None]
    reached = drafted & (pos <= num_accepted[:, None])
    accepted = reached & (pos < num_accepted[:, None])
    onehot = jax.nn.one_hot(bins, nb, dtype=jnp.float32)  # [B, K, NB]
    rows = jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
    observed = (k_used > 0) & jnp.any(active)
    decay = jnp.where(observed, TABLE_DECAY, 1.0)
    hits = decay * hits + jnp.sum(accepted[..., None] * onehot, axis=0) / rows
    obs = decay * obs + jnp.sum(reached[..., None] * onehot, axis=0) / rows
    plain_run = jnp.where(observed, 0, plain_run + 1).astype(jnp.int32)
    return hits, obs, plain_run
