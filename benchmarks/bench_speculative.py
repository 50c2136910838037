"""Plain vs draft-target speculative decoding on SmolLM2 (CPU), with the speedup model.

For each (draft, k): measured tokens/s of plain and speculative decoding on held-out chat prompts
(greedy, same run), mean accepted length, the per-token acceptance rate alpha (maximum-likelihood
under the i.i.d. model: accepted drafts / drafts examined), and component costs timed separately:
target decode (T=1), target verify (T=k+1), draft step (T=1) and draft catch-up (T=2). Then:

  predicted (issue formula)  = (1 - a^(k+1)) / ((1 - a)(1 + c k)),      c = draft / target step
  predicted (CPU cost model) = E[tokens/step] / (verify(k+1) + (k-1) draft(1) + draft(2)) * target(1)

The second model accounts for what the formula ignores on CPU: a T=k+1 verify costs more than a
T=1 decode (skinny GEMMs are dearer than mat-vecs here).

  python benchmarks/bench_speculative.py                      # early-exit drafts + self-draft
  python benchmarks/bench_speculative.py --draft checkpoints/smollm2-draft --ks 1,2,3,4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax as sj
from specjax.bench import time_forward
from specjax import kv_cache
from specjax.model import forward
from specjax.train.corpora import chat_prompts


def alpha_mle(per_pos: list[float]) -> float:
    """i.i.d. acceptance rate: accepted drafts / drafts examined (position i examined iff i-1 accepted)."""
    examined = 1.0 + sum(per_pos[:-1])
    return sum(per_pos) / examined if examined else 0.0


def run_generate(target, prompts, draft, k, max_new, repeats):
    method = "none" if draft is None else "draft"
    kw = dict(max_new_tokens=max_new, draft=draft, method=method, num_draft_tokens=k, eos_token_id=[])
    sj.generate(target, prompts, **kw)  # compile
    outs = [sj.generate(target, prompts, **kw) for _ in range(repeats)]
    tps = statistics.median(o.stats["tokens_per_second"] for o in outs)
    return outs[-1], tps


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--draft", action="append", default=None,
                    help="draft path (repeatable); default: early-exit drafts and the self-draft")
    ap.add_argument("--early-exit", default="2,4,8", help="early-exit draft depths to include")
    ap.add_argument("--self-draft", action="store_true", default=None)
    ap.add_argument("--ks", default="1,2,4")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/speculative.json")
    args = ap.parse_args(argv)

    target = sj.load_model(args.model)
    tok = sj.load_tokenizer(args.model)
    prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=args.batch)]
    ks = [int(x) for x in args.ks.split(",")]
    drafts = []
    for path in args.draft or []:
        drafts.append((path, sj.load_draft(path, target=target)))
    if args.draft is None:
        for n in [int(x) for x in args.early_exit.split(",") if x]:
            drafts.append((f"early-exit {n} layers", sj.early_exit_draft(target, n)))
    if args.self_draft or (args.self_draft is None and args.draft is None):
        drafts.append(("self-draft (target)", target))

    context = len(prompts[0]) + args.max_new_tokens // 2
    plain, plain_tps = run_generate(target, prompts, None, 1, args.max_new_tokens, args.repeats)
    t_dec = time_forward(target, 1, context)
    rows = []
    for name, draft in drafts:
        d1, d2 = time_forward(draft, 1, context), time_forward(draft, 2, context)
        for k in ks:
            out, tps = run_generate(target, prompts, draft, k, args.max_new_tokens, args.repeats)
            s = out.stats
            a = alpha_mle(s["per_position_acceptance"])
            c = d1 / t_dec
            pred_formula = ((1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1) / (1 + c * k)
            t_ver = time_forward(target, k + 1, context)
            step_cost = (t_ver + (k - 1) * d1 + d2) / t_dec
            pred_cpu = s["mean_accepted_length"] / step_cost
            rows.append(dict(draft=name, k=k, identical=out.tokens == plain.tokens,
                             mean_accepted_length=s["mean_accepted_length"], alpha=a, c=c,
                             verify_over_decode=t_ver / t_dec, spec_tps=tps, plain_tps=plain_tps,
                             speedup=tps / plain_tps, predicted_formula=pred_formula,
                             predicted_cpu_model=pred_cpu,
                             per_position_acceptance=s["per_position_acceptance"]))
            r = rows[-1]
            print(f"{name:24s} k={k} len={r['mean_accepted_length']:.2f} a={a:.3f} c={c:.3f} "
                  f"speedup={r['speedup']:.2f} pred={pred_formula:.2f}/{pred_cpu:.2f}", file=sys.stderr)

    head = ("| draft | k | identical | mean acc. len | alpha | c | verify/decode | plain tok/s | "
            "spec tok/s | measured speedup | predicted (formula) | predicted (CPU model) |")
    print(head)
    print("|" + "---|" * 12)
    for r in rows:
        print(f"| {r['draft']} | {r['k']} | {r['identical']} | {r['mean_accepted_length']:.2f} | "
              f"{r['alpha']:.3f} | {r['c']:.3f} | {r['verify_over_decode']:.2f} | {r['plain_tps']:.1f} | "
              f"{r['spec_tps']:.1f} | {r['speedup']:.2f}x | {r['predicted_formula']:.2f}x | "
              f"{r['predicted_cpu_model']:.2f}x |")
    meta = dict(command=" ".join(["python"] + sys.argv), machine=platform.platform(),
                cpus=os.cpu_count(), jax=jax.__version__, batch=args.batch,
                max_new_tokens=args.max_new_tokens, target_decode_ms=t_dec * 1e3, rows=rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(meta, f, indent=2)


if __name__ == "__main__":
    main()
