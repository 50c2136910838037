"""Plain decoding with the blockwise XLA attention vs the one-shot reference, side by side.

``attn_impl="reference"`` runs ``specjax.attention.paged_attention_blockwise`` (an online softmax
over page blocks that skips blocks past the batch's live length, KV heads and batch kept as dot
batch dimensions); before it ran ``paged_attention_reference`` (gathers the whole page table,
transposes it, one softmax). This times ``sj.generate`` (plain, greedy, EOS off, random prompts)
with each, interleaved: every round runs both variants in alternating order, each after
``jax.clear_caches()`` and an untimed compile call, so compilation is excluded on both sides.
Reports new tokens/s median [min..max] over rounds, the per-round ratio, the foreign CPU, and
checks that both variants produce the same tokens:

    python benchmarks/bench_attention.py --settings 1x100x128,64x40x192,64x200x64 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--settings", default="1x100x128,64x40x192,64x200x64",
                    help="comma-separated BATCHxPROMPTxNEW")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be >= 1, got {args.rounds}")
    import jax  # noqa: PLC0415

    import specjax as sj  # noqa: PLC0415
    from specjax import attention, timing  # noqa: PLC0415

    blockwise = attention.paged_attention_blockwise

    def oneshot(q, k, v, pt, start, nnew, new_mask=None, *, scale=None, block_pages=None):
        return attention.paged_attention_reference(q, k, v, pt, start, nnew, new_mask, scale=scale)

    variants = {"one-shot": oneshot, "blockwise": blockwise}
    target = sj.load_model(args.model)
    rng = np.random.default_rng(0)
    report = {"machine": timing.machine_info(), "command": " ".join(sys.argv), "settings": {}}
    for setting in args.settings.split(","):
        b, plen, new = (int(x) for x in setting.split("x"))
        prompts = [rng.integers(100, 20000, plen).tolist() for _ in range(b)]
        res = {n: {"wall_s": [], "foreign_cpu": [], "tokens": None} for n in variants}
        for r in range(args.rounds):
            for name in (list(variants) if r % 2 == 0 else list(variants)[::-1]):
                attention.paged_attention_blockwise = variants[name]
                jax.clear_caches()
                kw = dict(max_new_tokens=new, temperature=0.0, eos_token_id=[])
                sj.generate(target, prompts, **kw)  # compile (untimed)
                with timing.Timer() as t:
                    out = sj.generate(target, prompts, **kw)
                res[name]["wall_s"].append(t.wall)
                res[name]["foreign_cpu"].append(t.foreign)
                if res[name]["tokens"] is None:
                    res[name]["tokens"] = out.tokens
        attention.paged_attention_blockwise = blockwise
        same = res["one-shot"]["tokens"] == res["blockwise"]["tokens"]
        row = {"identical_tokens": same}
        for name in variants:
            tps = [b * new / w for w in res[name]["wall_s"]]
            row[name] = {"tokens_per_s": timing.spread(tps), "wall_s": res[name]["wall_s"],
                         "max_foreign_cpu": max(f or 0.0 for f in res[name]["foreign_cpu"])}
        row["blockwise_vs_oneshot"] = timing.paired_speedup(res["one-shot"]["wall_s"],
                                                           res["blockwise"]["wall_s"])
        report["settings"][setting] = row
        o, bw, sp = row["one-shot"]["tokens_per_s"], row["blockwise"]["tokens_per_s"], row["blockwise_vs_oneshot"]
        print(f"batch {b} prompt {plen} new {new}: one-shot {o['median']:.1f} [{o['min']:.1f}..{o['max']:.1f}] "
              f"blockwise {bw['median']:.1f} [{bw['min']:.1f}..{bw['max']:.1f}] tok/s; "
              f"ratio {sp['median']:.2f}x [{sp['min']:.2f}..{sp['max']:.2f}]; identical {same}; "
              f"foreign {max(row[n]['max_foreign_cpu'] for n in variants):.1%}", flush=True)
    if args.out:
        from specjax.provenance import with_provenance  # noqa: PLC0415
        with open(args.out, "w") as f:
            json.dump(with_provenance(report), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
