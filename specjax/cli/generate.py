"""``specjax generate``: generate from prompts (plain or speculative), optionally streamed."""

from __future__ import annotations

import argparse
import json
import time

import specjax as sj
from specjax.cli import _common as C
from specjax.engine import Engine, EngineConfig, RequestParams


def add_parser(sub) -> None:
    gen = sub.add_parser(
        "generate", help="generate from prompts (plain or speculative), optionally streamed",
        description="Generates for each prompt (batched in one call unless --stream).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="--stream: runs the prompts through the serving engine (specjax.Engine): one "
               "prefill per prompt,\nthen tokens as each step produces them (a speculative step "
               "delivers up to k+1 at once).\nGreedy output matches the batched run up to "
               "floating-point ties; sampled output draws from the\nsame distribution with other "
               "random streams.")
    C.add_model_flags(gen)
    C.add_spec_flags(gen)
    C.add_sampling_flags(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--file", help="a file with one prompt per line")
    gen.add_argument("--no-chat", dest="chat", action="store_false",
                     help="raw text, no chat template")
    gen.add_argument("--stream", action="store_true",
                     help="print text as it is produced, prompt by prompt (see below)")
    gen.add_argument("--warmup", action="store_true",
                     help="compile with a first run and time a second (clean tokens/s)")
    gen.set_defaults(run=run)


def sample_kwargs(args) -> dict:
    """sj.generate's sampling keywords of the flags."""
    return dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed)


def stream_generate(loaded: C.Loaded, prompts, args, write, begin=None):
    """Generates for every prompt through the serving engine, streaming text as it is produced.

    All prompts are submitted to one ``specjax.Engine`` (one prefill per prompt; each step hands
    out its tokens at once, up to k+1 for a speculative step) and printed prompt by prompt:
    ``begin(i)`` is called before prompt i's text, then ``write(text)`` with each new piece
    (serve's ``Detokenizer``: an incomplete UTF-8 sequence is held back). Greedy output equals
    ``sj.generate``'s up to floating-point ties; sampled output draws from the same distribution
    with the engine's streams (seed + i for prompt i).

    Returns (tokens per prompt, stats: the engine's metrics snapshot, compilation included).
    """
    from specjax.serve.app import Detokenizer  # noqa: PLC0415 - app.py imports fastapi (serve extra)

    target = loaded.target
    longest = max(map(len, prompts))
    width = 16  # one prefill chunk holds the longest prompt
    while width < longest:
        width *= 2
    slots = min(len(prompts), 8)
    engine = Engine(target, loaded.draft, EngineConfig(
        loaded.spec, max_slots=slots, batch_buckets=(slots,), token_buckets=(width,),
        max_model_len=min(longest + args.max_new_tokens, target.config.max_position_embeddings),
        seed=args.seed))
    t0 = time.perf_counter()
    handles = [engine.submit(p, RequestParams(
        max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=args.top_p, seed=args.seed + i)) for i, p in enumerate(prompts)]
    outputs = []
    for i, handle in enumerate(handles):
        if begin is not None:
            begin(i)
        text = Detokenizer(loaded.tok)
        for token in handle:  # drives engine.step() until this request has its next tokens
            write(text.add([token], None)[0])
        write(text.add([], "length")[0])  # the held-back tail
        outputs.append(text.ids)
    wall = time.perf_counter() - t0
    stats = dict(engine.stats(), wall_time_s=wall, includes_compilation=True,
                 note="streamed through specjax.Engine: one prefill per prompt, tokens as each "
                      "step produces them")
    return outputs, stats


def run(args) -> int:
    if not args.prompt and not args.file:
        C.log("specjax generate: give --prompt TEXT or --file FILE")
        return 2
    loaded = C.load(args)
    tok = loaded.tok
    texts = list(args.prompt or [])
    if args.file:
        with open(args.file) as f:
            texts += [line.rstrip("\n") for line in f if line.strip()]
    if not texts:
        C.log(f"specjax generate: no prompts in {args.file}")
        return 2
    _, prompts = C.encode_prompts(tok, texts, texts, chat=args.chat)
    if args.stream:
        quiet = bool(args.json)
        begin = (lambda i: None) if quiet else (
            lambda i: print(("\n\n" if i else "") + f"### {texts[i]}", flush=True))
        write = (lambda s: None) if quiet else (lambda s: print(s, end="", flush=True))
        all_tokens, stats = stream_generate(loaded, prompts, args, write, begin)
        if args.json:
            C.write_json({"texts": [tok.decode(t) for t in all_tokens], "tokens": all_tokens,
                          "stats": stats}, args.json)
        else:
            print("\n", flush=True)
            C.log(json.dumps(stats, default=float))
        return 0
    kw = dict(sample_kwargs(args), draft=loaded.draft, spec=loaded.spec)
    with C.bar(1 + args.warmup, "generate", args.progress) as bar:
        if args.warmup:
            bar.set_postfix_str("compiling (warm-up run)")
            sj.generate(loaded.target, prompts, **kw)
            bar.update(1)
        bar.set_postfix_str("timed run" if args.warmup else "compiling + running")
        out = sj.generate(loaded.target, prompts, **kw)
        bar.update(1)
    stats = dict(out.stats, includes_compilation=not args.warmup)
    if args.json:
        C.write_json({"texts": [tok.decode(t) for t in out.tokens], "tokens": out.tokens,
                      "stats": stats}, args.json)
    else:
        for t, toks in zip(texts, out.tokens):
            print(f"### {t}\n{tok.decode(toks).strip()}\n")
        C.log(json.dumps(stats))
    return 0
