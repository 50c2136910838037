"""Shipped drafts for SmolLM2 side by side: mean accepted length and speedup over plain decoding.

Every draft (MTP / EAGLE heads, draft LLMs) runs on the same held-out chat prompts (never trained
on), temperature 0, batch 1 (each prompt its own call, as a chat user would), at each k; plain
decoding is timed in the same process, interleaved with the speculative runs so that load drift
hits both alike. Every speculative output is checked token for token against plain greedy.

  python benchmarks/bench_drafts.py --drafts checkpoints/smollm2-mtp,checkpoints/smollm2-draft
  python benchmarks/bench_drafts.py --ks 1,3 --prompts 16 --max-new-tokens 96

Speedup = sum of plain wall times / sum of speculative wall times (compile excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax
import numpy as np

import specjax as sj
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

    def timed(p, **extra):
        t0 = time.perf_counter()
        out = sj.generate(target, [p], **kw, **extra)
        return out, time.perf_counter() - t0

    configs = [(name, k) for name in drafts for k in ks]
    for name, k in [(None, None)] + configs:  # compile every program once
        extra = {} if name is None else dict(draft=drafts[name], method=_method(drafts[name]),
                                              num_draft_tokens=k)
        sj.generate(target, prompts[:1], **kw, **extra)

    plain_t = 0.0
    acc = {c: dict(time=0.0, lens=[], per_pos=[], same=True) for c in configs}
    for p in prompts:
        want, t = timed(p)
        plain_t += t
        for name, k in configs:
            d = drafts[name]
            out, t = timed(p, draft=d, method=_method(d), num_draft_tokens=k)
            a = acc[(name, k)]
            a["time"] += t
            a["lens"].append(out.stats["mean_accepted_length"])
            a["per_pos"].append(out.stats["per_position_acceptance"])
            a["same"] &= out.tokens[0] == want.tokens[0]

    rows = []
    print(f"\n{len(prompts)} held-out chat prompts, {args.max_new_tokens} new tokens, greedy, batch 1; "
          f"plain {plain_t:.1f} s total")
    print("| draft | method | k | mean accepted length | speedup over plain | identical to plain |")
    print("|---|---|---|---|---|---|")
    for (name, k), a in acc.items():
        row = dict(draft=name, method=_method(drafts[name]), k=k,
                   mean_accepted_length=float(np.mean(a["lens"])), speedup=plain_t / a["time"],
                   identical_to_plain=bool(a["same"]), wall_time_s=a["time"],
                   per_position_acceptance=np.mean(np.asarray(a["per_pos"], float), 0).tolist())
        rows.append(row)
        print(f"| {name} | {row['method']} | {k} | {row['mean_accepted_length']:.2f} | "
              f"{row['speedup']:.2f}x | {'yes' if a['same'] else 'NO'} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "ks": ks,
                   "plain_wall_time_s": plain_t, "rows": rows,
                   "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                               "devices": [str(d) for d in jax.devices()]}}, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
