"""``specjax bench``: specjax vs HF transformers on the same weights, in the same run, with
small defaults. The harness is ``benchmarks/hf_compare.py`` (benchmarks/bench_compare.py runs it
with the RESULTS.md defaults); the library never imports benchmarks/, so this command loads that
file by path and needs a source checkout."""

from __future__ import annotations

import importlib.util
import os
import sys

from specjax.cli import _common as C

HARNESS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "benchmarks", "hf_compare.py")


def harness():
    """The benchmarks/hf_compare.py module (ValueError outside a source checkout)."""
    if not os.path.exists(HARNESS):
        raise ValueError(f"specjax bench runs {HARNESS}, which this installation lacks: run it "
                         "from a source checkout (benchmarks/bench_compare.py)")
    name = "_specjax_benchmarks_hf_compare"
    if name not in sys.modules:  # loaded once (its dataclasses need a registered module)
        spec = importlib.util.spec_from_file_location(name, HARNESS)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def add_parser(sub) -> None:
    be = sub.add_parser(
        "bench", help="specjax (plain/draft/MTP/EAGLE) vs HF transformers (plain/assisted/prompt "
                      "lookup), same weights, same run",
        description="Runs benchmarks/hf_compare.py (in a source checkout) with small defaults; "
                    "benchmarks/bench_compare.py has the full ones.")
    be.set_defaults(run=run)
    if os.path.exists(HARNESS):
        harness().add_arguments(be, max_new_tokens=32, num_prompts=2, batch=4, repeats=1)


def run(args) -> int:
    h = harness()
    report = h.run_from_args(args)
    if args.json:
        C.write_json(report, args.json)
    else:
        print(report["table_md"])
        print(h.summary(report))
    return 0
