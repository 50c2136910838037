"""``specjax train-draft``: distill a small draft LLM sharing the target's embedding and
lm_head (resumable)."""

from __future__ import annotations

from specjax.cli import _common as C


def add_parser(sub) -> None:
    td = sub.add_parser("train-draft", help="distill a small draft LLM sharing the target's "
                                               "embedding and lm_head (resumable)")
    C.add_train_flags(td)
    td.add_argument("--layers", type=int, default=4)
    td.set_defaults(run=run)


def run(args) -> int:
    target, tok, tc, pipeline = C.prepare_training(args)
    pipeline.train_draft(target, tok, args.work, args.out, args.layers, tc,
                         eval_prompts=args.eval_prompts, run_name=args.run_name)
    return 0
