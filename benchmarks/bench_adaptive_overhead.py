"""The adaptive loop's own cost: plain decoding vs ``adaptive=True`` with every k >= 1 priced out.

The cost model is replaced by one where any speculative k costs 100 plain steps, so the device
chooses k = 0 on every step: the ratio measures what the adaptive machinery adds to a plain step
(the lax.switch over k-variants, the lag-window writes, the estimate update, catch-ups never
happen). SmolLM2 + the best shipped MTP head, batch 1, greedy, EOS off; one warm-up call per
case, then ``--rounds`` interleaved rounds (alternating order), median tokens/s with the spread
and the foreign CPU share (specjax.timing.interleaved_rounds).

    python benchmarks/bench_adaptive_overhead.py            # quiet machine, ~3 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import specjax as sj  # noqa: E402
from specjax import cost_model, shipped, timing  # noqa: E402
from specjax.train.corpora import chat_prompts  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    target = sj.load_model("smollm2-135m")
    tok = sj.load_tokenizer("smollm2-135m")
    found = shipped.load_best(target, "mtp")
    if found is None:
        p.error("no shipped MTP head in checkpoints/")
    head, name = found
    prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=args.num_prompts)]
    measured = cost_model.measure_costs

    def priced_out(*a, **kw):  # every k >= 1 costs infinity: never run, not even as a probe
        return [1.0] + [float("inf")] * (len(measured(*a, **kw)) - 1)
    cost_model.measure_costs = priced_out
    hists = []

    def run(adaptive):
        def go():
            n = 0
            for pr in prompts:
                kw = (dict(draft=head, method="mtp", num_draft_tokens=args.k, adaptive=True)
                      if adaptive else {})
                out = sj.generate(target, [pr], max_new_tokens=args.max_new_tokens,
                                  temperature=0.0, eos_token_id=[], **kw)
                n += len(out.tokens[0])
                if adaptive:
                    hists.append(out.stats["k_histogram"])
            return n
        return go

    res = timing.interleaved_rounds({"plain": run(False), "adaptive k=0": run(True)},
                                   rounds=args.rounds)
    report = {"command": " ".join(["python"] + sys.argv), "machine": timing.machine_info(),
              "head": name, "k_histogram_last": hists[-1], "cases": {}}
    for case, r in res.items():
        tps = [r["result"] / w for w in r["wall_s"]]
        sp = timing.spread(tps)
        report["cases"][case] = {"tokens_per_second": tps, **sp, "foreign_cpu": r["foreign_cpu"]}
        print(f"{case:14s} {sp['median']:6.1f} tok/s [{sp['min']:.1f}..{sp['max']:.1f}]"
              f"  foreign {max(f or 0 for f in r['foreign_cpu']):.1%}")
    ratio = report["cases"]["adaptive k=0"]["median"] / report["cases"]["plain"]["median"]
    report["ratio"] = ratio
    assert all(h[1:] == [0] * (len(h) - 1) for h in hists), "a k >= 1 step ran"
    print(f"adaptive (k forced to 0) / plain: {ratio:.3f}  (k histogram {hists[-1]})")
    if args.out:
        from specjax.provenance import with_provenance  # noqa: PLC0415
        with open(args.out, "w") as f:
            json.dump(with_provenance(report), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
