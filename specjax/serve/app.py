"""An OpenAI-compatible HTTP server over ``specjax.engine.Engine`` (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming with
server-sent events and not), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus,
vLLM names: ``specjax.serve.metrics``) and ``GET /stats`` (``Engine.stats()`` as JSON).

Threading: the engine steps in its own background thread (``Engine.start``); request handlers
are coroutines on the event loop and never block it. A handler validates the request, submits
it (``Engine.submit`` only queues) with a callback that the engine thread calls per delivered
token batch; the callback hands the batch to the handler's ``asyncio.Queue`` through
``loop.call_soon_threadsafe``. Detokenization and stop-string matching run on the event loop.
Structured outputs (``response_format``, vLLM's ``structured_outputs`` / ``guided_*``:
``specjax.serve.protocol``) are compiled while the request is validated (xgrammar; an invalid
schema, regex or grammar is a 400 naming the field) and enforced by the engine with
speculation on (``specjax.engine.grammar``).
A client that disconnects aborts its engine request (``Engine.abort``: slot and pages go back at
the next step); a stop string that matches ends it as a success (``Engine.finish_stopped``: a
"stop" finish in ``request_success_total`` and the latency histograms, counting only the tokens
up to the one that completed the stop string, which is also what ``usage`` reports).

Admission: at most ``max_slots + max_queue`` requests are in the server at once (those beyond
the slots wait in the engine's queue); one more gets HTTP 503 with an OpenAI-style JSON error.
Bad requests get HTTP 400 with ``{"error": {"message", "type": "invalid_request_error",
"param", "code"}}``; FastAPI's default 422 for body validation is overridden to 400.

Text: a streamed request receives one SSE chunk per token batch the engine emits (a speculative
step emits several tokens at once), then ``data: [DONE]``. Text is decoded incrementally; a
trailing incomplete UTF-8 sequence, and the tail that could still begin a stop string, are held
back until resolved. The stop token or stop string itself is not part of the text.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specjax.engine import Engine, EngineConfig, RequestParams
from specjax.options import spec_from_options
from specjax.serve import protocol as P
from specjax.serve.metrics import CompileCounter, make_registry

_COMPILES: CompileCounter | None = None


def compile_counter() -> CompileCounter:
    """The process's compile counter (created, and its jax.monitoring listener registered, once)."""
    global _COMPILES
    if _COMPILES is None:
        _COMPILES = CompileCounter()
    return _COMPILES


def make_engine_config(*, max_slots: int = 8, max_model_len: int = 2048,
                       num_pages: int | None = None, batch_buckets: tuple | None = None,
                       token_buckets: tuple = (16, 64), seed: int = 0,
                       enable_prefix_caching: bool = False,
                       num_speculative_tokens_per_batch_size=None,
                       recommended: dict | None = None, **spec_options) -> EngineConfig:
    """The one place the server builds an EngineConfig (its SpecConfig and capacity settings).

    ``spec_options`` are the speculation options of ``specjax.options.spec_from_options`` (every
    SpecConfig field: method, num_draft_tokens, draft_sampling, attn_impl, page_size, ngram_*,
    hybrid_min, adaptive, adaptive_by, tree or tree_*; None = unset), filled from
    ``recommended`` (a checkpoints/fastest.json entry) where given.

    Raises ValueError (from spec_from_options / SpecConfig) for an unknown option or an invalid
    speculation setting, e.g. ``adaptive`` without a speculative method.
    """
    spec = spec_from_options(spec_options, recommended)
    return EngineConfig(spec=spec, max_slots=max_slots, max_model_len=max_model_len,
                        num_pages=num_pages, batch_buckets=batch_buckets,
                        token_buckets=tuple(token_buckets), seed=seed,
                        enable_prefix_caching=enable_prefix_caching,
                        num_speculative_tokens_per_batch_size=num_speculative_tokens_per_batch_size)


# ---------------------------------------------------------------------------------- text


class Detokenizer:
    """Incremental text of one request's tokens, with stop strings.

    ``add(tokens, reason)`` returns (new text, finish reason): text is released only when it can
    no longer change (no trailing U+FFFD of an incomplete UTF-8 sequence, not a possible start of
    a stop string); the reason becomes "stop" when a stop string appears (text cut before it).
    ``num_tokens`` counts the tokens the text stands for: all received, or after a stop string
    only those up to the one that completed it (``stopped_by_string`` is then True).
    """

    def __init__(self, tokenizer, stop_strings=()):
        self.tok = tokenizer
        self.stops = list(stop_strings)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.ids: list = []
        self.sent = ""
        self.stopped_by_string = False
        self._num_tokens = None

    @property
    def num_tokens(self) -> int:
        return len(self.ids) if self._num_tokens is None else self._num_tokens

    def _find_stop(self, text: str) -> int:
        return min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)

    def add(self, tokens, reason: str | None):
        before = len(self.ids)
        self.ids.extend(tokens)
        ids = self.ids[:-1] if reason == "stop" and tokens else self.ids  # drop the stop token
        text = self.tok.decode(ids)
        cut = self._find_stop(text)
        if cut >= 0:
            text, reason = text[:cut], "stop"
            self.stopped_by_string = True
            # the stop string was not in the text before this batch: the first prefix that
            # holds it ends at one of this batch's tokens
            n = before + 1
            while n < len(ids) and self._find_stop(self.tok.decode(ids[:n])) < 0:
                n += 1
            self._num_tokens = n
        if reason is None:
            safe = text.rstrip("\ufffd")
            end = len(safe) - self.hold
            if end <= len(self.sent) or not safe.startswith(self.sent):
                return "", None
            delta = safe[len(self.sent):end]
        else:
            delta = text[len(self.sent):] if text.startswith(self.sent) else ""
        self.sent += delta
        return delta, reason


# ---------------------------------------------------------------------------------- server


def _finite(x):
    """JSON-safe copy (NaN / inf -> None)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


class _Server:
    """Shared state of one app: the engine, tokenizer, admission count."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, max_queue: int):
        if not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue must be an int >= 0, got {max_queue!r}")
        if tokenizer is None:
            raise ValueError("the server needs a tokenizer (text prompts, chat, detokenization)")
        self.engine, self.tok, self.model_name = engine, tokenizer, model_name
        self.vocab = engine.target.config.vocab_size
        self.max_model_len = engine.config.max_model_len
        self.capacity = engine.config.max_slots + max_queue
        self.active = 0  # requests admitted and not finished (event-loop thread only)
        eos = set(engine.target.config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        self.eos = sorted(e for e in eos if 0 <= e < self.vocab)
        self.compiles = compile_counter()

    # -- request preparation -----------------------------------------------------------------

    def check_model(self, body) -> None:
        if body.model != self.model_name:
            raise P.APIError(f"model {body.model!r} does not exist; this server serves "
                             f"{self.model_name!r}", param="model", code="model_not_found")

    def completion_prompt(self, body: P.CompletionRequest) -> list:
        p = body.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise P.APIError(f"one prompt per request is supported, got {len(p)}", param="prompt")
            p = p[0]
        ids = (self.tok.encode(p, add_special_tokens=body.add_special_tokens) if isinstance(p, str)
               else list(p))
        if not ids:
            raise P.APIError("prompt is empty", param="prompt")
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise P.APIError(f"prompt token {bad[0]} is outside the vocabulary [0, {self.vocab})",
                             param="prompt")
        return ids

    def chat_prompt(self, body: P.ChatCompletionRequest) -> list:
        if self.tok.chat_template is None:
            raise P.APIError("this model's tokenizer has no chat template", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            ids = self.tok.apply_chat_template(messages, add_generation_prompt=True)
        except Exception as e:  # noqa: BLE001 - a template's raise_exception() rejects the chat
            raise P.APIError(f"chat template: {e}", param="messages") from None
        if not ids:
            raise P.APIError("messages render to an empty prompt", param="messages")
        return ids

    def params(self, body, ids: list, max_tokens: int | None,
               max_name: str = "max_tokens") -> tuple:
        """(RequestParams, stop strings) for a validated body and prompt; ``max_name``: the
        field ``max_tokens`` came from (chat: ``max_completion_tokens`` when only it is set)."""
        body.check_unsupported()
        n = len(ids)
        where = "messages" if isinstance(body, P.ChatCompletionRequest) else "prompt"
        if n >= self.max_model_len:
            raise P.APIError(f"{where} has {n} tokens; the context is {self.max_model_len} "
                             "tokens including at least one generated", param=where)
        if max_tokens is None:
            max_tokens = self.max_model_len - n
        if n + max_tokens > self.max_model_len:
            raise P.APIError(f"{where} ({n} tokens) + {max_name} ({max_tokens}) exceeds the "
                             f"context of {self.max_model_len} tokens", param=max_name)
        strings, stop_ids = body.stop_lists()
        bad = [t for t in stop_ids if not 0 <= t < self.vocab]
        if bad:
            raise P.APIError(f"stop token id {bad[0]} is outside the vocabulary [0, {self.vocab})",
                             param="stop_token_ids")
        stop = set(stop_ids) | (set() if body.ignore_eos else set(self.eos))
        constraint = self.constraint(body)
        top_k = body.top_k or 0
        params = RequestParams(
            max_tokens=int(max_tokens),
            temperature=float(1.0 if body.temperature is None else body.temperature),
            top_k=0 if top_k < 0 else int(top_k),
            top_p=float(1.0 if body.top_p is None else body.top_p),
            seed=body.seed, stop_token_ids=tuple(sorted(stop)), constraint=constraint)
        return params, strings

    def constraint(self, body):
        """The request's structured-output Constraint (or None), compiled once here so that a
        grammar xgrammar rejects is a 400 naming the field (the engine reuses the compiled one)."""
        constraint, field = body.constraint()
        if constraint is None:
            return None
        try:
            self.engine.grammar_compiler().compile(constraint)
        except ImportError:
            raise P.APIError("structured outputs need xgrammar (pip install specjax[serve])",
                             param=field) from None
        except ValueError as e:
            raise P.APIError(f"{field}: {e}", param=field) from None
        return constraint

    # -- running --------------------------------------------------------------------------------

    def admit(self) -> None:
        if self.engine.failure is not None:
            raise P.APIError("the engine has failed", status=500, type="server_error")
        if self.active >= self.capacity:
            raise P.APIError(f"the server is at capacity ({self.capacity} requests); retry later",
                             status=503, type="server_error", code="overloaded")


class _Run:
    """One engine request seen from the event loop: token batches arrive on an asyncio.Queue."""

    def __init__(self, srv: _Server, ids: list, params: RequestParams, stop_strings):
        loop = asyncio.get_running_loop()
        self.srv = srv
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompt_tokens = len(ids)
        self.detok = Detokenizer(srv.tok, stop_strings)

        def on_tokens(handle, new):  # engine thread
            try:
                loop.call_soon_threadsafe(self.queue.put_nowait, (list(new), handle.finish_reason))
            except RuntimeError:  # the event loop is closed: nobody is reading any more
                pass

        try:
            self.handle = srv.engine.submit(ids, params, callback=on_tokens)
        except (ValueError, TypeError) as e:
            raise P.APIError(str(e)) from None
        srv.active += 1
        self._open = True

    @property
    def completion_tokens(self) -> int:
        return self.detok.num_tokens

    def usage(self) -> dict:
        c = self.completion_tokens
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": c,
                "total_tokens": self.prompt_tokens + c, "spec_decoding": self.spec_decoding()}

    def close(self) -> None:
        """Releases the admission slot; aborts the engine request if it is still running."""
        if self._open:
            self._open = False
            self.srv.active -= 1
            if self.detok.stopped_by_string:  # a success: the engine counts it as "stop"
                # (also when the engine already finished it by length: it restates the count)
                self.srv.engine.finish_stopped(self.handle.id, self.detok.num_tokens)
            elif not self.handle.finished:
                self.srv.engine.abort(self.handle.id)

    def spec_decoding(self) -> dict:
        """This request's speculation numbers (the response's ``spec_decoding`` field)."""
        return _finite(self.handle.spec_stats(self.detok.num_tokens))

    async def batches(self, request: Request | None):
        """Yields (text delta, finish reason or None) per token batch; stops after the last."""
        checked = time.monotonic()
        try:
            while True:
                try:
                    new, reason = await asyncio.wait_for(self.queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    new = None
                if new is None or time.monotonic() - checked > 0.5:
                    checked = time.monotonic()
                    if self.srv.engine.failure is not None:
                        raise P.APIError("the engine has failed", status=500,
                                         type="server_error")
                    if request is not None and await request.is_disconnected():
                        return
                    if new is None:
                        continue
                delta, reason = self.detok.add(new, reason)
                yield delta, reason
                if reason is not None:
                    return
        finally:
            self.close()


def _sse(obj) -> str:
    return f"data: {json.dumps(obj)}\n\n"


class _ClosingStream(StreamingResponse):
    """A StreamingResponse that always closes its generator (and so aborts the request), also
    when the client went away and a send failed."""

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


def create_app(engine: Engine, tokenizer, *, model_name: str, max_queue: int = 64,
               start_engine: bool = True) -> FastAPI:
    """The FastAPI app serving ``engine``.

    Args:
      engine: a (warmed-up) Engine; its thread is started and stopped with the app's lifespan
        when ``start_engine``.
      tokenizer: a specjax Tokenizer (text prompts, chat template, detokenization).
      model_name: the id clients pass as ``model``.
      max_queue: requests that may wait beyond the engine's slots before HTTP 503.
    """
    srv = _Server(engine, tokenizer, model_name, max_queue)
    if engine.tokenizer is None:  # structured outputs compile grammars against it
        engine.tokenizer = tokenizer
    registry = make_registry(engine, model_name)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if start_engine:
            engine.start()
        try:
            yield
        finally:
            if start_engine:
                engine.stop()

    app = FastAPI(title="specjax", lifespan=lifespan)
    app.state.server = srv

    @app.exception_handler(P.APIError)
    async def _api_error(request, exc: P.APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ())]
        param = loc[1] if len(loc) > 1 and loc[0] == "body" and first.get("type") != "json_invalid" \
            else None
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('msg', '')}"
        elif first.get("type") == "extra_forbidden":
            msg = f"{'.'.join(loc[1:])} is not supported by this server"
        else:
            msg = f"{'.'.join(loc[1:]) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(P.APIError(msg, param=param).body(), status_code=400)

    @app.get("/health")
    async def health():
        occ = engine.occupancy()
        ok = engine.failure is None
        return JSONResponse({"status": "ok" if ok else "engine failed", **occ,
                             "requests_in_server": srv.active, "capacity": srv.capacity,
                             "compiles": srv.compiles.count}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "specjax", "root": model_name,
                                            "max_model_len": srv.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/stats")
    async def stats():
        return _finite(engine.stats())

    async def run(request: Request, body, ids: list, max_tokens, chat: bool,
                  max_name: str = "max_tokens"):
        params, strings = srv.params(body, ids, max_tokens, max_name)
        srv.admit()
        r = _Run(srv, ids, params, strings)
        rid, created = P.new_id("chatcmpl" if chat else "cmpl"), P.now()
        if not body.stream:
            text, reason = [], None
            async for delta, reason in r.batches(request):
                text.append(delta)
            if reason is None:  # client gone: nobody reads this
                return Response(status_code=499)
            text = "".join(text)
            if chat:
                choice = P.ChatChoice(message=P.ChatChoiceMessage(content=text), finish_reason=reason)
                out = P.ChatCompletionResponse(id=rid, created=created, model=model_name,
                                               choices=[choice], usage=r.usage())
            else:
                out = P.CompletionResponse(id=rid, created=created, model=model_name,
                                           choices=[P.CompletionChoice(text=text, finish_reason=reason)],
                                           usage=r.usage())
            return out.model_dump()
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        def chunk(delta: str | None, reason, role=None) -> dict:
            if chat:
                return {"id": rid, "object": "chat.completion.chunk", "created": created,
                        "model": model_name, "choices": [{"index": 0, "delta": _delta(role, delta),
                                                          "finish_reason": reason}]}
            return {"id": rid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"index": 0, "text": delta, "logprobs": None,
                                 "finish_reason": reason}]}

        async def events():
            try:
                if chat:
                    yield _sse(chunk("", None, role="assistant"))
                async for delta, reason in r.batches(request):
                    yield _sse(chunk(delta, reason))
                    if reason is not None:
                        if include_usage:
                            yield _sse({"id": rid, "object": chunk("", None)["object"],
                                        "created": created, "model": model_name, "choices": [],
                                        "usage": r.usage()})
                        yield "data: [DONE]\n\n"
            except P.APIError as e:  # after the headers went out: the error is the last event
                yield _sse(e.body())
                yield "data: [DONE]\n\n"
            finally:
                r.close()

        return _ClosingStream(events(), media_type="text/event-stream",
                              headers={"Cache-Control": "no-cache"})

    @app.post("/v1/completions")
    async def completions(body: P.CompletionRequest, request: Request):
        srv.check_model(body)
        if body.echo:
            raise P.APIError("echo is not supported", param="echo")
        if body.suffix:
            raise P.APIError("suffix is not supported", param="suffix")
        ids = srv.completion_prompt(body)
        return await run(request, body, ids, body.max_tokens, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: P.ChatCompletionRequest, request: Request):
        srv.check_model(body)
        ids = srv.chat_prompt(body)
        name = "max_completion_tokens" if body.max_tokens is None else "max_tokens"
        return await run(request, body, ids, getattr(body, name), chat=True, max_name=name)

    return app


def _delta(role, content) -> dict:
    d = {}
    if role is not None:
        d["role"] = role
    if content is not None:
        d["content"] = content
    return d


def serve(engine: Engine, tokenizer, *, model_name: str, host: str = "127.0.0.1",
          port: int = 8000, max_queue: int = 64, log_level: str = "info") -> None:
    """Runs the server until interrupted (uvicorn, one worker; the engine thread does the work)."""
    import uvicorn  # noqa: PLC0415 - uvicorn only when serving

    app = create_app(engine, tokenizer, model_name=model_name, max_queue=max_queue)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
