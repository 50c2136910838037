"""Target forward cost by new-token count T: XLA's dot vs the native few-row kernel.

The verify / decode cost ratio decides whether speculation pays (a k-token chain verifies
T = k + 1 tokens; a tree N + 1). This times one jitted SmolLM2 forward at batch 1 after
``--context`` cached tokens for each T, with the canonical params (every product is XLA's dot)
and with ``specjax.native.inference_params`` (the packed kernel for up to MAX_ROWS rows), in
interleaved rounds (specjax.timing.interleaved_rounds: warm-up excluded, alternating order, the
other processes' CPU share recorded), and reports milliseconds and the ratios to each side's own
T = 1 step (median [min..max] over rounds).

  python benchmarks/bench_native.py --ts 1,2,3,4,5,8,16 --rounds 5 --out benchmarks/results/native.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import specjax as sj
from specjax import cost_model, native, timing


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--ts", default="1,2,3,4,5,8,16", help="new-token counts T to time")
    p.add_argument("--context", type=int, default=128, help="cached tokens before the T new ones")
    p.add_argument("--repeats", type=int, default=10, help="forwards per timed call")
    p.add_argument("--out", default=None, help="write the JSON result here")
    timing.add_timing_args(p)
    args = p.parse_args(argv)
    timing.check_timing_args(p, args)
    if not native.available():
        p.error("the native kernel is not available here (needs the CPU backend and a C++ compiler)")
    ts = sorted({int(t) for t in args.ts.split(",")})
    target = sj.load_model(args.model)
    sides = {"xla": target.params, "native": native.inference_params(target)}
    runs = {}
    for t in ts:
        for side, params in sides.items():
            fwd = cost_model.forward_fn(target, t, args.context, params=params)
            runs[f"{side} T={t}"] = (lambda f=fwd: [f() for _ in range(args.repeats)])
    timed = timing.interleaved_rounds(runs, rounds=args.rounds, wait_idle_s=args.wait_idle)
    ms = {n: [1e3 * w / args.repeats for w in r["wall_s"]] for n, r in timed.items()}
    rows = []
    for t in ts:
        row = {"T": t}
        for side in sides:
            own = ms[f"{side} T={t}"]
            row[f"{side}_ms"] = timing.spread(own)
            row[f"{side}_over_own_decode"] = timing.paired_speedup(own, ms[f"{side} T=1"])
        row["native_over_xla"] = timing.paired_speedup(ms[f"native T={t}"], ms[f"xla T={t}"])
        rows.append(row)
    result = {"command": "python benchmarks/bench_native.py " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "model": args.model, "context": args.context, "repeats": args.repeats,
              "rounds": args.rounds, "rows": rows, "max_foreign_cpu": timing.max_foreign(*timed.values()),
              "machine": timing.machine_info()}
    print(f"{'T':>3} | {'xla ms':>8} | {'native ms':>9} | xla / own T=1 | native / own T=1 | "
          f"native / xla")
    for r in rows:
        print(f"{r['T']:>3} | {r['xla_ms']['median']:8.2f} | {r['native_ms']['median']:9.2f} | "
              f"{_fmt(r['xla_over_own_decode'])} | {_fmt(r['native_over_own_decode'])} | "
              f"{_fmt(r['native_over_xla'])}")
    fc = result["max_foreign_cpu"]
    print(f"max foreign CPU: {'?' if fc is None else f'{100 * fc:.1f}%'}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        from specjax.provenance import with_provenance  # noqa: PLC0415
        with open(args.out, "w") as f:
            json.dump(with_provenance(result), f, indent=1)
    return result


def _fmt(s: dict) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}..{s['max']:.2f}]"


if __name__ == "__main__":
    main()
