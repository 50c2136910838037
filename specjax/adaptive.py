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

Shapes: K the largest draft length.
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

    cost: [K+1] float32 k-step costs, or [K+2] with the drafter's catch-up cost last (module
    docstring), charged to every k >= 1 when ``lagging`` ([] bool: plain steps left an active
    row's drafter behind); plain_run: [] int32 consecutive steps that drafted nothing.
    """
    kmax = hits.shape[0]
    step_cost = cost[:kmax + 1]
    if cost.shape[0] == kmax + 2:
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


# ------------------------------------------------------------------------------- cost model
