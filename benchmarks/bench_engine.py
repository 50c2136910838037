"""Serving engine vs static batches of ``sj.generate``: throughput and latency per method and batch.

For each method (plain, draft-target, MTP) and batch size B, the same N greedy requests (EOS off,
``--max-tokens`` each) are served two ways:

* engine: ``Engine(max_slots=B)``, built and ``warmup()``-compiled once, then per run all N
  submitted at once (offline throughput; continuous batching refills slots as requests finish);
* static: ``sj.generate`` on consecutive groups of B prompts (static batching, one jitted
  while-loop per group).

How it times (specjax.timing.interleaved_rounds): for each (method, batch) the engine run and the
static run are each run once untimed (every compilation, the static run's last short group
included), then timed in ``--rounds`` rounds, in alternating order (engine, static / static,
engine, ...), so load drift hits both alike. ``--wait-idle`` waits up to that many seconds for a
quiet machine before each timed run. Reported per row: the wall time of every round, median
tokens/s with the spread (min..max over rounds) for both, engine / static = ratio of the median
tokens/s (and the per-round paired ratios' spread), the largest share of the CPUs other processes
used during the timed runs ("foreign CPU"), the engine's TTFT / inter-token latency (p50, last
round's requests only) and mean accepted length, and whether both produced identical tokens (they
must: greedy is lossless). The JSON also records the date, the machine and the command line.

    python benchmarks/bench_engine.py                      # tiny models (seconds; CI-sized)
    python benchmarks/bench_engine.py --model smollm2      # SmolLM2-135M + shipped MTP head
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import specjax as sj  # noqa: E402
from specjax import timing  # noqa: E402
from specjax.config import SpecConfig  # noqa: E402
from specjax.engine import Engine, EngineConfig, RequestParams  # noqa: E402


def tiny_setup(args):
    from specjax.heads import Head, HeadConfig, init_head  # noqa: PLC0415
    from specjax.model import Model, init_params  # noqa: PLC0415

    cfg = sj.ModelConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=32, max_position_embeddings=512)
    target = Model(init_params(cfg, jax.random.key(0), scale=0.3), cfg)
    hcfg = HeadConfig.for_target(cfg, "mtp")
    drafts = {"draft": (sj.early_exit_draft(target, 1), "early-exit 1 layer"),
              "mtp": (Head(init_head(hcfg, jax.random.key(3), scale=1.0), hcfg), "random MTP head")}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 512, int(rng.integers(4, 17))).tolist() for _ in range(args.num_requests)]
    return target, drafts, prompts, 16


def smollm2_setup(args):
    from specjax import shipped  # noqa: PLC0415
    from specjax.train.corpora import chat_prompts  # noqa: PLC0415

    target = sj.load_model("smollm2-135m")
    tok = sj.load_tokenizer("smollm2-135m")
    drafts = {"draft": (sj.early_exit_draft(target, args.early_exit), f"early-exit {args.early_exit} layers")}
    mtp = shipped.load_best(target, "mtp")
    if mtp is not None:
        drafts["mtp"] = mtp
    prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=args.num_requests)]
    return target, drafts, prompts, 64


def engine_runner(target, draft, method, batch, prompts, args, token_bucket):
    """An engine built and compiled for ``batch`` slots, and a call serving all ``prompts`` on
    it: returns (tokens per request, the engine's stats for that call alone)."""
    longest = max(map(len, prompts))
    eng = Engine(target, draft, EngineConfig(
        SpecConfig(method=method, num_draft_tokens=args.k, page_size=16), max_slots=batch,
        token_buckets=(token_bucket,),  # batch buckets: powers of two <= B (small prefill steps)
        max_model_len=longest + args.max_tokens))
    eng.warmup()
    params = RequestParams(max_tokens=args.max_tokens, stop_token_ids=())

    def run():
        eng.metrics.reset()  # latency samples and counters of this call only
        steps0, host0 = eng.num_steps, eng.host_time_s
        handles = [eng.submit(p, params) for p in prompts]
        eng.run()
        out = [h.result() for h in handles]
        s = eng.stats()
        n_steps = eng.num_steps - steps0
        mal = s["mean_accepted_length"]
        return out, {"ttft_p50_ms": 1e3 * s["time_to_first_token_seconds"]["p50"],
                     "itl_p50_ms": 1e3 * s["inter_token_latency_seconds"]["p50"],
                     "mean_accepted_length": None if math.isnan(mal) else mal,
                     "engine_steps": n_steps, "steps": s["steps"],
                     "host_ms_per_step": 1e3 * (eng.host_time_s - host0) / max(n_steps, 1)}
    return run


def static_runner(target, draft, method, batch, prompts, args):
    """``sj.generate`` over consecutive groups of ``batch`` prompts: returns (tokens, {})."""
    kw = dict(max_new_tokens=args.max_tokens, eos_token_id=[], method=method, draft=draft,
              num_draft_tokens=args.k)

    def run():
        out = []
        for i in range(0, len(prompts), batch):
            out += sj.generate(target, prompts[i:i + batch], **kw).tokens
        return out, {}
    return run


def _timed(r: dict, n_tok: int) -> dict:
    return {"wall_s": r["wall_s"], "tokens_per_second": timing.spread([n_tok / w for w in r["wall_s"]]),
            "foreign_cpu": r["foreign_cpu"], "max_foreign_cpu": timing.max_foreign(r)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--methods", default="none,draft,mtp")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=None, help="draft length (default 3 tiny, 1 smollm2)")
    p.add_argument("--early-exit", type=int, default=8)
    timing.add_timing_args(p)
    p.add_argument("--out", default=None, help="JSON report (default "
                                               "benchmarks/results/engine_<model>.json)")
    args = p.parse_args(argv)
    timing.check_timing_args(p, args)
    if args.rounds < 3:
        print(f"note: {args.rounds} round(s): the spread needs >= 3", file=sys.stderr)
    args.k = args.k or (3 if args.model == "tiny" else 1)
    target, drafts, prompts, bucket = (tiny_setup if args.model == "tiny" else smollm2_setup)(args)
    rows = []
    for method in args.methods.split(","):
        if method != "none" and method not in drafts:
            print(f"skip {method}: no draft")
            continue
        draft, desc = (None, "-") if method == "none" else drafts[method]
        for batch in map(int, args.batches.split(",")):
            res = timing.interleaved_rounds(
                {"engine": engine_runner(target, draft, method, batch, prompts, args, bucket),
                 "static": static_runner(target, draft, method, batch, prompts, args)},
                rounds=args.rounds, wait_idle_s=args.wait_idle)
            (eng_out, eng_stats), (gen_out, _) = res["engine"]["result"], res["static"]["result"]
            eng = {**_timed(res["engine"], sum(map(len, eng_out))), **eng_stats}
            gen = _timed(res["static"], sum(map(len, gen_out)))
            row = {"method": method, "draft": desc, "batch": batch, "engine": eng, "generate": gen,
                   "engine_over_static": eng["tokens_per_second"]["median"]
                   / gen["tokens_per_second"]["median"],
                   "engine_over_static_per_round": timing.paired_speedup(res["static"]["wall_s"],
                                                                        res["engine"]["wall_s"]),
                   "max_foreign_cpu": timing.max_foreign(res["engine"], res["static"]),
                   "identical": eng_out == gen_out}
            rows.append(row)
            et, gt, fc = eng["tokens_per_second"], gen["tokens_per_second"], row["max_foreign_cpu"]
            mal = eng["mean_accepted_length"]
            print(f"{method:5s} B={batch:2d} engine {et['median']:8.1f} tok/s "
                  f"[{et['min']:.1f}..{et['max']:.1f}] (TTFT p50 {eng['ttft_p50_ms']:7.1f} ms, "
                  f"ITL p50 {eng['itl_p50_ms']:6.1f} ms, accepted "
                  f"{'-' if mal is None else f'{mal:.2f}'}, host {eng['host_ms_per_step']:.2f} "
                  f"ms/step) | static {gt['median']:8.1f} tok/s [{gt['min']:.1f}..{gt['max']:.1f}] "
                  f"| engine/static {row['engine_over_static']:.2f}x | identical {row['identical']} "
                  f"| foreign CPU {'?' if fc is None else f'{100 * fc:.0f}%'}", flush=True)
    fcs = [r["max_foreign_cpu"] for r in rows if r["max_foreign_cpu"] is not None]
    max_fc = max(fcs) if fcs else None
    print(f"max foreign CPU during timed runs: {'?' if max_fc is None else f'{100 * max_fc:.0f}%'}"
          + (" -- contended: treat the tok/s with care" if max_fc is not None and max_fc > 0.1 else ""))
    result = {"model": args.model, "k": args.k, "num_requests": len(prompts),
              "max_tokens": args.max_tokens, "rounds": args.rounds, "wait_idle_s": args.wait_idle,
              "max_foreign_cpu": max_fc, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "command": " ".join(["python", "benchmarks/bench_engine.py"]
                                  + (sys.argv[1:] if argv is None else list(argv))),
              "machine": timing.machine_info(), "jax": jax.__version__,
              "backend": jax.default_backend(), "rows": rows}
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"engine_{args.model}.json")
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    from specjax.provenance import with_provenance  # noqa: PLC0415
    with open(out, "w") as f:
        json.dump(with_provenance(result), f, indent=1)
    print("wrote", out)
    return result


if __name__ == "__main__":
    main()
