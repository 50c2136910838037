"""N-gram drafting and adaptive k: the measurements behind issue 20's "Done means".

Three comparisons, each at batch 1 (prompts one after another), greedy, EOS off, interleaved
rounds (a warm-up round compiles, then ``--rounds`` timed rounds with the cases in alternating
order; specjax.hf_compare.measure), median tokens/s with the spread (min..max over rounds) and the
foreign CPU share during every timed run:

1. ``reuse``: prompts whose answers reuse the prompt (benchmarks/data/reuse_prompts.json:
   rewrite, summarize, fix this code, add type hints, reformat a list): specjax plain, specjax
   ``method="ngram"`` (k = ``--k-ngram``), HF transformers plain and HF prompt lookup
   (``prompt_lookup_num_tokens`` = the same k) on the same weights.
   Targets: n-gram >= 1.15x specjax plain and >= 1.3x HF prompt lookup.
2. ``useless``: an untrained early-exit draft (the target's first 2 layers): plain, fixed k=3,
   ``adaptive=True`` (K = 3). Target: adaptive >= 0.95x plain while fixed k=3 is far below.
3. ``head``: the best shipped head (checkpoints/, MTP first), fixed k in {1, 2, 3, 4} and
   adaptive (K = 4), on chat prompts and on the reuse prompts. Target: adaptive within 5% of
   the best fixed k, or better.

    python benchmarks/bench_ngram.py --tiny            # a tiny random model: checks it runs
    python benchmarks/bench_ngram.py --out benchmarks/results/ngram.json   # SmolLM2, quiet machine

CPU timings are only meaningful on a quiet machine: check ``max_foreign_cpu`` in the report
(``--wait-idle`` waits for one before each timed run).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

import specjax as sj  # noqa: E402
from specjax import timing  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: hf_compare
import hf_compare  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "reuse_prompts.json")


def _case(target, name, method, draft, k, n_new, adaptive=False, desc="-"):
    def run(prompts):
        out = sj.generate(target, prompts, max_new_tokens=n_new, draft=draft, method=method,
                          num_draft_tokens=k, temperature=0.0, eos_token_id=[], adaptive=adaptive)
        s = out.stats
        extra = {"row_steps": s["row_steps"],
                 "step_tokens": s["generated_tokens"] - len(prompts)}
        if "k_histogram" in s:
            extra["k_histogram"] = s["k_histogram"]
        return out.tokens, extra
    return hf_compare.Case(name, "specjax", method + (" adaptive" if adaptive else ""), desc,
                      0 if method == "none" else k, run)


def _summarise(res: dict, base: str) -> dict:
    """Median, spread and ratio to ``base`` per case (ratios of medians, same interleaved run)."""
    b = res[base]["median_tokens_per_second"]
    out = {}
    for name, d in res.items():
        tps = d["tokens_per_second"]
        out[name] = {"median_tok_s": d["median_tokens_per_second"], "min_tok_s": min(tps),
                     "max_tok_s": max(tps), "vs_" + base.replace(" ", "_"):
                     d["median_tokens_per_second"] / b,
                     "mean_accepted_length": d.get("mean_accepted_length"),
                     "k_histogram": d.get("k_histogram"), "max_foreign_cpu": d.get("max_foreign_cpu"),
                     "greedy_equal_to_plain": d["tokens"] == res[base]["tokens"]}
    return out


def _measure(cases, prompts, args):
    res = hf_compare.measure(cases, prompts, batch=1, repeats=args.rounds, wait_idle_s=args.wait_idle,
                        progress=args.progress)["batch1"]
    return res


def tiny_setup():
    from tests.conftest import tiny_model  # noqa: PLC0415
    from specjax.heads import Head, HeadConfig, init_head  # noqa: PLC0415
    import jax  # noqa: PLC0415

    target = tiny_model(0, vocab=64, hidden=64, layers=4)
    rng = np.random.default_rng(0)
    reuse = []
    for _ in range(3):  # a random "document" repeated with edits: n-gram lookup has matches
        doc = rng.integers(0, 64, 24).tolist()
        reuse.append(doc + [1] + doc[:12])
    chat = [rng.integers(0, 64, int(rng.integers(8, 20))).tolist() for _ in range(3)]
    hcfg = HeadConfig.for_target(target.config, "mtp")
    head = (Head(init_head(hcfg, jax.random.key(3), scale=0.3), hcfg), "random MTP head")
    return target, reuse, chat, head


def smollm2_setup(args):
    from specjax import shipped  # noqa: PLC0415
    from specjax.train.corpora import chat_prompts  # noqa: PLC0415

    target = sj.load_model("smollm2-135m")
    tok = sj.load_tokenizer("smollm2-135m")
    with open(DATA) as f:
        data = json.load(f)["prompts"]
    reuse = [tok.apply_chat_template([{"role": "user", "content": p["text"]}])
             for p in data[:args.num_prompts]]
    chat = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=args.num_prompts)]
    head = shipped.load_best(target, "mtp") or shipped.load_best(target, "eagle")
    return target, reuse, chat, head


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a tiny random model (checks the script)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (>= 3) after a warm-up")
    p.add_argument("--k-ngram", type=int, default=3)
    p.add_argument("--head-ks", default="1,2,3,4", help="fixed k of the head parts (comma list; "
                   "adaptive runs with K = the largest)")
    p.add_argument("--parts", default="reuse,useless,head")
    p.add_argument("--no-hf", dest="hf", action="store_false")
    p.add_argument("--wait-idle", type=float, default=0.0)
    p.add_argument("--out", default=None)
    p.add_argument("--no-progress", dest="progress", action="store_false")
    args = p.parse_args(argv)
    if args.rounds < 3:
        p.error("--rounds must be >= 3 (median and spread over interleaved rounds)")
    head_ks = [int(k) for k in args.head_ks.split(",")]
    if not head_ks or min(head_ks) < 1:
        p.error(f"--head-ks must be a comma list of k >= 1, got {args.head_ks!r}")
    kmax = max(head_ks)
    target, reuse, chat, head = tiny_setup() if args.tiny else smollm2_setup(args)
    n = args.max_new_tokens
    parts = args.parts.split(",")
    report = {"machine": timing.machine_info(), "versions": hf_compare.versions(args.hf),
              "command": " ".join(sys.argv), "max_new_tokens": n, "rounds": args.rounds,
              "tiny": args.tiny}

    if "reuse" in parts:
        cases = [_case(target, "specjax plain", "none", None, 1, n),
                 _case(target, "specjax ngram", "ngram", None, args.k_ngram, n, desc="n-grams")]
        if args.hf:
            cases = hf_compare.hf_cases(target, n, prompt_lookup_k=args.k_ngram) + cases
        res = _measure(cases, reuse, args)
        report["reuse"] = _summarise(res, "specjax plain")
        if args.hf:
            pl = res["HF prompt lookup"]["median_tokens_per_second"]
            report["reuse"]["specjax ngram"]["vs_hf_prompt_lookup"] = \
                res["specjax ngram"]["median_tokens_per_second"] / pl

    if "useless" in parts:
        draft = sj.early_exit_draft(target, 2)
        cases = [_case(target, "specjax plain", "none", None, 1, n),
                 _case(target, "draft k=3", "draft", draft, 3, n, desc="early-exit 2 layers"),
                 _case(target, "draft adaptive K=3", "draft", draft, 3, n, adaptive=True,
                       desc="early-exit 2 layers")]
        report["useless"] = _summarise(_measure(cases, chat, args), "specjax plain")

    if "head" in parts and head is not None:
        hd, desc = head
        method = hd.config.kind
        for label, prompts in (("head_chat", chat), ("head_reuse", reuse)):
            cases = [_case(target, "specjax plain", "none", None, 1, n)]
            cases += [_case(target, f"{method} k={k}", method, hd, k, n, desc=desc)
                      for k in head_ks]
            cases.append(_case(target, f"{method} adaptive K={kmax}", method, hd, kmax,
                               n, adaptive=True, desc=desc))
            summ = _summarise(_measure(cases, prompts, args), "specjax plain")
            best = max((v["median_tok_s"], k) for k, v in summ.items() if "k=" in k)
            summ["adaptive_vs_best_fixed"] = {
                "best_fixed": best[1],
                "ratio": summ[f"{method} adaptive K={kmax}"]["median_tok_s"] / best[0]}
            report[label] = summ

    fcs = [v.get("max_foreign_cpu") for part in report.values() if isinstance(part, dict)
           for v in part.values() if isinstance(v, dict) and v.get("max_foreign_cpu") is not None]
    report["max_foreign_cpu"] = max(fcs) if fcs else None
    from specjax.provenance import with_provenance  # noqa: PLC0415
    text = json.dumps(with_provenance(report), indent=1, default=float)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    for part in ("reuse", "useless", "head_chat", "head_reuse"):
        if part in report:
            print(f"\n## {part}")
            for name, v in report[part].items():
                if "median_tok_s" in v:
                    print(f"  {name:24s} {v['median_tok_s']:8.1f} tok/s "
                          f"[{v['min_tok_s']:.1f}..{v['max_tok_s']:.1f}]  "
                          f"x{list(v.values())[3]:.2f} plain  acc.len {v['mean_accepted_length']}"
                          f"  k-hist {v['k_histogram']}  foreign {v['max_foreign_cpu']}")
                else:
                    print(f"  {name}: {v}")
    print(f"\nmax foreign CPU during timed runs: {report['max_foreign_cpu']}"
          " (numbers are only meaningful on a quiet machine)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
