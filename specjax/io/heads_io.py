"""Draft-head checkpoints <-> ``specjax.heads.Head``.

Three formats:

* **EAGLE-1** (SafeAILab/EAGLE ``cnets1.Model`` state dicts, ``pytorch_model.bin`` or
  ``*.safetensors`` + optional Llama-style ``config.json``)::

      fc.weight [E, 2E], fc.bias [E]  # fc(cat(inputs_embeds, hidden_states)): embedding first
      layers.0.self_attn.{q,k,v,o}_proj.weight
      layers.0.post_attention_layernorm.weight  # layer 0 has no input_layernorm
      layers.0.mlp.{gate,up,down}_proj.weight
      embed_tokens.weight [V, E]              # a frozen copy of the target's: checked, not loaded

  ``config.json`` may say ``"bias": false`` (fc without bias; EAGLE's loader defaults to true).
* **DeepSeek-V3 MTP** (what vLLM/SGLang load for ``num_nextn_predict_layers``), layer N = the
  target's ``num_hidden_layers`` ("the index after the last layer")::

      model.layers.{N}.enorm.weight, .hnorm.weight
      model.layers.{N}.eh_proj.weight [E, 2E]        # eh_proj(concat(enorm(embed), hnorm(hidden)))
      model.layers.{N}.shared_head.norm.weight
      model.layers.{N}.{input_layernorm, self_attn.*, post_attention_layernorm, mlp.*}.weight
      (model.layers.{N}.embed_tokens.weight, .shared_head.head.weight)  # target's: not loaded

  These readers/writers cover heads with a dense Llama block; a DeepSeek-V3 MTP block (MLA + MoE)
  is read with the DeepSeek target by ``specjax.io.deepseek_hf.mtp_head_from_hf``.
* **Ours**: orbax params + ``specjax_config.json`` (``kind="head"``, the HeadConfig in ``extra``).

Torch Linear weights are [out, in]; specjax stores [in, out], so every projection is transposed.
The block's names come from ``specjax.io.hf._LAYER_TABLE``; the expected tensor set and shapes come
from ``init_head`` (under ``jax.eval_shape``), so loaders and the model can't drift apart.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import re
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from specjax.config import ModelConfig
from specjax.heads import Head, HeadConfig, cast_floats, init_head
from specjax.io.hf import _LAYER_TABLE, _read_safetensors

__all__ = ["load_eagle1", "save_mtp_deepseek", "load_mtp_deepseek", "save_head", "load_head"]

# our layer-dict key -> (HF/torch name inside a decoder layer, transpose?)
_INV_LAYER = {ours: (name, transpose) for name, (ours, transpose) in _LAYER_TABLE.items()}
_ROTARY = "self_attn.rotary_emb.inv_freq"  # a buffer old transformers versions saved: skipped


# ------------------------------------------------------------------------------------- helpers

def _expected_shapes(cfg: HeadConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{path: shape} of a head's params, e.g. ("layer", "wq"): (E, H*D); from init_head's shapes."""
    tree = jax.eval_shape(lambda: init_head(cfg, jax.random.key(0)))
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            out.update({(k, kk): tuple(vv.shape) for kk, vv in v.items()})
        else:
            out[(k,)] = tuple(v.shape)
    return out


def _name_table(cfg: HeadConfig, top: Mapping[str, tuple[str, bool]], layer_prefix: str):
    """{torch name: (our path, transpose, our shape)} for every tensor ``cfg`` needs."""
    table = {}
    for path, shape in _expected_shapes(cfg).items():
        if path[0] == "layer":
            name, transpose = _INV_LAYER[path[1]]
            name = layer_prefix + name
        else:
            name, transpose = top[path[0]]
        table[name] = (path, transpose, shape)
    return table


def _to_numpy(x) -> np.ndarray:
    if hasattr(x, "detach"):  # a torch tensor (bf16 has no numpy dtype)
        import torch  # noqa: PLC0415
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x = x.to(torch.float32)
        return x.numpy()
    return np.asarray(x)


def _read_safetensors_file(path: str) -> dict[str, np.ndarray]:
    try:
        from safetensors.numpy import load_file  # noqa: PLC0415
        return load_file(path)
    except TypeError:  # bfloat16: go through torch
        from safetensors.torch import load_file as load_torch  # noqa: PLC0415
        return {k: _to_numpy(v) for k, v in load_torch(path).items()}


def _read_torch_file(path: str) -> dict[str, np.ndarray]:
    import torch  # noqa: PLC0415
    sd = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(sd, Mapping):
        raise ValueError(f"{path!r} does not hold a state dict (got {type(sd).__name__})")
    return {k: _to_numpy(v) for k, v in sd.items()}


def _read_tensors(src) -> tuple[dict[str, np.ndarray], dict | None, str]:
    """(tensors, config.json dict or None, description) from a state dict, a file or a directory."""
    if isinstance(src, Mapping):
        return {k: _to_numpy(v) for k, v in src.items()}, None, "state dict"
    path = os.fspath(src)
    if os.path.isfile(path):
        if path.endswith(".safetensors"):
            return _read_safetensors_file(path), None, repr(path)
        return _read_torch_file(path), None, repr(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is neither a state dict, a file nor a directory")
    cfg = None
    if os.path.isfile(os.path.join(path, "config.json")):
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    if glob.glob(os.path.join(path, "*.safetensors")):
        return _read_safetensors(path), cfg, repr(path)
    bins = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not bins:
        raise FileNotFoundError(f"{path!r} has no *.safetensors or pytorch_model*.bin")
    tensors = {}
    for b in bins:
        tensors.update(_read_torch_file(b))
    return tensors, cfg, repr(path)


def _build_params(tensors, table, source, dtype, shared: Mapping[str, tuple[int, ...]] = (),
                  skip=lambda name: False) -> dict:
    """Maps torch tensors to a head params dict; ValueError naming any missing, unexpected or
    mis-shaped tensor. ``shared``: names that may be present (the target's tensors) with the shape
    they must have; ``skip(name)``: names ignored outright."""
    params: dict = {"layer": {}}
    unexpected = []
    for name, arr in tensors.items():
        if name in table:
            path, transpose, shape = table[name]
            want = shape[::-1] if transpose else shape
            if tuple(arr.shape) != want:
                raise ValueError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, "
                                 f"expected {want}")
            value = jnp.asarray(np.asarray(arr.T if transpose else arr, np.float32), dtype)
            (params["layer"] if path[0] == "layer" else params)[path[-1]] = value
        elif name in shared:
            if tuple(arr.shape) != tuple(shared[name]):
                raise ValueError(f"{source}: tensor {name!r} has shape {tuple(arr.shape)}, "
                                 f"expected {tuple(shared[name])} (the target's; not loaded)")
        elif not skip(name):
            unexpected.append(name)
    missing = sorted(set(table) - set(tensors))
    if missing or unexpected:
        parts = ([f"missing tensors {missing}"] if missing else []) + (
            [f"unexpected tensors {sorted(unexpected)}"] if unexpected else [])
        raise ValueError(f"{source}: " + "; ".join(parts))
    return params


def _check_params(params, cfg: HeadConfig, source: str) -> None:
    want = _expected_shapes(cfg)
    have = {}
    for k, v in params.items():
        if isinstance(v, Mapping):
            have.update({(k, kk): tuple(np.shape(vv)) for kk, vv in v.items()})
        else:
            have[(k,)] = tuple(np.shape(v))
    if set(have) != set(want):
        raise ValueError(f"{source}: params {sorted(have)} do not match the head config's "
                         f"{sorted(want)}")
    for path, shape in want.items():
        if have[path] != shape:
            raise ValueError(f"{source}: {'/'.join(path)} has shape {have[path]}, expected {shape}")


# --------------------------------------------------------------------------------------- EAGLE-1

_EAGLE_TOP = {"eh_proj": ("fc.weight", True), "eh_bias": ("fc.bias", False)}


def _eagle_layer_config(target_cfg: ModelConfig, hf_cfg: dict | None, source: str) -> ModelConfig:
    """The head block's config: the target's dims, with eps/RoPE/biases from the head's config.json
    when there is one (EAGLE-1's block is a plain bias-free Llama layer otherwise)."""
    layer = dataclasses.replace(target_cfg, num_layers=1, attention_bias=False, mlp_bias=False)
    if hf_cfg is None:
        return layer
    try:
        ecfg = ModelConfig.from_hf_config(hf_cfg)
    except KeyError as e:
        raise ValueError(f"{source}: config.json lacks {e.args[0]!r}") from None
    if ecfg.num_layers != 1:
        raise ValueError(f"{source}: EAGLE head with {ecfg.num_layers} layers; only 1 is supported")
    dims = ("vocab_size", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
            "head_dim")
    bad = [f"{d} {getattr(ecfg, d)} != {getattr(target_cfg, d)}" for d in dims
           if getattr(ecfg, d) != getattr(target_cfg, d)]
    if bad:
        raise ValueError(f"{source}: EAGLE head config does not fit the target: {', '.join(bad)}")
    return dataclasses.replace(layer, rms_norm_eps=ecfg.rms_norm_eps, rope_theta=ecfg.rope_theta,
                               rope_scaling=ecfg.rope_scaling, attention_bias=ecfg.attention_bias,
                               mlp_bias=ecfg.mlp_bias)


def load_eagle1(path_or_state_dict, target_cfg: ModelConfig, dtype=jnp.float32) -> Head:
    """Loads an EAGLE-1 head (SafeAILab/EAGLE ``cnets1`` layout) for a Llama-family target.

    Args:
      path_or_state_dict: a directory (``pytorch_model.bin`` or ``*.safetensors``, optional
        ``config.json``), a single ``.bin``/``.safetensors`` file, or a {name: array/tensor} dict.
      target_cfg: the target's ModelConfig (the head shares its embedding and lm_head).
      dtype: the params' dtype.
    Returns:
      Head(kind="eagle", norms=False): ``eh_proj`` = fc.weight.T ([2E, E], rows: embed then
      feature), ``eh_bias`` = fc.bias, and a layer dict without ``attn_norm``.
    Raises:
      ValueError naming any missing, unexpected or mis-shaped tensor, or a config.json whose
      dimensions do not fit the target.
    """
    tensors, hf_cfg, source = _read_tensors(path_or_state_dict)
    layer = _eagle_layer_config(target_cfg, hf_cfg, source)
    fc_bias = bool(hf_cfg.get("bias", True)) if hf_cfg is not None else True
    cfg = dataclasses.replace(HeadConfig.for_target(target_cfg, "eagle"), layer=layer,
                              fc_bias=fc_bias)
    table = _name_table(cfg, _EAGLE_TOP, "layers.0.")
    shared = {"embed_tokens.weight": (target_cfg.vocab_size, target_cfg.hidden_size)}
    params = _build_params(tensors, table, source, dtype, shared,
                           skip=lambda n: n == "layers.0." + _ROTARY)
    return Head(params, cfg)


# ---------------------------------------------------------------------------------- DeepSeek MTP

def _mtp_top(prefix: str):
    return {"enorm": (prefix + "enorm.weight", False), "hnorm": (prefix + "hnorm.weight", False),
            "eh_proj": (prefix + "eh_proj.weight", True),
            "eh_bias": (prefix + "eh_proj.bias", False),
            "final_norm": (prefix + "shared_head.norm.weight", False)}


def _mtp_table(cfg: HeadConfig, layer_index: int):
    prefix = f"model.layers.{layer_index}."
    return _name_table(cfg, _mtp_top(prefix), prefix)


def save_mtp_deepseek(head: Head, path: str, layer_index: int, *, target_params=None,
                      write_config: bool | None = None) -> None:
    """Writes an MTP head (norms=True) under DeepSeek-V3 names ``model.layers.{layer_index}.*``.

    Args:
      head: the head; its config must have norms (EAGLE-1 heads have no enorm/hnorm: use save_head).
      path: a directory (writes ``model.safetensors`` and, by default, ``config.json``) or a
        ``*.safetensors`` file (written alone, e.g. next to a target's own files).
      layer_index: N, by DeepSeek's convention the target's num_layers.
      target_params: optional target params; when given, also writes the shared tensors DeepSeek
        checkpoints carry in the MTP layer (``embed_tokens.weight``, ``shared_head.head.weight``).
      write_config: write ``config.json`` (``num_nextn_predict_layers: 1``,
        ``num_hidden_layers: N``); default True for a directory, False for a file.
    Weights are written as float32.
    """
    from safetensors.numpy import save_file  # noqa: PLC0415

    cfg = head.config
    if not cfg.norms:
        raise ValueError("save_mtp_deepseek needs a head with norms (MTP); DeepSeek's layout has "
                         "enorm/hnorm/shared_head.norm. Save EAGLE-1 heads with save_head")
    if isinstance(layer_index, bool) or not isinstance(layer_index, int) or layer_index < 0:
        raise ValueError(f"layer_index must be an int >= 0, got {layer_index!r}")
    _check_params(head.params, cfg, "save_mtp_deepseek")
    tensors = {}
    for name, (path_, transpose, _) in _mtp_table(cfg, layer_index).items():
        a = head.params["layer"][path_[1]] if path_[0] == "layer" else head.params[path_[0]]
        a = np.asarray(a, np.float32)
        tensors[name] = np.ascontiguousarray(a.T if transpose else a)
    if target_params is not None:
        prefix = f"model.layers.{layer_index}."
        emb = np.asarray(target_params["embed"], np.float32)
        lm = target_params.get("lm_head")
        tensors[prefix + "embed_tokens.weight"] = np.ascontiguousarray(emb)
        tensors[prefix + "shared_head.head.weight"] = np.ascontiguousarray(
            emb if lm is None else np.asarray(lm, np.float32).T)
    is_file = os.fspath(path).endswith(".safetensors")
    directory = os.path.dirname(os.path.abspath(path)) if is_file else os.fspath(path)
    os.makedirs(directory, exist_ok=True)
    save_file(tensors, path if is_file else os.path.join(directory, "model.safetensors"))
    if write_config if write_config is not None else not is_file:
        lc = cfg.layer
        hf_cfg = {
            "model_type": "llama", "num_hidden_layers": layer_index, "num_nextn_predict_layers": 1,
            "vocab_size": lc.vocab_size, "hidden_size": lc.hidden_size,
            "intermediate_size": lc.intermediate_size, "num_attention_heads": lc.num_heads,
            "num_key_value_heads": lc.num_kv_heads, "head_dim": lc.head_dim,
            "rms_norm_eps": lc.rms_norm_eps, "rope_theta": lc.rope_theta,
            "attention_bias": lc.attention_bias, "mlp_bias": lc.mlp_bias, "hidden_act": "silu",
            "torch_dtype": "float32", "specjax_head_config": cfg.to_dict(),
        }
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(hf_cfg, f, indent=2)


_MTP_ENORM = re.compile(r"^model\.layers\.(\d+)\.enorm\.weight$")
_ANY_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def load_mtp_deepseek(path_or_state_dict, target_cfg: ModelConfig, layer_index: int | None = None,
                      dtype=jnp.float32) -> Head:
    """Loads an MTP head stored under DeepSeek-V3 names (see the module docstring).

    Args:
      path_or_state_dict: a directory (``*.safetensors``, optional ``config.json``), a
        ``.safetensors``/``.bin`` file, or a {name: array} dict. The target's own tensors
        (``model.embed_tokens``, ``model.norm``, ``lm_head``, other ``model.layers.i``) may be
        present, as in DeepSeek's combined checkpoints: they are ignored.
      target_cfg: the target's ModelConfig.
      layer_index: N; default: config.json's ``num_hidden_layers`` if that layer has an ``enorm``,
        else the only layer that has one.
    Returns:
      Head(kind="mtp", norms=True).
    Raises:
      ValueError naming missing, unexpected or mis-shaped tensors, or when N is ambiguous/absent.
    """
    tensors, hf_cfg, source = _read_tensors(path_or_state_dict)
    if layer_index is None:
        found = sorted(int(m.group(1)) for m in map(_MTP_ENORM.match, tensors) if m)
        hint = (hf_cfg or {}).get("num_hidden_layers")
        if hint in found:
            layer_index = hint
        elif len(found) == 1:
            layer_index = found[0]
        elif not found:
            raise ValueError(f"{source}: no MTP layer found (no model.layers.N.enorm.weight)")
        else:
            raise ValueError(f"{source}: several MTP layers {found}; pass layer_index")
    cfg = HeadConfig.for_target(target_cfg, "mtp")
    table = _mtp_table(cfg, layer_index)
    prefix = f"model.layers.{layer_index}."
    ve = (target_cfg.vocab_size, target_cfg.hidden_size)
    shared = {prefix + "embed_tokens.weight": ve, prefix + "shared_head.head.weight": ve}

    def skip(name):  # the target's tensors in a combined checkpoint
        m = _ANY_LAYER.match(name)
        if m:
            return int(m.group(1)) != layer_index or name == prefix + _ROTARY
        return name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")

    return Head(_build_params(tensors, table, source, dtype, shared, skip), cfg)


# ------------------------------------------------------------------------------------ our format

def save_head(head: Head, path: str) -> None:
    """Saves a head in specjax's orbax format (kind "head", the HeadConfig in ``extra``)."""
    from specjax.io.checkpoint import save_checkpoint  # noqa: PLC0415

    _check_params(head.params, head.config, "save_head")
    save_checkpoint(path, head.params, head.config.layer, kind="head",
                    extra={"head_config": head.config.to_dict()})


def load_head(path: str, dtype=None) -> Head:
    """Loads a head saved by save_head. dtype: cast the params (default: as saved)."""
    from specjax.io.checkpoint import load_checkpoint  # noqa: PLC0415

    kind, _, params, extra = load_checkpoint(path)
    if kind != "head" or "head_config" not in (extra or {}):
        raise ValueError(f"{path!r} holds a {kind!r} checkpoint, not a draft head")
    cfg = HeadConfig.from_dict(extra["head_config"])
    _check_params(params, cfg, repr(path))
    return Head(cast_floats(params, dtype), cfg)
