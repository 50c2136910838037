"""``specjax train-head``: train an MTP / EAGLE / EAGLE-3 head on self-distilled data, or a block
drafter (DFlash, ``specjax.train.dflash_train``; P-EAGLE, ``specjax.train.peagle_train``) on the
broad distilled corpus (resumable: rerun the same command)."""

from __future__ import annotations

import os

from specjax.cli import _common as C


def add_parser(sub) -> None:
    th = sub.add_parser("train-head", help="train an MTP / EAGLE / EAGLE-3 head or a DFlash / "
                                              "P-EAGLE block drafter on self-distilled data "
                                              "(resumable: rerun the same command)")
    C.add_train_flags(th)
    th.add_argument("--kind", choices=["mtp", "eagle", "eagle3", *BLOCK_KINDS], default="mtp",
                    help="eagle3: fused low/mid/high target features, own lm_head over the draft "
                         "vocabulary, trained with the training-time test (--rollout, default 3 "
                         "for eagle3) and saved in the reference EAGLE-3 layout. dflash: a block "
                         "drafter (z-lab's layout), peagle: an EAGLE-3 head drafting --depths "
                         "tokens in one pass (speculators' layout); both train on --corpus "
                         "(default checkpoints/corpus/broad), their features under --work, their "
                         "run under --work/--run-name, and write the drafter to --out")
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
    blk = th.add_argument_group("block drafters (--kind dflash / peagle)")
    blk.add_argument("--block-size", type=int, default=8, help="dflash: block size B (k <= B-1)")
    blk.add_argument("--layers", type=int, default=1, help="dflash: decoder layers of the drafter")
    blk.add_argument("--target-layer-ids", default=None, metavar="I,J,...",
                     help="dflash: target layers whose outputs are fused (default 1, L//2-1, L-4)")
    blk.add_argument("--depths", type=int, default=4, help="peagle: drafts per pass K")
    blk.add_argument("--mask-token-id", type=int, default=16,
                     help="the placeholder token of the drafted slots")
    blk.add_argument("--anchors", type=int, default=16, help="blocks trained per sequence")
    blk.add_argument("--gamma", type=float, default=None,
                     help="loss weight of slot d is exp(-(d-1)/gamma) (default 7 for B=16, else 4)")
    blk.add_argument("--save-every", type=int, default=50, help="orbax state every N steps")
    th.set_defaults(run=run)


BLOCK_KINDS = ("dflash", "peagle")
DEFAULT_CORPUS = ("checkpoints/corpus/broad", "checkpoints/corpus/broad-held-out")


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


def block_drafter_argv(args) -> list[str]:
    """train-head's flags -> the argv of the block drafter's trainer (``--kind dflash|peagle``).
    Flags that only the MTP / EAGLE heads read are refused by name, not ignored."""
    unused = {"--rollout": args.rollout is not None, "--rollout-decay": args.rollout_decay is not None,
              "--draft-vocab": args.draft_vocab != 0, "--norms": args.norms != "on",
              "--aux-layers": args.aux_layers is not None, "--loss-on": args.loss_on != "answer"}
    if args.kind == "peagle":
        unused.update({"--block-size": args.block_size != 8, "--layers": args.layers != 1,
                       "--target-layer-ids": args.target_layer_ids is not None})
    else:
        unused.update({"--depths": args.depths != 4, "--init-from": args.init_from is not None})
    named = [flag for flag, given in unused.items() if given]
    if named:
        raise ValueError(f"{', '.join(named)} not read by --kind {args.kind}")
    if args.corpus is None and args.held_out_corpus is not None:
        raise ValueError("--held-out-corpus needs --corpus")
    if args.corpus is not None and args.held_out_corpus is None:
        raise ValueError("--corpus needs --held-out-corpus (distill --split held_out)")
    corpus, held = (args.corpus, args.held_out_corpus) if args.corpus else DEFAULT_CORPUS
    C.resolve_train_defaults(args)
    argv = ["--out", os.path.join(args.work, args.run_name or f"run-{args.kind}"),
            "--features", args.work, "--export", args.out, "--model", args.model,
            "--corpus", corpus, "--held-out-corpus", held, "--steps", str(args.steps),
            "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
            "--lr", str(args.lr), "--seed", str(args.seed), "--anchors", str(args.anchors),
            "--mask-token-id", str(args.mask_token_id), "--save-every", str(args.save_every)]
    if args.shards is not None:
        argv += ["--shards", str(args.shards)]
    if args.gamma is not None:
        argv += ["--gamma", str(args.gamma)]
    if args.kind == "dflash":
        argv += ["--block-size", str(args.block_size), "--layers", str(args.layers)]
        if args.target_layer_ids is not None:
            argv += ["--target-layer-ids", args.target_layer_ids]
    else:
        argv += ["--depths", str(args.depths)]
        if args.init_from is not None:
            argv += ["--init-from", args.init_from]
    return argv


def run(args) -> int:
    if args.init_from is not None and not os.path.exists(args.init_from):
        raise ValueError(f"--init-from {args.init_from!r}: no such head checkpoint")
    if args.kind in BLOCK_KINDS:
        argv = block_drafter_argv(args)  # bad flags fail before any work
        if args.kind == "dflash":
            from specjax.train import dflash_train as trainer_main
        else:
            from specjax.train import peagle_train as trainer_main
        return trainer_main.main(argv)
    block_flags = {"--block-size": args.block_size != 8, "--layers": args.layers != 1,
                   "--target-layer-ids": args.target_layer_ids is not None,
                   "--depths": args.depths != 4, "--mask-token-id": args.mask_token_id != 16,
                   "--anchors": args.anchors != 16, "--gamma": args.gamma is not None,
                   "--save-every": args.save_every != 50}
    named = [flag for flag, given in block_flags.items() if given]
    if named:
        raise ValueError(f"{', '.join(named)} only read by --kind dflash / peagle, "
                         f"not --kind {args.kind}")
    aux = _aux_layers_arg(args.aux_layers, args.kind)  # bad flags fail before any work
    target, tok, tc, pipeline = C.prepare_training(args)
    pipeline.train_head(target, tok, args.work, args.out, args.kind, args.norms == "on", tc,
                        eval_prompts=args.eval_prompts, draft_vocab=args.draft_vocab,
                        run_name=args.run_name, data=args.data,
                        aux_layers=aux, init_from=args.init_from)
    return 0
