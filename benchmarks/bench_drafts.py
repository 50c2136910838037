"""Shipped drafts for SmolLM2 side by side: mean accepted length and speedup over plain decoding.

Every draft (MTP / EAGLE heads, draft LLMs) runs on the same held-out chat prompts (never trained
on), temperature 0, batch 1 (each prompt its own call, as a chat user would), at each k. Timing
(specjax.bench.interleaved_rounds): one warm-up pass per configuration, then ``--rounds`` rounds;
a pass runs every prompt once, and each round runs plain decoding and every configuration in
alternating order, so load drift hits all alike. Speedup = plain pass wall time / speculative pass
wall time per round: the median and the [min, max] over rounds are reported, with the largest
share of the CPUs other processes used during any timed pass ("foreign CPU"). Every speculative
output is checked token for token against plain greedy.

  python benchmarks/bench_drafts.py --drafts checkpoints/smollm2-mtp,checkpoints/smollm2-draft
  python benchmarks/bench_drafts.py --ks 1,3 --prompts 16 --max-new-tokens 96 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax

import specjax as sj
from specjax import bench
from specjax import shipped
from specjax.heads import Head
from specjax.train.corpora import chat_prompts


def _method(draft) -> str:
    return draft.config.kind if isinstance(draft, Head) else "draft"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", default=",".join(shipped.path(n) for n, _ in shipped.available()),
                    help="comma-separated draft checkpoints (default: every shipped one)")
    ap.add_argument("--ks", default="1,3")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wait-idle", type=float, default=0.0,
                    help="seconds to wait for a quiet machine before each timed pass")
    ap.add_argument("--out", default="benchmarks/results/drafts.json")
    args = ap.parse_args(argv)
    ks = [int(k) for k in args.ks.split(",")]

    target = sj.load_model("smollm2-135m")
    tok = sj.load_tokenizer("smollm2-135m")
    drafts = {}
    for path in args.drafts.split(","):
        if os.path.isdir(path):
            drafts[path] = sj.load_draft(path, target)
        else:
            print(f"skipping {path}: not found")
    prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=args.prompts)]
    kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=[])

    def spec_kw(name, k):
        return {} if name is None else dict(draft=drafts[name], method=_method(drafts[name]),
                                            num_draft_tokens=k)

    def one_pass(name, k):  # every prompt once, batch 1
        return [sj.generate(target, [p], **kw, **spec_kw(name, k)) for p in prompts]

    configs = [(name, k) for name in drafts for k in ks]
    runs = {"plain": lambda: one_pass(None, None)}
    runs.update({c: (lambda c=c: one_pass(*c)) for c in configs})
    res = bench.interleaved_rounds(runs, rounds=args.rounds, wait_idle_s=args.wait_idle)
    plain = res["plain"]
    want = [o.tokens[0] for o in plain["result"]]

    rows = []
    print(f"\n{len(prompts)} held-out chat prompts, {args.max_new_tokens} new tokens, greedy, "
          f"batch 1, {args.rounds} interleaved rounds; plain pass median "
          f"{bench.spread(plain['wall_s'])['median']:.1f} s")
    print("| draft | method | k | mean accepted length | speedup over plain (median [min, max]) | "
          "identical to plain | max foreign CPU |")
    print("|---|---|---|---|---|---|---|")
    for (name, k) in configs:
        r = res[(name, k)]
        outs = r["result"]
        steps = sum(o.stats["row_steps"] for o in outs)
        after_first = sum(o.stats["generated_tokens"] - 1 for o in outs)
        sp = bench.paired_speedup(plain["wall_s"], r["wall_s"])
        fc = bench.max_foreign(plain, r)
        row = dict(draft=name, method=_method(drafts[name]), k=k,
                   mean_accepted_length=after_first / steps if steps else float("nan"),
                   speedup=sp, identical_to_plain=[o.tokens[0] for o in outs] == want,
                   wall_time_s=r["wall_s"], plain_wall_time_s=plain["wall_s"], max_foreign_cpu=fc,
                   per_position_acceptance=[
                       sum(o.stats["per_position_acceptance"][i] * o.stats["row_steps"]
                           for o in outs) / steps for i in range(k)])
        rows.append(row)
        print(f"| {name} | {row['method']} | {k} | {row['mean_accepted_length']:.2f} | "
              f"{sp['median']:.2f}x [{sp['min']:.2f}, {sp['max']:.2f}] | "
              f"{'yes' if row['identical_to_plain'] else 'NO'} | "
              f"{'?' if fc is None else f'{100 * fc:.0f}%'} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "ks": ks,
                   "rounds": args.rounds, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                   "plain_wall_time_s": plain["wall_s"], "rows": rows,
                   "machine": dict(bench.machine_info(), platform=platform.platform(),
                                   devices=[str(d) for d in jax.devices()])}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
