"""Batched plain decoding throughput vs prompt length and temperature (the corpus job's regime).

Times ``sj.generate`` (plain, EOS off) on random prompts of the given lengths after a warm-up
call, one run per setting, and prints new tokens per second. It shows how the cost of a decode
step grows with the padded cache (decode attention reads every cached slot of the row's buffer):

    python benchmarks/probe_decode_context.py --batch 64 --lengths 40,200 --new-tokens 64
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lengths", default="40,200", help="prompt lengths, comma-separated")
    ap.add_argument("--temperatures", default="0,0.7")
    ap.add_argument("--new-tokens", type=int, default=64)
    args = ap.parse_args(argv)
    import specjax as sj  # noqa: PLC0415

    target = sj.load_model(args.model)
    rng = np.random.default_rng(0)
    print(f"batch {args.batch}, {args.new_tokens} new tokens, load {os.getloadavg()[0]:.1f}")
    for length in (int(x) for x in args.lengths.split(",")):
        prompts = [rng.integers(100, 20000, length).tolist() for _ in range(args.batch)]
        for temp in (float(x) for x in args.temperatures.split(",")):
            kw = dict(max_new_tokens=args.new_tokens, temperature=temp, eos_token_id=[])
            sj.generate(target, prompts, **kw)  # compile
            t0 = time.perf_counter()
            sj.generate(target, prompts, **kw)
            dt = time.perf_counter() - t0
            print(f"prompt {length:4d} temperature {temp:.1f}: {args.batch * args.new_tokens / dt:6.0f} "
                  f"new tokens/s ({dt:.1f} s, prefill included)", flush=True)


if __name__ == "__main__":
    main()
