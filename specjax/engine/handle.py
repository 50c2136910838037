"""A submitted request's handle: stream its tokens or wait for all of them."""

from __future__ import annotations

import queue
import threading

from specjax.engine.metrics import request_spec_stats

class RequestHandle:
    """A submitted request: stream its tokens (iterate) or wait for all of them (``result``).

    Iteration yields token ids as steps deliver them (a speculative step delivers several at once).
    Without a background thread, iterating or ``result()`` drives ``engine.step()`` itself.
    Attributes: ``id``, ``prompt``, ``tokens`` (delivered so far), ``finished``,
    ``finish_reason`` ("stop", "length" or "abort").
    """

    def __init__(self, engine, req_id: int, prompt: list):  # engine: specjax.engine.Engine
        self.id = req_id
        self.prompt = prompt
        self.tokens: list = []
        self.finished = False
        self.finish_reason = None
        self.callback_error = None
        self._engine = engine
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Event()
        self._req = None  # the engine's Request (set by submit)

    def _push(self, new, reason) -> None:
        self.tokens.extend(new)
        if reason is not None:
            self.finish_reason = reason
            self.finished = True
        self._queue.put((new, reason))
        if reason is not None:
            self._done.set()

    def spec_stats(self, num_tokens: int | None = None) -> dict:
        """This request's speculation numbers (``specjax.engine.metrics.request_spec_stats``),
        counted from its first ``num_tokens`` generated tokens (default: all received so far)."""
        n = len(self.tokens) if num_tokens is None else num_tokens
        return request_spec_stats(list(self._req.spec_steps), n, self._engine.k_eff)

    def _next_chunk(self):
        while True:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                pass
            if self._engine.serving:
                try:
                    return self._queue.get(timeout=0.1)
                except queue.Empty:
                    self._engine._raise_if_failed()
                    continue
            if not self._engine.step() and self._queue.empty():
                raise RuntimeError(f"request {self.id} cannot finish: the engine has no work")

    def __iter__(self):
        while True:
            new, reason = self._next_chunk()
            yield from new
            if reason is not None:
                return

    def result(self, timeout: float | None = None) -> list:
        """Blocks until the request finishes; returns all its generated tokens."""
        if self._engine.serving:
            if not self._done.wait(timeout):
                self._engine._raise_if_failed()
                raise TimeoutError(f"request {self.id} not finished after {timeout} s")
        else:
            while not self._done.is_set():
                if not self._engine.step() and not self._done.is_set():
                    raise RuntimeError(f"request {self.id} cannot finish: the engine has no work")
        return list(self.tokens)
