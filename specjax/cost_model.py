"""The cost model of adaptive speculation, measured on the actual device at warm-up.

``measure_costs`` times a plain one-token target step, a (k+1)-token verify and k draft steps
for k = 1..K at the given batch bucket and context, and returns ``cost[k]`` =
(verify(k+1) + drafting(k)) / decode(1) (``cost[0]`` = 1) and, last (``cost[K+1]``), the drafter's
catch-up over the lag window after plain steps, relative to decode(1): the input of
``specjax.adaptive.choose_k``. Results are cached per (model, draft, dtype, batch bucket,
backend, method, K) in-process and in ``~/.cache/specjax/cost_model.json``. Host-side code
(it times compiled programs): the decode loop itself only imports ``specjax.adaptive``.
"""

from __future__ import annotations
import hashlib
import json
import os
import time
import jax
import jax.numpy as jnp
import numpy as np

_COSTS: dict = {}  # in-process cache: key -> list of K+2 relative costs


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
    """Relative costs [K+2] on this device, cached (module docstring): a k-step for k = 0..K,
    then the drafter's catch-up after plain steps (one forward over the lag window; 0 for n-gram).

    Times the target forward over T = 1..K+1 tokens (with logits) after ``context`` cached
    tokens, and the drafter's forwards over 1, K+1 and LAG_WINDOW tokens, at this batch size.
    """
    from specjax import heads, kv_cache, speculate  # noqa: PLC0415

    key = cost_key(target_cfg, draft_cfg, dtype, batch, method, kmax)
    if key in _COSTS:
        return _COSTS[key]
    stored = _load_file().get(key)
    if stored is not None and len(stored) == kmax + 2:
        _COSTS[key] = stored
        return stored

    per_seq = kv_cache.pages_needed(context + max(kmax + 2, speculate.LAG_WINDOW + 1), page_size)
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
    catch_up = 0.0  # n-gram drafting has no drafter to catch up
    if method in ("draft", "mtp", "eagle", "eagle3"):
        d1, dk = fwd_draft(1), fwd_draft(kmax + 1)
        d2 = fwd_draft(2) if method == "draft" else None
        catch_up = fwd_draft(speculate.LAG_WINDOW) / verify[0]
    costs = [1.0]
    for k in range(1, kmax + 1):
        c = verify[k]
        if method == "draft":  # k-1 rollout steps + a two-token catch-up
            c += (k - 1) * d1 + d2
        elif method in ("mtp", "eagle", "eagle3"):  # k-1 rollout steps + a (k+1)-token re-run
            c += (k - 1) * d1 + d1 + (dk - d1) * k / kmax
        costs.append(float(c / verify[0]))
    costs = [float(x) for x in np.maximum(costs, 1e-3)] + [float(catch_up)]
    _COSTS[key] = costs
    _store_file(key, costs)
    return costs
