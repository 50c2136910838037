"""Teacher-forced held-out metrics of shipped heads: answer tokens only vs every position.

Scores each head on the held-out hidden states of the training pipeline (``--work``, built by
``specjax train-head``), over the self-distilled chat answers and the wiki extracts separately,
once counting only answer tokens (what drafting meets) and once every position including the
chat template and system prompt (how the first shipped heads were scored).

  python benchmarks/eval_held_out.py --heads checkpoints/smollm2-mtp,checkpoints/smollm2-eagle
"""

from __future__ import annotations

import argparse
import json
import os

import specjax as sj
from specjax.train import pipeline, trainer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", default="checkpoints/smollm2-mtp,checkpoints/smollm2-eagle")
    ap.add_argument("--work", default="data/smollm2")
    ap.add_argument("--out", default="benchmarks/results/held_out.json")
    args = ap.parse_args(argv)
    target = sj.load_model("smollm2-135m")
    res = {}
    print("| head | positions | split | soft CE | top-1 |")
    print("|---|---|---|---|---|")
    for path in args.heads.split(","):
        head = sj.load_draft(path, target)
        res[path] = {}
        for answer_only in (True, False):
            tc = trainer.TrainConfig(answer_only=answer_only)

            def loss_fn(p, tp, tokens, lengths, hidden, plens, tc=tc):
                return trainer.head_loss(p, head.config, tp, target.config, tokens, lengths, hidden,
                                         tc, plens, exact_top1=True)

            m = pipeline.held_out_eval(loss_fn, head.params, target.params, args.work, tc)
            key = "answer" if answer_only else "all"
            res[path][key] = m
            for split, v in m.items():
                print(f"| {path} | {key} | {split} | {v['cls']:.3f} | {v['top1']:.3f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
