"""Acceptance of a draft per domain, on held-out broad-domain prompts (never trained on).

For each domain of specjax.train.prompts (fact, explain, how-to, lists, creative writing, code
writing / explanation / fixing / type hints, rewriting, translation, multi-turn chat) the first
``--prompts`` held-out prompts are answered greedily by speculative decoding with the draft, and
the script reports the mean accepted length (tokens emitted per target step) and the acceptance
per draft position, per domain and overall. Every output is checked token for token against
plain greedy decoding of the same prompt.

Acceptance counts do not depend on machine load (greedy decoding is deterministic and rows of a
batch are independent), so this runs batched (one batch per domain) and may run on a busy
machine; wall-clock speedups are measured separately (benchmarks/bench_drafts.py).

  python benchmarks/eval_domains.py --draft checkpoints/smollm2-mtp-v8k --ks 1,3
  python benchmarks/eval_domains.py --draft checkpoints/smollm2-mtp-v8k --tree 5,4,16
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

import specjax as sj
from specjax.train.prompts import DOMAINS, broad_prompts




def evaluate(target, tok, draft, configs, prompts_per_domain: int, max_new_tokens: int,
             batch_size: int = 8, encoded: list[dict] | None = None) -> dict:
    """configs: list of (label, generate-kwargs). ``encoded``: held-out prompts already
    chat-templated ({ids, domain}, e.g. ``specjax.train.distill.load_prompts``; the first
    ``prompts_per_domain`` of each domain are used) instead of building them here.
    Returns {label: {domain: stats}}."""
    if encoded is None:
        held = broad_prompts("held_out", limit_per_domain=prompts_per_domain)
        encoded = [{"ids": tok.apply_chat_template(p["messages"]), "domain": p["domain"]} for p in held]
    by_domain = {d: [p["ids"] for p in encoded if p["domain"] == d][:prompts_per_domain]
                 for d in DOMAINS}
    by_domain = {d: ps for d, ps in by_domain.items() if ps}
    if not by_domain:
        raise ValueError(f"no held-out prompt belongs to a domain of {DOMAINS}")
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=tok.eos_token_id)
    plain = {d: [] for d in DOMAINS}
    for d, ps in by_domain.items():
        for b0 in range(0, len(ps), batch_size):
            plain[d] += sj.generate(target, ps[b0:b0 + batch_size], **kw).tokens
    out = {}
    for label, extra in configs:
        res, tot = {}, dict(acc=None, steps=0, tokens=0, same=True)
        for d, ps in by_domain.items():
            acc_pos, steps, same, toks = None, 0, True, 0
            for b0 in range(0, len(ps), batch_size):
                o = sj.generate(target, ps[b0:b0 + batch_size], draft=draft, **kw, **extra)
                same &= o.tokens == plain[d][b0:b0 + batch_size]
                rs = o.stats["speculative_steps"]  # per_position_acceptance is per speculative step
                a = np.asarray(o.stats["per_position_acceptance"]) * rs
                acc_pos = a if acc_pos is None else acc_pos + a
                steps += rs
                toks += o.stats["generated_tokens"]
            res[d] = {"prompts": len(ps), "mean_accepted_length": float((acc_pos.sum() + steps) / steps),
                      "per_position_acceptance": (acc_pos / steps).round(4).tolist(),
                      "row_steps": int(steps), "tokens": int(toks), "identical_to_plain": bool(same)}
            tot["acc"] = acc_pos if tot["acc"] is None else tot["acc"] + acc_pos
            tot["steps"] += steps
            tot["tokens"] += toks
            tot["same"] &= same
            print(f"  {label:>16} {d:>13}: accepted length {res[d]['mean_accepted_length']:.2f} "
                  f"per position {res[d]['per_position_acceptance']}"
                  + ("" if same else "  OUTPUT DIFFERS FROM PLAIN"), flush=True)
        res["all"] = {"mean_accepted_length": float((tot["acc"].sum() + tot["steps"]) / tot["steps"]),
                      "per_position_acceptance": (tot["acc"] / tot["steps"]).round(4).tolist(),
                      "row_steps": int(tot["steps"]), "tokens": int(tot["tokens"]),
                      "identical_to_plain": bool(tot["same"])}
        out[label] = res
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="checkpoints/smollm2-mtp-v8k")
    ap.add_argument("--ks", default="3", help="chain draft lengths, comma-separated ('' for none)")
    ap.add_argument("--tree", default="", help="EAGLE-2 dynamic tree depth,top_k,nodes (heads only)")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts per domain")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", default=None, help="JSON path (default: print only)")
    args = ap.parse_args(argv)

    target = sj.load_model("smollm2-135m")
    tok = sj.load_tokenizer("smollm2-135m")
    draft = sj.load_draft(args.draft, target=target)
    configs = [(f"k={k}", dict(method=sj.draft_method(draft), num_draft_tokens=int(k)))
               for k in args.ks.split(",") if k]
    if args.tree:
        from specjax.tree import TreeConfig  # noqa: PLC0415
        depth, top_k, nodes = (int(x) for x in args.tree.split(","))
        configs.append((f"tree {depth}/{top_k}/{nodes}",
                        dict(method="eagle-tree", tree=TreeConfig(depth=depth, top_k=top_k, num_nodes=nodes))))
    t0 = time.perf_counter()
    res = evaluate(target, tok, draft, configs, args.prompts, args.max_new_tokens, args.batch_size)
    print(f"\n{args.draft}: held-out broad prompts, {args.prompts} per domain, greedy, "
          f"{args.max_new_tokens} new tokens ({time.perf_counter() - t0:.0f} s)")
    print("| domain | " + " | ".join(label for label, _ in configs) + " |")
    print("|---|" + "---|" * len(configs))
    for d in [d for d in DOMAINS if d in res[configs[0][0]]] + ["all"]:
        print(f"| {d} | " + " | ".join(f"{res[label][d]['mean_accepted_length']:.2f}"
                                       for label, _ in configs) + " |")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        from specjax.provenance import with_provenance  # noqa: PLC0415
        with open(args.out, "w") as f:
            json.dump(with_provenance({"draft": args.draft, "prompts_per_domain": args.prompts,
                                       "max_new_tokens": args.max_new_tokens, "results": res}),
                      f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
