"""Where the engine's time goes, against static ``sj.generate`` batches: step kinds, padded
target work, wasted row-steps, host vs blocked time.

Target work is counted in token slots the target forward processes (batch bucket x tokens per
row: T for extend steps, k+1 for speculative ones), which does not depend on machine load, so it
explains a throughput gap even on a contended machine; wall times are printed too (compare the
ratios within one run).

    python benchmarks/profile_engine.py --model smollm2 --method mtp --slots 8 --requests 24 \
        --max-tokens 48
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_engine  # noqa: E402

import specjax as sj  # noqa: E402
from specjax.engine import Engine, EngineConfig, RequestParams  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--method", default="mtp")
    p.add_argument("--slots", type=int, default=8)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=1)
    p.add_argument("--early-exit", type=int, default=8)
    p.add_argument("--batch-buckets", default=None, help="e.g. '8' (default: powers of two)")
    args = p.parse_args(argv)
    args.num_requests = args.requests
    setup = bench_engine.tiny_setup if args.model == "tiny" else bench_engine.smollm2_setup
    target, drafts, prompts, tbucket = setup(args)
    draft = None if args.method == "none" else drafts[args.method][0]
    buckets = tuple(int(x) for x in args.batch_buckets.split(",")) if args.batch_buckets else None
    eng = Engine(target, draft, EngineConfig(
        sj.SpecConfig(method=args.method, num_draft_tokens=args.k, page_size=16),
        max_slots=args.slots, batch_buckets=buckets, token_buckets=(tbucket,),
        max_model_len=max(map(len, prompts)) + args.max_tokens, record_timeline=True))
    eng.warmup()
    params = RequestParams(max_tokens=args.max_tokens, stop_token_ids=())
    t0 = time.perf_counter()
    handles = [eng.submit(q, params) for q in prompts]
    eng.run()
    wall = time.perf_counter() - t0
    out = [h.result() for h in handles]
    k1 = eng.k_eff + 1
    kinds, work, rows = collections.Counter(), collections.Counter(), collections.Counter()
    for st in eng.timeline:
        kind = st["kind"] if st["kind"] == "spec" else ("decode" if st["t"] == 1 else "extend")
        kinds[kind] += 1
        work[kind] += st["batch"] * (k1 if kind == "spec" else st["t"])
        rows[kind] += st["rows"]
    s = eng.stats()
    n_tok = sum(map(len, out))
    print(f"engine: {n_tok} tokens in {wall:.2f}s = {n_tok / wall:.1f} tok/s; steps {dict(kinds)}")
    print(f"  target token slots per kind {dict(work)} (total {sum(work.values())}); "
          f"real rows per kind {dict(rows)}")
    print(f"  host {1e3 * eng.host_time_s / eng.num_steps:.2f} ms/step, blocked "
          f"{1e3 * eng.blocked_time_s / eng.num_steps:.2f} ms/step, mean accepted "
          f"{s['mean_accepted_length']:.2f}")
    kw = dict(max_new_tokens=args.max_tokens, eos_token_id=[], method=args.method, draft=draft,
              num_draft_tokens=args.k)
    sj.generate(target, prompts[:args.slots], **kw)
    t0 = time.perf_counter()
    gen, static_work = [], 0
    for i in range(0, len(prompts), args.slots):
        o = sj.generate(target, prompts[i:i + args.slots], **kw)
        gen += o.tokens
        b = len(prompts[i:i + args.slots])
        tp = max(16, 1 << (max(map(len, prompts[i:i + args.slots])) - 1).bit_length())
        static_work += b * tp + o.stats["steps"] * b * (k1 if args.method != "none" else 1)
    gwall = time.perf_counter() - t0
    print(f"static: {sum(map(len, gen))} tokens in {gwall:.2f}s = {sum(map(len, gen)) / gwall:.1f} "
          f"tok/s; target token slots {static_work}; identical {gen == out}")
    print(f"engine / static throughput: {(n_tok / wall) / (sum(map(len, gen)) / gwall):.2f}x "
          f"(same process, same load)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
