"""Grouped MoE dispatch (specjax.moe) against the dense all-expert reference, and expert
parallelism over 8 fake CPU devices against one device.

Fake devices need XLA_FLAGS before jax initialises, so the expert-parallel check runs this file
as a script in a subprocess (as tests/test_deepseek_sharding.py does); it prints "OK ...".
"""

import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
FAST_XLA = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
T, E, F, X = 37, 16, 12, 16  # T on purpose not a multiple of the ep size, the tile or X


def _weights(seed=0, x=X):
    rng = np.random.RandomState(seed)
    return tuple((0.3 * rng.randn(*s)).astype(np.float32)
                 for s in ((T, E), (x, E, F), (x, E, F), (x, F, E)))


def routing(kind: str, t=T, k=2, x=X, seed=0):
    """(topk_ids [t, k] int32, topk_weights [t, k] float32) of a named routing pattern."""
    rng = np.random.RandomState(seed)
    if kind == "random":  # top-k of random scores: uneven loads, some experts empty
        ids = np.argsort(-rng.randn(t, x), axis=1)[:, :k]
    elif kind == "hot":  # every token's first choice is expert 5: one expert holds t rows
        ids = np.stack([np.full(t, 5)] + [(np.arange(t) + j) % 4 + 8 for j in range(1, k)], 1)
    elif kind == "one_device":  # all choices among experts 0..k-1: one ep shard gets everything
        ids = np.stack([np.full(t, j) for j in range(k)], 1)
    elif kind == "skewed":  # experts drawn from a steep power law: a few heavy, most empty
        p = 1.0 / np.arange(1, x + 1) ** 2
        ids = np.stack([rng.choice(x, k, replace=False, p=p / p.sum()) for _ in range(t)])
    else:
        raise ValueError(kind)
    w = rng.rand(t, k).astype(np.float32)
    return ids.astype(np.int32), w


def _dense_and_grouped(kinds, impls_tiles, k=2):
    import jax  # noqa: PLC0415

    from specjax import moe  # noqa: PLC0415

    x, wg, wu, wd = _weights()
    dense = jax.jit(moe.moe_dense_reference)
    grouped = jax.jit(moe.moe_ffn, static_argnames=("impl", "tile"))
    out = []
    for kind in kinds:
        ids, w = routing(kind, k=k)
        ref = np.asarray(dense(x, ids, w, wg, wu, wd))
        for impl, tile in impls_tiles:
            got = np.asarray(grouped(x, ids, w, wg, wu, wd, impl=impl, tile=tile))
            out.append((kind, impl, tile, ref, got))
    return out


@pytest.mark.parametrize("k", [1, 2, 4])
def test_grouped_equals_dense_reference(k):
    cases = _dense_and_grouped(["random", "hot", "one_device", "skewed"],
                               [("tiled", None), ("tiled", 1), ("tiled", 5), ("ragged_dot", None)],
                               k=k)
    for kind, impl, tile, ref, got in cases:
        np.testing.assert_allclose(got, ref, atol=2e-6, rtol=1e-5, err_msg=f"{kind} {impl} {tile}")
    assert np.abs(cases[0][3]).max() > 0.1  # the reference is not trivially zero


def test_grouped_detects_a_wrong_routing():
    """Negative control: the comparison fails when the grouped path gets other expert ids."""
    import jax  # noqa: PLC0415

    from specjax import moe  # noqa: PLC0415

    x, wg, wu, wd = _weights()
    ids, w = routing("random")
    ref = np.asarray(moe.moe_dense_reference(x, ids, w, wg, wu, wd))
    got = np.asarray(jax.jit(moe.moe_ffn)(x, (ids + 1) % X, w, wg, wu, wd))
    assert np.abs(got - ref).max() > 1e-2


@pytest.mark.parametrize("norm", [False, True])
def test_softmax_topk_routing(norm):
    from specjax import moe  # noqa: PLC0415

    logits = np.random.RandomState(1).randn(T, X).astype(np.float32)
    ids, w = (np.asarray(a) for a in moe.softmax_topk(logits, 3, norm_topk_prob=norm))
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want_ids = np.argsort(-p, axis=1)[:, :3]
    want_w = np.take_along_axis(p, want_ids, 1)
    if norm:
        want_w /= want_w.sum(1, keepdims=True)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(w, want_w, rtol=1e-5)
    with pytest.raises(ValueError, match="k must be"):
        moe.softmax_topk(logits, X + 1)


def test_bad_shapes_are_rejected():
    from specjax import moe  # noqa: PLC0415

    x, wg, wu, wd = _weights()
    ids, w = routing("random")
    with pytest.raises(ValueError, match="topk_ids"):
        moe.moe_ffn(x, ids[:-1], w, wg, wu, wd)
    with pytest.raises(ValueError, match="w_down"):
        moe.moe_ffn(x, ids, w, wg, wu, wd[:, :-1])
    with pytest.raises(ValueError, match="impl"):
        moe.moe_ffn(x, ids, w, wg, wu, wd, impl="dense")


def test_deepseek_uses_the_grouped_dispatch_and_its_ep_path():
    """DeepSeek's MoE layer == its routing + the dense reference + shared experts, through the
    grouped path and the expert-parallel path (a 1-device ep mesh); the placement is not saved."""
    import jax  # noqa: PLC0415

    from specjax import deepseek, moe  # noqa: PLC0415

    cfg = deepseek.DeepseekConfig(
        vocab_size=64, hidden_size=E, intermediate_size=24, moe_intermediate_size=F, num_layers=2,
        num_heads=2, kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4,
        n_routed_experts=X, num_experts_per_tok=3, n_group=4, topk_group=2)
    lp = deepseek.init_layer(cfg, jax.random.key(0), moe_layer=True, scale=0.3)
    x = _weights()[0][None]  # [1, T, E]

    @jax.jit
    def reference(lp, x):
        w, idx = deepseek.route(lp, cfg, x)
        return (moe.moe_dense_reference(x, idx, w, lp["we_gate"], lp["we_up"], lp["we_down"])
                + deepseek._mlp(x, lp["ws_gate"], lp["ws_up"], lp["ws_down"]))

    want = reference(lp, x[0])
    ep_cfg = deepseek.with_expert_parallel(cfg, deepseek.make_mesh())
    for c in (cfg, ep_cfg):
        got = jax.jit(deepseek.moe, static_argnums=1)(lp, c, x)[0]
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-6, rtol=1e-5)
    assert ep_cfg.to_dict() == cfg.to_dict() and ep_cfg != cfg


def test_bench_moe_smoke():
    """benchmarks/bench_moe.py on a tiny setting (so the script cannot rot)."""
    import importlib.util  # noqa: PLC0415

    path = os.path.join(os.path.dirname(HERE), "benchmarks", "bench_moe.py")
    spec = importlib.util.spec_from_file_location("_bench_moe", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    r = mod.main(["--tokens", "5", "--experts", "8", "--hidden", "16", "--expert-hidden", "8",
                  "--rounds", "1", "--iters", "1"])
    assert r["max_abs_diff"] < 1e-5 and r["setting"]["impl"] == "tiled"
    assert set(r["ms_per_call"]) == {"dense", "grouped"} and r["grouped_over_dense"] > 0


# ------------------------------------------------------------------ expert parallel (8 devices)

def _ep_check() -> str:
    import jax  # noqa: PLC0415
    from jax.sharding import Mesh, NamedSharding  # noqa: PLC0415
    from jax.sharding import PartitionSpec as P  # noqa: PLC0415

    from specjax import moe  # noqa: PLC0415

    assert len(jax.devices()) == 8, jax.devices()
    x, wg, wu, wd = _weights()
    one, dense = jax.jit(moe.moe_ffn), jax.jit(moe.moe_dense_reference)
    lines = []
    for ep_size, tp_size, impl in ((8, 1, "tiled"), (4, 2, "tiled"), (8, 1, "ragged_dot")):
        mesh = Mesh(np.asarray(jax.devices()).reshape(tp_size, ep_size), ("tp", "ep"))
        ep = moe.ExpertParallel(mesh, "ep", "tp" if tp_size > 1 else None)
        tp = ep.tp_axis
        wgs, wus = (jax.device_put(w, NamedSharding(mesh, P("ep", None, tp))) for w in (wg, wu))
        wds = jax.device_put(wd, NamedSharding(mesh, P("ep", tp, None)))
        run = jax.jit(lambda *a, ep=ep, impl=impl: moe.moe_ffn(*a, expert_parallel=ep, impl=impl))
        worst = 0.0
        for kind in ("random", "hot", "one_device", "skewed"):
            for t in (T, 1, 8):
                ids, w = routing(kind, t=t)
                ref = np.asarray(one(x[:t], ids, w, wg, wu, wd))
                got = np.asarray(run(x[:t], ids, w, wgs, wus, wds))
                np.testing.assert_allclose(got, ref, atol=2e-6, rtol=1e-5, err_msg=f"{kind} {t}")
                np.testing.assert_allclose(got, np.asarray(dense(x[:t], ids, w, wg, wu, wd)),
                                           atol=2e-6, rtol=1e-5)
                worst = max(worst, float(np.abs(got - ref).max()))
        hlo = run.lower(x, *routing("random"), wgs, wus, wds).compile().as_text()
        assert hlo.count("all-to-all") >= 3, "expected the dispatch / return all-to-alls"
        lines.append(f"ep={ep_size} tp={tp_size} {impl} max|d|={worst:.1e}")
    # A capacity factor: exact while no buffer overflows (random routing, factor 4 on ep=8:
    # room for 4x the mean load), tokens dropped (a difference) when the hot case overflows.
    ep = moe.ExpertParallel(mesh, "ep", None, capacity_factor=4.0)
    run = jax.jit(lambda *a: moe.moe_ffn(*a, expert_parallel=ep))
    ids, w = routing("random")
    np.testing.assert_allclose(np.asarray(run(x, ids, w, wgs, wus, wds)),
                               np.asarray(one(x, ids, w, wg, wu, wd)), atol=2e-6, rtol=1e-5)
    ids, w = routing("one_device")
    dropped = np.abs(np.asarray(run(x, ids, w, wgs, wus, wds))
                     - np.asarray(one(x, ids, w, wg, wu, wd))).max()
    assert dropped > 1e-3, "an overflowing buffer must drop assignments"
    lines.append(f"capacity_factor=4: exact on random routing, drops on overflow ({dropped:.2f})")
    return "OK " + "; ".join(lines)


def test_expert_parallel_equals_one_device():
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count=8 {FAST_XLA}",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(HERE))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and "OK " in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(HERE))
    print(_ep_check())
