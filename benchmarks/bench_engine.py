"""Serving engine vs static batches of ``sj.generate``: throughput and latency per method and batch.

For each method (plain, draft-target, MTP) and batch size B, the same N greedy requests (EOS off,
``--max-tokens`` each) are served two ways:

* engine: ``Engine(max_slots=B)``, warmed up (no compilation timed), all N submitted at once
  (offline throughput; continuous batching refills slots as requests finish);
* generate: ``sj.generate`` on consecutive groups of B prompts (static batching, one jitted
  while-loop per group), warmed up on the first group.

Reported: generated tokens/s, the engine's TTFT / inter-token latency (p50) and mean accepted
length, and whether both produced identical tokens (they must: greedy is lossless).

    python benchmarks/bench_engine.py                      # tiny models (seconds; CI-sized)
    python benchmarks/bench_engine.py --model smollm2      # SmolLM2-135M + shipped MTP head
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import specjax as sj  # noqa: E402
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
    from specjax.cli import _repo_checkpoints  # noqa: PLC0415
    from specjax.train.corpora import chat_prompts  # noqa: PLC0415

    target = sj.load_model("smollm2-135m")
    tok = sj.load_tokenizer("smollm2-135m")
    drafts = {"draft": (sj.early_exit_draft(target, args.early_exit), f"early-exit {args.early_exit} layers")}
    mtp = os.path.join(_repo_checkpoints(), "smollm2-mtp")
    if os.path.isdir(mtp):
        drafts["mtp"] = (sj.load_draft(mtp, target=target), "checkpoints/smollm2-mtp")
    prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=args.num_requests)]
    return target, drafts, prompts, 64


def run_engine(target, draft, method, batch, prompts, args, token_bucket):
    longest = max(map(len, prompts))
    eng = Engine(target, draft, EngineConfig(
        SpecConfig(method=method, num_draft_tokens=args.k, page_size=16), max_slots=batch,
        batch_buckets=(batch,), token_buckets=(token_bucket,),
        max_model_len=longest + args.max_tokens))
    eng.warmup()
    params = RequestParams(max_tokens=args.max_tokens, stop_token_ids=())
    t0 = time.perf_counter()
    handles = [eng.submit(p, params) for p in prompts]
    eng.run()
    wall = time.perf_counter() - t0
    out = [h.result() for h in handles]
    s = eng.stats()
    return out, {"tokens_per_second": sum(map(len, out)) / wall, "wall_s": wall,
                 "ttft_p50_ms": 1e3 * s["time_to_first_token_seconds"]["p50"],
                 "itl_p50_ms": 1e3 * s["inter_token_latency_seconds"]["p50"],
                 "mean_accepted_length": s["mean_accepted_length"], "engine_steps": s["engine_steps"],
                 "steps": s["steps"], "host_ms_per_step": 1e3 * s["host_time_s"] / s["engine_steps"]}


def run_generate(target, draft, method, batch, prompts, args):
    kw = dict(max_new_tokens=args.max_tokens, eos_token_id=[], method=method, draft=draft,
              num_draft_tokens=args.k)
    sj.generate(target, prompts[:batch], **kw)  # compile
    t0 = time.perf_counter()
    out = []
    for i in range(0, len(prompts), batch):
        out += sj.generate(target, prompts[i:i + batch], **kw).tokens
    wall = time.perf_counter() - t0
    return out, {"tokens_per_second": sum(map(len, out)) / wall, "wall_s": wall}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    p.add_argument("--methods", default="none,draft,mtp")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=None, help="draft length (default 3 tiny, 1 smollm2)")
    p.add_argument("--early-exit", type=int, default=8)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.k = args.k or (3 if args.model == "tiny" else 1)
    target, drafts, prompts, bucket = (tiny_setup if args.model == "tiny" else smollm2_setup)(args)
    rows = []
    for method in args.methods.split(","):
        if method != "none" and method not in drafts:
            print(f"skip {method}: no draft")
            continue
        draft, desc = (None, "-") if method == "none" else drafts[method]
        for batch in map(int, args.batches.split(",")):
            eng_out, eng = run_engine(target, draft, method, batch, prompts, args, bucket)
            gen_out, gen = run_generate(target, draft, method, batch, prompts, args)
            row = {"method": method, "draft": desc, "batch": batch, "engine": eng, "generate": gen,
                   "identical": eng_out == gen_out}
            rows.append(row)
            print(f"{method:5s} B={batch:2d} engine {eng['tokens_per_second']:8.1f} tok/s "
                  f"(TTFT p50 {eng['ttft_p50_ms']:7.1f} ms, ITL p50 {eng['itl_p50_ms']:6.1f} ms, "
                  f"accepted {eng['mean_accepted_length']:.2f}, host {eng['host_ms_per_step']:.2f} "
                  f"ms/step) | generate {gen['tokens_per_second']:8.1f} tok/s | "
                  f"identical {row['identical']}", flush=True)
    result = {"model": args.model, "k": args.k, "num_requests": len(prompts),
              "max_tokens": args.max_tokens, "jax": jax.__version__, "rows": rows}
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"engine_{args.model}.json")
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)


if __name__ == "__main__":
    main()
