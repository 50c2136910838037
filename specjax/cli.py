"""The ``specjax`` command: demo, generate, serve, bench, convert, train-head, train-draft.

Every command takes ``--help``; ``--json`` gives machine-readable output on stdout (or a file);
progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEMO_PROMPTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _bar(total: int, desc: str, enabled: bool = True):
    from tqdm.auto import tqdm  # noqa: PLC0415
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled,
                bar_format="{desc}: {n}/{total} [{elapsed}] {postfix}")


def _write_json(obj, dest: str | None) -> None:
    """dest "-" = stdout, else a file path."""
    text = json.dumps(obj, indent=2, default=float)
    if dest in (None, "-"):
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text + "\n")
        _log(f"wrote {dest}")


def _load(args):
    import specjax as sj  # noqa: PLC0415
    from specjax import shipped  # noqa: PLC0415

    t0 = time.perf_counter()
    target = sj.load_model(args.model)
    tok = sj.load_tokenizer(args.tokenizer or args.model)
    draft, draft_name, rec = None, None, None
    if args.method == "ngram" and not args.draft:
        draft_name = "n-gram lookup (no draft model)"
    elif args.method != "none":
        if args.draft:
            draft, draft_name = sj.load_draft(args.draft, target=target), args.draft
            args.method = args.method or ("draft" if isinstance(draft, sj.Model) else draft.config.kind)
        elif (rec := shipped.recommended(target, args.method)) is not None:
            # the configuration measured fastest on this backend (checkpoints/fastest.json)
            draft = sj.load_draft(shipped.path(rec["draft"]), target=target)
            draft_name, args.method = f"checkpoints/{rec['draft']}", rec["method"]
            _apply_recommended(args, rec)
        else:
            draft, draft_name, args.method = shipped.default_draft(target, args.method)
    if args.k is None:
        args.k = 1 if args.method == "mtp" and not args.adaptive else (3 if args.method == "ngram" else 4)
    args.recommended = rec
    args.draft_name = draft_name
    _log(f"loaded {args.model} ({target.config.num_layers} layers) in "
         f"{time.perf_counter() - t0:.1f}s" + (f"; draft: {draft_name}" if draft_name else ""))
    return target, tok, draft


def _apply_recommended(args, rec: dict) -> None:
    """Fills the settings the user left unset from a measured-fastest entry (shipped.fastest)."""
    if args.k is None and rec.get("num_draft_tokens"):
        args.k = int(rec["num_draft_tokens"])
    if getattr(args, "adaptive", None) is None and rec.get("adaptive"):
        args.adaptive = rec.get("adaptive_by") or "history"
    if args.hybrid_min is None:
        args.hybrid_min = int(rec.get("hybrid_min") or 0)
    if rec.get("tree"):
        for name, value in zip(("tree_depth", "tree_top_k", "tree_nodes"), rec["tree"]):
            if getattr(args, name, None) is None:
                setattr(args, name, int(value))


def _tree_args(parser) -> None:
    """--tree-depth / --tree-top-k / --tree-nodes (method eagle-tree)."""
    parser.add_argument("--tree-depth", type=int, default=None,
                        help="eagle-tree: draft levels (default: measured-fastest tree, else 5)")
    parser.add_argument("--tree-top-k", type=int, default=None,
                        help="eagle-tree: children per expanded node and nodes expanded per "
                             "level (default: measured-fastest tree, else 4)")
    parser.add_argument("--tree-nodes", type=int, default=None,
                        help="eagle-tree: nodes kept, the target verifies nodes + 1 tokens "
                             "(default: measured-fastest tree, else 16)")


TREE_DEFAULTS = dict(tree_depth=5, tree_top_k=4, tree_nodes=16)


def _tree(args, method):
    """The TreeConfig of --tree-* for method "eagle-tree" (None otherwise)."""
    if method != "eagle-tree":
        return None
    from specjax.tree import TreeConfig  # noqa: PLC0415

    depth, top_k, nodes = (getattr(args, n, None) or TREE_DEFAULTS[n]
                           for n in ("tree_depth", "tree_top_k", "tree_nodes"))
    return TreeConfig(depth=depth, top_k=top_k, num_nodes=nodes)


def _spec_kw(args, method, adaptive=None, k=None) -> dict:
    """The n-gram / hybrid / adaptive settings of --ngram-*, --hybrid-min, --adaptive.

    ``adaptive``: None (as --adaptive says), False, or True (adapt by --adaptive's signal, else
    by confidence where the method has a model drafter)."""
    if method == "none":
        return {}
    model_drafter = method in ("draft", "mtp", "eagle", "eagle3")
    signal = args.adaptive or ("confidence" if model_drafter else "history")
    on = bool(args.adaptive) if adaptive is None else adaptive
    on = on and method != "eagle-tree"
    return dict(num_draft_tokens=k or args.k, ngram_min=args.ngram_min, ngram_max=args.ngram_max,
                hybrid_min=(args.hybrid_min or 0) if model_drafter else 0,
                adaptive=on, adaptive_by=signal if on else "history")


def _generate_kwargs(args, draft, method, adaptive=None, k=None) -> dict:
    """The ``sj.generate`` keyword arguments of the command-line settings."""
    kw = dict(max_new_tokens=args.max_new_tokens, draft=draft, method=method,
              num_draft_tokens=args.k, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed, tree=_tree(args, method))
    kw.update(_spec_kw(args, method, adaptive, k))
    return kw


def _run(target, prompts, draft, args, method, warmup: bool = True, bar=None, adaptive=None,
         k=None):
    """One generation; with ``warmup`` a first run compiles so the second is timed cleanly."""
    import specjax as sj  # noqa: PLC0415

    kw = _generate_kwargs(args, draft, method, adaptive, k)
    label = ("plain" if method == "none" else method) + (" adaptive" if kw.get("adaptive") else "")
    if warmup:
        if bar is not None:
            bar.set_postfix_str(f"{label}: compiling (warm-up run)")
        sj.generate(target, prompts, **kw)
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.set_postfix_str(f"{label}: timed run")
    out = sj.generate(target, prompts, **kw)
    if bar is not None:
        bar.update(1)
    return out


def stream_generate(target, tok, prompts, draft, args, method, write, begin=None):
    """Generates for every prompt through the serving engine, streaming text as it is produced.

    All prompts are submitted to one ``specjax.Engine`` (one prefill per prompt; each step hands
    out its tokens at once, up to k+1 for a speculative step) and printed prompt by prompt:
    ``begin(i)`` is called before prompt i's text, then ``write(text)`` with each new piece.
    Greedy output equals ``sj.generate``'s up to floating-point ties; sampled output draws from
    the same distribution with the engine's streams (seed + i for prompt i).

    Returns (tokens per prompt, stats: the engine's metrics snapshot, compilation included).
    """
    from specjax.config import SpecConfig  # noqa: PLC0415
    from specjax.engine import Engine, EngineConfig, RequestParams  # noqa: PLC0415

    longest = max(map(len, prompts))
    width = 16  # one prefill chunk holds the longest prompt
    while width < longest:
        width *= 2
    slots = min(len(prompts), 8)
    engine = Engine(target, draft, EngineConfig(
        SpecConfig(method=method, tree=_tree(args, method),
                   **{"num_draft_tokens": args.k, **_spec_kw(args, method)}),
        max_slots=slots, batch_buckets=(slots,), token_buckets=(width,),
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
        done, printed = [], ""
        for token in handle:  # drives engine.step() until this request has its next tokens
            done.append(token)
            safe = tok.decode(done).rstrip("\ufffd")  # hold back an incomplete UTF-8 sequence
            if safe.startswith(printed) and len(safe) > len(printed):
                write(safe[len(printed):])
                printed = safe
        text = tok.decode(done)
        if text.startswith(printed) and len(text) > len(printed):
            write(text[len(printed):])
        outputs.append(done)
    wall = time.perf_counter() - t0
    stats = dict(engine.stats(), wall_time_s=wall, includes_compilation=True,
                 note="streamed through specjax.Engine: one prefill per prompt, tokens as each "
                      "step produces them")
    return outputs, stats


def cmd_demo(args) -> int:
    import specjax as sj  # noqa: PLC0415
    from specjax import bench  # noqa: PLC0415
    from specjax.api import merge_outputs  # noqa: PLC0415

    if args.rounds < 1:
        raise SystemExit(f"specjax demo: --rounds must be >= 1, got {args.rounds}")
    target, tok, draft = _load(args)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in DEMO_PROMPTS]
    k_adapt = max(args.k, 3)  # adaptive speculation picks k in 0..k_adapt every step
    # adaptive k is a chain length: a tree's head drafts the adaptive chain of its own kind
    adapt_method = draft.config.kind if args.method == "eagle-tree" else args.method
    kws = {"plain": _generate_kwargs(args, None, "none"),
           "speculative": _generate_kwargs(args, draft, args.method),
           "adaptive": _generate_kwargs(args, draft, adapt_method, adaptive=True, k=k_adapt)}
    # plain, fixed k and adaptive: a warm-up (compile) each, then interleaved timed rounds
    with _bar(3 * (1 + args.rounds), "demo", args.progress) as bar:
        def runner(name):
            def run():  # each prompt its own call (batch 1, as a chat user would), merged
                bar.set_postfix_str(name)
                out = merge_outputs([sj.generate(target, [p], **kws[name]) for p in prompts])
                bar.update(1)
                return out
            return run
        timed = bench.interleaved_rounds({n: runner(n) for n in kws}, rounds=args.rounds)
    plain, spec, adapt = (timed[n]["result"] for n in kws)
    speedup = {n: bench.paired_speedup(timed["plain"]["wall_s"], timed[n]["wall_s"])
               for n in ("speculative", "adaptive")}
    tps = {n: bench.spread([timed[n]["result"].stats["generated_tokens"] / w
                            for w in timed[n]["wall_s"]]) for n in kws}
    foreign = bench.max_foreign(*timed.values())
    timing = {"rounds": args.rounds, "tokens_per_second": tps, "speedup": speedup,
              "max_foreign_cpu": foreign,
              "note": "interleaved rounds after one warm-up each (compilation excluded); "
                      "median, min, max over rounds"}
    same = plain.tokens == spec.tokens
    if args.json == "-":
        _write_json({"answers": [tok.decode(t).strip() for t in spec.tokens],
                     "prompts": list(DEMO_PROMPTS), "plain": plain.stats, "speculative": spec.stats,
                     "adaptive": adapt.stats, "identical": same,
                     "adaptive_identical": plain.tokens == adapt.tokens, "draft": args.draft_name,
                     "speedup": speedup["speculative"]["median"], "timing": timing}, "-")
        return 0

    def fmt(x, unit=""):
        return f"{x['median']:.2f}{unit} [{x['min']:.2f}..{x['max']:.2f}]"

    for q, toks in zip(DEMO_PROMPTS, spec.tokens):
        print(f"\n### {q}\n{tok.decode(toks).strip()}")
    s = spec.stats
    tc = kws["speculative"]["tree"]
    shape = (f"tree depth {tc.depth}, top-k {tc.top_k}, {tc.num_nodes} nodes" if tc is not None
             else f"k={args.k}")
    print(f"\n--- speculative decoding (method {args.method}, draft {args.draft_name}, {shape}, "
          f"temperature {args.temperature:.2g}) ---")
    rec = getattr(args, "recommended", None)
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
    a = adapt.stats
    signal = kws["adaptive"].get("adaptive_by", "history")
    print(f"\n--- adaptive speculation (method {adapt_method}, k chosen on device each step in "
          f"0..{k_adapt}, by {signal}) ---")
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
        _write_json({"plain": plain.stats, "speculative": s, "adaptive": a, "identical": same,
                     "draft": args.draft_name, "timing": timing}, args.json)
    return 0


def cmd_generate(args) -> int:
    target, tok, draft = _load(args)
    texts = list(args.prompt or [])
    if args.file:
        with open(args.file) as f:
            texts += [line.rstrip("\n") for line in f if line.strip()]
    if not texts:
        print("specjax generate: give --prompt TEXT or --file FILE", file=sys.stderr)
        return 2
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}]) if args.chat
               else tok.encode(t) for t in texts]
    if args.stream:
        quiet = bool(args.json)
        begin = (lambda i: None) if quiet else (
            lambda i: print(("\n\n" if i else "") + f"### {texts[i]}", flush=True))
        write = (lambda s: None) if quiet else (lambda s: print(s, end="", flush=True))
        all_tokens, stats = stream_generate(target, tok, prompts, draft, args, args.method, write,
                                            begin)
        if args.json:
            _write_json({"texts": [tok.decode(t) for t in all_tokens], "tokens": all_tokens,
                         "stats": stats}, args.json)
        else:
            print("\n", flush=True)
            _log(json.dumps(stats, default=float))
        return 0
    with _bar(1 + args.warmup, "generate", args.progress) as bar:
        out = _run(target, prompts, draft, args, args.method, warmup=args.warmup, bar=bar)
    stats = dict(out.stats, includes_compilation=not args.warmup)
    if args.json:
        _write_json({"texts": [tok.decode(t) for t in out.tokens], "tokens": out.tokens,
                     "stats": stats}, args.json)
    else:
        for t, toks in zip(texts, out.tokens):
            print(f"### {t}\n{tok.decode(toks).strip()}\n")
        _log(json.dumps(stats))
    return 0


def _ints(text: str | None):
    return None if text is None else tuple(int(x) for x in text.split(",") if x.strip())


def cmd_serve(args) -> int:
    from specjax.engine import Engine  # noqa: PLC0415
    from specjax.serve import app as serve_app  # noqa: PLC0415

    if args.adaptive and args.method == "none":  # fail before loading anything
        raise ValueError("--adaptive needs a speculative --method, got 'none'")
    target, tok, draft = _load(args)
    config = serve_app.make_engine_config(
        method=args.method, num_draft_tokens=args.k, adaptive=bool(args.adaptive),
        adaptive_by=args.adaptive or "history",
        tree=_tree(args, args.method), max_slots=args.max_slots, max_model_len=args.max_model_len,
        num_pages=args.num_pages, page_size=args.page_size,
        batch_buckets=_ints(args.batch_buckets), token_buckets=_ints(args.token_buckets),
        attn_impl=args.attn_impl, seed=args.seed)
    engine = Engine(target, draft, config)
    serve_app.compile_counter()  # count from here: /health reports warm-up compiles too
    if args.warmup:
        t0 = time.perf_counter()
        n = engine.warmup()
        _log(f"compiled {n} step variants in {time.perf_counter() - t0:.1f}s")
    name = args.served_model_name or args.model
    _log(f"serving {name!r} (method {args.method}, k={args.k}) on http://{args.host}:{args.port}/v1")
    serve_app.serve(engine, tok, model_name=name, host=args.host, port=args.port,
                    max_queue=args.max_queue, log_level=args.log_level)
    return 0


def cmd_bench(args) -> int:
    from specjax import bench  # noqa: PLC0415

    report = bench.run_from_args(args)
    if args.json:
        _write_json(report, args.json)
    else:
        print(report["table_md"])
        print(bench.summary(report))
    return 0


def cmd_convert(args) -> int:
    import specjax as sj  # noqa: PLC0415
    from specjax.io.checkpoint import save_checkpoint  # noqa: PLC0415
    from specjax.io.hf import save_hf_dir  # noqa: PLC0415

    import jax.numpy as jnp  # noqa: PLC0415

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[args.dtype]
    with _bar(2, "convert", args.progress) as bar:
        bar.set_postfix_str(f"loading {args.src}")
        if args.target:
            target = sj.load_model(args.target)
            model = sj.load_draft(args.src, target=target)
            if not isinstance(model, sj.Model) and args.to == "hf" and model.config.kind != "eagle3":
                raise ValueError(f"{args.src!r} is a {model.config.kind} head, not a model: heads "
                                 "have no transformers model class (see "
                                 "specjax.io.heads_io.save_mtp_deepseek for DeepSeek MTP names; "
                                 "EAGLE-3 heads convert to their reference layout)")
        else:
            model = sj.load_model(args.src, dtype=dtype)
        bar.update(1)
        bar.set_postfix_str(f"writing {args.out}")
        if not isinstance(model, sj.Model):  # a head: EAGLE-3 reference layout or ours
            from specjax.io.heads_io import save_eagle3, save_head  # noqa: PLC0415
            if args.to == "hf":
                if args.dtype == "bfloat16":
                    raise ValueError("--dtype: an EAGLE-3 head is written as float32 or float16")
                save_eagle3(model, args.out, dtype=args.dtype)
            else:
                save_head(model, args.out)
        elif args.to == "hf":
            save_hf_dir(model.params, model.config, args.out)
            _save_hf_tokenizer(args.tokenizer or args.target or args.src, args.out)
        else:
            save_checkpoint(args.out, model.params, model.config, kind="model",
                            extra={"converted_from": args.src})
        bar.update(1)
    import numpy as np  # noqa: PLC0415

    layers = model.config.num_layers if isinstance(model, sj.Model) else 1
    info = {"src": args.src, "out": args.out, "to": args.to, "layers": layers,
            "params": int(sum(int(np.prod(a.shape)) for a in _leaves(model.params)))}
    if args.json:
        _write_json(info, args.json)
    else:
        print(f"wrote {args.out} ({'transformers directory' if args.to == 'hf' else 'specjax checkpoint'}, "
              f"{info['layers']} layers, {info['params'] / 1e6:.1f}M parameters)")
    return 0


def _leaves(tree):
    import jax  # noqa: PLC0415
    return jax.tree.leaves(tree)


def _save_hf_tokenizer(name: str, out: str) -> None:
    """Writes tokenizer.json + tokenizer_config.json next to an exported model, when the source
    has a tokenizer (so transformers' AutoTokenizer loads the directory as well)."""
    import specjax as sj  # noqa: PLC0415

    try:
        tok = sj.load_tokenizer(name)
    except Exception:  # noqa: BLE001 - a draft checkpoint has no tokenizer of its own
        return
    tok.save(out)


def _train_common(p):
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--work", default="data/smollm2", help="corpus, hidden states and run state")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--num-prompts", type=int, default=768, help="self-distilled train answers")
    p.add_argument("--num-wiki", type=int, default=2048, help="wiki extracts framed as answers")
    p.add_argument("--held-out-prompts", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rollout", type=int, default=None,
                   help="heads: training passes fed the head's own previous output (EAGLE-3-style "
                        "training-time test; 1 = teacher-forced only; default 3 for eagle3, else 1)")
    p.add_argument("--loss-on", choices=("answer", "all"), default="answer",
                   help="positions trained and scored: answer tokens only (default) or every "
                        "position including the chat template / system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--run-name", default=None,
                   help="run directory under --work (resumed when it exists; default from the kind)")


def _prepare_training(args):
    import logging  # noqa: PLC0415

    import specjax as sj  # noqa: PLC0415
    from specjax.train import pipeline, trainer  # noqa: PLC0415

    # Stage and resume messages of the training pipeline go to stderr, timestamped.
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    from specjax.heads import default_aux_layers  # noqa: PLC0415

    target = sj.load_model(args.model)
    tok = sj.load_tokenizer(args.model)
    eagle3 = getattr(args, "kind", None) == "eagle3"
    aux = default_aux_layers(target.config.num_layers) if eagle3 else ()
    args.data = None
    if getattr(args, "corpus", None):
        if not args.held_out_corpus:
            raise ValueError("--corpus needs --held-out-corpus (distill --split held_out)")
        # the three EAGLE-3 layers are stored for every head kind (others read the final
        # hidden states, the first E features), so one feature collection serves all kinds
        args.data = pipeline.prepare_broad(target, args.corpus, args.held_out_corpus, args.work,
                                           aux_layers=default_aux_layers(target.config.num_layers),
                                           shards=args.shards)
    else:
        pipeline.prepare(target, tok, args.work, args.num_prompts, args.num_wiki,
                         args.held_out_prompts, args.answer_tokens, args.seq_len, aux_layers=aux)
    rollout = args.rollout if args.rollout is not None else (3 if eagle3 else 1)
    decay = getattr(args, "rollout_decay", None)
    tc = trainer.TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                             lr=args.lr, seed=args.seed, rollout=rollout,
                             rollout_decay=decay if decay is not None else (0.8 if eagle3 else 1.0),
                             answer_only=args.loss_on == "answer")
    return target, tok, tc, pipeline


def _aux_layers_arg(text, kind: str):
    """--aux-layers "2,15,27" -> (2, 15, 27); None when not given. ValueError names the flag."""
    if text is None:
        return None
    if kind != "eagle3":
        raise ValueError(f"--aux-layers is for --kind eagle3, got --kind {kind}")
    try:
        layers = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--aux-layers must be comma-separated layer indices, got {text!r}") from None
    if not layers or any(i < 0 for i in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"--aux-layers must be distinct layer indices >= 0, got {text!r}")
    return layers


def cmd_train_head(args) -> int:
    aux = _aux_layers_arg(args.aux_layers, args.kind)  # bad flags fail before any work
    if args.init_from is not None and not os.path.exists(args.init_from):
        raise ValueError(f"--init-from {args.init_from!r}: no such head checkpoint")
    target, tok, tc, pipeline = _prepare_training(args)
    pipeline.train_head(target, tok, args.work, args.out, args.kind, args.norms == "on", tc,
                        eval_prompts=args.eval_prompts, draft_vocab=args.draft_vocab,
                        run_name=args.run_name, data=args.data,
                        aux_layers=aux, init_from=args.init_from)
    return 0


def cmd_train_draft(args) -> int:
    target, tok, tc, pipeline = _prepare_training(args)
    pipeline.train_draft(target, tok, args.work, args.out, args.layers, tc,
                         eval_prompts=args.eval_prompts, run_name=args.run_name)
    return 0


def _common(p):
    p.add_argument("--model", default="smollm2-135m",
                   help="target: 'smollm2-135m' (built in), a transformers dir, a .gguf or a "
                        "specjax checkpoint (default: %(default)s)")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: same as --model)")
    p.add_argument("--draft", default=None,
                   help="draft path: a draft LLM or MTP/EAGLE head checkpoint, or any model path "
                        "(default: the best shipped draft in checkpoints/: MTP, EAGLE, draft LLM; "
                        "else an untrained early-exit draft)")
    p.add_argument("-k", "--num-draft-tokens", dest="k", type=int, default=None,
                   help="draft length k (default: the measured-fastest k of checkpoints/"
                        "fastest.json when the shipped draft is used; else 1 for MTP heads, 4 "
                        "otherwise, 3 for n-gram)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--adaptive", nargs="?", const="history", default=None,
                   choices=("history", "confidence"),
                   help="pick k in 0..k on device every step (k = 0: a plain step) from the "
                        "recent acceptance ('history', the default) or from each step's drafts "
                        "('confidence': the drafter's calibrated confidence, model drafters "
                        "only), with a cost model measured at warm-up")
    p.add_argument("--ngram-min", type=int, default=1,
                   help="n-gram lookup: shortest suffix match (default: %(default)s)")
    p.add_argument("--ngram-max", type=int, default=3,
                   help="n-gram lookup: longest suffix match (default: %(default)s)")
    p.add_argument("--hybrid-min", type=int, default=None,
                   help="with a draft/head: rows with an n-gram match this long draft by lookup "
                        "(0 = off; default: the measured-fastest setting, else 0)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, nargs="?", const="-", metavar="PATH",
                   help="JSON output on stdout (or to PATH) instead of text")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars on stderr")


EPILOG = """examples:
  specjax demo                                   # SmolLM2 + shipped head: answers, acceptance, speedup
  specjax generate --prompt "Why is the sky blue?" --stream
  specjax generate --file prompts.txt --method draft --draft checkpoints/smollm2-draft -k 3 --json
  specjax generate --prompt "Rewrite: ..." --method ngram -k 3    # prompt lookup, no draft model
  specjax generate --prompt "Why is the sky blue?" --adaptive -k 4  # k chosen per step on device
  specjax serve --port 8000                      # OpenAI-compatible server, SmolLM2 + shipped head
  specjax bench                                  # specjax vs HF transformers, small settings
  specjax convert smollm2-135m out/smollm2 --to hf        # our weights -> transformers dir
  specjax convert checkpoints/smollm2-draft out/draft --to hf --target smollm2-135m
  specjax convert some/hf_dir out/ckpt                   # HF dir or .gguf -> specjax checkpoint
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specjax", epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Speculative decoding in JAX: a draft proposes k tokens, the target verifies "
                    "them in one pass, lossless acceptance keeps the target's distribution.")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    demo = sub.add_parser(
        "demo", help="SmolLM2 + shipped draft on chat prompts: answers, acceptance, speedup",
        description="Runs plain, speculative and adaptive decoding on three chat prompts (batch "
                    "1: one call per prompt; each setting compiled by a warm-up run, then timed "
                    "in --rounds interleaved rounds) and "
                    "prints the answers, acceptance per draft position, tokens/s and the speedup "
                    "as median [min..max] with the other processes' CPU use.")
    _common(demo)
    demo.add_argument("--method", choices=["draft", "mtp", "eagle", "eagle3", "eagle-tree", "ngram"], default=None,
                      help="default: the configuration measured fastest on this backend "
                           "(checkpoints/fastest.json), else the best shipped draft")
    _tree_args(demo)
    demo.add_argument("--rounds", type=int, default=5,
                      help="timed rounds, interleaved plain / speculative / adaptive (default 5)")

    gen = sub.add_parser(
        "generate", help="generate from prompts (plain or speculative), optionally streamed",
        description="Generates for each prompt (batched in one call unless --stream).",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="--stream: runs the prompts through the serving engine (specjax.Engine): one "
               "prefill per prompt,\nthen tokens as each step produces them (a speculative step "
               "delivers up to k+1 at once).\nGreedy output matches the batched run up to "
               "floating-point ties; sampled output draws from the\nsame distribution with other "
               "random streams.")
    _common(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--file", help="a file with one prompt per line")
    gen.add_argument("--method", choices=["none", "draft", "mtp", "eagle", "eagle3", "eagle-tree",
                                          "ngram"],
                     default=None,
                     help="none = plain decoding; eagle-tree = a head drafting an EAGLE-2 "
                          "dynamic tree (--tree-*); ngram = prompt lookup (no draft model, "
                          "--ngram-*); default: the best shipped draft's method")
    _tree_args(gen)
    gen.add_argument("--no-chat", dest="chat", action="store_false",
                     help="raw text, no chat template")
    gen.add_argument("--stream", action="store_true",
                     help="print text as it is produced, prompt by prompt (see below)")
    gen.add_argument("--warmup", action="store_true",
                     help="compile with a first run and time a second (clean tokens/s)")

    sv = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serves the model over the continuous-batching engine: POST /v1/completions "
                    "and /v1/chat/completions (stream or not), GET /v1/models, /health, /metrics "
                    "(Prometheus, vLLM names), /stats. Needs the 'serve' extra.")
    sv.add_argument("--model", default="smollm2-135m", help="target (as for generate)")
    sv.add_argument("--tokenizer", default=None, help="tokenizer (default: same as --model)")
    sv.add_argument("--draft", default=None, help="draft / head checkpoint (default: the best "
                                                  "shipped one; see generate --help)")
    sv.add_argument("--method", choices=["none", "draft", "mtp", "eagle", "eagle-tree"],
                    default=None, help="none = plain decoding; default: the best shipped draft's")
    sv.add_argument("-k", "--num-draft-tokens", dest="k", type=int, default=None,
                    help="draft length k (default: 1 for MTP heads, else 4)")
    sv.add_argument("--adaptive", nargs="?", const="history", default=None,
                    choices=("history", "confidence"),
                    help="pick k in 0..k on device every speculative step from the recent "
                         "acceptance ('history', the default) or each step's drafts "
                         "('confidence'), with a cost model measured per batch bucket at warm-up")
    sv.add_argument("--tree-depth", type=int, default=5)
    sv.add_argument("--tree-top-k", type=int, default=4)
    sv.add_argument("--tree-nodes", type=int, default=16)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=int, default=8000)
    sv.add_argument("--served-model-name", default=None, help="model id (default: --model)")
    sv.add_argument("--max-slots", type=int, default=8, help="requests decoded at once")
    sv.add_argument("--max-queue", type=int, default=64,
                    help="requests waiting beyond the slots before HTTP 503")
    sv.add_argument("--max-model-len", type=int, default=2048, help="prompt + output tokens")
    sv.add_argument("--num-pages", type=int, default=None, help="KV pages (default: max-slots "
                                                                "full-length sequences)")
    sv.add_argument("--page-size", type=int, default=16)
    sv.add_argument("--batch-buckets", default=None, metavar="B1,B2,..",
                    help="static batch sizes (default: powers of two up to --max-slots)")
    sv.add_argument("--token-buckets", default="16,64", metavar="T1,T2,..",
                    help="prefill chunk widths (default: %(default)s)")
    sv.add_argument("--attn-impl", choices=["reference", "pallas"], default="reference")
    sv.add_argument("--seed", type=int, default=0, help="seeds requests sent without a seed")
    sv.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="do not compile every step variant before serving")
    sv.add_argument("--log-level", default="info", help="uvicorn log level")

    from specjax import bench  # noqa: PLC0415
    be = sub.add_parser(
        "bench", help="specjax (plain/draft/MTP/EAGLE) vs HF transformers (plain/assisted/prompt "
                      "lookup), same weights, same run",
        description=bench.__doc__.split("\n\n")[0] + " Small defaults; "
                    "benchmarks/bench_compare.py has the full ones.")
    bench.add_arguments(be, max_new_tokens=32, num_prompts=2, batch=4, repeats=1)

    cv = sub.add_parser(
        "convert", help="HF dir / GGUF / name -> specjax checkpoint, or a model/draft -> HF dir",
        description="--to specjax (default): load SRC (a transformers dir, .gguf, or built-in name) "
                    "and save a specjax checkpoint (orbax). --to hf: save SRC as a transformers "
                    "LlamaForCausalLM directory (float32 safetensors + config.json, plus the "
                    "tokenizer when SRC has one); with --target, SRC is a draft LLM checkpoint "
                    "for that target (its shared embedding and lm_head are filled in), so "
                    "transformers can use it as assistant_model=; an EAGLE-3 head (a "
                    "specjax-trained one or a reference directory) with --target is written in "
                    "the reference EAGLE-3 layout (vLLM / SGLang load it), or as a specjax head "
                    "checkpoint with --to specjax.")
    cv.add_argument("src")
    cv.add_argument("out")
    cv.add_argument("--to", choices=["specjax", "hf"], default="specjax")
    cv.add_argument("--target", default=None, help="the target a draft checkpoint belongs to")
    cv.add_argument("--tokenizer", default=None, help="tokenizer to export with --to hf")
    cv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="parameter dtype of a specjax checkpoint (default: %(default)s)")
    cv.add_argument("--json", default=None, nargs="?", const="-", metavar="PATH")
    cv.add_argument("--no-progress", dest="progress", action="store_false")

    th = sub.add_parser("train-head", help="train an MTP / EAGLE head on self-distilled data "
                                              "(resumable: rerun the same command)")
    _train_common(th)
    th.add_argument("--kind", choices=["mtp", "eagle", "eagle3"], default="mtp",
                    help="eagle3: fused low/mid/high target features, own lm_head over the draft "
                         "vocabulary, trained with the training-time test (--rollout, default 3 "
                         "for eagle3) and saved in the reference EAGLE-3 layout")
    th.add_argument("--rollout-decay", type=float, default=None,
                    help="loss weight of rollout pass r is DECAY**r (default 0.8 for eagle3, else 1)")
    th.add_argument("--draft-vocab", type=int, default=0,
                    help="score only this many of the training answers' most frequent tokens "
                         "(EAGLE-3's reduced draft vocabulary; 0 = the full vocabulary)")
    th.add_argument("--norms", choices=["on", "off"], default="on",
                    help="restored RMSNorms (enorm/hnorm/block/final) on or off (EAGLE-1 style)")
    th.add_argument("--corpus", default=None,
                    help="train on a broad distilled corpus (answers-*.jsonl.gz shards written by "
                         "python -m specjax.train.distill) instead of building the small one")
    th.add_argument("--held-out-corpus", default=None,
                    help="with --corpus: distilled held-out shards (distill --split held_out), "
                         "scored per domain")
    th.add_argument("--shards", type=int, default=None,
                    help="with --corpus: train on the first N shards only (default: all)")
    th.add_argument("--aux-layers", default=None, metavar="I,J,...",
                    help="eagle3: the target layers whose entering hidden states the head fuses "
                         "(default 2, L//2, L-3); any of those and L (the final hidden state), "
                         "e.g. '30' for a last-layer-only head on a 30-layer target")
    th.add_argument("--init-from", default=None, metavar="HEAD",
                    help="start from this head (a checkpoint of the same --kind and features, "
                         "e.g. a teacher-forced run fine-tuned with --rollout 3; its draft "
                         "vocabulary is kept) instead of the target's last layer")
    td = sub.add_parser("train-draft", help="distill a small draft LLM sharing the target's "
                                               "embedding and lm_head (resumable)")
    _train_common(td)
    td.add_argument("--layers", type=int, default=4)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return {"demo": cmd_demo, "generate": cmd_generate, "serve": cmd_serve, "bench": cmd_bench,
                "convert": cmd_convert, "train-head": cmd_train_head,
                "train-draft": cmd_train_draft}[args.cmd](args)
    except (ValueError, TypeError, FileNotFoundError, NotImplementedError) as e:
        print(f"specjax {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
