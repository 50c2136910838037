"""Our own checkpoints: orbax-saved params + a JSON config, in one directory."""

from __future__ import annotations

import json
import os

import jax
import numpy as np

from specjax import registry

CONFIG_FILE = "specjax_config.json"
PARAMS_DIR = "params"


def is_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def save_checkpoint(path: str, params, config, kind: str = "model", extra=None) -> None:
    """Saves params with orbax and the config as JSON. kind: "model" or a draft-head kind."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 - orbax (~1 s) only when saving or loading

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    params_dir = os.path.join(path, PARAMS_DIR)
    params = jax.tree.map(np.asarray, params)
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(params_dir, params, force=True)
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump({"kind": kind, "family": registry.family_of(config).name,
                   "config": config.to_dict(), "extra": extra or {}}, f, indent=2)


def checkpoint_kind(path: str) -> str:
    with open(os.path.join(path, CONFIG_FILE)) as f:
        return json.load(f)["kind"]


def load_checkpoint(path: str):
    """Returns (kind, config dict, params as numpy, extra)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 - orbax (~1 s) only when saving or loading

    path = os.path.abspath(path)
    if not is_checkpoint(path):
        raise FileNotFoundError(f"{path!r} is not a specjax checkpoint (no {CONFIG_FILE})")
    with open(os.path.join(path, CONFIG_FILE)) as f:
        meta = json.load(f)
    with ocp.PyTreeCheckpointer() as ckptr:
        params = ckptr.restore(os.path.join(path, PARAMS_DIR))
    params = jax.tree.map(np.asarray, params)
    # orbax restores python lists as lists, dict keys as saved; layers may come back as dict
    if isinstance(params.get("layers"), dict):
        params["layers"] = [params["layers"][k] for k in sorted(params["layers"], key=int)]
    return meta["kind"], meta["config"], params, meta.get("extra", {})


def load_model_checkpoint(path: str):
    kind, cfg, params, _ = load_checkpoint(path)
    if kind != "model":
        raise ValueError(f"{path!r} holds a {kind!r}, not a model; use sj.load_draft")
    with open(os.path.join(os.path.abspath(path), CONFIG_FILE)) as f:
        family = json.load(f).get("family", "llama")  # checkpoints before the registry: llama
    return registry.family_named(family).config_class.from_dict(cfg), params
