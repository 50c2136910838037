"""``specjax serve``: an OpenAI-compatible HTTP server over the serving engine.

* ``protocol``: request / response shapes and the OpenAI error body.
* ``metrics``: the Prometheus collector (vLLM metric names) and the compile counter.
* ``app``: the FastAPI app (``create_app``), ``make_engine_config`` and ``serve``.

Needs the ``serve`` extra (fastapi, uvicorn, prometheus_client).
"""
