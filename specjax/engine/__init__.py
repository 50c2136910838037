"""Serving engine: continuous batching, shared page allocation, overlapped host work, metrics.

* ``allocator``: host page allocator shared by target and draft (one page table for both caches).
* ``scheduler``: admission, chunked prefill, allocation ahead for k+1 growth, preemption.
* ``steps``: the jitted device steps over request slots (ordinary extend / speculative decode)
  and the packed per-step metadata buffer.
* ``engine``: ``Engine`` (submit / step / stream / abort / background serving, sync and async
  schedules).
* ``metrics``: vLLM / SGLang-named metrics.
"""

from specjax.engine.allocator import OutOfPages, PageAllocator
from specjax.engine.engine import Engine, EngineConfig, RequestHandle, RequestParams
from specjax.engine.metrics import EngineMetrics

__all__ = ["Engine", "EngineConfig", "EngineMetrics", "OutOfPages", "PageAllocator",
           "RequestHandle", "RequestParams"]
