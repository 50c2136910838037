"""The engine's configuration (``EngineConfig``), per-request settings (``RequestParams``) and
the draft-length-by-batch-size table, validated before an engine is built."""

from __future__ import annotations

import dataclasses
import numbers

from specjax.config import SpecConfig

SCHEDULES = ("sync", "async")


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """Per-request generation settings.

    max_tokens: >= 1 tokens to generate (fewer if a stop token comes first; it is included).
    temperature, top_k, top_p: as ``sj.generate`` (0 = greedy; top_k 0 / top_p 1.0 = off).
    seed: int in [-2**31, 2**31) for a reproducible stream, None for one drawn by the engine.
    stop_token_ids: ids that end the request; None = the model's EOS ids; () = never stop early.
    constraint: a ``specjax.structured.Constraint`` the output must match (structured outputs;
      the engine needs a tokenizer), or None. The request also ends when its grammar does.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple | None = None
    constraint: object = None


def parse_spec_tokens_per_batch_size(text: str) -> tuple:
    """Parses ``specjax serve --num-speculative-tokens-per-batch-size`` (a JSON list like vLLM's
    ``[[1, 8, 3], [9, 16, 1], [17, 64, 0]]``: batch sizes lo..hi draft k tokens, 0 = plain) into
    EngineConfig's ``num_speculative_tokens_per_batch_size``; the Engine validates the ranges."""
    import json  # noqa: PLC0415

    if not isinstance(text, str):
        raise TypeError(f"spec tokens per batch size must be a JSON string, got {text!r}")
    try:
        table = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"spec tokens per batch size is not JSON: {e}") from None
    if not isinstance(table, list) or not all(
            isinstance(r, list) and len(r) == 3 and all(_is_int(x) for x in r) for r in table):
        raise ValueError(f"spec tokens per batch size must be a list of [lo, hi, k] int "
                         f"triples, got {text!r}")
    return tuple(tuple(r) for r in table)


def check_spec_table(table, max_slots: int, num_draft_tokens: int) -> tuple:
    """Validates ``num_speculative_tokens_per_batch_size``: [lo, hi, k] int rows, sorted, without
    gaps or overlaps, covering batch sizes 1..max_slots, 0 <= k <= num_draft_tokens."""
    name = "num_speculative_tokens_per_batch_size"
    try:
        rows = tuple(tuple(r) for r in table)
    except TypeError:
        raise TypeError(f"{name} must be a sequence of (lo, hi, k), got {table!r}") from None
    if not rows or not all(len(r) == 3 and all(_is_int(x) for x in r) for r in rows):
        raise ValueError(f"{name} must be non-empty (lo, hi, k) int triples, got {table!r}")
    expect = 1
    for lo, hi, k in rows:
        if lo != expect or hi < lo:
            raise ValueError(f"{name}: ranges must start at 1 and follow each other without "
                             f"gaps or overlaps (lo <= hi), got {table!r}")
        if not 0 <= k <= num_draft_tokens:
            raise ValueError(f"{name}: k = {k} outside 0..num_draft_tokens ({num_draft_tokens})")
        expect = hi + 1
    if expect <= max_slots:
        raise ValueError(f"{name} covers batch sizes up to {expect - 1}, not max_slots "
                         f"{max_slots}")
    return tuple((int(lo), int(hi), int(k)) for lo, hi, k in rows)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Static engine settings.

    spec: how steps speculate (``specjax.SpecConfig``: method, k, draft sampling, tree, attention
      implementation, page size, ...), the same config ``sj.generate(spec=...)`` takes.
    max_slots: S, requests resident at once (= the largest batch bucket).
    batch_buckets: static batch sizes a step is padded to (default: powers of two up to S, and S).
    token_buckets: static prefill-chunk widths T (prompts longer than the largest are chunked).
    max_prefill_tokens: prefill tokens per step (None: no limit beyond slots and buckets).
    max_model_len: prompt + max_tokens limit per request.
    num_pages: KV pages shared by target and draft (default: S full-length sequences, so no
      preemption); at least one full-length sequence.
    schedule: "sync" or "async" (module docstring); None = "sync" for "draft", else "async".
    spec_max_batch: speculate only while the decode batch has at most this many rows; larger
      batches decode plainly (None = always speculate).
    seed: seeds the streams of requests submitted without one.
    record_timeline: keep per-step host/device timestamps in ``Engine.timeline``.
    num_speculative_tokens_per_batch_size: vLLM's table ``((lo, hi, k), ...)``: a speculative
      step of a decode batch of lo..hi rows drafts k tokens (0 = a plain step); one compiled
      step variant per (batch bucket, k). Chain methods without ``spec.adaptive`` only; ranges
      cover 1..max_slots, 0 <= k <= ``spec.num_draft_tokens`` (``check_spec_table``; a JSON
      string parses with ``parse_spec_tokens_per_batch_size``). None = always ``k``.
    enable_prefix_caching: reuse the KV pages of full prompt pages across requests
      (``specjax.engine.allocator``: hash chain over page contents, reference counts, an LRU of
      free cached pages); a request's prefill starts at its first uncached token, and at least
      its last prompt token is always prefilled (the drafter's carried per-slot state). With a
      head drafter a cached page also depends on the token after it (the head's KV at the page's
      last position consumes it). Off by default (see the report in the issue: not yet run
      against the whole suite). With "ngram" the slot's token history gets the cached prefix's
      tokens before its first prefill chunk (drafts as if it had been prefilled).
    window_page_release: with a target that has sliding-window layers (Gemma 3), give those
      layers their own page pool and hand back each request's pages that fall out of every
      future query's window (``specjax.engine.kv_groups``; the draft's KV follows the same
      tables; with prefix caching a hit needs the sliding copies of its last window's pages,
      kv_groups' rule). No effect on other families.
    num_window_pages: the sliding layers' pool size with window page release (default:
      max_slots times one request's bound, ``kv_groups.bound_per_slot``).
    With ``spec.method == "ngram"`` no draft is needed (each slot keeps its token history on
    device); with ``spec.adaptive`` every speculative step picks k on device, from a cost model
    measured for each batch bucket at ``warmup()`` (speculation fades out as batches become
    compute-bound).
    """

    spec: SpecConfig = SpecConfig()
    max_slots: int = 8
    batch_buckets: tuple | None = None
    token_buckets: tuple = (16, 64)
    max_prefill_tokens: int | None = None
    max_model_len: int = 512
    num_pages: int | None = None
    schedule: str | None = None
    spec_max_batch: int | None = None
    seed: int = 0
    record_timeline: bool = False
    enable_prefix_caching: bool = False
    num_speculative_tokens_per_batch_size: tuple | None = None
    window_page_release: bool = True
    num_window_pages: int | None = None


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _int_tuple(name: str, value) -> tuple:
    """``value`` (a sequence of ints) as a sorted tuple without repeats; TypeError otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)) \
            or not all(_is_int(x) for x in value):
        raise TypeError(f"EngineConfig.{name} must be a tuple of ints, got {value!r}")
    return tuple(sorted({int(x) for x in value}))


def resolve(cfg: EngineConfig, target_cfg) -> tuple[str, tuple, tuple]:
    """Checks ``cfg`` for a target of config ``target_cfg``; returns (schedule, batch buckets,
    token buckets) with the defaults filled in (batch buckets: powers of two up to max_slots).
    Raises TypeError / ValueError naming the field."""
    if not isinstance(cfg.spec, SpecConfig):
        raise TypeError(f"EngineConfig.spec must be a specjax.SpecConfig, got "
                        f"{type(cfg.spec).__name__}")
    spec = cfg.spec
    if not _is_int(cfg.max_slots) or cfg.max_slots < 1:
        raise ValueError(f"max_slots must be an int >= 1, got {cfg.max_slots!r}")
    schedule = cfg.schedule or ("sync" if spec.method == "draft" else "async")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {cfg.schedule!r}")
    if not _is_int(cfg.max_model_len) or not 2 <= cfg.max_model_len <= \
            target_cfg.max_position_embeddings:
        raise ValueError(f"max_model_len must be an int in [2, "
                         f"{target_cfg.max_position_embeddings}], got {cfg.max_model_len!r}")
    batch_buckets = cfg.batch_buckets
    if batch_buckets is None:
        batch_buckets = tuple(sorted({min(2 ** i, cfg.max_slots)
                                      for i in range(cfg.max_slots.bit_length() + 1)}))
    batch_buckets = _int_tuple("batch_buckets", batch_buckets)
    token_buckets = _int_tuple("token_buckets", cfg.token_buckets)
    if not batch_buckets or batch_buckets[-1] != cfg.max_slots or batch_buckets[0] < 1:
        raise ValueError(f"batch_buckets {batch_buckets} must be >= 1 and end at max_slots "
                         f"{cfg.max_slots}")
    if not token_buckets or token_buckets[0] < 1:
        raise ValueError(f"token_buckets must be positive ints, got {cfg.token_buckets}")
    if not _is_int(cfg.seed) or not 0 <= cfg.seed < 2**63:
        raise ValueError(f"EngineConfig.seed must be an int in [0, 2**63), got {cfg.seed!r}")
    if not isinstance(cfg.record_timeline, bool):
        raise TypeError(f"EngineConfig.record_timeline must be a bool, got {cfg.record_timeline!r}")
    if not isinstance(cfg.window_page_release, bool):
        raise TypeError(f"EngineConfig.window_page_release must be a bool, got "
                        f"{cfg.window_page_release!r}")
    for name in ("spec_max_batch", "max_prefill_tokens", "num_pages", "num_window_pages"):
        value = getattr(cfg, name)
        if value is not None and (not _is_int(value) or value < (0 if name == "spec_max_batch" else 1)):
            raise ValueError(f"{name} must be None or a positive int, got {value!r}")
    return schedule, batch_buckets, token_buckets
