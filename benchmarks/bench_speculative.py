"""Plain vs draft-target speculative decoding on SmolLM2 (CPU), with the speedup model.

For each (draft, k): measured tokens/s of plain and speculative decoding on held-out chat prompts
(greedy, same run), mean accepted length, the per-token acceptance rate alpha (maximum-likelihood
under the i.i.d. model: accepted drafts / drafts examined), and component costs timed separately:
target decode (T=1), target verify (T=k+1), draft step (T=1) and draft catch-up (T=2). Then:

  predicted (issue formula)  = (1 - a^(k+1)) / ((1 - a)(1 + c k)),      c = draft / target step
  predicted (CPU cost model) = E[tokens/step] / (verify(k+1) + (k-1) draft(1) + draft(2)) * target(1)

The second model accounts for what the formula ignores on CPU: a T=k+1 verify costs more than a
T=1 decode (skinny GEMMs are dearer than mat-vecs here).

Timing (specjax.timing.interleaved_rounds): plain and every (draft, k) are warmed up once, then
timed in ``--rounds`` rounds with the runs in alternating order; speedup = plain / speculative
wall time per round, reported as median [min, max], with the largest foreign CPU share seen.

  python benchmarks/bench_speculative.py                      # early-exit drafts + self-draft
  python benchmarks/bench_speculative.py --draft checkpoints/smollm2-draft --ks 1,2,3,4
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import jax

import specjax as sj
from specjax import timing
from specjax.cost_model import time_forward
from specjax.train.corpora import chat_prompts


def alpha_mle(per_pos: list[float]) -> float:
    """i.i.d. acceptance rate: accepted drafts / drafts examined (position i examined iff i-1 accepted)."""
    examined = 1.0 + sum(per_pos[:-1])
    return sum(per_pos) / examined if examined else 0.0


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
    ap.add_argument("--rounds", type=int, default=3)
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
    kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=[])
    runs = {"plain": lambda: sj.generate(target, prompts, **kw)}
    for i, (name, draft) in enumerate(drafts):
        for k in ks:
            runs[(i, k)] = (lambda d=draft, k=k: sj.generate(target, prompts, draft=d, method="draft",
                                                             num_draft_tokens=k, **kw))
    res = timing.interleaved_rounds(runs, rounds=args.rounds)
    plain = res["plain"]
    n_tok = plain["result"].stats["generated_tokens"]
    plain_tps = timing.spread([n_tok / w for w in plain["wall_s"]])
    t_dec = time_forward(target, 1, context)
    rows = []
    for i, (name, draft) in enumerate(drafts):
        d1, d2 = time_forward(draft, 1, context), time_forward(draft, 2, context)
        for k in ks:
            r = res[(i, k)]
            out = r["result"]
            s = out.stats
            a = alpha_mle(s["per_position_acceptance"])
            c = d1 / t_dec
            pred_formula = ((1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1) / (1 + c * k)
            t_ver = time_forward(target, k + 1, context)
            step_cost = (t_ver + (k - 1) * d1 + d2) / t_dec
            pred_cpu = s["mean_accepted_length"] / step_cost
            sp = timing.paired_speedup(plain["wall_s"], r["wall_s"])
            rows.append(dict(draft=name, k=k, identical=out.tokens == plain["result"].tokens,
                             mean_accepted_length=s["mean_accepted_length"], alpha=a, c=c,
                             verify_over_decode=t_ver / t_dec,
                             spec_tps=timing.spread([n_tok / w for w in r["wall_s"]]),
                             plain_tps=plain_tps, speedup=sp, predicted_formula=pred_formula,
                             predicted_cpu_model=pred_cpu, max_foreign_cpu=timing.max_foreign(plain, r),
                             per_position_acceptance=s["per_position_acceptance"]))
            print(f"{name:24s} k={k} len={s['mean_accepted_length']:.2f} a={a:.3f} c={c:.3f} "
                  f"speedup={sp['median']:.2f} pred={pred_formula:.2f}/{pred_cpu:.2f}", file=sys.stderr)

    head = ("| draft | k | identical | mean acc. len | alpha | c | verify/decode | plain tok/s | "
            "spec tok/s | measured speedup (median [min, max]) | predicted (formula) | "
            "predicted (CPU model) | max foreign CPU |")
    print(head)
    print("|" + "---|" * 13)
    for r in rows:
        sp, fc = r["speedup"], r["max_foreign_cpu"]
        print(f"| {r['draft']} | {r['k']} | {r['identical']} | {r['mean_accepted_length']:.2f} | "
              f"{r['alpha']:.3f} | {r['c']:.3f} | {r['verify_over_decode']:.2f} | "
              f"{r['plain_tps']['median']:.1f} | {r['spec_tps']['median']:.1f} | "
              f"{sp['median']:.2f}x [{sp['min']:.2f}, {sp['max']:.2f}] | "
              f"{r['predicted_formula']:.2f}x | {r['predicted_cpu_model']:.2f}x | "
              f"{'?' if fc is None else f'{100 * fc:.0f}%'} |")
    meta = dict(command=" ".join(["python"] + sys.argv), machine=timing.machine_info(),
                date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), rounds=args.rounds,
                platform=platform.platform(), jax=jax.__version__, batch=args.batch,
                max_new_tokens=args.max_new_tokens, target_decode_ms=t_dec * 1e3, rows=rows)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    from specjax.provenance import with_provenance  # noqa: PLC0415
    with open(args.out, "w") as f:
        json.dump(with_provenance(meta), f, indent=2)


if __name__ == "__main__":
    main()
