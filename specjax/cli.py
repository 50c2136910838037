"""The ``specjax`` command: demo, generate, train-head, train-draft."""

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


def _repo_checkpoints() -> str:
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")


SHIPPED = (("smollm2-mtp", "mtp"), ("smollm2-eagle", "eagle"), ("smollm2-draft", "draft"))


def default_draft(target, method: str | None = None, layers: int = 8):
    """The best shipped draft for SmolLM2 (MTP head, EAGLE head, distilled draft LLM, in that
    order; restricted to ``method`` if given), else an untrained early-exit draft.

    Returns (draft, description, method).
    """
    import specjax as sj  # noqa: PLC0415
    from specjax.io.checkpoint import is_checkpoint  # noqa: PLC0415

    if target.source == "smollm2-135m":
        for name, kind in SHIPPED:
            path = os.path.join(_repo_checkpoints(), name)
            if (method in (None, kind)) and is_checkpoint(path):
                return sj.load_draft(path, target=target), f"checkpoints/{name}", kind
    if method in (None, "draft"):
        return sj.early_exit_draft(target, layers), f"early-exit draft (first {layers} layers)", "draft"
    raise ValueError(f"no shipped {method!r} draft for {target.source!r}: pass --draft PATH")


def _load(args):
    import specjax as sj  # noqa: PLC0415

    t0 = time.perf_counter()
    target = sj.load_model(args.model)
    tok = sj.load_tokenizer(args.tokenizer or args.model)
    draft, draft_name = None, None
    if args.method != "none":
        if args.draft:
            draft, draft_name = sj.load_draft(args.draft, target=target), args.draft
            args.method = args.method or ("draft" if isinstance(draft, sj.Model) else draft.config.kind)
        else:
            draft, draft_name, args.method = default_draft(target, args.method)
    if args.k is None:
        args.k = 1 if args.method == "mtp" else 4
    print(f"loaded {args.model} ({target.config.num_layers} layers) in "
          f"{time.perf_counter() - t0:.1f}s" + (f"; draft: {draft_name}" if draft_name else ""),
          file=sys.stderr)
    return target, tok, draft


def _run(target, prompts, draft, args, method):
    """Compiles once (warm-up), then times a second run."""
    import specjax as sj  # noqa: PLC0415

    kw = dict(max_new_tokens=args.max_new_tokens, draft=draft, method=method,
              num_draft_tokens=args.k, temperature=args.temperature, top_k=args.top_k,
              top_p=args.top_p, seed=args.seed)
    sj.generate(target, prompts, **kw)
    return sj.generate(target, prompts, **kw)


def cmd_demo(args) -> int:
    target, tok, draft = _load(args)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in DEMO_PROMPTS]
    print("compiling and running (plain, then speculative)...", file=sys.stderr)
    plain = _run(target, prompts, None, args, "none")
    spec = _run(target, prompts, draft, args, args.method)
    same = plain.tokens == spec.tokens
    for q, toks in zip(DEMO_PROMPTS, spec.tokens):
        print(f"\n### {q}\n{tok.decode(toks).strip()}")
    s, p = spec.stats, plain.stats
    print(f"\n--- speculative decoding (method {args.method}, k={args.k}, temperature "
          f"{args.temperature:.2g}) ---")
    print(f"outputs identical to plain decoding: {same}")
    print(f"acceptance rate            {s['acceptance_rate']:.3f}")
    print(f"mean accepted length       {s['mean_accepted_length']:.2f} tokens / target step")
    print("acceptance per position    " + " ".join(f"{x:.2f}" for x in s["per_position_acceptance"]))
    print(f"plain tokens/s             {p['tokens_per_second']:.1f}")
    print(f"speculative tokens/s       {s['tokens_per_second']:.1f}")
    print(f"speedup                    {s['tokens_per_second'] / p['tokens_per_second']:.2f}x")
    print(f"host syncs per generation  {s['host_syncs']}")
    if args.json:
        json.dump({"plain": p, "speculative": s, "identical": same}, open(args.json, "w"), indent=2)
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
    out = _run(target, prompts, draft, args, args.method)
    if args.json:
        print(json.dumps({"texts": [tok.decode(t) for t in out.tokens], "tokens": out.tokens,
                          "stats": out.stats}, indent=2))
    else:
        for t, toks in zip(texts, out.tokens):
            print(f"### {t}\n{tok.decode(toks).strip()}\n")
        print(json.dumps(out.stats), file=sys.stderr)
    return 0


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
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-prompts", type=int, default=8)


def _prepare_training(args):
    import specjax as sj  # noqa: PLC0415
    from specjax.train import pipeline, trainer  # noqa: PLC0415

    target = sj.load_model(args.model)
    tok = sj.load_tokenizer(args.model)
    pipeline.prepare(target, tok, args.work, args.num_prompts, args.num_wiki, args.held_out_prompts,
                     args.answer_tokens, args.seq_len)
    tc = trainer.TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                             lr=args.lr, seed=args.seed)
    return target, tok, tc, pipeline


def cmd_train_head(args) -> int:
    target, tok, tc, pipeline = _prepare_training(args)
    pipeline.train_head(target, tok, args.work, args.out, args.kind, args.norms == "on", tc,
                        eval_prompts=args.eval_prompts)
    return 0


def cmd_train_draft(args) -> int:
    target, tok, tc, pipeline = _prepare_training(args)
    pipeline.train_draft(target, tok, args.work, args.out, args.layers, tc,
                         eval_prompts=args.eval_prompts)
    return 0


def _common(p):
    p.add_argument("--model", default="smollm2-135m", help="model name, HF dir, .gguf or checkpoint")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: same as --model)")
    p.add_argument("--draft", default=None, help="draft model path (default: the shipped draft)")
    p.add_argument("-k", "--num-draft-tokens", dest="k", type=int, default=None,
                   help="draft length (default: 1 for MTP heads, the one-token MTP case; else 4)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, nargs="?", const="-", help="JSON output")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="specjax", description="Speculative decoding in JAX.")
    sub = parser.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="SmolLM2 + draft on chat prompts: answers, acceptance, speedup")
    _common(demo)
    demo.add_argument("--method", choices=["draft", "mtp", "eagle"], default=None,
                      help="default: the best shipped draft (MTP head first)")
    gen = sub.add_parser("generate", help="generate from prompts (plain or speculative)")
    _common(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    gen.add_argument("--file", help="a file with one prompt per line")
    gen.add_argument("--method", choices=["none", "draft", "mtp", "eagle"], default=None,
                     help="default: the best shipped draft's method")
    gen.add_argument("--no-chat", dest="chat", action="store_false", help="raw text, no chat template")
    th = sub.add_parser("train-head", help="train an MTP / EAGLE head on self-distilled data "
                                              "(resumable: rerun the same command)")
    _train_common(th)
    th.add_argument("--kind", choices=["mtp", "eagle"], default="mtp")
    th.add_argument("--norms", choices=["on", "off"], default="on",
                    help="restored RMSNorms (enorm/hnorm/block/final) on or off (EAGLE-1 style)")
    td = sub.add_parser("train-draft", help="distill a small draft LLM sharing the target's "
                                               "embedding and lm_head (resumable)")
    _train_common(td)
    td.add_argument("--layers", type=int, default=4)
    args = parser.parse_args(argv)
    if args.cmd == "demo" and args.json == "-":
        args.json = None
    try:
        return {"demo": cmd_demo, "generate": cmd_generate, "train-head": cmd_train_head,
                "train-draft": cmd_train_draft}[args.cmd](args)
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"specjax {args.cmd}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
