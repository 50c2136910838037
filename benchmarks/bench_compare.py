"""specjax vs HF transformers side by side on SmolLM2-135M or Gemma 3 270M (same weights, same run).

HF transformers: plain ``generate``, assisted generation with the same draft LLM converted to a
transformers directory (constant k, no confidence cut-off; and HF's own defaults), and prompt
lookup. specjax: plain, the same draft LLM, the shipped MTP head, the EAGLE head when present.
Batch 1 (prompts one after another) and batched. Greedy, EOS off, float32 on both sides (HF
reads the exact float32 weights specjax dequantized from the GGUF, written as safetensors).
Greedy outputs are compared per row with HF plain; mismatches are reported, not hidden.

The draft LLM is ``checkpoints/smollm2-draft`` when it exists, else an untrained early-exit draft
(the target's first ``--early-exit-layers`` layers). The measurement code is
``benchmarks/hf_compare.py`` (``specjax bench`` runs the same with small defaults).

Gemma 3 270M (``--model gemma3-270m``, a base model, Gemma Terms of Use): HF loads the same GGUF
itself and dequantizes it; held-out Wikipedia continuations (BOS + ``--prompt-tokens``); plain
decoding and prompt lookup / n-gram on both sides (no draft LLM); ``--weights both`` times
specjax on the float32 weights (HF's math) and on the quantized blocks.

Usage (the RESULTS.md run; 1 core, see there for why):
  taskset -c 0 python benchmarks/bench_compare.py --torch-threads 1
Writes benchmarks/results/compare.json and compare.md.
  taskset -c 0 python benchmarks/bench_compare.py --torch-threads 1 --model gemma3-270m \
      --weights both
Writes benchmarks/results/gemma3_hf_compare.json and .md (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: hf_compare
import hf_compare  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    hf_compare.add_arguments(ap, max_new_tokens=64, num_prompts=8, batch=8, repeats=2)
    args = ap.parse_args(argv)
    if args.out is None:  # one results file per target
        args.out = ("benchmarks/results/gemma3_hf_compare.json" if args.model == "gemma3-270m"
                    else "benchmarks/results/compare.json")
    report = hf_compare.run_from_args(args)
    print(report["table_md"])
    print(hf_compare.summary(report))
    if args.json:
        from specjax.provenance import with_provenance  # noqa: PLC0415
        hf_compare.dump(with_provenance(report), "/dev/stdout" if args.json == "-" else args.json)
    return report


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
