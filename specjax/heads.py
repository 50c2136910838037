"""Draft heads fed by the target's hidden states: DeepSeek-V3-style MTP, EAGLE-1 and EAGLE-3.

One implementation, norms switchable (``HeadConfig.norms``)::

    x_i  = eh_proj(concat(enorm(embed(t_{i+1})), hnorm(f_i)))      # f_i: target feature at i
    h'_i = decoder_layer(x_i)                                      # one Llama block, own KV cache
    logits_i = lm_head(final_norm(h'_i))                           # shared, frozen lm_head

* MTP (``norms=True``, DeepSeek-V3 names ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``):
  features are the target's pre-norm final hidden states; the block keeps its input RMSNorm.
* EAGLE-1 (``norms=False``): ``fc(concat(embed, f))`` with a bias, no enorm/hnorm, no input
  RMSNorm in the block and no norm before the lm_head; features are the target's *post-norm*
  hidden states (what EAGLE's reference implementation feeds), i.e. the target's final norm is
  applied to them. The seed found that restoring the norms makes training converge on large
  targets; we keep both to reproduce that ablation.
* EAGLE-3 (``kind="eagle3"``): the feature is ``f_i = fc(concat(a_i^low, a_i^mid, a_i^high))``
  (``fc`` [3E_t, E], no bias) of the target's hidden states *entering* layers
  ``HeadConfig.aux_layers`` (default 2, L//2, L-3: transformers' ``hidden_states[i]``); the block
  ("midlayer") attends over ``concat(enorm(embed(t_{i+1})), hnorm(f_i))`` (width 2E, embedding
  first; q/k/v are [2E, .]) with ``f_i`` as the residual stream, then its MLP; logits come from
  its *own* ``lm_head`` ([E, Vd]) after ``final_norm``, over a reduced draft vocabulary
  (``params["draft_vocab"]``: draft id d is target id d + d2t[d]).

The embedding (and, for MTP/EAGLE-1, the lm_head) are the target's (frozen, not stored in the
head's params; an EAGLE-3 head may carry its own ``params["embed"]``). Head position i consumes
token t_{i+1} with feature f_i and predicts t_{i+2}: its input-token buffer is the target's shifted
one step left. Drafting beyond the first token feeds the head's own output h'_i (before its
final norm) as the next position's feature, for every kind.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache, registry
from specjax.config import ModelConfig, RopeScaling
from specjax.model import decoder_layer, embed, rms_norm, valid_mask


@dataclasses.dataclass(frozen=True)
class HeadConfig:
    """A draft head attached to a target (static)."""

    kind: str  # "mtp" | "eagle" | "eagle3"
    # the head's decoder block (num_layers = 1), dims of the target: a config of the block's
    # family (ModelConfig; DeepseekConfig for DeepSeek-V3's MTP layer), see specjax.registry
    layer: Any
    norms: bool = True  # enorm/hnorm/block input norm/final norm (MTP) vs none (EAGLE-1)
    fc_bias: bool = False  # EAGLE-1's fc has a bias
    # > 0: the head scores only this many tokens (params["draft_vocab"], EAGLE-3's reduced draft
    # vocabulary); every other token gets probability 0 as a draft. 0: the full vocabulary.
    draft_vocab_size: int = 0
    # EAGLE-3: the target layers whose *entering* hidden states are fused (transformers'
    # hidden_states[i], 0 = embeddings), low to high; empty for MTP / EAGLE-1.
    aux_layers: tuple[int, ...] = ()
    target_hidden_size: int = 0  # EAGLE-3: E_t of the fused features (0 = layer.hidden_size)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"HeadConfig.kind must be one of {KINDS}, got {self.kind!r}")
        if self.layer.num_layers != 1:
            raise ValueError("a draft head has exactly one decoder layer")
        if not isinstance(self.aux_layers, tuple) or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in self.aux_layers):
            raise ValueError(f"HeadConfig.aux_layers must be a tuple of ints >= 0, got "
                             f"{self.aux_layers!r}")
        if (self.kind == "eagle3") != bool(self.aux_layers):
            raise ValueError("HeadConfig.aux_layers must be given exactly for kind 'eagle3'")
        if self.kind == "eagle3" and (not self.norms or self.fc_bias):
            raise ValueError("an EAGLE-3 head has norms=True and fc_bias=False")
        if not isinstance(self.target_hidden_size, int) or self.target_hidden_size < 0:
            raise ValueError(f"HeadConfig.target_hidden_size must be an int >= 0, got "
                             f"{self.target_hidden_size!r}")
        v = self.layer.vocab_size
        if not isinstance(self.draft_vocab_size, int) or not 0 <= self.draft_vocab_size <= v:
            raise ValueError(f"HeadConfig.draft_vocab_size must be an int in [0, {v}] "
                             f"(0 = full vocabulary), got {self.draft_vocab_size!r}")

    @property
    def feature_size(self) -> int:
        """E_t: width of one fused target hidden state (EAGLE-3) / of the target's hidden."""
        return self.target_hidden_size or self.layer.hidden_size

    def to_dict(self):
        return {"kind": self.kind, "layer": self.layer.to_dict(), "norms": self.norms,
                "fc_bias": self.fc_bias, "draft_vocab_size": self.draft_vocab_size,
                "aux_layers": list(self.aux_layers), "target_hidden_size": self.target_hidden_size}

    @classmethod
    def from_dict(cls, d):
        return cls(kind=d["kind"], layer=ModelConfig.from_dict(d["layer"]), norms=d["norms"],
                   fc_bias=d.get("fc_bias", False), draft_vocab_size=d.get("draft_vocab_size", 0),
                   aux_layers=tuple(d.get("aux_layers", ())),
                   target_hidden_size=d.get("target_hidden_size", 0))

    @classmethod
    def for_target(cls, target_cfg: ModelConfig, kind: str = "mtp", norms: bool | None = None,
                   aux_layers: tuple[int, ...] | None = None):
        """A head whose block has the target's dimensions. norms defaults to True for MTP and
        EAGLE-3, False for EAGLE-1; an EAGLE-3 head fuses ``aux_layers`` (default
        ``default_aux_layers``). The block's per-layer fields (a Gemma 3 window and RoPE base)
        are those of the target's last layer; an EAGLE-3 midlayer is a Llama layer
        (``llama_block_config``) whatever the target's family."""
        norms = (kind != "eagle") if norms is None else norms
        if kind == "eagle3":
            aux_layers = default_aux_layers(target_cfg.num_layers) if aux_layers is None \
                else tuple(aux_layers)
            layer = llama_block_config(target_cfg)
        else:
            layer = target_cfg.with_layers((target_cfg.num_layers - 1,))  # Gemma: last layer's type
        return cls(kind=kind, layer=layer, norms=norms,
                   fc_bias=(kind == "eagle" and not norms), aux_layers=aux_layers or ())


KINDS = ("mtp", "eagle", "eagle3")


def llama_block_config(target_cfg) -> ModelConfig:
    """A one-layer Llama ``ModelConfig`` with the target's sizes, whatever the target's family
    (a Gemma 3 or Qwen3-MoE target's extra fields and a Qwen3 target's q/k norms are dropped): a new EAGLE-3 head's midlayer
    (the reference ``LlamaForCausalLMEagle3``; ``io.heads_io.load_eagle3`` reads one too) and
    the widths of a new DFlash drafter (``train.dflash_train.drafter_config``). A target
    without Llama attention sizes (DeepSeek's MLA) gets its H query heads, its
    ``num_kv_heads`` and D = E // H (rounded down to even)."""
    kw = {f.name: getattr(target_cfg, f.name) for f in dataclasses.fields(ModelConfig)
          if hasattr(target_cfg, f.name)}
    if "head_dim" not in kw:
        kw["head_dim"] = max(2, target_cfg.hidden_size // target_cfg.num_heads // 2 * 2)
    if not isinstance(kw.get("rope_scaling"), RopeScaling):
        kw["rope_scaling"] = None  # another family's scaling (DeepSeek's YaRN): plain RoPE
    # a Llama layer has no q/k norms (a Qwen3 target's do not carry over: the EAGLE-3 layout
    # has no tensors for them)
    return ModelConfig(**dict(kw, num_layers=1, qk_norm=False))


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's default fused layers for an L-layer target: hidden states entering layers 2,
    L//2 and L-3 (what SafeAILab/EAGLE, SpecForge, vLLM and SGLang use when a head names none)."""
    if num_layers < 4:
        raise ValueError(f"EAGLE-3 needs a target with >= 4 layers for its default features, "
                         f"got {num_layers}")
    return (2, num_layers // 2, num_layers - 3)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Head:
    """Head params (pytree) + config. ``params``: enorm [E], hnorm [E], eh_proj [2E, E],
    (eh_bias [E]), layer (one decoder-layer dict), final_norm [E], (draft_vocab [Vd] int32: the
    token ids the head scores, unique)."""

    params: dict
    config: HeadConfig = dataclasses.field(metadata=dict(static=True))


def init_head(cfg: HeadConfig, key, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random head params (the block initialised like a model layer, norms at 1)."""
    e = cfg.layer.hidden_size
    k1, k2 = jax.random.split(key)
    layer = registry.init_params(cfg.layer, k1, dtype, scale)["layers"][0]
    if cfg.kind == "eagle3":  # fc, a midlayer attending over [2E] inputs, its own lm_head
        lc = cfg.layer
        hd, hkvd = lc.num_heads * lc.head_dim, lc.num_kv_heads * lc.head_dim
        k3, k4 = jax.random.split(jax.random.fold_in(key, 3))
        wk = jax.random.split(k3, 3)
        layer.update(wq=(scale * jax.random.normal(wk[0], (2 * e, hd))).astype(dtype),
                     wk=(scale * jax.random.normal(wk[1], (2 * e, hkvd))).astype(dtype),
                     wv=(scale * jax.random.normal(wk[2], (2 * e, hkvd))).astype(dtype))
        del layer["attn_norm"]
        vd = cfg.draft_vocab_size or cfg.layer.vocab_size
        params = {"fc": (scale * jax.random.normal(
                      k2, (len(cfg.aux_layers) * cfg.feature_size, e))).astype(dtype),
                  "enorm": jnp.ones((e,), dtype), "hnorm": jnp.ones((e,), dtype), "layer": layer,
                  "final_norm": jnp.ones((e,), dtype),
                  "lm_head": (scale * jax.random.normal(k4, (e, vd))).astype(dtype)}
        if cfg.draft_vocab_size:
            params["draft_vocab"] = jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32)
        return params
    params = {"eh_proj": (scale * jax.random.normal(k2, (2 * e, e))).astype(dtype), "layer": layer}
    if cfg.norms:
        params.update(enorm=jnp.ones((e,), dtype), hnorm=jnp.ones((e,), dtype),
                      final_norm=jnp.ones((e,), dtype))
    else:
        del params["layer"]["attn_norm"]
    if cfg.fc_bias:
        params["eh_bias"] = jnp.zeros((e,), dtype)
    if cfg.draft_vocab_size:
        params["draft_vocab"] = jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32)
    return params


def cast_floats(params, dtype=None):
    """Casts float leaves to ``dtype`` (None: unchanged); integer leaves (a head's draft
    vocabulary) keep theirs."""
    def cast(a):
        a = jnp.asarray(a)
        return a if dtype is None or jnp.issubdtype(a.dtype, jnp.integer) else a.astype(dtype)
    return jax.tree.map(cast, params)


def set_draft_vocab(head: "Head", vocab) -> "Head":
    """A copy of ``head`` scoring only the token ids ``vocab`` (1-D, unique, in [0, V))."""
    if head.config.kind == "eagle3":
        raise ValueError("set_draft_vocab: an EAGLE-3 head's own lm_head is trained over its draft "
                         "vocabulary (d2t); it cannot be changed afterwards")
    v = np.asarray(vocab)
    size = head.config.layer.vocab_size
    if v.ndim != 1 or v.size == 0 or not np.issubdtype(v.dtype, np.integer):
        raise ValueError(f"set_draft_vocab: vocab must be a non-empty 1-D integer array, got "
                         f"shape {v.shape} dtype {v.dtype}")
    if v.min() < 0 or v.max() >= size or len(np.unique(v)) != v.size:
        raise ValueError(f"set_draft_vocab: vocab must hold unique token ids in [0, {size})")
    cfg = dataclasses.replace(head.config, draft_vocab_size=int(v.size))
    return Head(params=dict(head.params, draft_vocab=jnp.asarray(v, jnp.int32)), config=cfg)


def head_features(head_params, cfg: HeadConfig, target_params, target_cfg: ModelConfig, hidden,
                  aux=None):
    """The first-step feature f_i the head consumes from the target: [B, T, E].

    hidden: [B, T, E_t] the target's pre-norm final hidden states; aux: [B, T, A * E_t] the
    hidden states entering ``cfg.aux_layers`` (model.forward(aux_layers=...)), EAGLE-3 only.
    MTP: hidden as is; EAGLE-1: post-norm hidden; EAGLE-3: fc(aux).
    """
    if cfg.kind == "eagle3":
        if aux is None:
            raise ValueError("an EAGLE-3 head needs the target's aux hidden states "
                             f"(forward(..., aux_layers={cfg.aux_layers}))")
        return aux.astype(head_params["fc"].dtype) @ head_params["fc"]
    if cfg.norms:
        return hidden
    return rms_norm(hidden, target_params["norm"], target_cfg.rms_norm_eps)


def head_forward(head_params, cfg: HeadConfig, target_params, tokens, features, positions,
                 kv: kv_cache.KVCache, page_table, cache_start, num_new=None, new_mask=None, *,
                 attn_impl: str = "reference"):
    """Runs the head's block over T positions (no lm_head: see head_logits).

    Args:
      target_params: the target's params (its embedding, unless the head has its own).
      tokens: [B, T] token t_{i+1} for head position i (the target's tokens shifted left).
      features: [B, T, E] the target feature f_i (see head_features), or the head's own output
        hidden state when drafting beyond the first token.
      positions, kv, page_table, cache_start, num_new, new_mask: as in model.forward (the head's
        one-layer cache shares the target's page table).
    Returns:
      (hidden [B, T, E] the head's output h', kv).
    """
    lcfg = cfg.layer
    e = embed(head_params if "embed" in head_params else target_params, tokens)
    valid = valid_mask(tokens.shape, num_new)
    if cfg.kind == "eagle3":  # midlayer: attend over [enorm(emb), hnorm(f)], residual f
        x = features.astype(e.dtype)
        attn_in = jnp.concatenate([rms_norm(e, head_params["enorm"], lcfg.rms_norm_eps),
                                   rms_norm(x, head_params["hnorm"], lcfg.rms_norm_eps)], axis=-1)
        h, k0, v0 = decoder_layer(dict(head_params["layer"], attn_norm=None), lcfg, x, positions,
                                  kv.k[0], kv.v[0], page_table, cache_start, valid, new_mask,
                                  attn_impl, attn_in=attn_in)
        return h, kv_cache.KVCache(k=(k0,), v=(v0,))
    if cfg.norms:
        e = rms_norm(e, head_params["enorm"], lcfg.rms_norm_eps)
        features = rms_norm(features, head_params["hnorm"], lcfg.rms_norm_eps)
    x = jnp.concatenate([e, features.astype(e.dtype)], axis=-1) @ head_params["eh_proj"]
    if cfg.fc_bias:
        x = x + head_params["eh_bias"]
    lp = head_params["layer"]
    if "attn_norm" not in lp:  # EAGLE-1 drops the block's input norm
        lp = dict(lp, attn_norm=None)
    # the block's family (Llama, or DeepSeek-V3 MTP's MLA + MoE/dense) runs it
    return registry.block(lp, lcfg, x, positions, kv, page_table, cache_start, valid, new_mask,
                          attn_impl)


def _columns(w, vocab):
    return w if vocab is None else jnp.take(w, vocab, axis=1)


def output_matrix(target_params, target_cfg: ModelConfig, vocab=None):
    """The target's output projection [E, V] (or its [E, Vd] columns ``vocab``)."""
    if target_cfg.tie_word_embeddings:
        emb = target_params["embed"]
        return (emb if vocab is None else jnp.take(emb, vocab, axis=0)).T
    return _columns(target_params["lm_head"], vocab)


def target_logits(target_params, target_cfg: ModelConfig, hidden, vocab=None):
    """The target's logits (final norm + output projection) over all tokens or only ``vocab``:
    [..., E] pre-norm -> float32 [..., V] or [..., Vd]."""
    x = rms_norm(hidden, target_params["norm"], target_cfg.rms_norm_eps)
    return (x @ output_matrix(target_params, target_cfg, vocab)).astype(jnp.float32)


NEG_LOGIT = -1e9  # logit of tokens outside a reduced draft vocabulary (exp -> exactly 0)


def head_logits(head_params, cfg: HeadConfig, target_params, target_cfg: ModelConfig, hidden,
                *, compact: bool = False):
    """The shared, frozen lm_head over the head's output: [..., E] -> float32 [..., V].

    With a reduced draft vocabulary (``params["draft_vocab"]``, [Vd]) only those columns are
    computed; the rest are NEG_LOGIT, so the draft's distribution is 0 off the subset (the
    acceptance rule stays exact). ``compact=True`` returns the [..., Vd] scores instead. An
    EAGLE-3 head's own ``lm_head`` is [E, Vd] already (column d scores target id vocab[d]).
    """
    vocab = head_params.get("draft_vocab")
    if cfg.norms:
        norm = head_params["final_norm"]
        eps = cfg.layer.rms_norm_eps if "lm_head" in head_params else target_cfg.rms_norm_eps
        x = rms_norm(hidden, norm, eps)
    else:
        x = hidden
    if "lm_head_packed" in head_params:  # specjax.native.inference_params: the matrix below, packed
        w = head_params["lm_head_packed"]
    elif cfg.kind == "eagle3":
        w = head_params["lm_head"]  # [E, Vd]: trained over the draft vocabulary
    elif "lm_head" in head_params:  # own full-vocabulary head (loaded DeepSeek MTP)
        w = _columns(head_params["lm_head"], vocab)
    else:
        w = output_matrix(target_params, target_cfg, vocab)
    logits = (x @ w).astype(jnp.float32)
    if vocab is None or compact:
        return logits
    full = jnp.full(logits.shape[:-1] + (cfg.layer.vocab_size,), NEG_LOGIT, jnp.float32)
    return full.at[..., vocab].set(logits)
