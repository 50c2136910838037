"""``specjax serve``: the OpenAI-compatible HTTP server (specjax.serve) over the engine."""

from __future__ import annotations

import time

from specjax.cli import _common as C
from specjax.engine import Engine


def add_parser(sub) -> None:
    sv = sub.add_parser(
        "serve", help="OpenAI-compatible HTTP server (completions, chat, streaming, /metrics)",
        description="Serves the model over the continuous-batching engine: POST /v1/completions "
                    "and /v1/chat/completions (stream or not), GET /v1/models, /health, /metrics "
                    "(Prometheus, vLLM names), /stats. Speculation as for generate (every "
                    "method and option). Needs the 'serve' extra.")
    C.add_model_flags(sv)
    C.add_spec_flags(sv)
    sv.add_argument("--host", default="127.0.0.1")
    sv.add_argument("--port", type=_int_in(0, 65535), default=8000)
    sv.add_argument("--served-model-name", default=None, help="model id (default: --model)")
    sv.add_argument("--max-slots", type=_int_in(1), default=8, help="requests decoded at once")
    sv.add_argument("--max-queue", type=_int_in(0), default=64,
                    help="requests waiting beyond the slots before HTTP 503")
    sv.add_argument("--max-model-len", type=_int_in(2), default=2048,
                    help="prompt + output tokens")
    sv.add_argument("--num-pages", type=_int_in(1), default=None,
                    help="KV pages (default: max-slots full-length sequences)")
    sv.add_argument("--batch-buckets", type=_ints, default=None, metavar="B1,B2,..",
                    help="static batch sizes (default: powers of two up to --max-slots)")
    sv.add_argument("--token-buckets", type=_ints, default="16,64", metavar="T1,T2,..",
                    help="prefill chunk widths (default: %(default)s)")
    sv.add_argument("--enable-prefix-caching", action="store_true",
                    help="share full KV pages of repeated prompt prefixes across requests "
                         "(content-hashed, reference-counted, LRU-evicted; vLLM's flag)")
    sv.add_argument("--num-speculative-tokens-per-batch-size", type=_k_table, default=None,
                    metavar="JSON", help="draft length by batch size, vLLM's table: e.g. "
                    "'[[1, 4, 3], [5, 8, 1]]' (batch sizes lo..hi draft k; 0 = plain); rows cover "
                    "1..--max-slots, k <= -k")
    sv.add_argument("--seed", type=int, default=0, help="seeds requests sent without a seed")
    sv.add_argument("--no-warmup", dest="warmup", action="store_false",
                    help="do not compile every step variant before serving")
    sv.add_argument("--warmup-structured", action="store_true",
                    help="also compile the grammar-masked twin of every step variant, so the "
                         "first structured-output request compiles nothing (doubles warm-up; "
                         "not with --no-warmup)")
    sv.add_argument("--log-level", default="info", help="uvicorn log level")
    sv.set_defaults(run=run)


def _k_table(text: str):
    import argparse  # noqa: PLC0415

    from specjax.engine.config import parse_spec_tokens_per_batch_size  # noqa: PLC0415
    try:
        return parse_spec_tokens_per_batch_size(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ints(text):
    """A comma-separated list of positive ints (argparse type: a bad one is a usage error);
    None and an already parsed tuple pass through."""
    import argparse  # noqa: PLC0415

    if text is None or isinstance(text, tuple):
        return text
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"must be comma-separated positive ints, got {text!r}")
    return values


def _int_in(lo: int, hi: int | None = None):
    """An argparse type: an int in [lo, hi] (hi None: no upper bound)."""
    import argparse  # noqa: PLC0415

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < lo or (hi is not None and value > hi):
            raise argparse.ArgumentTypeError(
                f"must be an int {'in [%d, %d]' % (lo, hi) if hi is not None else '>= %d' % lo}, "
                f"got {text!r}")
        return value
    return parse


def run(args) -> int:
    from specjax.serve import app as serve_app  # noqa: PLC0415 - fastapi/uvicorn: the serve extra

    loaded = C.load(args)  # flags are checked before anything is loaded
    spec = loaded.spec
    config = serve_app.make_engine_config(
        **loaded.options, recommended=loaded.rec, max_slots=args.max_slots,
        max_model_len=args.max_model_len, num_pages=args.num_pages,
        batch_buckets=_ints(args.batch_buckets), token_buckets=_ints(args.token_buckets),
        seed=args.seed, enable_prefix_caching=args.enable_prefix_caching,
        num_speculative_tokens_per_batch_size=args.num_speculative_tokens_per_batch_size)
    engine = Engine(loaded.target, loaded.draft, config, tokenizer=loaded.tok)
    serve_app.compile_counter()  # count from here: /health reports warm-up compiles too
    if args.warmup:
        t0 = time.perf_counter()
        n = engine.warmup(structured=args.warmup_structured)
        twins = " and their masked twins" if args.warmup_structured else ""
        C.log(f"compiled {n} step variants{twins} in {time.perf_counter() - t0:.1f}s")
    name = args.served_model_name or args.model
    C.log(f"serving {name!r} (method {spec.method}, {C.describe(spec)}, draft "
          f"{loaded.draft_name}) on http://{args.host}:{args.port}/v1")
    serve_app.serve(engine, loaded.tok, model_name=name, host=args.host, port=args.port,
                    max_queue=args.max_queue, log_level=args.log_level)
    return 0
