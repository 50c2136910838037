"""``specjax demo``: SmolLM2 + the recommended draft on three chat prompts (a base model without
a chat template, e.g. ``--model gemma3-270m``: three continuations): the answers, acceptance per
draft position, tokens/s and the speedup of fixed-k and adaptive speculation."""

from __future__ import annotations

import dataclasses

import specjax as sj
from specjax import timing
from specjax.api import merge_outputs
from specjax.cli import _common as C
from specjax.cli.generate import sample_kwargs
from specjax.config import METHODS, SpecConfig

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
)
# for a base model (its tokenizer has no chat template, e.g. gemma3-270m): continuations
CONTINUATION_PROMPTS = (
    "The capital of France is",
    "The sea at night was",
    "The sky is blue because",
)
MODEL_DRAFTERS = ("draft", "mtp", "eagle", "eagle3")


def add_parser(sub) -> None:
    demo = sub.add_parser(
        "demo", help="SmolLM2 + shipped draft on chat prompts: answers, acceptance, speedup",
        description="Runs plain, speculative and adaptive decoding on three chat prompts (batch "
                    "1: one call per prompt; each setting compiled by a warm-up run, then timed "
                    "in --rounds interleaved rounds) and prints the answers, acceptance per draft "
                    "position, tokens/s and the speedup as median [min..max] with the other "
                    "processes' CPU use.")
    C.add_model_flags(demo)
    # (a DFlash drafter has no adaptive run yet: demo it with `specjax generate --draft DIR`)
    C.add_spec_flags(demo, methods=[m for m in METHODS if m not in ("none", "custom", "dflash", "peagle")])
    C.add_sampling_flags(demo)
    demo.add_argument("--rounds", type=int, default=5,
                      help="timed rounds, interleaved plain / speculative / adaptive (default 5)")
    demo.set_defaults(run=run)


def adaptive_spec(spec: SpecConfig, draft) -> SpecConfig:
    """The adaptive counterpart of ``spec``: k chosen per step in 0..max(k, 3), by --adaptive's
    signal or else confidence for a model drafter (history for n-gram); a tree's head drafts the
    adaptive chain of its own kind (adaptive k is a chain length)."""
    method = draft.config.kind if spec.method == "eagle-tree" else spec.method
    signal = spec.adaptive_by if spec.adaptive else (
        "confidence" if method in MODEL_DRAFTERS else "history")
    return dataclasses.replace(spec, method=method, tree=None, adaptive=True, adaptive_by=signal,
                               num_draft_tokens=max(spec.k, 3))


def run(args) -> int:
    if args.rounds < 1:
        raise SystemExit(f"specjax demo: --rounds must be >= 1, got {args.rounds}")
    loaded = C.load(args)
    target, tok, draft, spec = loaded.target, loaded.tok, loaded.draft, loaded.spec
    texts, prompts = C.encode_prompts(tok, DEMO_PROMPTS, CONTINUATION_PROMPTS)
    specs = {"plain": SpecConfig(attn_impl=spec.attn_impl, page_size=spec.page_size),
             "speculative": spec, "adaptive": adaptive_spec(spec, draft)}
    sample = sample_kwargs(args)
    # plain, fixed k and adaptive: a warm-up (compile) each, then interleaved timed rounds
    with C.bar(3 * (1 + args.rounds), "demo", args.progress) as bar:
        def runner(name):
            def run_once():  # each prompt its own call (batch 1, as a chat user would), merged
                bar.set_postfix_str(name)
                d = None if name == "plain" else draft
                out = merge_outputs([sj.generate(target, [p], draft=d, spec=specs[name], **sample)
                                     for p in prompts])
                bar.update(1)
                return out
            return run_once
        timed = timing.interleaved_rounds({n: runner(n) for n in specs}, rounds=args.rounds)
    plain, spec_out, adapt = (timed[n]["result"] for n in specs)
    speedup = {n: timing.paired_speedup(timed["plain"]["wall_s"], timed[n]["wall_s"])
               for n in ("speculative", "adaptive")}
    tps = {n: timing.spread([timed[n]["result"].stats["generated_tokens"] / w
                             for w in timed[n]["wall_s"]]) for n in specs}
    foreign = timing.max_foreign(*timed.values())
    tinfo = {"rounds": args.rounds, "tokens_per_second": tps, "speedup": speedup,
             "max_foreign_cpu": foreign,
             "note": "interleaved rounds after one warm-up each (compilation excluded); "
                     "median, min, max over rounds"}
    same = plain.tokens == spec_out.tokens
    if args.json == "-":
        C.write_json({"answers": [tok.decode(t).strip() for t in spec_out.tokens],
                      "prompts": list(texts), "plain": plain.stats,
                      "speculative": spec_out.stats, "adaptive": adapt.stats, "identical": same,
                      "adaptive_identical": plain.tokens == adapt.tokens,
                      "draft": loaded.draft_name, "speedup": speedup["speculative"]["median"],
                      "timing": tinfo}, "-")
        return 0

    def fmt(x, unit=""):
        return f"{x['median']:.2f}{unit} [{x['min']:.2f}..{x['max']:.2f}]"

    for q, toks in zip(texts, spec_out.tokens):
        print(f"\n### {q}\n{tok.decode(toks).strip()}")
    s = spec_out.stats
    print(f"\n--- speculative decoding (method {spec.method}, draft {loaded.draft_name}, "
          f"{C.describe(spec)}, temperature {args.temperature:.2g}) ---")
    rec = loaded.rec
    if rec:
        med = rec.get("speedup", {}).get("median")
        print(f"settings: the fastest measured on this backend (checkpoints/fastest.json: "
              f"{rec.get('prompt_set', '?')} prompts, batch 1, "
              f"{'?' if med is None else f'{med:.2f}x'} over plain, {rec.get('date', '?')})")
    print(f"outputs identical to plain decoding: {same}")
    print(f"acceptance rate            {s['acceptance_rate']:.3f}")
    print(f"mean accepted length       {s['mean_accepted_length']:.2f} tokens / target step")
    print("acceptance per position    " + " ".join(f"{x:.2f}" for x in s["per_position_acceptance"]))
    print(f"plain tokens/s             {fmt(tps['plain'])}")
    print(f"speculative tokens/s       {fmt(tps['speculative'])}")
    print(f"speedup                    {fmt(speedup['speculative'], 'x')}")
    a, aspec = adapt.stats, specs["adaptive"]
    print(f"\n--- adaptive speculation (method {aspec.method}, k chosen on device each step in "
          f"0..{aspec.k}, by {aspec.adaptive_by}) ---")
    print(f"outputs identical to plain decoding: {plain.tokens == adapt.tokens}")
    print("steps per chosen k         " + "  ".join(f"k={i}: {c}" for i, c in
                                                    enumerate(a["k_histogram"])))
    print(f"mean accepted length       {a['mean_accepted_length']:.2f} tokens / target step")
    print(f"adaptive tokens/s          {fmt(tps['adaptive'])}")
    print(f"speedup                    {fmt(speedup['adaptive'], 'x')}")
    load = "unknown" if foreign is None else f"{100 * foreign:.0f}%"
    print(f"\ntimes: median [min..max] of {args.rounds} interleaved rounds after a warm-up each; "
          f"largest CPU share used by other processes during a timed run: {load}"
          + (" (a busy machine: the speedups are not meaningful)" if foreign and foreign > 0.1 else ""))
    if args.json:
        C.write_json({"plain": plain.stats, "speculative": s, "adaptive": a, "identical": same,
                      "draft": loaded.draft_name, "timing": tinfo}, args.json)
    return 0
