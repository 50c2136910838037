"""Tree vs chain drafting with a trained head on SmolLM2: accepted length at equal verify width.

For each width W (tokens the target verifies per step, root included): the chain drafts
k = W - 1 tokens with the head (method "mtp"/"eagle"), the EAGLE-2 dynamic tree keeps N = W - 1
nodes (method "eagle-tree"). Held-out chat prompts, temperature 0, all prompts in one batch;
every output is checked token for token against plain greedy decoding. Reports the mean accepted
length (tokens emitted per target verify, bonus included) and tokens/s of each, side by side.

  python benchmarks/bench_tree.py --head checkpoints/smollm2-mtp
  python benchmarks/bench_tree.py --head checkpoints/smollm2-eagle --widths 5,9,17
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax

import specjax as sj
from specjax import shipped
from specjax.train.corpora import chat_prompts
from specjax.tree import TreeConfig

# dynamic tree shape per node budget N: (depth, top_k)
SHAPES = {3: (3, 2), 4: (3, 2), 7: (4, 3), 8: (4, 3), 15: (5, 4), 16: (5, 4), 31: (6, 5)}


def tree_for(n: int) -> TreeConfig:
    depth, top_k = SHAPES.get(n, (min(6, n), 4))
    return TreeConfig(depth=depth, top_k=top_k, num_nodes=n)


def run(target, head, prompts, method, max_new, **kw):
    sj.generate(target, prompts, max_new_tokens=max_new, draft=head, method=method,
                eos_token_id=[], **kw)  # compile
    t0 = time.perf_counter()
    out = sj.generate(target, prompts, max_new_tokens=max_new, draft=head, method=method,
                      eos_token_id=[], **kw)
    return out, time.perf_counter() - t0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=None, help="head checkpoint (default: the best shipped MTP head)")
    ap.add_argument("--widths", default="5,9,17", help="verified tokens per step (root included)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/tree.json")
    args = ap.parse_args(argv)

    target = sj.load_model("smollm2-135m")
    tok = sj.load_tokenizer("smollm2-135m")
    args.head = args.head or shipped.path(shipped.best("mtp") or "smollm2-mtp")
    head = sj.load_draft(args.head, target)
    chain_method = head.config.kind
    prompts = [tok.apply_chat_template(m)
               for m in chat_prompts("held_out", limit=args.prompts)]
    plain, plain_t = run(target, None, prompts, "none", args.max_new_tokens)
    rows = [{"config": "plain", "verified": 1, "mean_accepted_length": 1.0,
             "tokens_per_s": plain.stats["generated_tokens"] / plain_t, "identical": True}]
    for w in [int(x) for x in args.widths.split(",")]:
        tc = tree_for(w - 1)
        chain, chain_t = run(target, head, prompts, chain_method, args.max_new_tokens,
                             num_draft_tokens=w - 1)
        tree, tree_t = run(target, head, prompts, "eagle-tree", args.max_new_tokens, tree=tc)
        for name, out, t in ((f"chain k={w - 1}", chain, chain_t),
                             (f"tree N={w - 1} (depth {tc.depth}, top-k {tc.top_k})", tree, tree_t)):
            rows.append({"config": name, "verified": w,
                         "mean_accepted_length": out.stats["mean_accepted_length"],
                         "per_depth_acceptance": out.stats["per_position_acceptance"],
                         "tokens_per_s": out.stats["generated_tokens"] / t,
                         "identical": out.tokens == plain.tokens})
        rows[-1]["gain_over_chain"] = rows[-1]["mean_accepted_length"] - rows[-2]["mean_accepted_length"]

    print(f"\nhead {args.head} ({chain_method}), {len(prompts)} held-out prompts x "
          f"{args.max_new_tokens} tokens, greedy, batch {len(prompts)}")
    print(f"{'config':38s} {'verified':>8s} {'accepted len':>12s} {'tree gain':>9s} "
          f"{'tok/s':>7s} {'= plain':>7s}")
    for r in rows:
        gain = f"{r['gain_over_chain']:+.2f}" if "gain_over_chain" in r else ""
        print(f"{r['config']:38s} {r['verified']:8d} {r['mean_accepted_length']:12.2f} {gain:>9s} "
              f"{r['tokens_per_s']:7.1f} {str(r['identical']):>7s}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    meta = {"head": args.head, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
            "jax": jax.__version__, "machine": platform.machine(), "cpus": os.cpu_count()}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
