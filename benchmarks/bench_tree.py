"""Tree vs chain drafting with a trained head on SmolLM2: accepted length at equal verify width.

For each width W (tokens the target verifies per step, root included): the chain drafts
k = W - 1 tokens with the head (method "mtp"/"eagle"), the EAGLE-2 dynamic tree keeps N = W - 1
nodes (method "eagle-tree"). Held-out chat prompts, temperature 0, all prompts in one batch;
every output is checked token for token against plain greedy decoding. Reports the mean accepted
length (tokens emitted per target verify, bonus included; load-independent) and tokens/s of each.

How it times (specjax.timing.interleaved_rounds): every compared configuration (plain, each chain,
each tree) is run once untimed (compilation excluded), then ``--rounds`` timed rounds each run
every configuration once, in alternating order (forward, reversed, ...), so load drift hits all
alike. Reported per configuration: the wall time of every round, median tokens/s with the spread
(min..max over rounds), speedup vs plain = ratio of the median tokens/s (with the per-round
paired ratios' spread), and the largest share of the CPUs other processes used during its timed
runs ("foreign CPU"; ``--wait-idle`` waits up to that many seconds for a quiet machine before
each timed run). The JSON also records the date, the machine and the command line.

  python benchmarks/bench_tree.py --tiny                     # tiny random target + head: seconds
  python benchmarks/bench_tree.py --head checkpoints/smollm2-mtp
  python benchmarks/bench_tree.py --head checkpoints/smollm2-eagle --widths 5,9,17
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

import specjax as sj  # noqa: E402
from specjax import timing  # noqa: E402
from specjax.tree import TreeConfig  # noqa: E402

# dynamic tree shape per node budget N: (depth, top_k)
SHAPES = {3: (3, 2), 4: (3, 2), 7: (4, 3), 8: (4, 3), 15: (5, 4), 16: (5, 4), 31: (6, 5)}


def tree_for(n: int) -> TreeConfig:
    depth, top_k = SHAPES.get(n, (min(6, n), 4))
    return TreeConfig(depth=depth, top_k=top_k, num_nodes=n)


def tiny_setup(args):
    """A tiny random target and a random MTP head (checks the script; acceptance is low)."""
    import numpy as np  # noqa: PLC0415

    from tests.conftest import random_head, tiny_model  # noqa: PLC0415

    target = tiny_model(0, vocab=64, hidden=64, layers=4)
    head = random_head(target, "mtp", seed=3, scale=0.3)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 64, int(rng.integers(6, 16))).tolist() for _ in range(args.prompts)]
    return target, head, "random MTP head (tiny)", prompts


def smollm2_setup(args):
    from specjax import shipped  # noqa: PLC0415
    from specjax.train.corpora import chat_prompts  # noqa: PLC0415

    target = sj.load_model("smollm2-135m")
    tok = sj.load_tokenizer("smollm2-135m")
    path = args.head or shipped.path(shipped.best("mtp") or "smollm2-mtp")
    head = sj.load_draft(path, target)
    prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=args.prompts)]
    return target, head, path, prompts


def main(argv=None) -> list:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true",
                    help="a tiny random target and random head (seconds; checks the script)")
    ap.add_argument("--head", default=None, help="head checkpoint (default: the best shipped MTP head)")
    ap.add_argument("--widths", default="5,9,17", help="verified tokens per step (root included)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts in the batch (default 16; "
                                                               "tiny 4)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default 64; tiny 16")
    timing.add_timing_args(ap)
    ap.add_argument("--out", default=None, help="JSON report (default benchmarks/results/tree.json; "
                                                 "tiny: none)")
    args = ap.parse_args(argv)
    timing.check_timing_args(ap, args)
    if args.tiny and args.head:
        ap.error("--tiny uses a random head; drop --head")
    widths = [int(x) for x in args.widths.split(",")]
    if any(w < 2 for w in widths):
        ap.error(f"--widths must all be >= 2 (root + at least one draft), got {args.widths}")
    args.prompts = args.prompts or (4 if args.tiny else 16)
    args.max_new_tokens = args.max_new_tokens or (16 if args.tiny else 64)
    if args.out is None and not args.tiny:
        args.out = "benchmarks/results/tree.json"

    target, head, head_desc, prompts = (tiny_setup if args.tiny else smollm2_setup)(args)
    chain_method = head.config.kind
    kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=[])

    def gen(method, draft=None, **extra):
        return lambda: sj.generate(target, prompts, draft=draft, method=method, **kw, **extra)

    configs = [("plain", 1, None, gen("none"))]
    for w in widths:
        tc = tree_for(w - 1)
        configs.append((f"chain k={w - 1}", w, None, gen(chain_method, head, num_draft_tokens=w - 1)))
        configs.append((f"tree N={w - 1} (depth {tc.depth}, top-k {tc.top_k})", w, tc,
                        gen("eagle-tree", head, tree=tc)))
    if args.rounds < 3:
        print(f"note: {args.rounds} round(s): the spread needs >= 3", file=sys.stderr)
    res = timing.interleaved_rounds({name: fn for name, _, _, fn in configs}, rounds=args.rounds,
                                   wait_idle_s=args.wait_idle)

    plain = res["plain"]
    plain_tokens = plain["result"].tokens
    rows = []
    for name, w, tc, _ in configs:
        r = res[name]
        out = r["result"]
        n_tok = out.stats["generated_tokens"]
        tps = timing.spread([n_tok / t for t in r["wall_s"]])
        row = {"config": name, "verified": w,
               "mean_accepted_length": 1.0 if name == "plain" else out.stats["mean_accepted_length"],
               "wall_s": r["wall_s"], "tokens_per_s": tps,
               "foreign_cpu": r["foreign_cpu"], "max_foreign_cpu": timing.max_foreign(r),
               "identical": out.tokens == plain_tokens}
        if name != "plain":
            row["per_depth_acceptance"] = out.stats["per_position_acceptance"]
            row["speedup_vs_plain"] = tps["median"] / rows[0]["tokens_per_s"]["median"]
            row["speedup_vs_plain_per_round"] = timing.paired_speedup(plain["wall_s"], r["wall_s"])
        if tc is not None:
            row["tree"] = {"depth": tc.depth, "top_k": tc.top_k, "num_nodes": tc.num_nodes}
            row["gain_over_chain"] = row["mean_accepted_length"] - rows[-1]["mean_accepted_length"]
        rows.append(row)

    max_fc = timing.max_foreign(*res.values())
    print(f"\nhead {head_desc} ({chain_method}), {len(prompts)} prompts x {args.max_new_tokens} "
          f"tokens, greedy, batch {len(prompts)}; {args.rounds} interleaved rounds after a warm-up")
    print(f"{'config':38s} {'verified':>8s} {'acc. len':>8s} {'gain':>6s} "
          f"{'tok/s median [min..max]':>26s} {'vs plain':>8s} {'foreign':>7s} {'= plain':>7s}")
    for r in rows:
        gain = f"{r['gain_over_chain']:+.2f}" if "gain_over_chain" in r else ""
        t = r["tokens_per_s"]
        sp = f"{r['speedup_vs_plain']:.2f}x" if "speedup_vs_plain" in r else ""
        fc = "?" if r["max_foreign_cpu"] is None else f"{100 * r['max_foreign_cpu']:.0f}%"
        tps = f"{t['median']:.1f} [{t['min']:.1f}..{t['max']:.1f}]"
        print(f"{r['config']:38s} {r['verified']:8d} {r['mean_accepted_length']:8.2f} {gain:>6s} "
              f"{tps:>26s} {sp:>8s} {fc:>7s} {str(r['identical']):>7s}")
    print(f"max foreign CPU during timed runs: {'?' if max_fc is None else f'{100 * max_fc:.0f}%'}"
          + (" -- contended: treat the tok/s with care" if max_fc is not None and max_fc > 0.1 else ""))
    meta = {"head": head_desc, "tiny": args.tiny, "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens, "widths": widths, "rounds": args.rounds,
            "wait_idle_s": args.wait_idle, "max_foreign_cpu": max_fc,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": " ".join(["python", "benchmarks/bench_tree.py"]
                                + (sys.argv[1:] if argv is None else list(argv))),
            "machine": timing.machine_info(),
            "jax": jax.__version__, "backend": jax.default_backend()}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        from specjax.provenance import with_provenance  # noqa: PLC0415
        with open(args.out, "w") as f:
            json.dump(with_provenance({"meta": meta, "rows": rows}), f, indent=1)
        print(f"wrote {args.out}")
    return rows


if __name__ == "__main__":
    main()
