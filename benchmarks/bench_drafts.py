"""Shipped drafts for SmolLM2 side by side: mean accepted length and speedup over plain decoding.

Every draft (MTP / EAGLE heads, draft LLMs) runs on the same held-out chat prompts (never trained
on), temperature 0, batch 1 (each prompt its own call, as a chat user would), at each k. Timing
(specjax.timing.interleaved_rounds): one warm-up pass per configuration, then ``--rounds`` rounds;
a pass runs every prompt once, and each round runs plain decoding and every configuration in
alternating order, so load drift hits all alike. Speedup = plain pass wall time / speculative pass
wall time per round: the median and the [min, max] over rounds are reported, with the largest
share of the CPUs other processes used during any timed pass ("foreign CPU"). Every speculative
output is checked token for token against plain greedy.

  python benchmarks/bench_drafts.py --drafts checkpoints/smollm2-mtp,checkpoints/smollm2-draft
  python benchmarks/bench_drafts.py --ks 1,3 --prompts 16 --max-new-tokens 96 --rounds 3
  python benchmarks/bench_drafts.py --prompt-set broad --prompts 2 --ks 1,2 --trees 3,2,4 --hybrid-min 2

Prompt sets: ``chat`` = held-out wiki chat prompts (``chat_prompts("held_out")``, the first
``--prompts``); ``broad`` = held-out prompts of every domain of ``specjax.train.prompts``
(``--prompts`` per domain); ``demo`` = the demo's prompts (``specjax.cli.DEMO_PROMPTS``), each its
own call. ``--trees`` adds EAGLE-2 dynamic trees (heads only), ``--hybrid-min`` adds n-gram
hybrid chains (an n-gram match of at least that many tokens replaces the head's draft),
``--confident K,..`` adds adaptive chains whose k in 0..K follows each step's draft confidence
(rows "conf K", ``adaptive_by="confidence"``), ``--hybrid-only`` keeps only the hybrid rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import jax

import specjax as sj
from specjax import timing
from specjax import shipped
from specjax.api import merge_outputs
from specjax.heads import Head
from specjax.train.corpora import chat_prompts
from specjax.tree import TreeConfig




def _prompts(tok, prompt_set: str, n: int) -> list[list[int]]:
    """Chat-templated prompt ids of the prompt set (module docstring)."""
    if prompt_set == "chat":
        return [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=n)]
    if prompt_set == "broad":
        from specjax.train.prompts import broad_prompts  # noqa: PLC0415
        return [tok.apply_chat_template(p["messages"])
                for p in broad_prompts("held_out", limit_per_domain=n)]
    from specjax.cli import DEMO_PROMPTS  # noqa: PLC0415
    return [tok.apply_chat_template([{"role": "user", "content": q}]) for q in DEMO_PROMPTS]


def _spec_of_label(label: str) -> dict:
    """The speculation settings of a row label: "K", "K hybrid H", "tree D/T/N", or "conf K"
    / "conf K hybrid H" (adaptive k in 0..K by the drafts' confidence)."""
    parts = str(label).split()
    if parts[0] == "tree":
        depth, top_k, nodes = (int(x) for x in parts[1].split("/"))
        return dict(num_draft_tokens=depth, tree=[depth, top_k, nodes],
                    hybrid_min=0)
    conf = parts[0] == "conf"
    parts = parts[1:] if conf else parts
    out = dict(num_draft_tokens=int(parts[0]), tree=None,
               hybrid_min=int(parts[2]) if len(parts) > 2 and parts[1] == "hybrid" else 0)
    if conf:
        out.update(adaptive=True, adaptive_by="confidence")
    return out


def _trusted(row) -> bool:
    """A row fit for fastest.json: a shipped draft, output identical to plain, foreign CPU <= 10%."""
    return (row["identical_to_plain"] and row["max_foreign_cpu"] is not None
            and row["max_foreign_cpu"] <= 0.10
            and os.path.basename(os.path.normpath(row["draft"])) in dict(shipped.SHIPPED))


def select(results) -> tuple | None:
    """Selection: the configuration with the best median speedup among trustworthy rows
    (``_trusted``). ``results``: one of this script's JSONs, or several (e.g. the chat and the
    demo prompt sets): then only configurations timed in every one count, each scored by its
    worst median over them (a default that holds on every prompt set).

    Returns ``(key, row, per_set, candidates)`` (key = (draft name, method, label); row = the
    key's row of the worst set; per_set = {prompt set: selection median}), or None when no
    configuration qualifies."""
    results = [results] if isinstance(results, dict) else list(results)

    def key(r):
        return os.path.basename(os.path.normpath(r["draft"])), r["method"], r["k"]

    per_set = [{key(r): r for r in res["rows"] if _trusted(r)} for res in results]
    common = set(per_set[0]).intersection(*per_set[1:])
    if not common:
        return None
    best = max(sorted(common), key=lambda c: min(rows[c]["speedup"]["median"] for rows in per_set))
    worst = min(range(len(results)), key=lambda i: per_set[i][best]["speedup"]["median"])
    medians = {res.get("prompt_set", "chat"): rows[best]["speedup"]["median"]
               for res, rows in zip(results, per_set)}
    return best, per_set[worst][best], medians, len(common)


def write_fastest(results, command: str, confirm, backend: str | None = None) -> dict | None:
    """Chooses on ``results`` (``select``), then has ``confirm`` time the chosen configuration
    against plain again, and stores the *confirmed* figure in checkpoints/fastest.json for
    ``backend`` (choose on one run, report from another: the selection run's figures are kept
    only under ``selection``).

    Args:
      results: see ``select``.
      command: the command that produced ``results``.
      confirm: ``confirm(key, row, results) -> dict`` with "speedup" (the worst prompt set's
        {median, min, max, rounds}), "speedup_by_prompt_set", "prompt_set" (the worst),
        "prompts", "max_new_tokens", "max_foreign_cpu", "identical_to_plain",
        "mean_accepted_length", "date", "machine", "command" (``confirm_run`` is the real one).
    Returns the entry written, or None when no configuration qualifies or the confirmation run
    does not (changed output or foreign CPU > 10%)."""
    results = [results] if isinstance(results, dict) else list(results)
    chosen = select(results)
    if chosen is None:
        print("fastest: no configuration qualifies (shipped draft, identical output, foreign CPU "
              "<= 10%, timed in every JSON): nothing written")
        return None
    best, row, medians, candidates = chosen
    conf = confirm(best, row, results)
    if not conf["identical_to_plain"] or conf["max_foreign_cpu"] is None \
            or conf["max_foreign_cpu"] > 0.10:
        print(f"fastest: the confirmation run of {best} does not qualify (identical "
              f"{conf['identical_to_plain']}, foreign CPU {conf['max_foreign_cpu']}): nothing written")
        return None
    entry = dict(draft=best[0], method=row["method"], **_spec_of_label(row["k"]),
                 speedup=conf["speedup"], mean_accepted_length=conf["mean_accepted_length"],
                 beats_plain=conf["speedup"]["median"] > 1.0, prompt_set=conf["prompt_set"],
                 prompts=conf["prompts"], max_new_tokens=conf["max_new_tokens"],
                 max_foreign_cpu=conf["max_foreign_cpu"],
                 speedup_by_prompt_set=conf["speedup_by_prompt_set"],
                 confirmed=dict(median=conf["speedup"]["median"], min=conf["speedup"]["min"],
                                max=conf["speedup"]["max"], rounds=conf["speedup"]["rounds"],
                                date=conf["date"], command=conf["command"]),
                 selection=dict(command=command, candidates=candidates,
                                speedup_by_prompt_set=medians,
                                dates=[r.get("date") for r in results]),
                 date=conf["date"], machine=conf["machine"])
    from specjax.provenance import git  # noqa: PLC0415
    entry.update(git())  # commit, dirty
    path = shipped.write_fastest(entry, backend or jax.default_backend())
    print(f"fastest: {entry['draft']} {row['k']} ({entry['method']}) chosen at "
          f"{min(medians.values()):.2f}x, confirmed {conf['speedup']['median']:.2f}x "
          f"[{conf['speedup']['min']:.2f}, {conf['speedup']['max']:.2f}] (worst prompt set: "
          f"{entry['prompt_set']}) -> {path}")
    return entry


def _load_target():
    return sj.load_model("smollm2-135m"), sj.load_tokenizer("smollm2-135m")


def confirm_run(rounds: int = 5, wait_idle: float = 0.0, target=None, tok=None):
    """The real ``confirm`` of ``write_fastest``: a fresh interleaved run of plain vs the chosen
    configuration on each prompt set of the selection (same prompts and lengths), ``rounds``
    (>= 5) rounds."""
    if rounds < 5:
        raise ValueError(f"confirmation rounds must be >= 5, got {rounds}")

    def confirm(key, row, results):
        nonlocal target, tok
        if target is None:
            target, tok = _load_target()
        path = shipped.path(key[0])  # a shipped draft (select keeps only those)
        d = sj.load_draft(path, target)
        spec = _spec_of_label(row["k"])
        extra = dict(draft=d, method=row["method"], num_draft_tokens=spec["num_draft_tokens"])
        if spec.get("tree"):
            depth, top_k, nodes = spec["tree"]
            extra["tree"] = TreeConfig(depth=depth, top_k=top_k, num_nodes=nodes)
        if spec.get("hybrid_min"):
            extra["hybrid_min"] = spec["hybrid_min"]
        if spec.get("adaptive"):
            extra.update(adaptive=True, adaptive_by=spec["adaptive_by"])
        per, rows = {}, {}
        for res in results:
            name = res.get("prompt_set", "chat")
            prompts = _prompts(tok, name, _per_set_count(res))
            kw = dict(max_new_tokens=res["max_new_tokens"], eos_token_id=[])
            out, _ = time_configs(target, prompts, {(path, row["k"]): (spec["num_draft_tokens"], extra)}, kw,
                                  rounds=rounds, wait_idle=wait_idle)
            rows[name] = out[0]
            per[name] = out[0]["speedup"]
        worst = min(per, key=lambda n: per[n]["median"])
        return dict(speedup=per[worst], speedup_by_prompt_set={n: v["median"] for n, v in per.items()},
                    prompt_set=worst, prompts=rows[worst]["prompts"],
                    max_new_tokens=results[0]["max_new_tokens"],
                    max_foreign_cpu=max((r["max_foreign_cpu"] or 0.0) for r in rows.values())
                    if all(r["max_foreign_cpu"] is not None for r in rows.values()) else None,
                    identical_to_plain=all(r["identical_to_plain"] for r in rows.values()),
                    mean_accepted_length=rows[worst]["mean_accepted_length"],
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    machine=_machine(), command=f"bench_drafts.confirm_run(rounds={rounds})")
    return confirm


def _per_set_count(res) -> int:
    """--prompts of a selection JSON (the broad set counts per domain)."""
    return res.get("prompts_arg", res["prompts"])


def _machine() -> dict:
    return dict(timing.machine_info(), platform=platform.platform(),
                devices=[str(d) for d in jax.devices()])


def time_configs(target, prompts, configs: dict, kw: dict, rounds: int, wait_idle: float = 0.0):
    """Plain decoding and every configuration, interleaved (specjax.timing.interleaved_rounds),
    each pass every prompt once at batch 1. configs: {(draft, label): (k, generate kwargs)}.
    Returns (rows, plain wall times)."""
    def one_pass(extra):
        return [sj.generate(target, [p], **kw, **extra) for p in prompts]

    runs = {"plain": lambda: one_pass({})}
    runs.update({c: (lambda c=c: one_pass(configs[c][1])) for c in configs})
    res = timing.interleaved_rounds(runs, rounds=rounds, wait_idle_s=wait_idle)
    plain = res["plain"]
    want = [o.tokens[0] for o in plain["result"]]
    rows = []
    for (name, label), (_, extra) in configs.items():
        r = res[(name, label)]
        outs = r["result"]
        merged = merge_outputs(outs).stats  # the definitions of stats.acceptance_summary
        rows.append(dict(
            draft=name, method=extra["method"], k=label, prompts=len(prompts),
            mean_accepted_length=merged["mean_accepted_length"],
            acceptance_rate=merged["acceptance_rate"],
            tokens_per_row_step=merged["tokens_per_row_step"],
            speedup=timing.paired_speedup(plain["wall_s"], r["wall_s"]),
            identical_to_plain=[o.tokens[0] for o in outs] == want,
            wall_time_s=r["wall_s"], plain_wall_time_s=plain["wall_s"],
            max_foreign_cpu=timing.max_foreign(plain, r),
            per_position_acceptance=merged["per_position_acceptance"]))
    return rows, plain["wall_s"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--drafts", default=",".join(shipped.path(n) for n, _ in shipped.available()),
                    help="comma-separated draft checkpoints (default: every shipped one)")
    ap.add_argument("--ks", default="1,3")
    ap.add_argument("--prompt-set", choices=("chat", "broad", "demo"), default="chat")
    ap.add_argument("--trees", default="", help="EAGLE-2 trees depth,top_k,nodes separated by ';' "
                    "(heads only), e.g. '3,2,4;4,4,16'")
    ap.add_argument("--confident", default="", metavar="KS",
                    help="also time adaptive k in 0..K by the drafts' confidence "
                         "(adaptive_by='confidence') for these K, e.g. '2,3' (rows 'conf K')")
    ap.add_argument("--hybrid-min", type=int, default=0,
                    help="also time n-gram hybrid chains with this minimum match (0 = none)")
    ap.add_argument("--hybrid-only", action="store_true",
                    help="with --hybrid-min: time only the hybrid rows of --ks / --confident")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--wait-idle", type=float, default=0.0,
                    help="seconds to wait for a quiet machine before each timed pass")
    ap.add_argument("--out", default="benchmarks/results/drafts.json")
    ap.add_argument("--write-fastest", action="store_true",
                    help="store the fastest configuration (identical output, foreign CPU <= 10%%) "
                         "in checkpoints/fastest.json for this backend: the CLI's and demo's "
                         "default (specjax.shipped.fastest)")
    ap.add_argument("--fastest-from", metavar="JSON[,JSON...]", default=None,
                    help="no timing: write checkpoints/fastest.json from earlier --out JSONs "
                         "(several: the configuration whose worst speedup over them is best; "
                         "the command is the one given with --fastest-command)")
    ap.add_argument("--fastest-command", default=None, help="with --fastest-from: the command "
                    "that produced the JSON")
    ap.add_argument("--confirm-rounds", type=int, default=5,
                    help="with --write-fastest / --fastest-from: rounds of the confirmation run "
                         "(plain vs the chosen configuration, timed again after the choice; >= 5)")
    args = ap.parse_args(argv)
    if args.fastest_from:
        results = []
        for name in args.fastest_from.split(","):
            with open(name) as f:
                results.append(json.load(f))
        return 0 if write_fastest(results, args.fastest_command or f"(from {args.fastest_from})",
                                  confirm_run(args.confirm_rounds, args.wait_idle)) else 1
    if not 0 <= args.hybrid_min <= 3:  # the CLI's default ngram_max, which fastest.json assumes
        raise SystemExit(f"--hybrid-min must be in [0, 3], got {args.hybrid_min}")
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    confident = [int(k) for k in args.confident.split(",") if k.strip()]

    target, tok = _load_target()
    drafts = {}
    for path in args.drafts.split(","):
        if os.path.isdir(path):
            drafts[path] = sj.load_draft(path, target)
        else:
            print(f"skipping {path}: not found")
    prompts = _prompts(tok, args.prompt_set, args.prompts)
    kw = dict(max_new_tokens=args.max_new_tokens, eos_token_id=[])
    trees = [tuple(int(x) for x in t.split(",")) for t in args.trees.split(";") if t.strip()]

    configs = {}  # (draft, label) -> (k: drafts verified per step at most, generate kwargs)
    for name, d in drafts.items():
        for k in ks:
            if not args.hybrid_only:
                configs[(name, f"{k}")] = (k, dict(draft=d, method=sj.draft_method(d), num_draft_tokens=k))
            if args.hybrid_min:
                configs[(name, f"{k} hybrid {args.hybrid_min}")] = (
                    k, dict(draft=d, method=sj.draft_method(d), num_draft_tokens=k, hybrid_min=args.hybrid_min))
        for k in confident:  # adaptive k in 0..K by the drafts' confidence
            for hybrid in sorted({args.hybrid_min} if args.hybrid_only else {0, args.hybrid_min}):
                label = f"conf {k}" + (f" hybrid {hybrid}" if hybrid else "")
                configs[(name, label)] = (k, dict(draft=d, method=sj.draft_method(d), num_draft_tokens=k,
                                                  hybrid_min=hybrid, adaptive=True,
                                                  adaptive_by="confidence"))
        for depth, top_k, nodes in (trees if isinstance(d, Head) else []):
            configs[(name, f"tree {depth}/{top_k}/{nodes}")] = (depth, dict(
                draft=d, method="eagle-tree",
                tree=TreeConfig(depth=depth, top_k=top_k, num_nodes=nodes)))

    rows, plain_wall = time_configs(target, prompts, configs, kw, args.rounds, args.wait_idle)
    print(f"\n{len(prompts)} {args.prompt_set} prompts, {args.max_new_tokens} new tokens, greedy, "
          f"batch 1, {args.rounds} interleaved rounds; plain pass median "
          f"{timing.spread(plain_wall)['median']:.1f} s")
    print("| draft | method | k | mean accepted length | speedup over plain (median [min, max]) | "
          "identical to plain | max foreign CPU |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        sp, fc = row["speedup"], row["max_foreign_cpu"]
        print(f"| {row['draft']} | {row['method']} | {row['k']} | {row['mean_accepted_length']:.2f} | "
              f"{sp['median']:.2f}x [{sp['min']:.2f}, {sp['max']:.2f}] | "
              f"{'yes' if row['identical_to_plain'] else 'NO'} | "
              f"{'?' if fc is None else f'{100 * fc:.0f}%'} |")
    result = {"prompt_set": args.prompt_set, "prompts": len(prompts), "prompts_arg": args.prompts,
              "max_new_tokens": args.max_new_tokens, "ks": ks, "rounds": args.rounds,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "plain_wall_time_s": plain_wall, "rows": rows, "machine": _machine()}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    from specjax.provenance import with_provenance  # noqa: PLC0415
    with open(args.out, "w") as f:
        json.dump(with_provenance(result), f, indent=2)
    print(f"wrote {args.out}")
    if args.write_fastest:
        import sys  # noqa: PLC0415

        write_fastest(result, "python benchmarks/bench_drafts.py " + " ".join(
            sys.argv[1:] if argv is None else argv),
            confirm_run(args.confirm_rounds, args.wait_idle, target, tok))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
