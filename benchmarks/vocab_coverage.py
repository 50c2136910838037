"""Coverage of a reduced draft vocabulary: the ceiling it puts on a head's acceptance.

A head restricted to the ``n`` most frequent answer tokens of its training shards (EAGLE-3's
draft vocabulary, chosen by ``specjax.train.data.draft_vocab`` itself: by count, EOS always
in) can only propose those tokens, so the share of the target's greedy held-out answer tokens
inside the set bounds the fraction of drafts that can be accepted. This counts that share for
each size, over all held-out greedy answers and per domain. Token counting only: no model runs.

  python benchmarks/vocab_coverage.py --shards 8 --sizes 1024,2048,4096,8192,16384
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from specjax.train import data as data_lib  # noqa: E402
from specjax.train import distill  # noqa: E402

VOCAB = 49152  # SmolLM2
EOS = 2  # SmolLM2-Instruct's <|im_end|>


def answers(rows):
    return [np.asarray(r["ids"][r["prompt_len"]:], np.int64) for r in rows]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--corpus", default="checkpoints/corpus/broad")
    ap.add_argument("--held-out", default="checkpoints/corpus/broad-held-out")
    ap.add_argument("--shards", type=int, default=None, help="first N training shards (default all)")
    ap.add_argument("--sizes", default="1024,2048,4096,8192,16384")
    ap.add_argument("--out", default=None, help="JSON file to write")
    args = ap.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(not 0 < s <= VOCAB for s in sizes):
        raise SystemExit(f"--sizes must be in [1, {VOCAB}], got {args.sizes}")
    paths = distill.shard_files(args.corpus)[:args.shards]
    if not paths:
        raise SystemExit(f"no answers-*.jsonl.gz shards in {args.corpus}")
    train = np.concatenate([a for p in paths for a in answers(distill.read_rows(p))])
    as_one_row = {"tokens": train[None], "lengths": np.array([len(train)]),
                  "prompt_lens": np.array([0])}  # every token an answer token
    held = [r for p in distill.shard_files(args.held_out) for r in distill.read_rows(p)
            if r.get("temperature", 0) == 0]
    domains = sorted({r["domain"] for r in held})
    held_answers = answers(held)
    result = {"train_shards": len(paths), "train_answer_tokens": int(len(train)),
              "distinct_train_tokens": int(len(np.unique(train))), "sizes": {}}
    print(f"{len(paths)} train shards; held-out greedy answers: {len(held)}")
    print("size | all | " + " | ".join(domains))
    for n in sizes:
        inside = np.zeros(VOCAB, bool)
        inside[data_lib.draft_vocab(as_one_row, n, VOCAB, always=(EOS,))] = True
        row = {}
        for name in ["all", *domains]:
            toks = np.concatenate([a for r, a in zip(held, held_answers)
                                   if name == "all" or r["domain"] == name])
            row[name] = float(inside[toks].mean())
        result["sizes"][n] = row
        print(f"{n} | " + " | ".join(f"{row[k]:.3f}" for k in ["all", *domains]))
    if args.out:
        from specjax.provenance import with_provenance  # noqa: PLC0415
        with open(args.out, "w") as f:
            json.dump(with_provenance(result), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
