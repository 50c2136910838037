"""P-EAGLE heads in vLLM speculators' layout (``speculators_model_type: "peagle"``, what
``vllm serve --speculative-config '{"model": DIR, "parallel_drafting": true}'`` converts through
its speculators config adapter) <-> ``specjax.peagle.PEagleHead``.

A directory with ``config.json``::

    {"architectures": ["PEagleSpeculator"], "speculators_model_type": "peagle",
     "transformer_layer_config": {a Llama config, num_hidden_layers: 1},
     "draft_vocab_size": Vd, "mask_token_id": m, "eagle_aux_hidden_state_layer_ids": [...],
     "norm_before_residual": false, "norm_before_fc": false, "fc_norm": false,
     "norm_output": false, "speculators_config": {"algorithm": "peagle",
       "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": K}], ...}}

and ``model.safetensors`` (speculators' Eagle3DraftModel names)::

    fc.weight [E, 3E_t], layers.0.{input_layernorm, hidden_norm}.weight [E]
    layers.0.self_attn.{q,k,v}_proj.weight [., 2E], o_proj, post_attention_layernorm, mlp.*
    norm.weight [E], lm_head.weight [Vd, E], d2t [Vd], t2d [V], (embed_tokens.weight [V, E])
    mask_hidden [1, 1, 3E_t]                 # the placeholder feature, before fc

``eagle_aux_hidden_state_layer_ids`` are taken as the indices of the layers whose *entering*
hidden states are fused (speculators' default [2, L//2, L-3] is EAGLE-3's default in that
convention: features come from vLLM's capture). Refused by name: more than one decoder layer
(published P-EAGLE heads have 4; specjax.heads runs one), ``norm_before_residual`` true or absent
(speculators' default is true; our midlayer's residual is the un-normed feature),
``norm_before_fc``, ``fc_norm``, ``norm_output``, a non-Llama layer, a missing ``mask_token_id``
or ``mask_hidden``. The EAGLE-3 part is read and checked by ``heads_io.load_eagle3``.
"""

from __future__ import annotations

import json
import os
import tempfile

import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file, save_file

from specjax.io import heads_io
from specjax.peagle import PEagleConfig, PEagleHead

ARCH = "PEagleSpeculator"
_OFF_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")


def is_peagle_dir(path) -> bool:
    """Whether ``path`` is a directory whose config.json is a speculators P-EAGLE config."""
    p = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(p):
        return False
    try:
        with open(p) as f:
            d = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(d, dict) and (d.get("speculators_model_type") == "peagle"
                                    or ARCH in (d.get("architectures") or ()))


def _num_depths(d: dict) -> int:
    methods = (d.get("speculators_config") or {}).get("proposal_methods") or [{}]
    return int(methods[0].get("speculative_tokens") or 4)


def load_peagle(path, target_cfg, dtype=jnp.float32, *, target_params=None) -> PEagleHead:
    """Loads a P-EAGLE head (see the module docstring); ValueError naming the config key or
    tensor (and both shapes) that does not fit ``target_cfg`` or is not supported."""
    path = os.fspath(path)
    source = repr(path)
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    if d.get("speculators_model_type", "peagle") != "peagle":
        raise ValueError(f"{source}: speculators_model_type {d['speculators_model_type']!r} is "
                         "not 'peagle'")
    lc = d.get("transformer_layer_config")
    if not isinstance(lc, dict):
        raise ValueError(f"{source}: config.json lacks 'transformer_layer_config'")
    if lc.get("model_type", "llama") != "llama":
        raise ValueError(f"{source}: transformer_layer_config.model_type {lc['model_type']!r} is "
                         "not supported (only 'llama' layers)")
    if int(lc.get("num_hidden_layers", 1)) != 1:
        raise ValueError(f"{source}: transformer_layer_config.num_hidden_layers "
                         f"{lc['num_hidden_layers']} is not supported (one decoder layer only)")
    if d.get("norm_before_residual", True):
        raise ValueError(f"{source}: norm_before_residual=true (or absent: speculators' default) "
                         "is not supported; only norm_before_residual=false heads load")
    for key in _OFF_FLAGS:
        if d.get(key):
            raise ValueError(f"{source}: {key}=true is not supported")
    if d.get("mask_token_id") is None:
        raise ValueError(f"{source}: config.json lacks 'mask_token_id'")
    ids = d.get("eagle_aux_hidden_state_layer_ids")
    tensors = heads_io._read_tensors(path)[0]
    mh = tensors.pop("mask_hidden", None)
    if mh is None:
        raise ValueError(f"{source}: missing tensor 'mask_hidden' ([1, 1, A*E_t])")
    tensors = {("midlayer." + k[len("layers.0."):] if k.startswith("layers.0.") else k): v
               for k, v in tensors.items()}
    hf = dict(lc, num_hidden_layers=1, draft_vocab_size=d.get("draft_vocab_size"))
    if d.get("target_hidden_size"):
        hf["target_hidden_size"] = d["target_hidden_size"]
    head = heads_io.load_eagle3(tensors, target_cfg, dtype, hf_config=hf,
                                aux_layers=None if ids is None else tuple(int(i) for i in ids),
                                target_params=target_params)
    width = len(head.config.aux_layers) * head.config.feature_size
    mh = np.asarray(mh)
    if mh.size != width or mh.shape not in ((width,), (1, width), (1, 1, width)):
        raise ValueError(f"{source}: tensor 'mask_hidden' has shape {mh.shape}, expected "
                         f"(1, 1, {width})")
    cfg = PEagleConfig(head.config, mask_token_id=int(d["mask_token_id"]),
                       num_depths=_num_depths(d))
    return PEagleHead(dict(head.params, mask_hidden=jnp.asarray(mh.reshape(-1), dtype)), cfg)


def save_peagle(head: PEagleHead, path: str, *, target_params=None,
                dtype: str = "float32") -> None:
    """Writes ``head`` in the layout ``load_peagle`` reads (the EAGLE-3 tensors through
    ``heads_io.save_eagle3``, renamed to speculators' ``layers.0.``, plus ``mask_hidden``)."""
    cfg = head.config
    with tempfile.TemporaryDirectory() as tmp:
        heads_io.save_eagle3(head.eagle3, tmp, target_params=target_params, dtype=dtype)
        tensors = load_file(os.path.join(tmp, "model.safetensors"))
        with open(os.path.join(tmp, "config.json")) as f:
            e3 = json.load(f)
    tensors = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
               for k, v in tensors.items()}
    tensors["mask_hidden"] = np.asarray(head.params["mask_hidden"], dtype).reshape(1, 1, -1)
    layer = {k: v for k, v in e3.items() if k not in ("architectures", "draft_vocab_size",
                                                      "target_hidden_size", "eagle_config")}
    out = {"architectures": [ARCH], "speculators_model_type": "peagle",
           "transformer_layer_config": layer, "draft_vocab_size": e3["draft_vocab_size"],
           "target_hidden_size": e3["target_hidden_size"], "mask_token_id": cfg.mask_token_id,
           "eagle_aux_hidden_state_layer_ids": list(cfg.aux_layers),
           "norm_before_residual": False, **{k: False for k in _OFF_FLAGS},
           "embed_requires_grad": "embed" in head.params,
           "speculators_config": {"algorithm": "peagle", "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": cfg.num_depths}]}}
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(out, f, indent=2)
