"""One MoE layer (routed experts only): dense all-expert reference vs grouped dispatch, on CPU.

Setting (defaults): X=64 experts, top-2, E=512 model dim, F=256 expert hidden, T=256 tokens,
float32, random router choices (softmax top-k over random logits, so loads are uneven).
Both paths are jitted and warmed up once (compile excluded); then ``--rounds`` interleaved
rounds each time ``--iters`` calls of dense, then of grouped. Reported: median ms per call,
the spread (min / max over rounds), grouped / dense ratio of the medians (target <= 0.25), the
foreign CPU share during the timed rounds (specjax.timing.Timer: other processes' busy time on
the usable CPUs) and the load average before and after. The outputs of the two paths are
compared (max |difference|) so a fast wrong path cannot pass.

Usage:
  python benchmarks/bench_moe.py [--tokens 256] [--experts 64] [--top-k 2] [--hidden 512]
      [--expert-hidden 256] [--rounds 7] [--iters 3] [--impl tiled] [--out results/moe.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from specjax import moe  # noqa: E402
from specjax.timing import Timer, machine_info  # noqa: E402


def _loadavg():
    try:
        return list(os.getloadavg())
    except OSError:
        return None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert-hidden", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--impl", default="auto", choices=moe.IMPLS)
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    t, xg, k, e, f = args.tokens, args.experts, args.top_k, args.hidden, args.expert_hidden
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (t, e), jnp.float32)
    wg = 0.05 * jax.random.normal(keys[1], (xg, e, f), jnp.float32)
    wu = 0.05 * jax.random.normal(keys[2], (xg, e, f), jnp.float32)
    wd = 0.05 * jax.random.normal(keys[3], (xg, f, e), jnp.float32)
    probs = jax.nn.softmax(2.0 * jax.random.normal(keys[4], (t, xg)), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    ids = ids.astype(jnp.int32)

    dense = jax.jit(moe.moe_dense_reference)
    grouped = jax.jit(lambda *a: moe.moe_ffn(*a, impl=args.impl))
    a = (x, ids, weights, wg, wu, wd)
    y_dense = np.asarray(dense(*a).block_until_ready())  # compile + warm up
    y_grouped = np.asarray(grouped(*a).block_until_ready())
    max_diff = float(np.abs(y_dense - y_grouped).max())

    load_before = _loadavg()
    times = {"dense": [], "grouped": []}
    foreign = []
    for _ in range(args.rounds):
        for name, fn in (("dense", dense), ("grouped", grouped)):
            with Timer() as tm:
                for _ in range(args.iters):
                    fn(*a).block_until_ready()
            times[name].append(1000 * tm.wall / args.iters)
            if tm.foreign is not None:
                foreign.append(tm.foreign)
    med = {n: statistics.median(v) for n, v in times.items()}
    loads = np.bincount(np.asarray(ids).ravel(), minlength=xg)
    result = {
        "setting": dict(tokens=t, experts=xg, top_k=k, hidden=e, expert_hidden=f,
                        dtype="float32", impl=moe._resolve(args.impl), rounds=args.rounds,
                        iters=args.iters, backend=jax.default_backend()),
        "expert_load": {"min": int(loads.min()), "max": int(loads.max()),
                        "empty_experts": int((loads == 0).sum())},
        "ms_per_call": {n: {"median": med[n], "min": min(v), "max": max(v)}
                        for n, v in times.items()},
        "grouped_over_dense": med["grouped"] / med["dense"],
        "max_abs_diff": max_diff,
        "foreign_cpu": {"median": statistics.median(foreign) if foreign else None,
                        "max": max(foreign) if foreign else None},
        "loadavg_before": load_before, "loadavg_after": _loadavg(),
        "machine": machine_info(), "jax": jax.__version__, "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    for n in ("dense", "grouped"):
        s = result["ms_per_call"][n]
        print(f"{n:8s} {s['median']:9.2f} ms  (min {s['min']:.2f}, max {s['max']:.2f})")
    print(f"grouped / dense = {result['grouped_over_dense']:.3f}   (target <= 0.25)   "
          f"max|diff| = {max_diff:.2e}")
    print(f"foreign CPU share median {result['foreign_cpu']['median']}, "
          f"loadavg before {load_before} after {result['loadavg_after']}")
    if args.out:
        from specjax.provenance import with_provenance  # noqa: PLC0415
        with open(args.out, "w") as fh:
            json.dump(with_provenance(result), fh, indent=1)
    return result


if __name__ == "__main__":
    main()
