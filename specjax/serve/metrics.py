"""Prometheus exposition of the engine's metrics (``GET /metrics``), under vLLM's names.

``EngineCollector`` is a ``prometheus_client`` custom collector: every scrape reads the engine's
own counters (``specjax.engine.metrics.EngineMetrics``) and gauges, so ``/metrics`` and
``Engine.stats()`` agree exactly; nothing is counted twice. Histograms are rebuilt at scrape time
from the engine's raw latency samples with vLLM's bucket boundaries.

Names (label ``model_name`` on all; counters gain ``_total`` in the text format):

* ``vllm:spec_decode_num_drafts``, ``vllm:spec_decode_num_draft_tokens``,
  ``vllm:spec_decode_num_accepted_tokens``, ``vllm:spec_decode_num_accepted_tokens_per_pos``
  (label ``position``), ``vllm:prompt_tokens``, ``vllm:generation_tokens``,
  ``vllm:request_success`` (label ``finished_reason``: stop / length / abort),
  ``vllm:num_preemptions``, ``vllm:prefix_cache_queries``, ``vllm:prefix_cache_hits`` (tokens;
  ``EngineConfig.enable_prefix_caching``) (counters);
* ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds``,
  ``vllm:time_per_output_token_seconds`` (histograms);
* ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``,
  ``specjax:kv_pages_in_use``, ``specjax:kv_pages_total`` (gauges).

``CompileCounter`` counts XLA backend compilations in this process (``jax.monitoring`` events),
reported by ``/health`` so a client can check that serving compiles nothing after warm-up.
"""

from __future__ import annotations

import threading

import jax
import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
HISTOGRAMS = {  # engine histogram -> (buckets, help)
    "time_to_first_token_seconds": (_TTFT_BUCKETS, "Time to first token in seconds."),
    "inter_token_latency_seconds": (_ITL_BUCKETS, "Time between token deliveries in seconds."),
    "time_per_output_token_seconds": (_ITL_BUCKETS, "Mean time per output token per request."),
    "e2e_request_latency_seconds": (_REQUEST_BUCKETS, "End-to-end request latency in seconds."),
    "request_queue_time_seconds": (_REQUEST_BUCKETS, "Time from arrival to admission in seconds."),
}


def _histogram(name: str, samples, buckets, doc: str, labels: dict) -> HistogramMetricFamily:
    a = np.asarray(samples, np.float64)
    cum = np.searchsorted(np.sort(a), np.asarray(buckets), side="right")  # count <= le
    h = HistogramMetricFamily(name, doc, labels=list(labels))
    h.add_metric(list(labels.values()),
                 [(repr(float(b)), int(c)) for b, c in zip(buckets, cum)] + [("+Inf", int(a.size))],
                 sum_value=float(a.sum()))
    return h


class EngineCollector:
    """prometheus_client collector reading an ``Engine``'s metrics at every scrape."""

    def __init__(self, engine, model_name: str):
        self.engine = engine
        self.labels = {"model_name": model_name}

    def describe(self):
        return []  # no registration-time collect(): the engine may still be warming up

    def collect(self):
        e, m, lab = self.engine, self.engine.metrics, self.labels
        names, values = list(lab), list(lab.values())

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        yield counter("vllm:spec_decode_num_drafts", "Speculative row-steps.",
                      m.spec_decode_num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                      m.spec_decode_num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      m.spec_decode_num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each draft position.",
                                      labels=names + ["position"])
        for i, n in enumerate(list(m.spec_decode_num_accepted_tokens_per_pos)):
            per_pos.add_metric(values + [str(i)], n)
        yield per_pos
        yield counter("vllm:prompt_tokens", "Prompt tokens received.", m.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Tokens generated.", m.generation_tokens_total)
        success = CounterMetricFamily("vllm:request_success", "Finished requests by reason.",
                                      labels=names + ["finished_reason"])
        for reason, n in dict(m.request_finished_by_reason).items():
            success.add_metric(values + [reason], n)
        yield success
        yield counter("vllm:num_preemptions", "Requests preempted (recomputed later).",
                      e.scheduler.num_preemptions)
        yield counter("vllm:prefix_cache_queries", "Prefix cache: tokens looked up at admission.",
                      e.scheduler.prefix_cache_queries)
        yield counter("vllm:prefix_cache_hits", "Prefix cache: tokens found cached.",
                      e.scheduler.prefix_cache_hits)
        for key, (buckets, doc) in HISTOGRAMS.items():
            yield _histogram("vllm:" + key, list(m.hist[key]), buckets, doc, lab)
        occ = e.occupancy()
        yield gauge("vllm:num_requests_running", "Requests holding a slot.",
                    occ["num_requests_running"])
        yield gauge("vllm:num_requests_waiting", "Requests waiting for a slot.",
                    occ["num_requests_waiting"])
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV pages in use.",
                    occ["kv_pages_in_use"] / occ["kv_pages_total"])
        yield gauge("specjax:kv_pages_in_use", "KV pages in use.", occ["kv_pages_in_use"])
        yield gauge("specjax:kv_pages_total", "KV pages in the pool.", occ["kv_pages_total"])


def make_registry(engine, model_name: str) -> CollectorRegistry:
    """A registry holding only the engine's collector (no process / platform collectors)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, model_name))
    return registry


class CompileCounter:
    """Counts XLA backend compilations process-wide from the moment it is created."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self):
        self.count = 0
        self._lock = threading.Lock()
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event, duration, **_):
        if event == self.EVENT:
            with self._lock:
                self.count += 1
