"""Cost of the on-device n-gram search per step (specjax.ngram.propose), jitted, on this device.

Times one ``propose`` call (the search over the whole history buffer + the gather of k drafts)
for a few batch sizes B and history widths L, and reports microseconds per step. The search
runs once per speculative step (twice with n-gram drafting: the no-match check and the draft),
so compare it with a decode step of the target (SmolLM2-135M: ~15 ms on a quiet 2-core CPU).

    python benchmarks/bench_ngram_search.py [--reps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from specjax import ngram, timing  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--ngram-max", type=int, default=3)
    args = p.parse_args(argv)
    fn = jax.jit(ngram.propose, static_argnums=(2, 3, 4))
    rng = np.random.default_rng(0)
    print(f"backend {jax.default_backend()}, k={args.k}, ngram 1..{args.ngram_max}")
    for b in (1, 8, 32):
        for width in (256, 1024, 4096):
            hist = jnp.asarray(rng.integers(0, 1000, (b, width)), jnp.int32)
            lens = jnp.full((b,), width - 8, jnp.int32)
            jax.block_until_ready(fn(hist, lens, args.k, 1, args.ngram_max))
            times = []
            with timing.Timer() as t:
                for _ in range(args.reps):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(hist, lens, args.k, 1, args.ngram_max))
                    times.append(time.perf_counter() - t0)
            print(f"B={b:3d} L={width:5d}: median {1e6 * statistics.median(times):8.1f} us "
                  f"(min {1e6 * min(times):.1f}), foreign CPU {t.foreign}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
