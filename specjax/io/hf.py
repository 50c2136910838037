"""transformers Llama-family directories (config.json + *.safetensors) <-> specjax params."""

from __future__ import annotations

import glob
import json
import os
import re

import numpy as np

from specjax.config import ModelConfig

# HF tensor name -> (our name, transpose?). One table, one shape check per tensor.
_LAYER_TABLE = {
    "input_layernorm.weight": ("attn_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.k_proj.weight": ("wk", True),
    "self_attn.v_proj.weight": ("wv", True),
    "self_attn.o_proj.weight": ("wo", True),
    "self_attn.q_proj.bias": ("bq", False),
    "self_attn.k_proj.bias": ("bk", False),
    "self_attn.v_proj.bias": ("bv", False),
    "self_attn.o_proj.bias": ("bo", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "mlp.gate_proj.bias": ("b_gate", False),
    "mlp.up_proj.bias": ("b_up", False),
    "mlp.down_proj.bias": ("b_down", False),
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_TOP_TABLE = {"model.embed_tokens.weight": ("embed", False), "model.norm.weight": ("norm", False),
              "lm_head.weight": ("lm_head", True)}


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file  # noqa: PLC0415

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path!r}")
    out = {}
    for f in files:
        try:
            out.update(load_file(f))
        except TypeError:  # bfloat16 is not a numpy dtype: go through torch if present
            import torch  # noqa: PLC0415
            from safetensors.torch import load_file as load_torch  # noqa: PLC0415
            out.update({k: v.to(torch.float32).numpy() for k, v in load_torch(f).items()})
    return out


def load_hf_dir(path: str, dtype=np.float32):
    """Loads a transformers Llama-family checkpoint directory.

    Returns:
      (ModelConfig, params) with numpy arrays of ``dtype`` in the specjax layout.
    """
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(cfg_path) as f:
        hf_cfg = json.load(f)
    archs = hf_cfg.get("architectures") or []
    if hf_cfg.get("model_type") not in (None, "llama", "mistral", "qwen2", "smollm3") and not any(
            "Llama" in a for a in archs):
        raise ValueError(f"{path!r}: model_type {hf_cfg.get('model_type')!r} is not Llama-family")
    cfg = ModelConfig.from_hf_config(hf_cfg)
    tensors = _read_safetensors(path)
    layers = [dict() for _ in range(cfg.num_layers)]
    params: dict = {"layers": layers}
    for name, arr in tensors.items():
        m = _LAYER_RE.match(name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            if rest.endswith("rotary_emb.inv_freq"):
                continue
            if rest not in _LAYER_TABLE or i >= cfg.num_layers:
                raise ValueError(f"unexpected tensor {name!r} in {path!r}")
            ours, transpose = _LAYER_TABLE[rest]
            layers[i][ours] = np.asarray(arr.T if transpose else arr, dtype=dtype)
        elif name in _TOP_TABLE:
            ours, transpose = _TOP_TABLE[name]
            params[ours] = np.asarray(arr.T if transpose else arr, dtype=dtype)
        else:
            raise ValueError(f"unexpected tensor {name!r} in {path!r}")
    if cfg.tie_word_embeddings:
        params.pop("lm_head", None)
    elif "lm_head" not in params:
        raise ValueError(f"{path!r}: untied config but no lm_head.weight")
    from specjax.model import check_params  # noqa: PLC0415

    check_params(params, cfg)
    return cfg, params


def iter_hf_tensors(params):
    """Yields (HF tensor name, our array, transpose?) for every tensor of a specjax params tree:
    the HF tensor is ``array.T`` when transpose is set (HF Linear weights are [out, in])."""
    inv_layer = {v[0]: (k, v[1]) for k, v in _LAYER_TABLE.items()}
    for ours, (hf_name, transpose) in {v[0]: (k, v[1]) for k, v in _TOP_TABLE.items()}.items():
        if ours in params:
            yield hf_name, params[ours], transpose
    for i, lp in enumerate(params["layers"]):
        for ours, arr in lp.items():
            hf_name, transpose = inv_layer[ours]
            yield f"model.layers.{i}.{hf_name}", arr, transpose


def hf_config_dict(cfg: ModelConfig, torch_dtype: str = "float32") -> dict:
    """The transformers LlamaForCausalLM config.json content for ``cfg``."""
    hf_cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim, "rope_theta": cfg.rope_theta, "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
        "mlp_bias": cfg.mlp_bias, "max_position_embeddings": cfg.max_position_embeddings,
        "bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_id,
        "hidden_act": "silu", "torch_dtype": torch_dtype,
    }
    if cfg.rope_scaling is not None:
        rs = cfg.rope_scaling
        hf_cfg["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor,
                                  "low_freq_factor": rs.low_freq_factor,
                                  "high_freq_factor": rs.high_freq_factor,
                                  "original_max_position_embeddings": rs.original_max_position_embeddings}
    return hf_cfg


def save_hf_dir(params, cfg: ModelConfig, path: str) -> None:
    """Writes params as a transformers LlamaForCausalLM directory (config.json + safetensors)."""
    from safetensors.numpy import save_file  # noqa: PLC0415

    os.makedirs(path, exist_ok=True)
    tensors = {}
    for hf_name, arr, transpose in iter_hf_tensors(params):
        a = np.asarray(arr, dtype=np.float32)
        tensors[hf_name] = np.ascontiguousarray(a.T if transpose else a)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg), f, indent=2)
