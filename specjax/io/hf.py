"""transformers directories (config.json + *.safetensors, sharded too) <-> specjax params.

``SafetensorsDir`` reads a directory's tensors lazily, one at a time (``safe_open``; sharded
``model-0000x-of-0000y.safetensors`` through ``model.safetensors.index.json``; bf16 as ml_dtypes'
bfloat16), so a loader never holds the whole checkpoint twice. ``load_hf_dir`` maps the
Llama-attention families' names (llama, mistral, qwen2, qwen3, qwen3_moe) to specjax params;
DeepSeek's names are in ``specjax.io.deepseek_hf``; ``specjax.io.families`` picks the loader.
"""

from __future__ import annotations

import collections.abc
import glob
import json
import os
import re

import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from specjax import registry
from specjax.config import ModelConfig
from specjax.model import check_params

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
    "self_attn.q_norm.weight": ("q_norm", False),
    "self_attn.k_norm.weight": ("k_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "mlp.gate_proj.bias": ("b_gate", False),
    "mlp.up_proj.bias": ("b_up", False),
    "mlp.down_proj.bias": ("b_down", False),
    "mlp.gate.weight": ("router", True),  # Qwen3-MoE router [X, E]
}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_EXPERT_RE = re.compile(r"^mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_TOP_TABLE = {"model.embed_tokens.weight": ("embed", False), "model.norm.weight": ("norm", False),
              "lm_head.weight": ("lm_head", True)}
INDEX_FILE = "model.safetensors.index.json"


class SafetensorsDir(collections.abc.Mapping):
    """A read-only {tensor name: numpy array} view of a directory's safetensors, read lazily.

    Each lookup reads one tensor from its file (``safetensors.safe_open``); with a
    ``model.safetensors.index.json`` the index's ``weight_map`` says which shard holds it.
    bfloat16 tensors come back as ml_dtypes' bfloat16 arrays (numpy has no bf16 of its own).
    """

    def __init__(self, path: str):
        self._open = safe_open
        self._handles: dict = {}
        self._headers: dict = {}
        index = os.path.join(path, INDEX_FILE)
        if os.path.isfile(index):
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            self._where = {name: os.path.join(path, fn) for name, fn in weight_map.items()}
            missing = sorted({f for f in self._where.values() if not os.path.isfile(f)})
            if missing:
                raise FileNotFoundError(f"{path!r}: {INDEX_FILE} names missing shards {missing}")
        else:
            files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
            if not files:
                raise FileNotFoundError(f"no *.safetensors files in {path!r}")
            self._where = {name: f for f in files for name in self._handle(f).keys()}

    def _handle(self, filename):
        if filename not in self._handles:
            self._handles[filename] = self._open(filename, framework="np")
        return self._handles[filename]

    def __getitem__(self, name: str) -> np.ndarray:
        h = self._handle(self._where[name])
        if h.get_slice(name).get_dtype() == "BF16":
            # numpy cannot decode BF16 itself: read the raw 16-bit words and reinterpret them.
            return _read_bf16(self._where[name], name, self._headers).view(ml_dtypes.bfloat16)
        return h.get_tensor(name)

    def __iter__(self):
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)


def _read_bf16(filename: str, name: str, headers: dict) -> np.ndarray:
    """One BF16 tensor as uint16 words, read from its byte range (safetensors' header gives the
    offsets: 8-byte little-endian header length, JSON header, then the data buffer); ``headers``
    caches each file's parsed header."""
    with open(filename, "rb") as f:
        if filename not in headers:
            n = int.from_bytes(f.read(8), "little")
            headers[filename] = (8 + n, json.loads(f.read(n)))
        base, header = headers[filename]
        meta = header[name]
        lo, hi = meta["data_offsets"]
        f.seek(base + lo)
        buf = f.read(hi - lo)
    return np.frombuffer(buf, np.uint16).reshape(meta["shape"])


def _read_safetensors(path: str) -> dict[str, np.ndarray]:
    """Every tensor of a directory as float32 numpy (small files: draft heads)."""
    tensors = SafetensorsDir(path)
    return {name: np.asarray(tensors[name], np.float32) for name in tensors}


def read_config(path: str) -> dict:
    """A transformers directory's config.json as a dict."""
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path!r} has no config.json")
    with open(cfg_path) as f:
        return json.load(f)


def load_hf_dir(path: str, dtype=np.float32, config_class=ModelConfig):
    """Loads a transformers Llama-attention checkpoint directory (llama, mistral, qwen2, qwen3,
    qwen3_moe), one tensor at a time.

    Args:
      path: the directory (config.json + one or several *.safetensors).
      dtype: the params' dtype (numpy / ml_dtypes: float32, bfloat16...); each tensor is cast
        as it is read.
      config_class: ModelConfig or a subclass (Qwen3MoeConfig); ``specjax.io.families`` picks it.
    Returns:
      (config, params) with host numpy arrays of ``dtype`` in the specjax layout.
    """
    cfg = config_class.from_hf_config(read_config(path))
    tensors = SafetensorsDir(path)
    layers = [dict() for _ in range(cfg.num_layers)]
    experts: dict = collections.defaultdict(dict)  # layer -> {(j, kind): [E, Fm] or [Fm, E]}
    params: dict = {"layers": layers}

    def conv(arr, transpose):
        return np.ascontiguousarray(np.asarray(arr.T if transpose else arr, dtype=dtype))

    for name in tensors:
        m = _LAYER_RE.match(name)
        if m:
            i, rest = int(m.group(1)), m.group(2)
            if rest.endswith("rotary_emb.inv_freq"):
                continue
            if i >= cfg.num_layers:
                raise ValueError(f"unexpected tensor {name!r} in {path!r}")
            if rest in _LAYER_TABLE:
                ours, transpose = _LAYER_TABLE[rest]
                layers[i][ours] = conv(tensors[name], transpose)
            elif rest == "mlp.experts.gate_up_proj":  # [X, 2Fm, E] (transformers >= 5, fused)
                arr = tensors[name]
                fm = arr.shape[1] // 2
                layers[i]["we_gate"] = conv(arr[:, :fm].transpose(0, 2, 1), False)
                layers[i]["we_up"] = conv(arr[:, fm:].transpose(0, 2, 1), False)
            elif rest == "mlp.experts.down_proj":  # [X, E, Fm]
                layers[i]["we_down"] = conv(tensors[name].transpose(0, 2, 1), False)
            elif (e := _EXPERT_RE.match(rest)) is not None:  # released checkpoints: per expert
                experts[i][(int(e.group(1)), e.group(2))] = conv(tensors[name], True)
            else:
                raise ValueError(f"unexpected tensor {name!r} in {path!r}")
        elif name in _TOP_TABLE:
            ours, transpose = _TOP_TABLE[name]
            params[ours] = conv(tensors[name], transpose)
        else:
            raise ValueError(f"unexpected tensor {name!r} in {path!r}")
    for i, got in experts.items():
        x = 1 + max(j for j, _ in got)
        for kind in ("gate", "up", "down"):
            layers[i][f"we_{kind}"] = np.stack([got.pop((j, kind)) for j in range(x)])
    if cfg.tie_word_embeddings:
        params.pop("lm_head", None)
    elif "lm_head" not in params:
        raise ValueError(f"{path!r}: untied config but no lm_head.weight")
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
    """The transformers config.json content for ``cfg`` (LlamaForCausalLM; Qwen3ForCausalLM when
    the config has per-head q/k norms)."""
    if registry.family_of(cfg).name != "llama":
        raise ValueError(f"save_hf_dir writes Llama-family directories; got a "
                         f"{registry.family_of(cfg).name} config")
    arch, model_type = ("Qwen3ForCausalLM", "qwen3") if cfg.qk_norm else ("LlamaForCausalLM", "llama")
    hf_cfg = {
        "architectures": [arch], "model_type": model_type,
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
    """Writes params as a transformers Llama (or Qwen3, with q/k norms) directory."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for hf_name, arr, transpose in iter_hf_tensors(params):
        a = np.asarray(arr, dtype=np.float32)
        tensors[hf_name] = np.ascontiguousarray(a.T if transpose else a)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg), f, indent=2)
