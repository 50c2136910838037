"""Adaptive speculation: pick the draft length k in {0 (plain step), 1..K} on device, every step.

The device keeps decayed counts of per-position acceptance over recent steps (one estimate per
batch): ``obs[i]`` (row-steps that reached draft position i+1, i.e. drafted it with every earlier
draft accepted) and ``hits[i]`` (those that accepted it), both multiplied by ``DECAY`` each step and
normalised per active row, so the estimate follows the last ~1/(1 - DECAY) steps. The conditional
acceptance of position i is (hits[i] + w * prior_i) / (obs[i] + w), w = PRIOR_WEIGHT
pseudo-observations, with prior_0 = PRIOR and prior_i = the estimate of position i-1 (positions
never tried borrow from the one before). Unobserved counts decay back towards the prior, so a k
that looked bad is eventually retried; the small w makes that retry (a probe) rare, every ~30
plain steps after a draft that accepted nothing, so a useless draft costs little.

Expected tokens of a k-step: E(k) = 1 + sum_{i<k} prod_{j<=i} alpha_j. Its cost, relative to a
plain one-token step, is ``cost[k]`` = (verify(k+1) + drafting(k)) / decode(1), measured on the
actual device at warm-up (``specjax.cost_model.measure_costs``; cached per model, draft, dtype,
batch bucket, backend, method and K). The device picks
argmax_k E(k) / cost[k]; k = 0 has E = 1 and cost 1, so speculation that does not pay is skipped.

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

DECAY = 0.95  # per-step decay of the acceptance counts
PRIOR = 0.5  # acceptance assumed for a position with no recent observation
PRIOR_WEIGHT = 0.25  # pseudo-observations the prior counts for



def acceptance_estimate(hits: jax.Array, obs: jax.Array) -> jax.Array:
    """[K] conditional acceptance estimate per draft position (module docstring)."""
    est, prior = [], jnp.float32(PRIOR)
    for i in range(hits.shape[0]):  # static, small
        prior = (hits[i] + PRIOR_WEIGHT * prior) / (obs[i] + PRIOR_WEIGHT)
        est.append(prior)
    return jnp.stack(est)


def choose_k(hits: jax.Array, obs: jax.Array, cost: jax.Array) -> jax.Array:
    """[] int32 k in [0, K] maximising expected tokens per unit cost. cost: [K+1] float32."""
    alpha = acceptance_estimate(hits, obs)  # [K]
    expected = 1.0 + jnp.concatenate([jnp.zeros((1,)), jnp.cumsum(jnp.cumprod(alpha))])  # [K+1]
    return jnp.argmax(expected / cost).astype(jnp.int32)


def update(hits, obs, num_accepted, k_used, active):
    """Decays the counts and adds one step's observations.

    num_accepted: [B] int32 drafts accepted per row; k_used: [] int32 draft length of the step
    (0 = plain step: nothing observed); active: [B] bool rows that took part.
    """
    kmax = hits.shape[0]
    pos = jnp.arange(kmax, dtype=jnp.int32)[None, :]  # position i+1 drafted at index i
    drafted = (pos < k_used) & active[:, None]
    reached = drafted & (pos <= num_accepted[:, None])  # every earlier draft accepted
    accepted = reached & (pos < num_accepted[:, None])
    rows = jnp.maximum(jnp.sum(active), 1).astype(jnp.float32)
    hits = DECAY * hits + jnp.sum(accepted, axis=0) / rows
    obs = DECAY * obs + jnp.sum(reached, axis=0) / rows
    return hits, obs


# ------------------------------------------------------------------------------- cost model
