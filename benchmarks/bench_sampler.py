"""The sampler's cost: two-level inverse CDF (specjax.sampling) vs Gumbel-max, and sampled vs
greedy decoding end to end.

1. ``sampling.sample_logits`` at temperature 0.7 on [B, V] logits against its Gumbel-max twin
   (defined here: ``argmax(log p + Gumbel)`` over the same processed probabilities, what the
   sampler did before 2026-12-02), B in ``--batches``, V = SmolLM2's 49,152.
2. Plain ``sj.generate`` on SmolLM2 at batch ``--gen-batch``: every row sampled at 0.7 vs every
   row greedy, same prompts and lengths (no EOS stop), so the ratio is what sampling adds to a
   decode step (the corpus job samples half its batches).

All runs interleaved (specjax.timing.interleaved_rounds), median and [min..max] over rounds, the
other processes' CPU share recorded.

  python benchmarks/bench_sampler.py --rounds 5 --out benchmarks/results/sampler.json
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax import sampling, timing


def gumbel_sample_logits(keys, logits, temperature, top_k, top_p):
    """The Gumbel-max sampler this replaced: V random numbers per draw."""
    probs = sampling.process_logits(logits, temperature, top_k, top_p)

    def row(key, p):
        g = jax.random.gumbel(key, p.shape, jnp.float32)
        return jnp.argmax(jnp.where(p > 0, jnp.log(jnp.where(p > 0, p, 1.0)) + g, -jnp.inf))

    return jax.vmap(row)(keys, probs).astype(jnp.int32)


def op_runs(b: int, v: int, calls: int):
    logits = jax.random.normal(jax.random.key(1), (b, v)) * 3.0
    keys = jax.random.split(jax.random.key(0), b)
    args = (keys, logits, jnp.full((b,), 0.7), jnp.zeros((b,), jnp.int32), jnp.ones((b,)))
    gumbel = jax.jit(gumbel_sample_logits)

    def timed(f):
        def run():
            for _ in range(calls):
                out = f(*args)
            return out.block_until_ready()
        return run

    return {"inverse_cdf": timed(sampling.sample_logits), "gumbel": timed(gumbel)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--calls", type=int, default=10, help="sampler calls per timed run")
    ap.add_argument("--gen-batch", type=int, default=64, help="0 skips the end-to-end part")
    ap.add_argument("--gen-tokens", type=int, default=48)
    ap.add_argument("--out", default=None)
    timing.add_timing_args(ap)
    args = ap.parse_args(argv)
    timing.check_timing_args(ap, args)
    report = {"machine": timing.machine_info(), "rounds": args.rounds, "op": {}, "generate": None}
    v = 49152
    for b in (int(x) for x in args.batches.split(",") if x):
        t = timing.interleaved_rounds(op_runs(b, v, args.calls), rounds=args.rounds,
                                     wait_idle_s=args.wait_idle)
        sp = timing.paired_speedup(t["gumbel"]["wall_s"], t["inverse_cdf"]["wall_s"])
        ms = {n: float(np.median(t[n]["wall_s"]) / args.calls * 1e3) for n in t}
        report["op"][b] = {"ms_per_call": ms, "gumbel_over_inverse_cdf": sp,
                           "max_foreign_cpu": timing.max_foreign(*t.values())}
        print(f"B={b:>3} V={v}: inverse CDF {ms['inverse_cdf']:.2f} ms, Gumbel {ms['gumbel']:.2f} ms "
              f"per call; Gumbel/inverse {sp['median']:.2f}x [{sp['min']:.2f}..{sp['max']:.2f}] "
              f"(foreign CPU <= {timing.max_foreign(*t.values())})", flush=True)
    if args.gen_batch:
        import specjax as sj  # noqa: PLC0415
        from specjax.train.prompts import broad_prompts  # noqa: PLC0415

        target = sj.load_model("smollm2-135m")
        tok = sj.load_tokenizer("smollm2-135m")
        held = broad_prompts("held_out")[:args.gen_batch]
        prompts = [tok.apply_chat_template(p["messages"])[:40] for p in held]
        kw = dict(max_new_tokens=args.gen_tokens, eos_token_id=[])
        runs = {"greedy": lambda: sj.generate(target, prompts, temperature=0.0, **kw),
                "sampled": lambda: sj.generate(target, prompts, temperature=0.7, seed=1, **kw)}
        t = timing.interleaved_rounds(runs, rounds=args.rounds, wait_idle_s=args.wait_idle)
        sp = timing.paired_speedup(t["greedy"]["wall_s"], t["sampled"]["wall_s"])
        n_tok = len(prompts) * args.gen_tokens
        tps = {n: n_tok / float(np.median(t[n]["wall_s"])) for n in t}
        report["generate"] = {"batch": len(prompts), "prompt_tokens": 40, "new_tokens": args.gen_tokens,
                              "tokens_per_s": tps, "sampled_over_greedy_speed": sp,
                              "max_foreign_cpu": timing.max_foreign(*t.values())}
        print(f"generate B={len(prompts)}, 40-token prompts, {args.gen_tokens} new: greedy "
              f"{tps['greedy']:.0f} tok/s, sampled {tps['sampled']:.0f} tok/s; sampled speed / greedy "
              f"{sp['median']:.2f}x [{sp['min']:.2f}..{sp['max']:.2f}] (foreign CPU <= "
              f"{timing.max_foreign(*t.values())})", flush=True)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        from specjax.provenance import with_provenance  # noqa: PLC0415
        with open(args.out, "w") as f:
            json.dump(with_provenance(report), f, indent=2, default=float)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
