"""Model families: the only place that dispatches on a model's family.

A ``Family`` record says, for one family, which HF ``model_type`` strings it reads, its static
config class, its forward and paged-cache init (same contract as ``specjax.model.forward``), its
params init, its decoder block for draft heads and what it does not support yet. Everything else
asks the registry (``family_of(cfg)`` / ``family_for_model_type(name)``) instead of testing config
types::

    family     model_types                           config            attention, MLP
    llama      llama, mistral, qwen2, qwen3, smollm3  ModelConfig       GQA (+ q/k norm), dense
    qwen3_moe  qwen3_moe                             Qwen3MoeConfig    GQA + q/k norm, sparse MoE
    deepseek   deepseek_v2, deepseek_v3              DeepseekConfig    MLA latent cache, MoE
    gemma3     gemma3_text                           Gemma3Config      GQA + q/k norm, sliding
                                                                       windows, GeGLU (gemma.py)

Qwen3-MoE shares Llama's decoder layer (``model.decoder_layer``) and runs its experts through
``_QWEN3_MOE`` (``deepseek.softmax_topk_moe``: softmax top-k routing, ``specjax.moe``'s grouped
dispatch).
A component that does not support a family says so through ``require``.

The registry sits in the model layer, below ``specjax.io`` and ``specjax.sharding`` (which import
heads and speculate, hence this module), and imports neither. Their per-family hooks live with
them as ``{family name: function}`` tables that ``check_table`` holds to this registry: the HF
loaders and MTP-layer readers in ``specjax.io.families``, the sharding rules in
``specjax.sharding.families``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from specjax import deepseek, gemma, kv_cache, model
from specjax.config import ModelConfig, Qwen3MoeConfig
from specjax.deepseek import DeepseekConfig
from specjax.gemma import Gemma3Config


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family (see the module docstring). Functions take the family's config."""

    name: str
    model_types: tuple[str, ...]  # HF config.json "model_type" values
    config_class: type
    # forward(params, cfg, tokens, positions, kv, page_table, cache_start, num_new=None,
    #         new_mask=None, *, attn_impl, return_logits, inputs_embeds) -> (logits, hidden, kv)
    forward: Callable
    init_cache: Callable  # (cfg, num_pages, page_size, dtype) -> KVCache
    init_params: Callable  # (cfg, key, dtype=float32) -> params
    # block(lp, cfg, x [B, T, E], positions, kv (one layer), page_table, cache_start, valid,
    #       new_mask, attn_impl) -> (h [B, T, E], kv): one decoder layer, for draft heads' blocks
    block: Callable
    # what does not work yet for this family: component -> reason (see ``require``)
    # Components: "sharding" (specjax.sharding.families.shard / load_model(mesh=...)),
    # "tp_sharding" (specjax.sharding's dp/tp fused loop), "engine" (specjax.engine),
    # "native" (specjax.native's packed CPU matmul).
    unsupported: tuple[tuple[str, str], ...] = ()

    def from_hf_config(self, hf) -> Any:
        """The family's static config from a transformers config (object or config.json dict)."""
        return self.config_class.from_hf_config(hf)


# ------------------------------------------------------------------------------- llama family

def _llama_block(lp, cfg, x, positions, kv, page_table, cache_start, valid, new_mask, attn_impl,
                 moe=None):
    h, k0, v0 = model.decoder_layer(lp, cfg, x, positions, kv.k[0], kv.v[0], page_table,
                                    cache_start, valid, new_mask, attn_impl, moe)
    return h, kv_cache.KVCache(k=(k0,), v=(v0,))


# --------------------------------------------------------------------------- qwen3_moe family

# The sparse-MoE MLP of Qwen3-MoE layers (softmax top-k routing + specjax.moe's grouped dispatch).
_QWEN3_MOE = deepseek.softmax_topk_moe


def _qwen3_moe_forward(params, cfg, *args, **kw):
    return model.forward(params, cfg, *args, moe=_QWEN3_MOE, **kw)


def _qwen3_moe_block(*args):
    return _llama_block(*args, moe=_QWEN3_MOE)


# ---------------------------------------------------------------------------- deepseek family

def _deepseek_block(lp, cfg, x, positions, kv, page_table, cache_start, valid, new_mask,
                    attn_impl):
    h, pool = deepseek.decoder_layer(lp, cfg, x, positions, kv.k[0], page_table, cache_start,
                                     valid, new_mask, attn_impl)
    return h, kv_cache.KVCache(k=(pool,), v=kv.v)


# ------------------------------------------------------------------------------- the table

FAMILIES: tuple[Family, ...] = (
    Family(name="llama", model_types=("llama", "mistral", "qwen2", "qwen3", "smollm3"),
           config_class=ModelConfig, forward=model.forward, init_cache=kv_cache.init_cache,
           init_params=model.init_params, block=_llama_block),
    Family(name="qwen3_moe", model_types=("qwen3_moe",), config_class=Qwen3MoeConfig,
           forward=_qwen3_moe_forward, init_cache=kv_cache.init_cache,
           init_params=model.init_params, block=_qwen3_moe_block,
           unsupported=(("sharding", "no expert-parallel sharding rules yet (specjax.moe)"),
                        ("tp_sharding", "no expert-parallel sharding rules yet (specjax.moe)"))),
    Family(name="deepseek", model_types=("deepseek_v2", "deepseek_v3"),
           config_class=DeepseekConfig, forward=deepseek.forward, init_cache=deepseek.init_cache,
           init_params=deepseek.init_params, block=_deepseek_block,
           unsupported=(("tp_sharding",
                         "specjax.sharding's dp/tp loop lays out Llama K/V pools and weights; "
                         "place DeepSeek on a deepseek.make_mesh (tp, ep) mesh with "
                         "load_model(mesh=...) / specjax.sharding.families.shard"),
                        ("native", "MLA and shared-expert weights are not packed for "
                         "specjax.native's CPU kernel yet (XLA's dot runs them)"))),
    Family(name="gemma3", model_types=("gemma3_text",), config_class=Gemma3Config,
           forward=gemma.forward, init_cache=kv_cache.init_cache, init_params=gemma.init_params,
           block=gemma.block),
)
_BY_CLASS = {f.config_class: f for f in FAMILIES}
FAMILIES_CLASSES = frozenset(_BY_CLASS)  # every registered config class
_BY_TYPE = {t: f for f in FAMILIES for t in f.model_types}


def supported_model_types() -> tuple[str, ...]:
    """Every HF ``model_type`` that ``sj.load_model`` reads, sorted."""
    return tuple(sorted(_BY_TYPE))


def family_of(cfg) -> Family:
    """The family of a static model config (exact type: a subclass is its own family)."""
    fam = _BY_CLASS.get(type(cfg))
    if fam is None:
        raise TypeError(f"{type(cfg).__name__} is not a registered model config; known: "
                        f"{sorted(c.__name__ for c in _BY_CLASS)}")
    return fam


def family_named(name: str) -> Family:
    """The family called ``name`` ("llama", "qwen3_moe", "deepseek")."""
    for fam in FAMILIES:
        if fam.name == name:
            return fam
    raise ValueError(f"unknown model family {name!r}; known: {[f.name for f in FAMILIES]}")


def family_for_model_type(model_type: str | None, architectures=()) -> Family:
    """The family reading HF ``model_type`` (a Llama architecture with no model_type: llama)."""
    if model_type is None and any("Llama" in a for a in architectures or ()):
        model_type = "llama"
    fam = _BY_TYPE.get(model_type)
    if fam is None:
        raise ValueError(f"model_type {model_type!r} is not supported; supported model_types: "
                         f"{', '.join(supported_model_types())}")
    return fam


def require(cfg, component: str) -> Family:
    """The config's family, or a ValueError when ``component`` does not support it yet."""
    fam = family_of(cfg)
    reason = dict(fam.unsupported).get(component)
    if reason is not None:
        raise ValueError(f"{component} does not support the {fam.name} family yet: {reason}")
    return fam


def check_table(table: dict, component: str, every_family: bool = True) -> dict:
    """Returns ``table`` ({family name: hook}, a layer above's per-family table) after checking
    that it names only registered families and, with ``every_family``, has an entry for each
    family that ``component`` supports (a ``require`` reason excuses one); ValueError otherwise."""
    unknown = sorted(set(table) - {f.name for f in FAMILIES})
    missing = sorted(f.name for f in FAMILIES if every_family and f.name not in table
                     and component not in dict(f.unsupported))
    if unknown or missing:
        raise ValueError(f"{component} table: unknown families {unknown}, no entry for {missing}")
    return table


# ----------------------------------------------------------- dispatch for the shared core

def forward(params, cfg, *args, **kw):
    """The family's forward (contract of ``specjax.model.forward``)."""
    return family_of(cfg).forward(params, cfg, *args, **kw)


def init_cache(cfg, num_pages: int, page_size: int, dtype=jnp.float32) -> kv_cache.KVCache:
    """The family's paged cache: Llama K/V pools or DeepSeek latent pools."""
    return family_of(cfg).init_cache(cfg, num_pages, page_size, dtype)


def check_params(params, cfg) -> None:
    """Raises ValueError unless ``params`` has exactly the family's tensors at the config's shapes."""
    if family_of(cfg).config_class is ModelConfig:
        return model.check_params(params, cfg)  # the Llama checker names the odd tensor
    want = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
    got_paths = {jax.tree_util.keystr(p): tuple(np.shape(a))
                 for p, a in jax.tree_util.tree_leaves_with_path(params)}
    want_paths = {jax.tree_util.keystr(p): tuple(a.shape)
                  for p, a in jax.tree_util.tree_leaves_with_path(want)}
    if got_paths != want_paths:
        bad = sorted(set(got_paths.items()) ^ set(want_paths.items()))[:4]
        raise ValueError(f"params do not match the {family_of(cfg).name} config: {bad}")


def init_params(cfg, key, dtype=jnp.float32, scale: float = 0.02):
    """Random params of the family's layout (tests, fresh drafts and heads)."""
    return family_of(cfg).init_params(cfg, key, dtype, scale)


def block(lp, cfg, x, positions, kv, page_table, cache_start, valid, new_mask, attn_impl):
    """One decoder layer of the family over a one-layer cache (draft heads' blocks)."""
    return family_of(cfg).block(lp, cfg, x, positions, kv, page_table, cache_start, valid,
                                new_mask, attn_impl)


def to_device(params):
    """Host params as device arrays, tensor by tensor, in place of the host copies (so the host
    never holds a tensor twice): dicts and lists are updated in place; returns ``params``."""
    def walk(node):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, v in list(items):
            if isinstance(v, (dict, list)):
                walk(v)
            else:
                node[k] = jax.device_put(v)
    walk(params)
    return params
