"""DeepSeek target + MTP head sharded over a (tp, ep) mesh of 8 fake CPU devices equals 1 device.

Fake devices need XLA_FLAGS before jax initialises, so the check runs this file as a script in a
subprocess (as tests/test_sharding.py does); it prints one "OK ..." line on success.
"""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FAST_XLA = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def _check(tp: int = 2, ep: int = 4) -> str:
    import dataclasses  # noqa: PLC0415

    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import specjax as sj  # noqa: PLC0415
    from specjax import deepseek, kv_cache  # noqa: PLC0415
    from specjax.heads import Head, HeadConfig  # noqa: PLC0415
    from specjax.model import Model  # noqa: PLC0415

    assert len(jax.devices()) >= tp * ep, jax.devices()
    cfg = deepseek.DeepseekConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=8, num_layers=2,
        num_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=8, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
        topk_group=2, routed_scaling_factor=2.0, first_k_dense_replace=1, max_position_embeddings=256)
    params = deepseek.init_params(cfg, jax.random.key(0), scale=0.2)
    block = cfg.mtp_block_config()
    e = cfg.hidden_size
    hp = {"enorm": jnp.ones((e,)), "hnorm": jnp.ones((e,)), "final_norm": jnp.ones((e,)),
          "eh_proj": 0.2 * jax.random.normal(jax.random.key(1), (2 * e, e)),
          "layer": deepseek.init_layer(block, jax.random.key(2), moe_layer=True, scale=0.2)}
    hcfg = HeadConfig(kind="mtp", layer=block)
    prompts = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12], [4] * 9]
    kw = dict(max_new_tokens=12, method="mtp", num_draft_tokens=1, eos_token_id=[])

    def run(p, h, c, hc):
        out = sj.generate(Model(p, c), prompts, draft=Head(h, hc), **kw)
        ids = jnp.asarray([[3, 1, 4, 1, 5, 9, 2, 6]] * 2)
        kv = deepseek.init_cache(c, 2, 8)
        logits, _, _ = jax.jit(deepseek.forward, static_argnums=1)(
            p, c, ids, jnp.broadcast_to(jnp.arange(8), (2, 8)), kv, kv_cache.contiguous_page_table(2, 1),
            jnp.zeros(2, jnp.int32))
        return out.tokens, np.asarray(logits)

    with jax.default_device(jax.devices()[0]):
        ref_tokens, ref_logits = run(params, hp, cfg, hcfg)

    mesh = deepseek.make_mesh(tp=tp, ep=ep)
    sp = deepseek.shard(params, deepseek.param_specs(params, cfg, mesh), mesh)
    sh = deepseek.shard(hp, deepseek.head_param_specs(hp, block, mesh), mesh)
    we = sp["layers"][1]["we_gate"]
    assert we.sharding.shard_shape(we.shape) == (8 // ep, e, 8 // tp), we.sharding
    assert sp["layers"][1]["wq_b"].sharding.shard_shape((16, 4 * 12)) == (16, 4 * 12 // tp)
    results = {}
    # The SPMD partitioner on its own (expert weights gathered), then expert parallelism with
    # all-to-alls, single batch and the two-half micro-batched MoE.
    for name, mb, ep_on in (("gspmd", 1, False), ("ep", 1, True), ("ep-micro", 2, True)):
        c = dataclasses.replace(cfg, moe_micro_batches=mb)
        b = dataclasses.replace(block, moe_micro_batches=mb)
        if ep_on:
            c, b = deepseek.with_expert_parallel(c, mesh), deepseek.with_expert_parallel(b, mesh)
        tokens, logits = run(sp, sh, c, dataclasses.replace(hcfg, layer=b))
        assert tokens == ref_tokens, (name, tokens, ref_tokens)
        np.testing.assert_allclose(logits, ref_logits, atol=2e-5, rtol=1e-5)
        results[name] = float(np.abs(logits - ref_logits).max())
    return f"OK tp={tp} ep={ep} max|dlogits| " + " ".join(f"{k}={v:.2e}" for k, v in results.items())


@pytest.mark.slow  # ~45 s CPU in a subprocess (compiles the fused loop 3x on 8 fake devices)
def test_sharded_tp_ep_equals_one_device():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {FAST_XLA}",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(HERE))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0 and "OK " in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


if __name__ == "__main__":
    print(_check())
