"""Draft-head checkpoints <-> ``specjax.heads.Head``.

Four formats:

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
* **EAGLE-3** (SafeAILab/EAGLE ``cnets.Model`` / SpecForge ``LlamaForCausalLMEagle3``: what vLLM
  and SGLang load), a directory with ``config.json`` (``architectures:
  ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, optional ``target_hidden_size`` and
  ``eagle_config.eagle_aux_hidden_state_layer_ids``) and ``model.safetensors`` or
  ``pytorch_model.bin``::

      fc.weight [E, 3E_t]                      # fc(cat(low, mid, high)), no bias
      midlayer.input_layernorm.weight [E]      # -> enorm (on the embedding)
      midlayer.hidden_norm.weight [E]          # -> hnorm (on the feature)
      midlayer.self_attn.{q,k,v}_proj.weight [., 2E], o_proj [E, H*D]
      midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight
      norm.weight [E]                          # -> final_norm
      lm_head.weight [Vd, E]                   # the head's own, over the draft vocabulary
      d2t [Vd] int64                           # draft id d -> target id d + d2t[d]
      t2d [V] bool                             # target id in the draft vocabulary
      embed_tokens.weight [V, E]               # optional; the target's when absent

  See load_eagle3 for the convention of ``eagle_aux_hidden_state_layer_ids``.
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
from safetensors.numpy import load_file, save_file

from specjax.config import ModelConfig
from specjax.heads import Head, HeadConfig, cast_floats, default_aux_layers, init_head
from specjax.io.checkpoint import load_checkpoint, save_checkpoint
from specjax.io.hf import _LAYER_TABLE, _read_safetensors

__all__ = ["load_eagle1", "load_eagle3", "save_eagle3", "is_eagle3_dir", "save_mtp_deepseek",
           "load_mtp_deepseek", "save_head", "load_head"]

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
        import torch  # noqa: PLC0415 - torch only for torch tensors
        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x = x.to(torch.float32)
        return x.numpy()
    return np.asarray(x)


def _read_safetensors_file(path: str) -> dict[str, np.ndarray]:
    try:
        return load_file(path)
    except TypeError:  # bfloat16: go through torch
        from safetensors.torch import load_file as load_torch  # noqa: PLC0415 - torch
        return {k: _to_numpy(v) for k, v in load_torch(path).items()}


def _read_torch_file(path: str) -> dict[str, np.ndarray]:
    import torch  # noqa: PLC0415 - torch only for .bin/.pt files
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
    if cfg.kind == "eagle3" and "embed" in params:  # an EAGLE-3 head's own embedding (optional)
        want[("embed",)] = (cfg.layer.vocab_size, cfg.layer.hidden_size)
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


# --------------------------------------------------------------------------------------- EAGLE-3

_EAGLE3_ARCH = "LlamaForCausalLMEagle3"
_EAGLE3_TOP = {"fc": ("fc.weight", True), "enorm": ("midlayer.input_layernorm.weight", False),
               "hnorm": ("midlayer.hidden_norm.weight", False),
               "final_norm": ("norm.weight", False), "lm_head": ("lm_head.weight", True)}


def _eagle3_table(cfg: HeadConfig):
    table = _name_table(cfg, dict(_EAGLE3_TOP, draft_vocab=("d2t", False)), "midlayer.")
    return {k: v for k, v in table.items() if k != "d2t"}  # d2t/t2d: int/bool, read separately


def is_eagle3_dir(path) -> bool:
    """True for a directory whose config.json names an EAGLE-3 architecture."""
    cfg_path = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(cfg_path):
        return False
    with open(cfg_path) as f:
        try:
            archs = json.load(f).get("architectures") or []
        except (json.JSONDecodeError, AttributeError):
            return False
    return any("eagle3" in str(a).lower() for a in archs)


def _shape_error(source, name, got, want, what=""):
    return ValueError(f"{source}: tensor {name!r} has shape {tuple(got)}, expected {tuple(want)}"
                      + (f" ({what})" if what else ""))


def load_eagle3(path_or_state_dict, target_cfg: ModelConfig, dtype=jnp.float32, *,
                hf_config: dict | None = None, aux_layers: tuple[int, ...] | None = None,
                target_params=None) -> Head:
    """Loads an EAGLE-3 head in the reference layout (see the module docstring).

    Which target hidden states are fused: without ``eagle_aux_hidden_state_layer_ids`` the
    default, the states *entering* layers (2, L//2, L-3) (transformers ``hidden_states[i]``);
    every engine agrees there. Explicit ids follow SpecForge's and SGLang's convention: id i
    names the layer whose *output* is taken, i.e. ``hidden_states[i + 1]`` (SpecForge writes its
    default as [1, L//2 - 1, L - 4] and SGLang captures ``[i + 1 for i in ids]``). vLLM passes the
    ids through as capture-before-layer indices, one layer lower; we follow SpecForge/SGLang
    because SpecForge trains and writes most published heads with explicit ids, and the ids we
    save round-trip through it. Pass ``aux_layers`` (hidden_states indices) to override.

    Args:
      path_or_state_dict: a directory (``config.json`` + ``*.safetensors`` or
        ``pytorch_model*.bin``), or a {name: array/tensor} dict with ``hf_config`` given.
      target_cfg: the target's ModelConfig (the fused features' width and layer count, vocab).
      dtype: the float params' dtype.
      hf_config: the head's config.json as a dict (default: read from the directory).
      aux_layers: override the fused layers (hidden_states indices in [0, L]).
      target_params: the target's params; an ``embed_tokens.weight`` equal to the target's
        embedding is then dropped (shared) instead of kept as the head's own ``embed``.
    Returns:
      Head(kind="eagle3"): fc [3E_t, E], enorm/hnorm/final_norm [E], layer (q/k/v [2E, .]),
      lm_head [E, Vd], draft_vocab [Vd] = arange(Vd) + d2t (absent for a full vocabulary),
      optional embed [V, E].
    Raises:
      ValueError naming the tensor (or config field) and both shapes when the checkpoint does not
      fit the target: hidden size, vocabulary, missing/unexpected tensors, d2t out of range.
    """
    tensors, file_cfg, source = _read_tensors(path_or_state_dict)
    hf = hf_config if hf_config is not None else file_cfg
    if hf is None:
        raise ValueError(f"{source}: an EAGLE-3 head needs its config.json (pass hf_config=...)")
    try:
        ecfg = ModelConfig.from_hf_config(dict(hf, num_hidden_layers=1))
    except KeyError as e:
        raise ValueError(f"{source}: config.json lacks {e.args[0]!r}") from None
    if ecfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(f"{source}: config.json vocab_size {ecfg.vocab_size} != the target's "
                         f"vocab_size {target_cfg.vocab_size}")
    et = int(hf.get("target_hidden_size") or target_cfg.hidden_size)
    if et != target_cfg.hidden_size:
        raise ValueError(f"{source}: config.json target_hidden_size {et} != the target's "
                         f"hidden_size {target_cfg.hidden_size}")
    num_layers = target_cfg.num_layers
    if aux_layers is None:
        ids = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        aux_layers = (default_aux_layers(num_layers) if ids is None
                      else tuple(int(i) + 1 for i in ids))
    aux_layers = tuple(int(i) for i in aux_layers)
    if not aux_layers or any(not 0 <= i <= num_layers for i in aux_layers):
        raise ValueError(f"{source}: fused layers {aux_layers} (hidden_states indices) must be in "
                         f"[0, {num_layers}] for a {num_layers}-layer target")
    v = target_cfg.vocab_size
    vd = int(hf.get("draft_vocab_size") or v)
    if not 0 < vd <= v:
        raise ValueError(f"{source}: config.json draft_vocab_size {vd} must be in [1, {v}]")
    layer = dataclasses.replace(
        ecfg, num_layers=1, attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
        max_position_embeddings=max(ecfg.max_position_embeddings,
                                    target_cfg.max_position_embeddings),
        bos_token_id=target_cfg.bos_token_id, eos_token_id=target_cfg.eos_token_id)
    tensors = dict(tensors)
    d2t = tensors.pop("d2t", None)
    t2d = tensors.pop("t2d", None)
    emb = tensors.pop("embed_tokens.weight", None)
    if d2t is None:
        raise ValueError(f"{source}: missing tensor 'd2t' (draft -> target id offsets, [{vd}])")
    d2t = np.asarray(d2t)
    if d2t.shape != (vd,):
        raise _shape_error(source, "d2t", d2t.shape, (vd,), "draft_vocab_size")
    vocab = np.arange(vd, dtype=np.int64) + d2t.astype(np.int64)
    if vocab.min() < 0 or vocab.max() >= v:
        bad = int(np.argmax((vocab < 0) | (vocab >= v)))
        raise ValueError(f"{source}: d2t maps draft id {bad} to target id {int(vocab[bad])}, "
                         f"outside the target's vocabulary [0, {v})")
    if len(np.unique(vocab)) != vd:
        raise ValueError(f"{source}: d2t maps two draft ids to the same target id")
    if t2d is not None:
        t2d = np.asarray(t2d)
        if t2d.shape != (v,):
            raise _shape_error(source, "t2d", t2d.shape, (v,), "vocab_size")
        want = np.zeros((v,), bool)
        want[vocab] = True
        if not np.array_equal(t2d.astype(bool), want):
            raise ValueError(f"{source}: t2d disagrees with d2t (t2d marks {int(t2d.sum())} "
                             f"target ids, d2t maps {vd})")
    full = vd == v and np.array_equal(vocab, np.arange(v))
    cfg = HeadConfig(kind="eagle3", layer=layer, norms=True, fc_bias=False,
                     draft_vocab_size=0 if full else vd, aux_layers=aux_layers,
                     target_hidden_size=et if et != layer.hidden_size else 0)
    params = _build_params(tensors, _eagle3_table(cfg), source, dtype,
                           skip=lambda n: n == "midlayer." + _ROTARY)
    if not full:
        params["draft_vocab"] = jnp.asarray(vocab, jnp.int32)
    if emb is not None:
        emb = np.asarray(emb)
        if emb.shape != (v, layer.hidden_size):
            raise _shape_error(source, "embed_tokens.weight", emb.shape, (v, layer.hidden_size))
        shared = (target_params is not None and layer.hidden_size == target_cfg.hidden_size
                  and np.array_equal(np.asarray(target_params["embed"], np.float32),
                                     np.asarray(emb, np.float32)))
        if not shared:
            params["embed"] = jnp.asarray(np.asarray(emb, np.float32), dtype)
    elif layer.hidden_size != target_cfg.hidden_size:
        raise ValueError(f"{source}: head hidden_size {layer.hidden_size} != the target's "
                         f"{target_cfg.hidden_size} and no embed_tokens.weight [V, E] of its own")
    return Head(params, cfg)


def save_eagle3(head: Head, path: str, *, target_params=None, dtype: str = "float32") -> None:
    """Writes an EAGLE-3 head in the reference layout (``config.json`` + ``model.safetensors``)
    that SafeAILab/EAGLE, SpecForge, vLLM and SGLang load.

    ``eagle_config.eagle_aux_hidden_state_layer_ids`` is written in SpecForge/SGLang's convention
    (id = aux layer - 1; see load_eagle3). ``target_params``: also write ``embed_tokens.weight``
    (the target's embedding; engines that load it from the target do not need it). A head
    without its own embedding is otherwise saved without one. Weights are written as ``dtype``
    ("float32", or "float16" to ship a head at half the size; loaders cast to their dtype).
    """
    cfg = head.config
    if cfg.kind != "eagle3":
        raise ValueError(f"save_eagle3 needs an EAGLE-3 head, got kind {cfg.kind!r}")
    if dtype not in ("float32", "float16"):
        raise ValueError(f"save_eagle3: dtype must be 'float32' or 'float16', got {dtype!r}")
    if min(cfg.aux_layers) < 1:
        raise ValueError(f"the reference layout names fused layers by the layer whose output they "
                         f"are: aux layer 0 (the embeddings) cannot be written ({cfg.aux_layers})")
    _check_params(head.params, cfg, "save_eagle3")
    tensors = {}
    for name, (path_, transpose, _) in _eagle3_table(cfg).items():
        a = head.params["layer"][path_[1]] if path_[0] == "layer" else head.params[path_[0]]
        a = np.asarray(a, dtype)
        tensors[name] = np.ascontiguousarray(a.T if transpose else a)
    lc = cfg.layer
    v = lc.vocab_size
    vocab = (np.asarray(head.params["draft_vocab"], np.int64) if cfg.draft_vocab_size
             else np.arange(v, dtype=np.int64))
    order = np.argsort(vocab, kind="stable")  # the reference keeps draft ids in target-id order
    if not np.array_equal(order, np.arange(len(vocab))):
        vocab = vocab[order]
        tensors["lm_head.weight"] = np.ascontiguousarray(tensors["lm_head.weight"][order])
    tensors["d2t"] = vocab - np.arange(len(vocab), dtype=np.int64)
    t2d = np.zeros((v,), bool)
    t2d[vocab] = True
    tensors["t2d"] = t2d
    emb = head.params.get("embed")
    if emb is None and target_params is not None:
        emb = target_params["embed"]
    if emb is not None:
        tensors["embed_tokens.weight"] = np.ascontiguousarray(np.asarray(emb, dtype))
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    hf_cfg = {
        "architectures": [_EAGLE3_ARCH], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": lc.hidden_size, "num_attention_heads": lc.num_heads,
        "num_key_value_heads": lc.num_kv_heads, "head_dim": lc.head_dim,
        "intermediate_size": lc.intermediate_size, "rms_norm_eps": lc.rms_norm_eps,
        "rope_theta": lc.rope_theta, "rope_scaling": None, "hidden_act": "silu",
        "max_position_embeddings": lc.max_position_embeddings, "vocab_size": v,
        "draft_vocab_size": len(vocab), "target_hidden_size": cfg.feature_size,
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "torch_dtype": dtype,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [i - 1 for i in cfg.aux_layers]},
    }
    if lc.rope_scaling is not None:
        rs = lc.rope_scaling
        hf_cfg["rope_scaling"] = {"rope_type": "llama3", "factor": rs.factor,
                                  "low_freq_factor": rs.low_freq_factor,
                                  "high_freq_factor": rs.high_freq_factor,
                                  "original_max_position_embeddings":
                                      rs.original_max_position_embeddings}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_cfg, f, indent=2)


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
    _check_params(head.params, head.config, "save_head")
    save_checkpoint(path, head.params, head.config.layer, kind="head",
                    extra={"head_config": head.config.to_dict()})


def load_head(path: str, dtype=None) -> Head:
    """Loads a head saved by save_head. dtype: cast the params (default: as saved)."""
    kind, _, params, extra = load_checkpoint(path)
    if kind != "head" or "head_config" not in (extra or {}):
        raise ValueError(f"{path!r} holds a {kind!r} checkpoint, not a draft head")
    cfg = HeadConfig.from_dict(extra["head_config"])
    _check_params(params, cfg, repr(path))
    return Head(cast_floats(params, dtype), cfg)
