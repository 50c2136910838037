"""Teacher-forced held-out metrics of shipped drafts: answer tokens only vs every position.

Scores each head (soft CE and top-1 of its next-next-token prediction) and draft LLM (KL and
top-1 of its next-token prediction) on the held-out hidden states of the training pipeline (``--work``, built by
``specjax train-head``), over the self-distilled chat answers and the wiki extracts separately,
once counting only answer tokens (what drafting meets) and once every position including the
chat template and system prompt (how the first shipped heads were scored).

  python benchmarks/eval_held_out.py --drafts checkpoints/smollm2-mtp,checkpoints/smollm2-draft
"""

from __future__ import annotations

import argparse
import json
import os

import specjax as sj
from specjax import shipped
from specjax.heads import Head
from specjax.train import pipeline, trainer


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", default=",".join(shipped.path(n) for n, k in shipped.available()
                                                 if k in ("mtp", "eagle")),
                    help="comma-separated head checkpoints (default: the shipped heads)")
    ap.add_argument("--work", default="data/smollm2")
    ap.add_argument("--out", default="benchmarks/results/held_out.json")
    args = ap.parse_args(argv)
    target = sj.load_model("smollm2-135m")
    res = {}
    print("| draft | positions | split | soft CE (heads) / KL (draft LLMs) | top-1 |")
    print("|---|---|---|---|---|")
    for path in args.drafts.split(","):
        draft = sj.load_draft(path, target)
        res[path] = {}
        for answer_only in (True, False):
            tc = trainer.TrainConfig(answer_only=answer_only)
            if isinstance(draft, Head):
                def loss_fn(p, tp, tokens, lengths, hidden, plens, tc=tc, cfg=draft.config):
                    return trainer.head_loss(p, cfg, tp, target.config, tokens, lengths, hidden,
                                             tc, plens, exact_top1=True)
                params, key_loss = draft.params, "cls"
            else:
                def loss_fn(p, tp, tokens, lengths, hidden, plens, tc=tc, cfg=draft.config):
                    return trainer.draft_loss(p, tp, target.config, cfg, tokens, lengths, hidden,
                                              tc, plens)
                params, key_loss = {"layers": draft.params["layers"], "norm": draft.params["norm"]}, "kl"
            m = pipeline.held_out_eval(loss_fn, params, target.params, args.work, tc)
            key = "answer" if answer_only else "all"
            res[path][key] = m
            for split, v in m.items():
                print(f"| {path} | {key} | {split} | {v[key_loss]:.3f} | {v['top1']:.3f} |")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    from specjax.provenance import with_provenance  # noqa: PLC0415
    with open(args.out, "w") as f:
        json.dump(with_provenance(res), f, indent=2)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
