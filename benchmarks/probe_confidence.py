"""Is a head's confidence a signal? First-draft acceptance by the head's own probability.

Teacher-forced over greedy held-out answers of the broad corpus (the target's features at every
position, as the decode loop's head sees them after each verify): for each answer position, the
head's top draft, its probability q, and whether it equals the target's greedy next token.
Prints the share of positions and the acceptance per q bin (the input that
``adaptive_by="confidence"`` calibrates online).

  python benchmarks/probe_confidence.py --draft checkpoints/smollm2-eagle3-broad16-r1 --answers 80
"""

from __future__ import annotations

import argparse

import numpy as np

import specjax as sj
from specjax.train.distill import read_shards


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default="checkpoints/smollm2-eagle3-broad16-r1")
    ap.add_argument("--corpus", default="checkpoints/corpus/broad-held-out")
    ap.add_argument("--answers", type=int, default=80)
    ap.add_argument("--bins", type=int, default=10)
    args = ap.parse_args(argv)
    target = sj.load_model("smollm2-135m")
    head = sj.load_draft(args.draft, target)
    rows = [r for r in read_shards(args.corpus) if r["temperature"] == 0][:args.answers]
    conf, hit = [], []
    for r in rows:
        ids, start = r["ids"], r["prompt_len"]
        tl = sj.logits(target, ids)  # [T, V]: row j predicts ids[j + 1]
        dl = sj.draft_logits(target, head, ids)  # [T-1, V]: row j predicts ids[j + 2]
        for j in range(start - 2, len(ids) - 2):
            z = dl[j] - dl[j].max()
            p = np.exp(z) / np.exp(z).sum()
            d = int(np.argmax(dl[j]))
            conf.append(float(p[d]))
            hit.append(d == int(np.argmax(tl[j + 1])))
    conf, hit = np.asarray(conf), np.asarray(hit)
    print(f"{args.draft}: {len(rows)} greedy held-out answers, {len(conf)} positions, "
          f"first-draft acceptance {hit.mean():.3f}, mean confidence {conf.mean():.3f}")
    print("| q | share of positions | accepted |\n|---|---|---|")
    edges = np.linspace(0, 1, args.bins + 1)
    for lo, hi in zip(edges[:-1], edges[1:]):
        sel = (conf >= lo) & ((conf < hi) | (hi == 1.0))
        acc = f"{hit[sel].mean():.2f}" if sel.any() else "-"
        print(f"| {lo:.1f}-{hi:.1f} | {sel.mean():.3f} | {acc} |")


if __name__ == "__main__":
    main()
