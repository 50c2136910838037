"""The ``specjax`` command: demo, generate, serve, bench, convert, train-head, train-draft (one
module each; ``_common`` holds the shared flags, among them the speculation flags that
``specjax.options.spec_from_options`` turns into a SpecConfig).

Every command takes ``--help``; ``--json`` gives machine-readable output on stdout (or a file);
progress goes to stderr.
"""

from __future__ import annotations

import argparse
import sys

from specjax.cli import bench, convert, demo, generate, serve, train_draft, train_head
from specjax.cli.demo import DEMO_PROMPTS  # noqa: F401 - benchmarks/bench_drafts.py reads it

COMMANDS = (demo, generate, serve, bench, convert, train_head, train_draft)

EPILOG = """examples:
  specjax demo                                   # SmolLM2 + shipped head: answers, acceptance, speedup
  specjax generate --prompt "Why is the sky blue?" --stream
  specjax generate --file prompts.txt --method draft --draft checkpoints/smollm2-draft -k 3 --json
  specjax generate --prompt "Rewrite: ..." --method ngram -k 3    # prompt lookup, no draft model
  specjax generate --prompt "Why is the sky blue?" --adaptive -k 4  # k chosen per step on device
  specjax serve --port 8000                      # OpenAI-compatible server, SmolLM2 + shipped head
  specjax bench                                  # specjax vs HF transformers, small settings
  specjax convert smollm2-135m out/smollm2 --to hf        # our weights -> transformers dir
  specjax convert checkpoints/smollm2-draft out/draft --to hf --target smollm2-135m
  specjax convert some/hf_dir out/ckpt                   # HF dir or .gguf -> specjax checkpoint
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specjax", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Speculative decoding in JAX: a draft proposes k tokens, the target verifies "
                    "them in one pass, lossless acceptance keeps the target's distribution.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError) as e:
        print(f"specjax {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
