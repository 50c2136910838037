"""The cost model of adaptive speculation, measured on the actual device at warm-up.

``measure_costs`` times the fused decode step the loop runs (draft, verify, accept, drafter
catch-up, commit) with draft length k = 0..K at the given batch bucket and context, and returns
``cost[k]`` = step(k) / step(0) (``cost[0]`` = 1, a plain one-token step), then ``cost[K+1]``,
the drafter's catch-up over the lag window after plain steps, and ``cost[K+2]``, one draft step
(a one-token draft forward; what confidence mode may leave unspent), relative to step(0).
A k-step measured cheaper than a (k-1)-step (k >= 2; it does strictly more work) is noise: the
steps are timed again with twice the rounds, and the costs kept non-decreasing in k. Timing the
whole step, not its forwards, matters: on a 2-core CPU a k = 2 step costs ~0.11
plain steps more than k = 1 in the loop, while the forwards alone differ by ~0.05. The input of
``specjax.adaptive.choose_k``. Results are cached per (model, draft, dtype, batch bucket,
backend, method, K, native kernel on or off, ``CODE_VERSION``) in-process and in
``~/.cache/specjax/cost_model.json``. Host-side code (it times compiled programs): the decode loop
itself only imports ``specjax.adaptive``.

``forward_fn`` / ``time_forward`` / ``cost_ratios`` time bare target forwards instead (verify(k+1)
over decode(1), the ratio behind every speedup): the benchmarks' reports, not adaptive k.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from specjax import heads, kv_cache, native, registry, speculate
from specjax.config import SpecConfig
from specjax.model import Model

# Bump when what a step does (and so what it costs) changes: cached costs of an older step are
# then not reused.
CODE_VERSION = 2

_COSTS: dict = {}  # in-process cache: key -> list of K+3 relative costs


def _cache_file() -> str:
    root = os.environ.get("SPECJAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache",
                                                               "specjax")
    return os.path.join(root, "cost_model.json")


def cost_key(target_cfg, draft_cfg, dtype, batch: int, method: str, kmax: int,
             native_on: bool | str = False) -> str:
    """Cache key: the model and draft configs, dtype, batch bucket, backend, method, K, which
    native CPU kernels run the forwards (``native_on``: ``uses_native``'s kinds, or a bool) and
    ``CODE_VERSION``."""
    text = repr(("fused-step", CODE_VERSION, target_cfg, draft_cfg, str(jnp.dtype(dtype)), batch,
                 jax.default_backend(), jax.devices()[0].device_kind, method, kmax,
                 native_on if isinstance(native_on, str) else bool(native_on)))
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


def _step_times(target_params, target_cfg, draft_params, draft_cfg, *, method: str, kmax: int,
                batch: int, context: int, dtype, page_size: int, attn_impl: str,
                reps: int = 25) -> list:
    """[K+1] median seconds of one fused decode step with draft length k = 0..K (k = 0: a
    plain step): the jitted step the loop runs (draft, verify, accept, drafter catch-up,
    commit), on a state prefilled with ``context`` tokens, its buffers donated so the caches
    stay in place as in the loop; ``reps`` rounds, each timing every k once (interleaved)."""
    lc = SpecConfig(method=method, num_draft_tokens=kmax, page_size=page_size, attn_impl=attn_impl)
    out_len = (reps + 3) * (kmax + 1) + 1  # every token the timed steps can emit
    per_seq = kv_cache.pages_needed(context + out_len + lc.extra_slots, page_size)
    rp = speculate.RowParams(temperature=jnp.zeros((batch,), jnp.float32),
                             top_k=jnp.zeros((batch,), jnp.int32),
                             top_p=jnp.ones((batch,), jnp.float32),
                             max_new=jnp.full((batch,), out_len, jnp.int32),
                             eos_ids=jnp.full((1,), -1, jnp.int32))
    prompts = jnp.tile(jnp.arange(context, dtype=jnp.int32) % 97 + 3, (batch, 1))
    lens = jnp.full((batch,), context, jnp.int32)
    prefill = jax.jit(lambda tp, dp: speculate.prefill(tp, target_cfg, dp, draft_cfg, prompts, lens,
                                                       rp, 0, lc, per_seq, out_len, kv_dtype=dtype))
    steps, states = [], []
    for k in range(kmax + 1):
        lck = SpecConfig(method="none") if k == 0 else dataclasses.replace(lc, num_draft_tokens=k)
        steps.append(jax.jit(lambda tp, dp, st, lck=lck: speculate.spec_step(
            tp, target_cfg, dp, draft_cfg, st, rp, lck), donate_argnums=2))
        state = steps[k](target_params, draft_params, prefill(target_params, draft_params))
        states.append(jax.block_until_ready(state))  # compiled and warm
    times = [[] for _ in steps]
    for _ in range(reps):  # interleaved, so drift in the machine's speed hits every k alike
        for k, step in enumerate(steps):
            t0 = time.perf_counter()
            states[k] = jax.block_until_ready(step(target_params, draft_params, states[k]))
            times[k].append(time.perf_counter() - t0)
    times = [float(np.median(ts)) for ts in times]
    return times


def measure_costs(target_params, target_cfg, draft_params, draft_cfg, *, method: str, kmax: int,
                  batch: int, context: int, dtype, page_size: int = 16,
                  attn_impl: str = "reference") -> list:
    """Relative costs [K+3] on this device, cached (module docstring): a k-step for k = 0..K,
    then the drafter's catch-up after plain steps (one forward over the lag window) and one
    draft step (both 0 for n-gram).

    Times the fused decode step itself for k = 0..K (``_step_times``: what a step of the loop
    costs, bookkeeping included) after ``context`` cached tokens, and the drafter's forwards
    over 1 and LAG_WINDOW tokens, at this batch size.
    """

    key = cost_key(target_cfg, draft_cfg, dtype, batch, method, kmax,
                   native_on="|".join((uses_native(target_params), uses_native(draft_params))))
    if key in _COSTS:
        return _COSTS[key]
    stored = _load_file().get(key)
    if stored is not None and len(stored) == kmax + 3:
        _COSTS[key] = stored
        return stored

    kw = dict(method=method, kmax=kmax, batch=batch, context=context, dtype=dtype,
              page_size=page_size, attn_impl=attn_impl)
    steps = _step_times(target_params, target_cfg, draft_params, draft_cfg, **kw)  # [K+1] s
    if np.any(np.diff(steps[1:]) < 0):  # a longer chain does strictly more work: noise, retime
        steps = _step_times(target_params, target_cfg, draft_params, draft_cfg, reps=50, **kw)
        steps = steps[:1] + list(np.maximum.accumulate(steps[1:]))
    per_seq = kv_cache.pages_needed(context + speculate.LAG_WINDOW + 1, page_size)
    page_table = kv_cache.contiguous_page_table(batch, per_seq)
    start = jnp.full((batch,), context, jnp.int32)

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

    catch_up = draft_step = 0.0  # n-gram drafting has no drafter
    if method in ("draft", "mtp", "eagle", "eagle3"):
        catch_up = fwd_draft(speculate.LAG_WINDOW) / steps[0]
        draft_step = fwd_draft(1) / steps[0]
    costs = [float(x) for x in np.maximum(np.asarray(steps) / steps[0], 1e-3)]
    costs = costs + [float(catch_up), float(draft_step)]
    _COSTS[key] = costs
    _store_file(key, costs)
    return costs


def uses_native(params) -> str:
    """Which native CPU kernels ``params`` run on (specjax.native): "" for none, else the sorted
    weight kinds joined by "+" ("PackedWeight", "QuantWeight", "Q8Weight"; truthy), so a cost
    cached for float32 panels is never reused for the quantized or int8-activation kernels."""
    kinds = (native.PackedWeight, native.QuantWeight, native.Q8Weight)
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, kinds))
    return "+".join(sorted({type(x).__name__ for x in leaves if isinstance(x, kinds)}))


# --------------------------------------------------------------- bare forwards (benchmarks)


def forward_fn(model, t: int, context: int, params=None):
    """A zero-argument callable running one jitted forward of ``model`` over ``t`` new tokens
    after ``context`` cached tokens (batch 1) and blocking on it; compiled on the first call.
    ``params`` default to what ``sj.generate`` runs (``specjax.native.inference_params``)."""
    cfg = model.config
    params = native.inference_params(model) if params is None else params
    per_seq = kv_cache.pages_needed(context + t + 16, 16)
    kv = registry.init_cache(cfg, per_seq, 16, model.dtype)  # the family's cache
    pt = kv_cache.contiguous_page_table(1, per_seq)
    toks = jnp.ones((1, t), jnp.int32)
    pos = context + jnp.arange(t, dtype=jnp.int32)[None]
    start = jnp.asarray([context], jnp.int32)
    fn = jax.jit(lambda p, kv: registry.forward(p, cfg, toks, pos, kv, pt, start)[0])
    return lambda: jax.block_until_ready(fn(params, kv))


def time_forward(model, t: int, context: int, repeats: int = 10) -> float:
    """Median seconds of one jitted target forward over ``t`` new tokens after ``context`` cached
    tokens (batch 1, the params ``sj.generate`` runs): the verify (t = k+1) / decode (t = 1) cost
    ratio behind every speedup."""
    run = forward_fn(model, t, context)
    run()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return float(statistics.median(times))


def cost_ratios(target, ks, context: int, drafts: dict | None = None) -> dict:
    """verify(k+1)/decode(1) for each k, and draft-step / target-step for draft LLMs
    (``drafts``: {method: (draft, description)})."""
    dec = time_forward(target, 1, context)
    out = {"context": context, "target_decode_ms": 1e3 * dec,
           "verify_over_decode": {str(k): time_forward(target, k + 1, context) / dec
                                  for k in sorted(set(ks))}}
    for method, (draft, _) in (drafts or {}).items():
        if isinstance(draft, Model):
            out[f"c_{method}"] = time_forward(draft, 1, context) / dec
    return out
