"""Two checkouts of specjax side by side: batch-1 decoding speed, interleaved in one run.

Each checkout runs in its own long-lived worker process (PYTHONPATH = that checkout), which
loads SmolLM2-135M and the shipped EAGLE-3 head once and compiles every configuration before
timing. The coordinator then runs ``--rounds`` rounds; in each round every configuration is
timed on both checkouts back to back, in alternating order, so load drift hits both alike.
A timed pass runs every demo prompt once (each its own call, greedy, ``--max-new-tokens``).
Reported per configuration: new/old wall-time ratio per round (median, min, max), each side's
tokens/s, and whether both produced the same tokens; the foreign CPU share (CPU time used by
processes other than the two workers, over the timed passes) is recorded.

  python benchmarks/bench_versions.py --old /work/wt-base --new . --rounds 5 \
      --out benchmarks/results/refactor_speed.json
  (--new-weights float32: the new checkout on float32 weights, to isolate code changes from
  the quantized GGUF weights it loads by default)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

CONFIGS = {  # name -> generate() keywords (the draft is the shipped EAGLE-3 head where needed)
    "plain": dict(method="none"),
    "chain k=1": dict(method="eagle3", num_draft_tokens=1),
    "chain k=3": dict(method="eagle3", num_draft_tokens=3),
    "tree 1/3/3": dict(method="eagle-tree", tree=(1, 3, 3)),
    "ngram k=3": dict(method="ngram", num_draft_tokens=3),
}
HEAD = "checkpoints/smollm2-eagle3-broad74-gpu"
PROMPTS = ("What is the capital of France?", "Write a short poem about the sea.",
           "Explain in two sentences why the sky is blue.")


def worker(max_new: int) -> None:
    """Reads config names on stdin, answers one JSON line per timed pass on stdout."""
    import specjax as sj  # noqa: PLC0415 - the checkout under test (PYTHONPATH)
    from specjax.tree import TreeConfig  # noqa: PLC0415

    weights = os.environ.get("BENCH_WEIGHTS")  # only for a checkout that has load_model(weights=)
    target = sj.load_model("smollm2-135m", **({"weights": weights} if weights else {}))
    tok = sj.load_tokenizer("smollm2-135m")
    head = sj.load_draft(os.path.join(os.environ["BENCH_REPO"], HEAD), target=target)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}]) for q in PROMPTS]

    def run(name):
        kw = dict(CONFIGS[name])
        if "tree" in kw:
            d, k, n = kw["tree"]
            kw["tree"] = TreeConfig(depth=d, top_k=k, num_nodes=n)
        draft = head if kw["method"] in ("eagle3", "eagle-tree") else None
        outs = [sj.generate(target, [p], max_new_tokens=max_new, draft=draft, **kw) for p in prompts]
        return [o.tokens[0] for o in outs]

    for name in CONFIGS:  # compile every configuration before anything is timed
        run(name)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        t0 = time.perf_counter()
        tokens = run(name)
        wall = time.perf_counter() - t0
        print(json.dumps({"wall": wall, "tokens": tokens}), flush=True)


def _busy() -> float:
    with open("/proc/stat") as f:
        vals = [float(v) for v in f.readline().split()[1:]]
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def _proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (float(fields[11]) + float(fields[12])) / os.sysconf("SC_CLK_TCK")


def _git(repo: str, *args) -> str:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old", required=True, help="checkout of the baseline")
    ap.add_argument("--new", default=".", help="checkout under test")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--new-weights", default=None, choices=("quantized", "float32"),
                    help="load_model(weights=...) for the new checkout (default: its default)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.max_new_tokens)
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    workers = {}
    for side in ("old", "new"):
        repo = os.path.abspath(getattr(args, side))
        env = dict(os.environ, PYTHONPATH=repo, BENCH_REPO=here)
        if side == "new" and args.new_weights:
            env["BENCH_WEIGHTS"] = args.new_weights
        workers[side] = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--worker", "--old", "-",
             "--max-new-tokens", str(args.max_new_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=repo)
    for side, w in workers.items():
        assert json.loads(w.stdout.readline())["ready"], side
    walls = {c: {"old": [], "new": []} for c in CONFIGS}
    same = {c: True for c in CONFIGS}
    plain_tokens = {}
    busy0, own0, t0 = _busy(), sum(_proc_cpu(w.pid) for w in workers.values()), time.time()
    for r in range(args.rounds):
        for i, c in enumerate(CONFIGS):
            order = ("old", "new") if (r + i) % 2 == 0 else ("new", "old")
            got = {}
            for side in order:
                workers[side].stdin.write(c + "\n")
                workers[side].stdin.flush()
                res = json.loads(workers[side].stdout.readline())
                walls[c][side].append(res["wall"])
                got[side] = res["tokens"]
            same[c] &= got["old"] == got["new"]
            if c == "plain":
                plain_tokens = got["old"]
            elif got["new"] != plain_tokens:
                same[c] = False
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    elapsed = time.time() - t0
    foreign = max(0.0, (_busy() - busy0) - (sum(_proc_cpu(w.pid) for w in workers.values()) - own0))
    for w in workers.values():
        w.stdin.close()
        w.wait()
    rows = {}
    for c, sides in walls.items():
        ratio = [n / o for n, o in zip(sides["new"], sides["old"])]
        rows[c] = {"new_over_old_wall": {"median": statistics.median(ratio), "min": min(ratio),
                                         "max": max(ratio), "rounds": len(ratio)},
                   "old_wall_median_s": statistics.median(sides["old"]),
                   "new_wall_median_s": statistics.median(sides["new"]),
                   "same_tokens_and_equal_to_plain": same[c]}
        print(f"{c:12s} new/old wall {rows[c]['new_over_old_wall']['median']:.3f} "
              f"[{min(ratio):.3f}, {max(ratio):.3f}]  same tokens: {same[c]}")
    cpus = os.cpu_count() or 1
    result = {"command": " ".join(["python"] + sys.argv), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "old_commit": _git(args.old, "rev-parse", "HEAD"), "new_commit": _git(args.new, "rev-parse", "HEAD"),
              "new_dirty": bool(_git(args.new, "status", "--porcelain", "--untracked-files=no")),
              "python": sys.version.split()[0], "cpu_count": cpus, "loadavg": os.getloadavg(),
              "foreign_cpu_share": foreign / (elapsed * cpus), "max_new_tokens": args.max_new_tokens, "new_weights": args.new_weights,
              "prompts": list(PROMPTS), "rows": rows}
    print(f"foreign CPU share over the timed rounds: {result['foreign_cpu_share']:.1%}")
    if args.out:
        # (imported here: the workers import the checkout under test, which may predate it)
        from specjax.provenance import with_provenance  # noqa: PLC0415
        with open(args.out, "w") as f:
            json.dump(with_provenance(result), f, indent=2)


if __name__ == "__main__":
    main()
