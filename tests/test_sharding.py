"""Tensor/data-parallel sharding: specs, HLO collectives, sharded == one device, two processes.

The device count is fixed when jax starts (this process has one device), so the mesh checks run
in subprocesses with fake CPU devices (tests/_sharding_check.py: 8 devices;
tests/_sharding_worker.py: 2 processes x 4 devices joined by jax.distributed). They are started
together so they share the machine's cores, and use XLA's cheap CPU codegen (compile time
dominates; both sides of every comparison are compiled the same way).
"""

import json
import math
import os
import re
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import specjax as sj
from specjax import gemma, registry, sharding
from specjax.config import ModelConfig
from specjax.model import Model, init_params
from specjax.sharding import families as sharding_families

HERE = os.path.dirname(os.path.abspath(__file__))
FAST_XLA = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
TIMEOUT_S = 900
# Split over two processes so that both cores work; together: every mesh, method, KV layout
# and draft placement (see _sharding_check.DEFAULT).
CHECKS = ["kv2:none:8:1,kv2:mtp:2:4", "kv8:draft:4:2,kv8:draft:8:1:sharded:no-tf,api"]
WORKER = ("draft", 4, 2)  # method, tp, dp: tp inside each process, dp across the two


def _env(devices: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env.update(XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_XLA}",
               JAX_PLATFORMS="cpu", PYTHONPATH=os.path.dirname(HERE))
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launcher:
    """Starts the subprocess groups once (lazily) and waits for their results."""

    def __init__(self, tmp):
        self.tmp, self.procs = tmp, {}

    def _start(self, name, args, devices):
        if name not in self.procs:
            self.procs[name] = subprocess.Popen(
                [sys.executable, *map(str, args)], env=_env(devices), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True)

    def start_checks(self, cases=CHECKS):
        for i, c in enumerate(cases):
            self._start(f"check{i}", [os.path.join(HERE, "_sharding_check.py"), c,
                                      self.tmp / f"check{i}.json"], 8)

    def start_workers(self, method=WORKER[0], tp=WORKER[1], dp=WORKER[2]):
        if "worker0" in self.procs:
            return
        port = _free_port()
        for i in range(2):
            self._start(f"worker{i}", [os.path.join(HERE, "_sharding_worker.py"), i, 2, port,
                                       self.tmp / f"worker{i}.json", method, tp, dp], 4)

    def wait(self, name):
        """(returncode, output) of a started process."""
        proc = self.procs[name]
        out, _ = proc.communicate(timeout=TIMEOUT_S)
        return proc.returncode, out

    def check_results(self, n=len(CHECKS)):
        records, api = [], {}
        for i in range(n):
            rc, out = self.wait(f"check{i}")
            assert rc == 0, out[-4000:]
            data = json.loads((self.tmp / f"check{i}.json").read_text())
            records += data["cases"]
            api.update(data.get("api_reference", {}))
        return records, api


@pytest.fixture(scope="module")
def launcher(tmp_path_factory):
    launch = Launcher(tmp_path_factory.mktemp("sharding"))
    yield launch
    for proc in launch.procs.values():
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def _tol(scale):
    return 2e-5 * max(1.0, scale)  # fp32: reductions split over devices change rounding only


def _check_record(r):
    assert r["tokens_equal"], r["case"]
    assert r["num_generated"] == 8 * 20
    assert r["accepted_per_pos"] == r["ref_accepted_per_pos"], r["case"]
    for what, diff in r["max_abs_diff"].items():
        assert diff <= _tol(r["logit_scale"]), (r["case"], what, diff)
    # The decode loop never gathers a weight (or the cache): every collective in it moves less
    # than the smallest tp-split weight and less than one page pool.
    smallest_weight = min(r["tp_split_weight_elements"])
    in_loop = [c for c in r["collectives"] if c[3]]
    for op, shape, elements, _ in in_loop:
        if op != "all-reduce":
            assert elements < smallest_weight, (r["case"], op, shape)
    for op, shape, elements, _ in r["collectives"]:  # prefill included
        assert elements < r["pool_elements"], (r["case"], op, shape)
    # TP really happens in the loop (the analysis sees it): the layers' all-reduces.
    assert any(op == "all-reduce" and len(shape.split(",")) == 3 for op, shape, _, _ in in_loop)
    # Pools [Hkv, P, S, D]: pages split over dp, KV heads over tp (repeated to lcm(Hkv, tp)).
    hkv, pages, s, d = r["pool_shape"]
    assert hkv == math.lcm(r["kv_heads"], r["tp"])
    assert r["pool_shard_shape"] == [hkv // r["tp"], pages // r["dp"], s, d]


@pytest.mark.slow
def test_sharded_generation_matches_one_device(launcher):
    """(tp=8), (tp=4, dp=2), (tp=2, dp=4) x plain / draft-target / MTP: greedy tokens identical,
    target and draft logits within fp32 tolerance, no weight or cache gathers in the loop."""
    launcher.start_checks()
    launcher.start_workers()  # overlaps with the checks
    records, _ = launcher.check_results()
    assert {(r["tp"], r["dp"]) for r in records} == {(8, 1), (4, 2), (2, 4)}
    assert {r["method"] for r in records} == {"none", "draft", "mtp"}
    assert {(r["tp"], r["dp"]) for r in records if "target_logits" in r["max_abs_diff"]} \
        == {(8, 1), (4, 2), (2, 4)}
    for r in records:
        _check_record(r)


@pytest.mark.slow  # default-run time (README: ~15 min on 2 cores); run with -m slow
def test_two_processes_generate_like_one(launcher):
    """2 CPU processes x 4 devices (jax.distributed, gloo) on a dp=2 x tp=4 mesh.

    Skipped only when this jax has no gloo CPU collectives (``jax_cpu_collectives_implementation``
    missing or not "gloo"), without which CPU processes cannot run collectives together; any
    worker failure otherwise fails the test."""
    if getattr(jax.config, "jax_cpu_collectives_implementation", None) != "gloo":
        pytest.skip("this jax has no gloo CPU collectives (jax_cpu_collectives_implementation)")
    launcher.start_checks()
    launcher.start_workers()
    outs = [launcher.wait(f"worker{i}") for i in range(2)]
    failed = [out for rc, out in outs if rc != 0]
    assert not failed, failed[0][-4000:]
    _, api = launcher.check_results()
    for i in range(2):
        data = json.loads((launcher.tmp / f"worker{i}.json").read_text())
        assert (data["process_count"], data["devices"], data["local"]) == (2, 8, 4)
        assert data["tokens"] == api[WORKER[0]]


@pytest.mark.slow
def test_sharded_full_matrix(tmp_path):
    """Both targets x every method x every mesh, and draft LLMs sharded like the target."""
    launch = Launcher(tmp_path)
    launch.start_checks(["full"])
    records, _ = launch.check_results(1)
    assert len(records) == 20
    for r in records:
        _check_record(r)


@pytest.mark.slow
@pytest.mark.parametrize("method,tp,dp", [("none", 8, 1), ("mtp", 8, 1)])
def test_two_processes_tp_across_processes(tmp_path, method, tp, dp):
    """TP spanning the two processes: every layer all-reduce crosses them."""
    launch = Launcher(tmp_path)
    launch.start_workers(method, tp, dp)
    launch.start_checks(["api"])
    for i in range(2):
        rc, out = launch.wait(f"worker{i}")
        assert rc == 0, out[-4000:]
    tokens = [json.loads((tmp_path / f"worker{i}.json").read_text())["tokens"] for i in range(2)]
    assert tokens[0] == tokens[1]
    assert len(tokens[0]) == 8


# Gemma 3 (windows of 6 < the sequences, every norm off its initial value). Default run: GQA
# on dp=2 x tp=2 with an early-exit draft (~20 s); the slow test adds MQA (its one KV head
# repeated to tp=2 and 4), n-gram drafts, plain decoding, tp=4 and a draft sharded like the
# target. (No replicated draft of the MQA target: its one-head pool is smaller than a prefill
# activation, which the pool-gather check of _check_record bounds.)
GEMMA_CHECKS = ["g2:draft:2:2"]
GEMMA_MORE = ["g1:ngram:2:1,g2:none:2:1,g2:draft:4:2,g2:ngram:2:2",
              "g1:ngram:4:1,g1:none:4:2,g2:draft:2:1:sharded"]


def _check_gemma(tmp_path, cases):
    launch = Launcher(tmp_path)
    launch.start_checks(cases)
    records, _ = launch.check_results(len(cases))
    assert len(records) == sum(len(c.split(",")) for c in cases)
    for r in records:
        _check_record(r)
        assert "target_logits" in r["max_abs_diff"], r["case"]
        if r["method"] != "none":  # speculation really ran on the mesh
            assert sum(r["accepted_per_pos"]) > 0, r["case"]
    return records


def test_gemma3_sharded_generation_matches_one_device(tmp_path):
    """Gemma 3 on a dp=2 x tp=2 mesh (post-attention / post-MLP and q/k norms replicated, heads
    and MLP split over tp, sliding-window attention per dp shard): greedy tokens with an
    early-exit draft identical to one device, teacher-forced and carried draft logits within
    fp32 tolerance, KV pools split over tp and dp, no weight or pool gathered in the loop."""
    (r,) = _check_gemma(tmp_path, GEMMA_CHECKS)
    assert (r["method"], r["tp"], r["dp"], r["kv_heads"]) == ("draft", 2, 2, 2)
    assert "draft_logits" in r["max_abs_diff"]


@pytest.mark.slow
def test_gemma3_sharded_matrix(tmp_path):
    """The other Gemma 3 cases: MQA (one KV head repeated to tp=2 and tp=4), n-gram drafts,
    plain decoding, tp=4 x dp=2, a draft LLM sharded like the target."""
    records = _check_gemma(tmp_path, GEMMA_MORE)
    assert {r["method"] for r in records} == {"none", "ngram", "draft"}
    assert {r["kv_heads"] for r in records} == {1, 2}
    assert {(r["tp"], r["dp"]) for r in records} == {(2, 1), (2, 2), (4, 1), (4, 2)}


# ------------------------------------------------------------------ specs (one device, cheap)

def _cfg(**kw):
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=192, num_layers=1, num_heads=8,
                num_kv_heads=2, head_dim=16)
    return ModelConfig(**{**base, **kw})


def _shapes(cfg):
    return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def test_layer_specs_split_heads_mlp_and_vocab():
    cfg = _cfg()
    params = _shapes(cfg)
    for tp, kv in ((2, "tp"), (8, None)):  # Hkv = 2: split at tp=2; at tp=8 repeat_kv_heads first
        specs = sharding.model_specs(params, cfg, tp)
        lp = specs["layers"][0]
        assert lp["wq"] == P(None, "tp") and lp["wo"] == P("tp", None)
        assert lp["w_gate"] == lp["w_up"] == P(None, "tp") and lp["w_down"] == P("tp", None)
        assert lp["wk"] == lp["wv"] == P(None, kv)
        assert lp["attn_norm"] == P()
        assert specs["embed"] == P("tp", None) and specs["lm_head"] == P(None, "tp")
        assert sharding.kv_spec(cfg.num_kv_heads, tp) == P(kv, "dp", None, None)
    odd_vocab = _cfg(vocab_size=100)  # tp=8 does not divide V: embed / lm_head replicated
    specs = sharding.model_specs(_shapes(odd_vocab), odd_vocab, 8)
    assert specs["embed"] == P(None, None) and specs["lm_head"] == P(None, None)


def test_repeat_kv_heads_gives_each_query_head_its_kv_head():
    cfg = _cfg(num_kv_heads=2)  # H = 8, D = 16
    params = jax.tree.map(lambda a: np.random.default_rng(0).normal(size=a.shape).astype(a.dtype),
                          _shapes(cfg))
    params["layers"][0]["bv"] = np.arange(2 * 16, dtype=np.float32)
    for tp, want in ((2, 2), (4, 4), (8, 8)):
        rep, rcfg = sharding.repeat_kv_heads(params, cfg, tp)
        assert rcfg.num_kv_heads == want and rcfg.num_heads == 8
        lp, rlp = params["layers"][0], rep["layers"][0]
        wk, rwk = lp["wk"].reshape(64, 2, 16), np.asarray(rlp["wk"]).reshape(64, want, 16)
        for j in range(8):  # query head j reads KV head j // group, before and after
            np.testing.assert_array_equal(rwk[:, j // (8 // want)], wk[:, j // 4])
        np.testing.assert_array_equal(np.asarray(rlp["bv"]).reshape(want, 16)[-1],
                                      lp["bv"].reshape(2, 16)[-1])
        assert rlp["wq"] is lp["wq"]
        assert sharding.model_specs(rep, rcfg, tp)["layers"][0]["wk"] == P(None, "tp")


def test_tp_must_divide_heads_and_mlp():
    smol_like = _cfg(num_heads=9, num_kv_heads=3, head_dim=8, intermediate_size=192)
    with pytest.raises(ValueError, match=r"tp=2 does not divide the target's num_heads=9.*\[1, 3"):
        sharding.check_tp(smol_like, 2, "target")
    with pytest.raises(ValueError, match="intermediate_size=100"):
        sharding.check_tp(_cfg(intermediate_size=100), 8)
    sharding.check_tp(smol_like, 3)
    from specjax import deepseek  # noqa: PLC0415

    ds = deepseek.DeepseekConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                                 moe_intermediate_size=8, num_layers=2, num_heads=4,
                                 kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                                 v_head_dim=8)
    with pytest.raises(ValueError, match="Llama-family.*DeepseekConfig.*deepseek.make_mesh"):
        sharding.check_tp(ds, 2, "target")
    with pytest.raises(ValueError, match="Llama-family"):
        sharding.repeat_kv_heads({}, ds, 2)


def test_plan_and_mesh_validation():
    with pytest.raises(ValueError, match="needs 16 devices"):
        sharding.make_mesh(tp=8, dp=2)
    with pytest.raises(ValueError, match="tp must be an int >= 1"):
        sharding.make_mesh(tp=0)
    mesh = sharding.make_mesh()
    assert mesh.axis_names == ("dp", "tp") and mesh.devices.shape == (1, 1)
    with pytest.raises(ValueError, match="draft_placement"):
        sharding.ShardingPlan(mesh, "everywhere")
    with pytest.raises(TypeError, match="Mesh or a specjax.sharding.ShardingPlan"):
        sharding.as_plan("tp=8")
    target, draft = (Model(jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), _shapes(c)), c)
                     for c in (_cfg(), _cfg(num_layers=1)))  # zeros: nothing runs
    with pytest.raises(ValueError, match='draft_placement="leader".*replicated'):
        sj.generate(target, [[1, 2]], max_new_tokens=2, draft=draft, method="draft",
                    mesh=sharding.ShardingPlan(mesh, "leader"))
    placed = sharding.shard_draft(draft, sharding.ShardingPlan(mesh, "leader"))
    assert placed.params["embed"].devices() == {mesh.devices[0, 0]}


_HLO = """HloModule m

%inner (p: f32[8,64]) -> f32[32,64] {
  %p = f32[8,64]{1,0} parameter(0)
  ROOT %ag = f32[32,64]{1,0} all-gather(%p), dimensions={0}
}

%body (t: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %t = (s32[], f32[8,64]{1,0}) parameter(0)
  %x = f32[8,64]{1,0} get-tuple-element(%t), index=1
  %ar = f32[8,64]{1,0} all-reduce(%x), to_apply=%add
  %c = f32[32,64]{1,0} call(%x), to_apply=%inner
  ROOT %r = (s32[], f32[8,64]{1,0}) tuple(%i, %ar)
}

%cond (t: (s32[], f32[8,64])) -> pred[] {
  %t = (s32[], f32[8,64]{1,0}) parameter(0)
  ROOT %done = pred[] all-reduce(%t), to_apply=%or
}

ENTRY %main (a: f32[8,64]) -> f32[8,64] {
  %a = f32[8,64]{1,0} parameter(0)
  %pre = f32[16,64]{1,0} all-gather(%a), dimensions={0}
  %w = (s32[], f32[8,64]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %o = f32[8,64]{1,0} get-tuple-element(%w), index=1
}
"""


def test_collectives_marks_what_runs_inside_the_loop():
    found = {(c.op, c.shape, c.elements, c.in_loop) for c in sharding.collectives(_HLO)}
    assert found == {("all-gather", "f32[16,64]", 1024, False),
                     ("all-reduce", "f32[8,64]", 512, True),
                     ("all-gather", "f32[32,64]", 2048, True),  # via a call in the body
                     ("all-reduce", "pred[]", 1, True)}  # the loop condition


def test_sharded_attention_is_an_explicit_static_choice():
    """The sharded attention core is an attn_impl value (hashable, in the jit key), not a global:
    on a 1-device plan it gives the reference logits, and no module-level switch is left."""
    import specjax.model as model_mod  # noqa: PLC0415
    from specjax import kv_cache  # noqa: PLC0415

    assert not any(type(v).__name__ == "ContextVar" for v in vars(model_mod).values())
    cfg = _cfg(num_layers=1)
    params = init_params(cfg, jax.random.key(0), scale=0.3)
    plan = sharding.ShardingPlan(sharding.make_mesh())
    impl = sharding.ShardedAttention.for_models(plan, cfg)
    assert hash(impl) == hash(sharding.ShardedAttention.for_models(plan, cfg))
    tokens = np.asarray([[3, 1, 4, 1, 5]], np.int32)
    kv, pt = kv_cache.init_contiguous(cfg, 1, 5)
    pos = np.arange(5, dtype=np.int32)[None]
    fwd = jax.jit(lambda p, a: model_mod.forward(p, cfg, tokens, pos, kv, pt,
                                                 np.zeros(1, np.int32), attn_impl=a)[0],
                  static_argnums=1)
    np.testing.assert_allclose(np.asarray(fwd(params, impl)), np.asarray(fwd(params, "reference")),
                               atol=1e-6)


def test_library_uses_no_private_jax_api():
    root = os.path.join(os.path.dirname(HERE), "specjax")
    private = re.compile(r"^\s*(from|import)\s+jax\._src", re.M)
    offenders = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs
                 if f.endswith(".py") and private.search(open(os.path.join(d, f)).read())]
    assert not offenders, offenders


def _gemma_cfg(**kw):
    base = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 192, "num_layers": 2,
            "num_heads": 8, "num_kv_heads": 2, "head_dim": 16, "sliding_window": 4,
            "tie_word_embeddings": True, "layer_types": (gemma.SLIDING, gemma.FULL)}
    return gemma.Gemma3Config(**{**base, **kw})


def test_gemma3_specs_replicate_norms_and_split_like_llama():
    """Gemma 3's extra tensors (post-attention / post-MLP norms, per-head q/k norms [D]) are
    replicated, its projections split as Llama's; load_model(mesh=)'s rules place it; a tp that
    does not divide the heads or the MLP is a ValueError naming them."""
    cfg = _gemma_cfg()
    params = registry.init_params(cfg, jax.random.key(0))
    specs = sharding.model_specs(params, cfg, 2)
    lp = specs["layers"][0]
    for name in ("attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm", "q_norm", "k_norm"):
        assert lp[name] == P(), name
    assert lp["wq"] == lp["wk"] == lp["w_up"] == P(None, "tp") and lp["wo"] == P("tp", None)
    assert specs["embed"] == P("tp", None) and specs["norm"] == P() and "lm_head" not in specs
    mqa = _gemma_cfg(num_kv_heads=1)
    rep, rcfg = sharding.repeat_kv_heads(registry.init_params(mqa, jax.random.key(1)), mqa, 4)
    assert rcfg.num_kv_heads == 4 and rcfg.layer_types == mqa.layer_types
    assert rep["layers"][0]["k_norm"].shape == (16,)  # per head_dim: shared by the copies
    placed = sharding_families.shard(Model(params, cfg), sharding.make_mesh())
    assert type(placed.config) is type(cfg)
    with pytest.raises(ValueError, match=r"tp=3 does not divide the target's num_heads=8"):
        sharding.model_specs(params, cfg, 3)
    with pytest.raises(ValueError, match=r"intermediate_size=100"):
        sharding.check_tp(_gemma_cfg(intermediate_size=100), 8, "target")
