"""Serving metrics, named as vLLM / SGLang export them.

Counters and histograms are plain Python (host side, updated when a step's results are read).
``EngineMetrics.snapshot()`` returns one flat dict; the names follow vLLM's Prometheus metrics
(``vllm:`` prefix dropped) with SGLang's aliases where they differ:

* speculation: ``spec_decode_num_drafts`` (row-steps that proposed drafts: an n-gram row
  without a match or an adaptive plain step proposes none), ``spec_decode_num_draft_tokens``,
  ``spec_decode_num_accepted_tokens``, ``spec_decode_num_accepted_tokens_per_pos``,
  ``spec_decode_num_emitted_tokens``, all counted from the tokens a request actually received
  (accepted drafts cut by its stop or max_tokens do not count); derived, with the definitions
  of ``specjax.stats.acceptance_summary`` (the same in ``sj.generate``, here and per request):
  ``acceptance_rate`` = accepted / draft tokens, ``mean_accepted_length`` (SGLang
  ``spec_accept_length``) = 1 + accepted / drafts (vLLM's mean acceptance length), and
  ``per_position_acceptance`` [K] = accepted at position i / drafts. Steps that proposed no
  draft are counted apart (``spec_decode_num_plain_steps``).
* latency histograms (seconds; mean/p50/p90/p99/count): ``time_to_first_token_seconds``,
  ``inter_token_latency_seconds`` (one sample per step in which a request received tokens, as in
  vLLM v1; speculative steps deliver several tokens at once), ``time_per_output_token_seconds``
  (per request: (e2e - TTFT) / (tokens - 1)), ``e2e_request_latency_seconds``,
  ``request_queue_time_seconds`` (arrival to first admission).
* throughput: ``generation_tokens_total``, ``prompt_tokens_total``, ``tokens_per_second``
  (SGLang ``gen_throughput``: generated tokens / wall time from the first arrival to the last
  token).
* gauges: ``num_requests_running``, ``num_requests_waiting`` (queue depth; SGLang
  ``num_queue_reqs``), ``kv_cache_usage_perc`` (fraction of pages in use; SGLang ``token_usage``).
* counters: ``request_success_total`` (finished by a stop token, a stop string found by the
  server (``Engine.finish_stopped``) or the length limit),
  ``request_finished_by_reason`` ("stop" / "length" / "abort", vLLM's ``finished_reason``
  label), steps by kind. ``Engine.stats()`` adds ``num_preemptions_total`` (the scheduler's).
"""

from __future__ import annotations

import numpy as np


def _summary(values) -> dict:
    if not values:
        return {"count": 0, "mean": float("nan"), "p50": float("nan"), "p90": float("nan"),
                "p99": float("nan")}
    a = np.asarray(values, np.float64)
    return {"count": int(a.size), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def request_spec_stats(spec_steps, num_tokens: int, k: int) -> dict:
    """One request's speculation numbers (vLLM's per-request spec metrics), from the tokens it
    received.

    Args:
      spec_steps: one ``(start, accepted, drafted)`` per speculative step of the request: the
        index in its output of the step's first token, drafts the verifier accepted, drafts
        proposed (0: the row proposed none, not counted).
      num_tokens: tokens the request returned (a stop token, stop string or max_tokens may cut a
        step: only the drafts among its first ``num_tokens`` tokens count).
      k: K, the most drafts one step can accept.
    Returns:
      ``{"num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos"
      [K], "mean_acceptance_length"}``: the last = 1 + accepted / drafts (vLLM's; None without
      drafts).
    """
    drafts = draft_tokens = accepted = 0
    per_pos = [0] * k
    for start, acc, drafted in spec_steps:
        got = min(acc + 1, num_tokens - start)
        if drafted == 0 or got <= 0:
            continue
        a = min(acc, got)
        drafts += 1
        draft_tokens += drafted
        accepted += a
        for i in range(a):
            per_pos[i] += 1
    return {"num_drafts": drafts, "num_draft_tokens": draft_tokens,
            "num_accepted_tokens": accepted, "num_accepted_tokens_per_pos": per_pos,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else None}


class EngineMetrics:
    """Accumulates the engine's counters and latency samples (see the module docstring)."""

    HISTOGRAMS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
                  "time_per_output_token_seconds", "e2e_request_latency_seconds",
                  "request_queue_time_seconds")

    def __init__(self, num_draft_tokens: int):
        self.k = num_draft_tokens
        self.reset()

    def reset(self) -> None:
        self.spec_decode_num_drafts = 0
        self.spec_decode_num_draft_tokens = 0
        self.spec_decode_num_accepted_tokens = 0
        self.spec_decode_num_emitted_tokens = 0
        self.spec_decode_num_plain_steps = 0
        self.spec_decode_num_accepted_tokens_per_pos = [0] * self.k
        self.generation_tokens_total = 0
        self.prompt_tokens_total = 0
        self.request_success_total = 0
        self.request_finished_by_reason = {"stop": 0, "length": 0, "abort": 0}
        self.steps = {"extend": 0, "decode": 0, "spec": 0}
        self.hist = {name: [] for name in self.HISTOGRAMS}
        self.first_arrival = None
        self.last_token_time = None

    def observe_spec(self, num_accepted: int, num_emitted: int, num_drafted: int) -> None:
        """One speculative row-step that proposed ``num_drafted`` drafts (0 for an n-gram row
        without a match or an adaptive plain step: not counted as a draft) and emitted
        ``num_emitted`` tokens, ``num_accepted`` of them drafts (accepted drafts cut by a stop or
        max_tokens are not counted)."""
        if num_drafted == 0:
            self.spec_decode_num_plain_steps += 1
            return
        self.spec_decode_num_emitted_tokens += num_emitted
        self.spec_decode_num_drafts += 1
        self.spec_decode_num_draft_tokens += num_drafted
        self.spec_decode_num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.spec_decode_num_accepted_tokens_per_pos[i] += 1

    def observe(self, name: str, value: float) -> None:
        self.hist[name].append(value)

    def snapshot(self, *, running: int = 0, waiting: int = 0, usage: float = 0.0) -> dict:
        drafts = self.spec_decode_num_drafts
        accepted = self.spec_decode_num_accepted_tokens
        span = None
        if self.first_arrival is not None and self.last_token_time is not None:
            span = self.last_token_time - self.first_arrival
        out = {
            "spec_decode_num_drafts": drafts,
            "spec_decode_num_draft_tokens": self.spec_decode_num_draft_tokens,
            "spec_decode_num_accepted_tokens": accepted,
            "spec_decode_num_accepted_tokens_per_pos": list(self.spec_decode_num_accepted_tokens_per_pos),
            "spec_decode_num_emitted_tokens": self.spec_decode_num_emitted_tokens,
            "acceptance_rate": accepted / self.spec_decode_num_draft_tokens if drafts else float("nan"),
            "spec_decode_num_plain_steps": self.spec_decode_num_plain_steps,
            "mean_accepted_length": 1 + accepted / drafts if drafts else float("nan"),
            "per_position_acceptance": [a / drafts for a in self.spec_decode_num_accepted_tokens_per_pos]
            if drafts else [],
            "generation_tokens_total": self.generation_tokens_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "tokens_per_second": self.generation_tokens_total / span if span else float("nan"),
            "num_requests_running": running,
            "num_requests_waiting": waiting,
            "kv_cache_usage_perc": usage,
            "request_success_total": self.request_success_total,
            "request_finished_by_reason": dict(self.request_finished_by_reason),
            "steps": dict(self.steps),
        }
        out["spec_accept_length"] = out["mean_accepted_length"]  # SGLang's name
        for name, values in self.hist.items():
            out[name] = _summary(values)
        return out
