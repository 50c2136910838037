"""``specjax train-head``: train an MTP / EAGLE / EAGLE-3 head on self-distilled data
(resumable: rerun the same command)."""

from __future__ import annotations

import os

from specjax.cli import _common as C


def add_parser(sub) -> None:
    th = sub.add_parser("train-head", help="train an MTP / EAGLE head on self-distilled data "
                                              "(resumable: rerun the same command)")
    C.add_train_flags(th)
    th.add_argument("--kind", choices=["mtp", "eagle", "eagle3"], default="mtp",
                    help="eagle3: fused low/mid/high target features, own lm_head over the draft "
                         "vocabulary, trained with the training-time test (--rollout, default 3 "
                         "for eagle3) and saved in the reference EAGLE-3 layout")
    th.add_argument("--rollout-decay", type=float, default=None,
                    help="loss weight of rollout pass r is DECAY**r (default 0.8 for eagle3, else 1)")
    th.add_argument("--draft-vocab", type=int, default=0,
                    help="score only this many of the training answers' most frequent tokens "
                         "(EAGLE-3's reduced draft vocabulary; 0 = the full vocabulary)")
    th.add_argument("--norms", choices=["on", "off"], default="on",
                    help="restored RMSNorms (enorm/hnorm/block/final) on or off (EAGLE-1 style)")
    th.add_argument("--corpus", default=None,
                    help="train on a broad distilled corpus (answers-*.jsonl.gz shards written by "
                         "python -m specjax.train.distill) instead of building the small one")
    th.add_argument("--held-out-corpus", default=None,
                    help="with --corpus: distilled held-out shards (distill --split held_out), "
                         "scored per domain")
    th.add_argument("--shards", type=int, default=None,
                    help="with --corpus: train on the first N shards only (default: all)")
    th.add_argument("--aux-layers", default=None, metavar="I,J,...",
                    help="eagle3: the target layers whose entering hidden states the head fuses "
                         "(default 2, L//2, L-3); any of those and L (the final hidden state), "
                         "e.g. '30' for a last-layer-only head on a 30-layer target")
    th.add_argument("--init-from", default=None, metavar="HEAD",
                    help="start from this head (a checkpoint of the same --kind and features, "
                         "e.g. a teacher-forced run fine-tuned with --rollout 3; its draft "
                         "vocabulary is kept) instead of the target's last layer")
    th.set_defaults(run=run)


def _aux_layers_arg(text, kind: str):
    """--aux-layers "2,15,27" -> (2, 15, 27); None when not given. ValueError names the flag."""
    if text is None:
        return None
    if kind != "eagle3":
        raise ValueError(f"--aux-layers is for --kind eagle3, got --kind {kind}")
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--aux-layers must be comma-separated layer indices, got {text!r}") from None
    if not layers or any(i < 0 for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"--aux-layers must be distinct layer indices >= 0, got {text!r}")
    return layers


def run(args) -> int:
    aux = _aux_layers_arg(args.aux_layers, args.kind)  # bad flags fail before any work
    if args.init_from is not None and not os.path.exists(args.init_from):
        raise ValueError(f"--init-from {args.init_from!r}: no such head checkpoint")
    target, tok, tc, pipeline = C.prepare_training(args)
    pipeline.train_head(target, tok, args.work, args.out, args.kind, args.norms == "on", tc,
                        eval_prompts=args.eval_prompts, draft_vocab=args.draft_vocab,
                        run_name=args.run_name, data=args.data,
                        aux_layers=aux, init_from=args.init_from)
    return 0
