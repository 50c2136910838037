"""HF DeepSeek-V2/V3 state dicts <-> ``specjax.deepseek`` params, and the V3 MTP layer as a Head.

Names (torch Linear weights are [out, in]; specjax stores [in, out], so projections transpose)::

    model.embed_tokens.weight [V, E]                      -> embed
    model.norm.weight, lm_head.weight [V, E]              -> norm, lm_head [E, V]
    model.layers.{i}.input_layernorm / post_attention_layernorm -> attn_norm / mlp_norm
      self_attn.q_proj | q_a_proj, q_a_layernorm, q_b_proj   -> wq | wq_a, q_norm, wq_b
      self_attn.kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj -> wkv_a, kv_norm, wkv_b, wo
      mlp.{gate,up,down}_proj                             -> w_gate, w_up, w_down (dense layers)
      mlp.gate.weight [X, E], mlp.gate.e_score_correction_bias -> router [E, X], router_bias
      mlp.experts.gate_up_proj [X, 2Fm, E], .down_proj [X, E, Fm]   (transformers >= 5, fused)
        or mlp.experts.{j}.{gate,up,down}_proj.weight    (DeepSeek's released checkpoints)
                                                          -> we_gate, we_up [X, E, Fm], we_down [X, Fm, E]
      mlp.shared_experts.{gate,up,down}_proj             -> ws_gate, ws_up, ws_down
    MTP layer N = num_hidden_layers (+ m for the m-th MTP module):
      model.layers.{N}.enorm, .hnorm, .eh_proj [E, 2E], .shared_head.norm, (.shared_head.head,
      .embed_tokens: the target's own in V3 — used only when they differ) + the block above.

Every tensor's shape is checked against ``deepseek.init_params`` / ``init_layer`` (under
``jax.eval_shape``), so the loader and the model cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from specjax import deepseek
from specjax.deepseek import DeepseekConfig
from specjax.heads import Head, HeadConfig
from specjax.io.hf import SafetensorsDir, read_config
from specjax.model import Model

__all__ = ["params_from_hf", "mtp_head_from_hf", "model_from_hf", "load_hf_dir", "load_mtp_dir"]

# HF name inside a decoder layer -> (our key, transpose?)
_LAYER_TABLE = {
    "input_layernorm.weight": ("attn_norm", False),
    "post_attention_layernorm.weight": ("mlp_norm", False),
    "self_attn.q_proj.weight": ("wq", True),
    "self_attn.q_a_proj.weight": ("wq_a", True),
    "self_attn.q_a_layernorm.weight": ("q_norm", False),
    "self_attn.q_b_proj.weight": ("wq_b", True),
    "self_attn.kv_a_proj_with_mqa.weight": ("wkv_a", True),
    "self_attn.kv_a_layernorm.weight": ("kv_norm", False),
    "self_attn.kv_b_proj.weight": ("wkv_b", True),
    "self_attn.o_proj.weight": ("wo", True),
    "mlp.gate_proj.weight": ("w_gate", True),
    "mlp.up_proj.weight": ("w_up", True),
    "mlp.down_proj.weight": ("w_down", True),
    "mlp.gate.weight": ("router", True),
    "mlp.gate.e_score_correction_bias": ("router_bias", False),
    "mlp.shared_experts.gate_proj.weight": ("ws_gate", True),
    "mlp.shared_experts.up_proj.weight": ("ws_up", True),
    "mlp.shared_experts.down_proj.weight": ("ws_down", True),
}
_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_MTP_EXTRA = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
              "shared_head.head.weight", "embed_tokens.weight")


def _np(x):
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().float().cpu().numpy()
    return np.asarray(x, np.float32)


def load_hf_dir(path: str, dtype=jnp.float32):
    """(DeepseekConfig, params) from a transformers DeepSeek-V2/V3 directory (config.json +
    *.safetensors, sharded too), read tensor by tensor (``io.hf.SafetensorsDir``)."""
    cfg = DeepseekConfig.from_hf_config(read_config(path))
    return cfg, params_from_hf(SafetensorsDir(path), cfg, dtype)


def load_mtp_dir(path: str, target, index: int = 0, dtype=None) -> Head:
    """DeepSeek-V3's ``index``-th MTP module from the target's own HF directory, as an MTP Head
    for ``target`` (a specjax Model of that directory)."""
    cfg = DeepseekConfig.from_hf_config(read_config(path))
    if cfg.num_mtp_layers <= index:
        raise ValueError(f"{path!r} has {cfg.num_mtp_layers} MTP layers (num_nextn_predict_layers); "
                         f"asked for MTP layer {index}")
    base = dataclasses.replace(cfg, num_mtp_layers=0)
    if dataclasses.replace(target.config, num_mtp_layers=0, moe_micro_batches=1) != base:
        raise ValueError(f"{path!r}'s config does not match the target's: load the MTP layer from "
                         "the target's own directory")
    return mtp_head_from_hf(SafetensorsDir(path), target.config, target.params, index,
                            dtype or target.dtype)


def _layer(sd: Mapping, prefix: str, want: dict, dtype) -> dict:
    """One block's params from names under ``prefix`` (e.g. "model.layers.3.")."""
    lp, experts = {}, {}
    for name in sd:  # names first: a lazy state dict (io.hf.SafetensorsDir) reads only these
        if not name.startswith(prefix):
            continue
        rest = name[len(prefix):]
        if rest in _MTP_EXTRA or rest.endswith("rotary_emb.inv_freq"):
            continue
        value = sd[name]
        if rest in _LAYER_TABLE:
            ours, transpose = _LAYER_TABLE[rest]
            arr = _np(value)
            lp[ours] = arr.T if transpose else arr
        elif rest == "mlp.experts.gate_up_proj":  # [X, 2Fm, E]
            arr = _np(value)
            fm = arr.shape[1] // 2
            lp["we_gate"] = arr[:, :fm].transpose(0, 2, 1)
            lp["we_up"] = arr[:, fm:].transpose(0, 2, 1)
        elif rest == "mlp.experts.down_proj":  # [X, E, Fm]
            lp["we_down"] = _np(value).transpose(0, 2, 1)
        elif (m := _EXPERT.fullmatch(rest)) is not None:
            experts[(int(m.group(1)), m.group(2))] = _np(value).T
        else:
            raise ValueError(f"unexpected tensor {name!r}")
    if experts:
        x = 1 + max(j for j, _ in experts)
        for kind in ("gate", "up", "down"):
            lp[f"we_{kind}"] = np.stack([experts[(j, kind)] for j in range(x)])
    missing = sorted(set(want) - set(lp))
    extra = sorted(set(lp) - set(want))
    if missing or extra:
        raise ValueError(f"{prefix}: missing {missing}, unexpected {extra}")
    for k, arr in lp.items():
        if tuple(arr.shape) != tuple(want[k].shape):
            raise ValueError(f"{prefix}{k}: shape {arr.shape}, expected {tuple(want[k].shape)}")
    return {k: jnp.asarray(v, dtype) for k, v in lp.items()}


def params_from_hf(sd: Mapping, cfg: DeepseekConfig, dtype=jnp.float32) -> dict:
    """Target params from an HF state dict (torch tensors or arrays); MTP layers are ignored."""
    want = jax.eval_shape(lambda: deepseek.init_params(cfg, jax.random.key(0)))
    params = {"embed": jnp.asarray(_np(sd["model.embed_tokens.weight"]), dtype),
              "norm": jnp.asarray(_np(sd["model.norm.weight"]), dtype),
              "layers": [_layer(sd, f"model.layers.{i}.", want["layers"][i], dtype)
                         for i in range(cfg.num_layers)]}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = jnp.asarray(_np(sd["lm_head.weight"]).T, dtype)
    for k in ("embed", "norm") + (() if cfg.tie_word_embeddings else ("lm_head",)):
        if params[k].shape != want[k].shape:
            raise ValueError(f"{k}: shape {params[k].shape}, expected {want[k].shape}")
    return params


def mtp_head_from_hf(sd: Mapping, cfg: DeepseekConfig, target_params: dict | None = None,
                     index: int = 0, dtype=jnp.float32) -> Head:
    """The m-th (``index``) MTP module at ``model.layers.{L + index}`` as an MTP ``Head``.

    The head's ``shared_head.head`` / ``embed_tokens`` are the target's in DeepSeek-V3; when
    ``target_params`` is given and the head's lm_head differs, it is kept as ``lm_head`` [E, V].
    """
    n = cfg.num_layers + index
    p = f"model.layers.{n}."
    if p + "eh_proj.weight" not in sd:
        raise ValueError(f"no MTP layer at {p}* in the state dict")
    block_cfg = cfg.mtp_block_config()
    want = jax.eval_shape(lambda: deepseek.init_layer(block_cfg, jax.random.key(0), moe_layer=block_cfg.is_moe_layer(0)))
    e = cfg.hidden_size
    eh = _np(sd[p + "eh_proj.weight"])
    if eh.shape != (e, 2 * e):
        raise ValueError(f"{p}eh_proj.weight: shape {eh.shape}, expected {(e, 2 * e)}")
    params = {"enorm": jnp.asarray(_np(sd[p + "enorm.weight"]), dtype),
              "hnorm": jnp.asarray(_np(sd[p + "hnorm.weight"]), dtype),
              "eh_proj": jnp.asarray(eh.T, dtype),
              "final_norm": jnp.asarray(_np(sd[p + "shared_head.norm.weight"]), dtype),
              "layer": _layer(sd, p, want, dtype)}
    head_w = sd.get(p + "shared_head.head.weight")
    if head_w is not None and target_params is not None:
        w = _np(head_w).T
        own = (np.asarray(target_params["embed"]).T if cfg.tie_word_embeddings
               else np.asarray(target_params["lm_head"]))
        if w.shape != own.shape or not np.array_equal(w, own):
            params["lm_head"] = jnp.asarray(w, dtype)
    return Head(params=params, config=HeadConfig(kind="mtp", layer=block_cfg, norms=True))


def model_from_hf(hf_model, dtype=jnp.float32, **overrides):
    """A specjax Model from an in-memory transformers DeepseekV3/V2ForCausalLM (tests, notebooks)."""
    cfg = DeepseekConfig.from_hf_config(hf_model.config, **overrides)
    return Model(params=params_from_hf(hf_model.state_dict(), cfg, dtype), config=cfg,
                 source=type(hf_model).__name__)
