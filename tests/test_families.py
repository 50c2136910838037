"""Every registered family through sj.load_model(hf_dir): HF transformers parity (fp32), greedy
generation identical to HF, lossless speculation, DeepSeek-V3's MTP layer from the same
directory, sharded bf16 checkpoints, and the registry's errors."""

import json
import os
import tracemalloc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import specjax as sj
from specjax import registry
from tests.hf_families import FAMILIES, build

PROMPTS = [[5, 9, 13], [7, 3, 3, 8, 10, 11, 12]]
NEW = 10


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    path = str(tmp_path_factory.mktemp(request.param))
    hf = build(request.param, path)
    model = sj.load_model(path)
    return request.param, hf, model


def _hf_greedy(hf, prompt, n):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                          eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_family_logits_match_hf(family):
    """Logits within 1e-4 relative of transformers (fp32), through the family's registry entry."""
    model_type, hf, model = family
    assert registry.family_of(model.config) is registry.family_for_model_type(model_type)
    ids = np.random.RandomState(1).randint(0, model.config.vocab_size, size=24)
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None])).logits[0].numpy()
    ours = sj.logits(model, ids.tolist())
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel < 1e-4, (model_type, rel)


@pytest.mark.slow
def test_family_greedy_matches_hf_and_lossless(family):
    """Greedy generation identical to transformers, and draft speculation (layer-skip draft)
    identical to plain greedy decoding."""
    model_type, hf, model = family
    plain = sj.generate(model, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).tokens
    assert plain == [_hf_greedy(hf, p, NEW) for p in PROMPTS]
    draft = sj.early_exit_draft(model, 1)
    spec = sj.generate(model, PROMPTS, max_new_tokens=NEW, draft=draft, method="draft",
                       num_draft_tokens=2, eos_token_id=[])
    assert spec.tokens == plain


def _save_v3_with_mtp(path):
    """A DeepseekV3 directory holding its MTP module at model.layers.{L} (as DeepSeek ships
    it; transformers itself drops those tensors), num_nextn_predict_layers = 1."""
    from safetensors.torch import save_file

    from tests.test_deepseek import build_v3

    m, sd, _ = build_v3(3, vocab=97, num_hidden_layers=2)
    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().clone().contiguous() for k, v in sd.items()},
              os.path.join(path, "model.safetensors"))
    m.config.num_nextn_predict_layers = 1
    m.config.save_pretrained(path)
    return m


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("v3_mtp"))
    return path, _save_v3_with_mtp(path)


def test_deepseek_v3_mtp_from_same_dir(v3_dir):
    """sj.load_draft(dir, target) reads DeepSeek-V3's MTP module from the target's directory."""
    from specjax.heads import Head
    from specjax.io import deepseek_hf
    from tests.test_deepseek import build_v3

    path, hf = v3_dir
    target = sj.load_model(path)
    head = sj.load_draft(path, target=target)
    assert isinstance(head, Head) and head.config.kind == "mtp"
    assert registry.family_of(head.config.layer).name == "deepseek"
    _, sd, _ = build_v3(3, vocab=97, num_hidden_layers=2)
    want = deepseek_hf.mtp_head_from_hf(sd, target.config, target.params)
    assert head.config == want.config
    for a, b in zip(jax.tree.leaves(head.params), jax.tree.leaves(want.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_deepseek_v3_mtp_lossless(v3_dir):
    path, hf = v3_dir
    target = sj.load_model(path)
    ids = list(range(3, 20))
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(sj.logits(target, ids), ref, rtol=1e-4, atol=2e-4)
    head = sj.load_draft(path, target=target)
    plain = sj.generate(target, PROMPTS, max_new_tokens=NEW, eos_token_id=[]).tokens
    out = sj.generate(target, PROMPTS, max_new_tokens=NEW, draft=head, method="mtp",
                      num_draft_tokens=2, eos_token_id=[])
    assert out.tokens == plain
    from specjax.engine import Engine, EngineConfig  # the engine runs the family's forward too

    spec = sj.SpecConfig(method="mtp", num_draft_tokens=2, page_size=4)
    engine = Engine(target, head, EngineConfig(spec=spec, max_slots=2, batch_buckets=(2,),
                                               max_model_len=32))
    assert engine.generate(PROMPTS, sj.RequestParams(max_tokens=NEW, stop_token_ids=())) == plain


def test_unsupported_model_type_names_supported(tmp_path):
    with open(tmp_path / "config.json", "w") as f:
        json.dump({"model_type": "gpt2", "vocab_size": 10}, f)
    with pytest.raises(ValueError, match="gpt2.*deepseek_v2.*llama.*qwen3_moe"):
        sj.load_model(str(tmp_path))


def test_family_tables_cover_the_registry():
    """The loaders and sharding rules above the registry are keyed by family name and checked
    against it: a missing family or an unknown name fails on import (negative control below)."""
    from specjax.io import families as io_families
    from specjax.sharding import families as sharding_families

    names = {f.name for f in registry.FAMILIES}
    assert set(io_families.LOAD_HF) == names
    assert set(io_families.READ_MTP) == {"deepseek"}
    no_rules = {f.name for f in registry.FAMILIES if "sharding" in dict(f.unsupported)}
    assert no_rules == {"qwen3_moe"}  # the registry says why (no rules yet)
    assert set(sharding_families.SHARD) == names - no_rules
    with pytest.raises(ValueError, match=r"load_hf table: unknown families \[\], "
                                         r"no entry for \['gemma3', 'qwen3_moe'\]"):
        registry.check_table({"llama": None, "deepseek": None}, "load_hf")
    with pytest.raises(ValueError, match=r"unknown families \['gpt2'\]"):
        registry.check_table({"gpt2": None}, "read_mtp", every_family=False)


def test_family_without_sharding_rules_names_itself(tmp_path):
    """load_model(mesh=...) of a family with no sharding rules yet: a ValueError naming the
    family and the reason (the registry's ``unsupported``), raised by sharding.families."""
    from specjax.sharding import make_mesh

    build("qwen3_moe", str(tmp_path))
    with pytest.raises(ValueError, match="sharding does not support the qwen3_moe family yet: "
                                         "no expert-parallel"):
        sj.load_model(str(tmp_path), mesh=make_mesh())


def test_sharded_bf16_checkpoint(tmp_path):
    """model-0000x-of-0000y.safetensors + index, bf16: loads bit-exactly, tensor by tensor
    (host peak below 1.5x the checkpoint's bytes), and matches transformers on those weights."""
    hf = build("qwen3", vocab_size=8192, hidden_size=128, intermediate_size=256).to(torch.bfloat16)
    hf.save_pretrained(str(tmp_path), max_shard_size="1MB")
    shards = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))
    assert len(shards) >= 2 and os.path.isfile(tmp_path / "model.safetensors.index.json")
    ckpt_bytes = sum(os.path.getsize(tmp_path / f) for f in shards)
    sj.load_model(str(tmp_path), dtype=jnp.bfloat16)  # warm-up: first-use imports and caches
    # tracemalloc sees numpy's host buffers (not XLA's): the loader's host copies
    tracemalloc.start()
    model = sj.load_model(str(tmp_path), dtype=jnp.bfloat16)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    print(f"\nsharded bf16 load: {len(shards)} shards, {ckpt_bytes / 1e6:.2f} MB on disk, "
          f"peak traced host memory {peak / 1e6:.2f} MB ({peak / ckpt_bytes:.2f}x)")
    assert peak < 1.5 * ckpt_bytes
    assert model.params["embed"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(model.params["layers"][1]["wq"], np.float32),
        hf.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T)
    from transformers import Qwen3ForCausalLM  # fp32 from the bf16 files (fp32 RoPE tables)

    hf32 = Qwen3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ids = list(range(3, 40))
    with torch.no_grad():
        ref = hf32(torch.tensor([ids])).logits[0].numpy()
    ours = sj.logits(sj.load_model(str(tmp_path)), ids)  # bf16 weights cast to fp32
    assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-4


def test_family_orbax_checkpoint_roundtrip(family, tmp_path):
    """Our own checkpoint records the family, so every family loads back with its config class."""
    from specjax.io.checkpoint import save_checkpoint

    _, _, model = family
    save_checkpoint(str(tmp_path / "ckpt"), model.params, model.config)
    again = sj.load_model(str(tmp_path / "ckpt"))
    assert again.config == model.config
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(model.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_engine_accepts_every_family_and_rejects_unknown(family):
    from specjax.engine import Engine, EngineConfig

    _, _, model = family
    Engine(model, sj.early_exit_draft(model, 1),
           EngineConfig(spec=sj.SpecConfig(method="draft"), max_model_len=64))
    bogus = sj.Model(params=model.params, config=object())
    with pytest.raises(TypeError, match="not a registered model config"):
        Engine(bogus, None, EngineConfig())
