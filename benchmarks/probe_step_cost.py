"""What one speculative step costs next to a plain one, in the fused loop (SmolLM2, batch 1).

Times plain decoding and EAGLE-3 chains at k = 1 and 2 (optionally with the n-gram hybrid) on
held-out chat prompts, greedy, EOS off: per-step time = (call time - prefill) / steps, where the
prefill is timed as a 1-token call; interleaved rounds, medians. ``--trace DIR`` also records
one k = 1 and one plain call with ``jax.profiler`` and splits the median step into the target's
layers, its output projection and everything between them (the head, acceptance, commit).

  python benchmarks/probe_step_cost.py --draft checkpoints/smollm2-eagle3-broad16-r1 --prompts 4 --max-new-tokens 128 --rounds 3
  python benchmarks/probe_step_cost.py --trace /tmp/trace
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import statistics

import jax
import numpy as np

import specjax as sj
from specjax.train.corpora import chat_prompts


def _phases(trace_dir: str, num_layers: int) -> dict:
    """Median ms per step of (lm_head, between, layers) from a Perfetto trace: the longest
    custom call per step is the target's output projection, a step runs from one to the next,
    and the target's layers are its last 4 * num_layers custom calls (qkv, o, gate/up, down
    each run on the native few-row matmul)."""
    path = glob.glob(trace_dir + "/plugins/profile/*/perfetto_trace.json.gz")[0]
    ev = json.load(gzip.open(path))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    calls = sorted([e for e in ev if e.get("ph") == "X" and e["name"].startswith("ffi")],
                   key=lambda e: e["ts"])
    total = collections.Counter()
    for e in calls:
        total[e["name"]] += e["dur"]
    lm = total.most_common(1)[0][0]
    heads = [e for e in calls if e["name"] == lm]
    rows = []
    for a, b in zip(heads, heads[1:]):
        inner = [e for e in calls if a["ts"] < e["ts"] < b["ts"] and e["name"] != lm]
        ends = a["ts"] + a["dur"]
        layer_calls = [e for e in inner if e["ts"] > ends]
        first_layer = layer_calls[-4 * num_layers]
        rows.append((a["dur"], first_layer["ts"] - ends, b["ts"] - first_layer["ts"]))
    return {name: statistics.median(r[i] for r in rows) / 1e3
            for i, name in enumerate(("lm_head", "between", "layers"))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="checkpoints/smollm2-eagle3-broad16-r1")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hybrid-min", type=int, default=2)
    ap.add_argument("--trace", default=None, help="also profile one plain and one k = 1 call here")
    args = ap.parse_args(argv)
    tok = sj.load_tokenizer("smollm2-135m")
    target = sj.load_model("smollm2-135m")
    head = sj.load_draft(args.draft, target)
    prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=args.prompts)]
    spec = dict(draft=head, method=head.config.kind)
    configs = {"plain": {}, "k=1": dict(spec, num_draft_tokens=1),
               f"k=1 hybrid {args.hybrid_min}": dict(spec, num_draft_tokens=1, hybrid_min=args.hybrid_min),
               "k=2": dict(spec, num_draft_tokens=2)}

    def run(name, p, n):
        return sj.generate(target, [p], max_new_tokens=n, eos_token_id=[], **configs[name])

    for p in prompts:  # compile every shape first
        for name in configs:
            run(name, p, args.max_new_tokens), run(name, p, 1)
    res = {name: [] for name in configs}
    prefill = {name: [] for name in configs}
    for _ in range(args.rounds):
        for p in prompts:
            for name in configs:
                prefill[name].append(run(name, p, 1).stats["wall_time_s"])
                o = run(name, p, args.max_new_tokens).stats
                res[name].append((o["wall_time_s"], o["row_steps"] or o["generated_tokens"] - 1,
                                  o["mean_accepted_length"]))
    per_step = {}
    for name in configs:
        pre = float(np.median(prefill[name]))
        per_step[name] = float(np.median([(w - pre) / s for w, s, _ in res[name]]))
    print(f"{len(prompts)} chat prompts x {args.max_new_tokens} tokens, {args.rounds} rounds, "
          f"draft {args.draft}")
    for name in configs:
        acc = np.mean([m for _, _, m in res[name]]) if name != "plain" else 1.0
        print(f"{name:>14}: {per_step[name] * 1e3:6.2f} ms per step = "
              f"{per_step[name] / per_step['plain']:.3f} plain steps; accepted {acc:.2f}")
    if args.trace:
        for name in ("plain", "k=1"):
            run(name, prompts[0], 64)  # compiled outside the trace
            with jax.profiler.trace(f"{args.trace}/{name}", create_perfetto_trace=True):
                run(name, prompts[0], 64)
            print(f"{name:>14} profiled, median ms per step:",
                  {k: round(v, 2) for k, v in _phases(f"{args.trace}/{name}", target.config.num_layers).items()})


if __name__ == "__main__":
    main()
