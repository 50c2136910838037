"""DFlash drafters in the published layout (z-lab/dflash; what vLLM / SGLang load) <->
``specjax.dflash.DFlashHead``.

A directory with ``config.json`` (a Qwen3 config: ``architectures: ["DFlashDraftModel"]``,
``block_size``, ``num_target_layers``, ``dflash_config: {mask_token_id, target_layer_ids}``) and
``model.safetensors`` (no ``model.`` prefix)::

    fc.weight [H, A*E_t]                  # fc(concat of the target layers' outputs), no bias
    hidden_norm.weight [H], norm.weight [H]
    layers.{i}.{input_layernorm, post_attention_layernorm}.weight [H]
    layers.{i}.self_attn.{q,k,v,o}_proj.weight, layers.{i}.self_attn.{q,k}_norm.weight [D]
    layers.{i}.mlp.{gate,up,down}_proj.weight

Optional config keys of the reference code: ``input_embedding_scale``, ``output_multiplier`` and
``final_logit_softcapping`` are honoured; ``layer_types`` with ``sliding_attention`` (causal,
windowed layers), ``is_causal``, ``rope_scaling``, ``attention_bias`` and DFlash2's extras
(``DFlash2DraftModel``, conv / candidate-selector tensors) are refused by name. Torch Linear
weights are [out, in]; specjax stores [in, out].
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from specjax.dflash import DFlashConfig, DFlashHead, expected_shapes
from specjax.io.heads_io import _read_safetensors_file

ARCH = "DFlashDraftModel"
_LAYER_NAMES = {  # published name (after "layers.{i}.") -> (our key, transpose)
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True), "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True), "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_norm.weight": ("q_norm", False), "self_attn.k_norm.weight": ("k_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True), "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
}
_TOP_NAMES = {"fc.weight": ("fc", True), "hidden_norm.weight": ("hidden_norm", False),
              "norm.weight": ("norm", False)}
_DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def _name_table(cfg: DFlashConfig) -> dict:
    """published tensor name -> (params path, transpose)."""
    table = {n: ((k,), t) for n, (k, t) in _TOP_NAMES.items()}
    for i in range(cfg.num_layers):
        table.update({f"layers.{i}.{n}": (("layers", i, k), t) for n, (k, t) in _LAYER_NAMES.items()})
    return table


def is_dflash_dir(path) -> bool:
    """Whether ``path`` is a directory whose config.json names the DFlashDraftModel architecture
    (or has a ``dflash_config``): the dispatch test of ``load_draft``."""
    p = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(p):
        return False
    try:
        with open(p) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return False
    archs = d.get("architectures") or ()
    return isinstance(d, dict) and (any("DFlash" in a for a in archs) or "dflash_config" in d)


def config_from_hf(d: dict, target_cfg=None) -> DFlashConfig:
    """The DFlashConfig of a published config.json dict; ValueError naming an unsupported key."""
    archs = list(d.get("architectures") or [])
    if archs and archs != [ARCH]:
        raise ValueError(f"architectures {archs} is not supported (only [{ARCH!r}]; DFlash2 heads "
                         "add conv and candidate-selector tensors we do not run)")
    dc = d.get("dflash_config") or {}
    for key in _DFLASH2_KEYS:
        if key in dc or key in d:
            raise ValueError(f"DFlash2 config key {key!r} is not supported")
    types = d.get("layer_types")
    if types and any(t != "full_attention" for t in types):
        raise ValueError(f"layer_types {sorted(set(types))}: 'sliding_attention' (causal, windowed "
                         "DFlash layers) is not supported")
    if d.get("is_causal"):
        raise ValueError("is_causal = true (causal DFlash blocks) is not supported")
    if d.get("rope_scaling"):
        raise ValueError(f"rope_scaling {d['rope_scaling']!r} is not supported for DFlash heads")
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            raise ValueError(f"{key} = true is not supported for DFlash heads")
    if d.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {d['hidden_act']!r} is not supported (silu only)")

    def get(name, default=None):  # the reference reads dflash_config first, then the config
        return dc.get(name, d.get(name, default))

    ids = get("target_layer_ids")
    if ids is None:
        raise ValueError("config.json has no dflash_config.target_layer_ids")
    mask = get("mask_token_id")
    if mask is None:
        raise ValueError("config.json has no dflash_config.mask_token_id")
    heads = d["num_attention_heads"]
    softcap = get("final_logit_softcapping")
    vocab = target_cfg.vocab_size if target_cfg is not None else d["vocab_size"]
    if target_cfg is not None and d.get("vocab_size") not in (None, vocab):
        raise ValueError(f"config.json vocab_size {d['vocab_size']} != the target's vocab_size {vocab}")
    ntl = d.get("num_target_layers")
    if target_cfg is not None and ntl is not None and ntl != target_cfg.num_layers:
        raise ValueError(f"config.json num_target_layers {ntl} != the target's "
                         f"{target_cfg.num_layers} layers")
    return DFlashConfig(
        num_layers=d["num_hidden_layers"], hidden_size=d["hidden_size"], num_heads=heads,
        num_kv_heads=d.get("num_key_value_heads", heads),
        head_dim=d.get("head_dim") or d["hidden_size"] // heads,
        intermediate_size=d["intermediate_size"], block_size=int(get("block_size", 16)),
        mask_token_id=int(mask), target_layer_ids=tuple(int(i) for i in ids),
        target_hidden_size=int(d.get("target_hidden_size") or
                               (target_cfg.hidden_size if target_cfg is not None else d["hidden_size"])),
        vocab_size=vocab, rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(d.get("rope_theta", 1000000.0)),
        max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
        input_embedding_scale=float(get("input_embedding_scale", 1.0)),
        output_multiplier=float(get("output_multiplier", 1.0)),
        final_logit_softcapping=None if softcap is None else float(softcap))


def config_to_hf(cfg: DFlashConfig, num_target_layers: int, dtype: str = "float32") -> dict:
    """The published config.json dict of ``cfg``."""
    d = {"architectures": [ARCH], "model_type": "qwen3", "num_hidden_layers": cfg.num_layers,
         "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
         "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
         "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
         "rope_theta": cfg.rope_theta, "rope_scaling": None, "hidden_act": "silu",
         "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
         "attention_bias": False, "tie_word_embeddings": False, "torch_dtype": dtype,
         "block_size": cfg.block_size, "num_target_layers": num_target_layers,
         "dflash_config": {"mask_token_id": cfg.mask_token_id,
                           "target_layer_ids": list(cfg.target_layer_ids)}}
    if cfg.target_hidden_size != cfg.hidden_size:
        d["target_hidden_size"] = cfg.target_hidden_size
    for key in ("input_embedding_scale", "output_multiplier"):
        if getattr(cfg, key) != 1.0:
            d["dflash_config"][key] = getattr(cfg, key)
    if cfg.final_logit_softcapping is not None:
        d["dflash_config"]["final_logit_softcapping"] = cfg.final_logit_softcapping
    return d


def params_from_tensors(tensors: dict, cfg: DFlashConfig, source: str = "tensors",
                        dtype=jnp.float32) -> dict:
    """Published tensors -> params; ValueError naming a missing, unknown or mis-shaped tensor."""
    table = _name_table(cfg)
    unknown = sorted(set(tensors) - set(table))
    if unknown:
        raise ValueError(f"{source}: unknown DFlash tensors {unknown[:6]} (DFlash2-style heads and "
                         "other extras are not supported)")
    missing = sorted(set(table) - set(tensors))
    if missing:
        raise ValueError(f"{source}: missing DFlash tensors {missing[:6]}")
    want = expected_shapes(cfg)
    params = {"layers": [{} for _ in range(cfg.num_layers)]}
    for name, (path, transpose) in table.items():
        a = np.asarray(tensors[name])
        a = a.T if transpose else a
        if tuple(a.shape) != want[path]:
            got = tuple(a.shape[::-1]) if transpose else tuple(a.shape)
            exp = tuple(want[path][::-1]) if transpose else want[path]
            raise ValueError(f"{source}: tensor {name} has shape {got}, expected {exp}")
        a = jnp.asarray(np.ascontiguousarray(a), dtype)
        if path[0] == "layers":
            params["layers"][path[1]][path[2]] = a
        else:
            params[path[0]] = a
    return params


def load_dflash(path, target_cfg, dtype=jnp.float32) -> DFlashHead:
    """Reads a published DFlash directory, checked against the target's config (hidden size,
    vocabulary, mask_token_id range, fc input = number of target layers x target hidden size)."""
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    st = os.path.join(path, "model.safetensors")
    if not os.path.isfile(st):
        raise FileNotFoundError(f"{path!r} has no model.safetensors")
    tensors = _read_safetensors_file(st)
    cfg = config_from_hf(d, target_cfg)
    fc = tensors.get("fc.weight")
    if fc is not None:
        want = (cfg.hidden_size, len(cfg.target_layer_ids) * target_cfg.hidden_size)
        if tuple(fc.shape) != want:
            raise ValueError(f"{path!r}: tensor fc.weight has shape {tuple(fc.shape)}, expected "
                             f"{want} ({len(cfg.target_layer_ids)} target layers x the target's "
                             f"hidden size {target_cfg.hidden_size})")
    cfg.check_target(target_cfg)
    return DFlashHead(params=params_from_tensors(tensors, cfg, repr(path), dtype), config=cfg)


def save_dflash(head: DFlashHead, path: str, num_target_layers: int, dtype: str = "float32") -> None:
    """Writes ``head`` in the published layout (config.json + model.safetensors); ``dtype``
    "float32" or "float16"."""
    if dtype not in ("float32", "float16"):
        raise ValueError(f"save_dflash: dtype must be 'float32' or 'float16', got {dtype!r}")
    cfg = head.config
    tensors = {}
    for name, (p, transpose) in _name_table(cfg).items():
        a = head.params["layers"][p[1]][p[2]] if p[0] == "layers" else head.params[p[0]]
        a = np.asarray(a, dtype)
        tensors[name] = np.ascontiguousarray(a.T if transpose else a)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg, num_target_layers, dtype), f, indent=2)
