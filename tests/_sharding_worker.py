"""One process of a multi-process sharded generation (run by tests/test_sharding.py).

``python tests/_sharding_worker.py PROCESS_ID NUM_PROCESSES PORT OUT METHOD TP DP`` with
``XLA_FLAGS=--xla_force_host_platform_device_count=4``: joins the coordinator at
127.0.0.1:PORT, generates greedily on a (dp, tp) mesh spanning every process's devices with
``specjax.generate(..., mesh=...)`` and writes the tokens as JSON to OUT.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    pid, nproc, port, out, method, tp, dp = sys.argv[1:8]
    from specjax import sharding  # noqa: PLC0415

    sharding.initialize_distributed(f"127.0.0.1:{port}", int(nproc), int(pid))
    import jax  # noqa: PLC0415

    import specjax as sj  # noqa: PLC0415
    from _sharding_check import K, MAX_NEW, PROMPTS, models  # noqa: PLC0415

    target, drafts = models()["kv8"]
    mesh = sharding.make_mesh(tp=int(tp), dp=int(dp))
    result = sj.generate(target, PROMPTS, max_new_tokens=MAX_NEW, draft=drafts[method],
                         method=method, num_draft_tokens=K, eos_token_id=[], mesh=mesh)
    with open(out, "w") as f:
        json.dump({"tokens": result.tokens, "process_count": jax.process_count(),
                   "devices": jax.device_count(), "local": jax.local_device_count()}, f)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
