"""Adaptive speculation: pick the draft length k in {0 (plain step), 1..K} on device, every step.

The device keeps decayed counts of per-position acceptance over recent steps (one estimate per
batch): ``obs[i]`` (row-steps that reached draft position i+1, i.e. drafted it with every earlier
draft accepted) and ``hits[i]`` (those that accepted it), both multiplied by ``DECAY`` each step and
normalised per active row, so the estimate follows the last ~1/(1 - DECAY) steps. The conditional
acceptance of position i is (hits[i] + prior_i) / (obs[i] + 1) with prior_0 = PRIOR and
prior_i = the estimate of position i-1 (positions never tried borrow from the one before).
Unobserved counts decay back towards the prior, so a k that looked bad is eventually retried.

Expected tokens of a k-step: E(k) = 1 + sum_{i<k} prod_{j<=i} alpha_j. Its cost, relative to a
plain one-token step, is ``cost[k]`` = (verify(k+1) + drafting(k)) / decode(1), measured on the
actual device at warm-up (``measure_costs``) and cached per (model, draft, dtype, batch bucket,
backend, method, K) in-process and in ``~/.cache/specjax/cost_model.json``. The device picks
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

_COSTS: dict = {}  # in-process cache: key -> list of K+1 relative costs


def acceptance_estimate(hits: jax.Array, obs: jax.Array) -> jax.Array:
    """[K] conditional acceptance estimate per draft position (module docstring)."""
    est, prior = [], jnp.float32(PRIOR)
    for i in range(hits.shape[0]):  # static, small
        prior = (hits[i] + prior) / (obs[i] + 1.0)
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

def _cache_file() -> str:
    root = os.environ.get("SPECJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                               "specjax")
    return os.path.join(root, "cost_model.json")


def cost_key(target_cfg, draft_cfg, dtype, batch: int, method: str, kmax: int) -> str:
    """Cache key: the model and draft configs, dtype, batch bucket, backend, method and K."""
    text = repr((target_cfg, draft_cfg, str(jnp.dtype(dtype)), batch, jax.default_backend(),
                 jax.devices()[0].device_kind, method, kmax))
    return hashlib.sha1(text.encode()).hexdigest()


def _load_file() -> dict:
    try:
        with open(_cache_file()) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _store_file(key: str, costs: list) -> None:
    try:
        data = _load_file()
        data[key] = costs
        os.makedirs(os.path.dirname(_cache_file()), exist_ok=True)
        tmp = _cache_file() + f".{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, _cache_file())
    except OSError:  # a read-only home only loses the cache
        pass


def _time(fn, *args, reps: int = 5) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measure_costs(target_params, target_cfg, draft_params, draft_cfg, *, method: str, kmax: int,
                  batch: int, context: int, dtype, page_size: int = 16,
                  attn_impl: str = "reference") -> list:
    """Relative cost [K+1] of a k-step (k = 0..K) on this device, cached (module docstring).

    Times the target forward over T = 1..K+1 tokens (with logits) after ``context`` cached
    tokens, and the drafter's one-token and (K+1)-token forwards, at this batch size.
    """
    from specjax import heads, kv_cache, speculate  # noqa: PLC0415 (speculate imports us)

    key = cost_key(target_cfg, draft_cfg, dtype, batch, method, kmax)
    if key in _COSTS:
        return _COSTS[key]
    stored = _load_file().get(key)
    if stored is not None and len(stored) == kmax + 1:
        _COSTS[key] = stored
        return stored

    per_seq = kv_cache.pages_needed(context + kmax + 2, page_size)
    page_table = kv_cache.contiguous_page_table(batch, per_seq)
    start = jnp.full((batch,), context, jnp.int32)

    def fwd_target(t):
        kv = speculate.init_cache(target_cfg, batch * per_seq, page_size, dtype)

        @jax.jit
        def f(params, kv):
            toks = jnp.zeros((batch, t), jnp.int32)
            pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            logits, _, kv = speculate.forward(params, target_cfg, toks, pos, kv, page_table, start,
                                              attn_impl=attn_impl)
            return logits, kv
        return _time(f, target_params, kv)

    def fwd_draft(t):
        if method == "draft":
            kv = speculate.init_cache(draft_cfg, batch * per_seq, page_size, dtype)

            @jax.jit
            def f(params, kv):
                toks = jnp.zeros((batch, t), jnp.int32)
                pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
                logits, _, kv = speculate.forward(params, draft_cfg, toks, pos, kv, page_table,
                                                  start, attn_impl=attn_impl)
                return logits[:, -1], kv
            return _time(f, draft_params, kv)
        kv = speculate.init_cache(draft_cfg.layer, batch * per_seq, page_size, dtype)

        @jax.jit
        def g(params, tparams, kv):
            toks = jnp.zeros((batch, t), jnp.int32)
            feats = jnp.zeros((batch, t, draft_cfg.layer.hidden_size), dtype)
            pos = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
            hh, kv = heads.head_forward(params, draft_cfg, tparams, toks, feats, pos, kv,
                                        page_table, start, attn_impl=attn_impl)
            return heads.head_logits(params, draft_cfg, tparams, target_cfg, hh[:, -1]), kv
        return _time(g, draft_params, target_params, kv)

    verify = [fwd_target(t) for t in range(1, kmax + 2)]
    if method in ("draft", "mtp", "eagle", "eagle3"):
        d1, dk = fwd_draft(1), fwd_draft(kmax + 1)
        d2 = fwd_draft(2) if method == "draft" else None
    costs = [1.0]
    for k in range(1, kmax + 1):
        c = verify[k]
        if method == "draft":  # k-1 rollout steps + a two-token catch-up
            c += (k - 1) * d1 + d2
        elif method in ("mtp", "eagle", "eagle3"):  # k-1 rollout steps + a (k+1)-token re-run
            c += (k - 1) * d1 + d1 + (dk - d1) * k / kmax
        costs.append(float(c / verify[0]))
    costs = [float(x) for x in np.maximum(costs, 1e-3)]
    _COSTS[key] = costs
    _store_file(key, costs)
    return costs
