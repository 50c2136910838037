"""Native CPU matmul for the few-row products of decode and verify (an XLA FFI custom call).

Why: on CPU, XLA runs ``x @ w`` with one row as a streaming GEMV but with 2..16 rows (a
speculative verify over k + 1 tokens) as a packed GEMM that costs 1.4-2x the GEMV, so verifying
k + 1 tokens cost ~1.4x a decode step before any draft ran (benchmarks/RESULTS.md, "Native
few-row matmul"). ``specjax/csrc/skinny_matmul.cc`` streams each weight from memory once for all
rows (from a panel-packed copy), so a verify costs little more than a decode step, and batched
decoding (up to ``MAX_ROWS`` rows) runs faster than XLA's GEMM too.

Pieces:

* ``skinny_matmul(x [M, K], panels [P, K, NB], n) -> [M, n]`` (the custom call) and its plain
  twin ``skinny_matmul_reference`` (unpack, ``x @ w``). Panels are float32, or bfloat16 /
  float16 when every value of the weight is exactly representable in that type (a bf16 or fp16
  checkpoint loaded as float32, e.g. most HF models and EAGLE-3 heads): half the bytes to
  stream, converted to float32 in registers, so the product is the one float32 panels give.
* ``PackedWeight``: a pytree holding a weight [K, N] and its panels; ``x @ packed`` (its
  ``__rmatmul__``) runs the kernel when x has at most ``MAX_ROWS`` rows and XLA's dot on the
  canonical weight otherwise (prefill, big batches). Model code keeps writing ``x @ w``.
* ``inference_params(model)``: a copy of a Llama-family or Gemma 3 model's params whose linear
  weights are ``PackedWeight``s (``QuantWeight``s for a GGUF's streamed blocks) plus
  ``"lm_head_packed"`` (the output projection, tied or not), built once per model object and
  kept on it. ``sj.generate`` and the engine run on it; everything else
  (training, checkpoints, heads reading the target's embedding) sees the canonical params.

The kernel is compiled on first use with the system C++ compiler for this CPU (``-march=native``)
into ``~/.cache/specjax/native`` (``SPECJAX_CACHE`` moves it) and registered with
``jax.ffi``. Without a compiler, on another backend, or with ``SPECJAX_NATIVE=0`` the packing is
skipped and every product is XLA's: the results agree to float32 rounding (the kernel
accumulates each row in k order with FMAs, so a row's result never depends on the other rows in
the call: decode and verify see bit-identical projections of the same input row).
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from specjax import heads, registry
from specjax.io import gguf
from specjax.native_build import MAX_ROWS, NB, QBLOCK, QTARGETS, TARGET, TARGETS, available  # noqa: F401
from specjax.native_q8 import ACTIVATIONS, Q8TARGETS, integer_weights, q8_layout, q8_matmul

log = logging.getLogger("specjax.native")

LINEAR_KEYS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
FUSED = (("wq", "wk", "wv"), ("w_gate", "w_up"))  # packed as one weight "wq+wk+wv", "w_gate+w_up"


# ----------------------------------------------------------------------------- build + register

# ----------------------------------------------------------------------------- the op + its twin

def pack(w, dtype=jnp.float32):
    """[K, N] weight -> [P, K, NB] column panels of ``dtype`` (P = ceil(N / NB), last one
    zero-padded). ``dtype`` float16 / bfloat16 rounds unless the weight is exact in it
    (``panel_dtype`` picks the narrowest exact one)."""
    k, n = w.shape
    p = -(-n // NB)
    w = jnp.pad(jnp.asarray(w, jnp.float32), ((0, 0), (0, p * NB - n)))
    return w.reshape(k, p, NB).transpose(1, 0, 2).astype(dtype)


def panel_dtype(w):
    """The narrowest panel dtype that holds every value of ``w`` exactly: bfloat16, float16, or
    float32 (bf16 first: its conversion is a shift on every CPU; fp16 needs F16C)."""
    w = jnp.asarray(w, jnp.float32)
    for dt in (jnp.bfloat16, jnp.float16):
        if bool(jnp.all(w.astype(dt).astype(jnp.float32) == w)):
            return jnp.dtype(dt)
    return jnp.dtype(jnp.float32)


def skinny_matmul(x, panels, n: int):
    """x [M, K] float32 @ the weight packed in ``panels`` [P, K, NB] -> [M, n] float32.

    ``panels`` float32, bfloat16 or float16 (converted to float32 in registers, exactly).

    The native kernel (``available()`` must be True). M may be any size; the weights stream
    from memory once, and the compute grows with M (XLA's GEMM wins for prefill-sized M).
    """
    if x.ndim != 2 or panels.ndim != 3 or panels.shape[1:] != (x.shape[1], NB):
        raise ValueError(f"skinny_matmul: x must be [M, K] and panels [P, K, {NB}], got "
                         f"{x.shape} and {panels.shape}")
    if not (panels.shape[0] - 1) * NB < n <= panels.shape[0] * NB:
        raise ValueError(f"skinny_matmul: n={n} does not fit {panels.shape[0]} panels of {NB}")
    if x.dtype != jnp.float32 or panels.dtype not in TARGETS:
        raise TypeError(f"skinny_matmul takes float32 x and float32/bfloat16/float16 panels, got "
                        f"{x.dtype} and {panels.dtype}")
    call = jax.ffi.ffi_call(TARGETS[panels.dtype][0],
                            jax.ShapeDtypeStruct((x.shape[0], n), jnp.float32),
                            vmap_method="sequential")
    return call(x, panels)


def skinny_matmul_reference(x, panels, n: int):
    """The plain-jnp twin of ``skinny_matmul``: unpack the panels, then ``x @ w``."""
    p, k, nb = panels.shape
    w = panels.transpose(1, 0, 2).reshape(k, p * nb)[:, :n].astype(jnp.float32)
    return jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedWeight:
    """A linear weight in both layouts: ``x @ packed`` picks the faster product by row count.

    Fields:
      w: [K, N] the canonical weight (XLA's dot, for more than MAX_ROWS rows).
      panels: [P, K, NB] its column panels (the native kernel, for up to MAX_ROWS rows):
        float32, or bfloat16 / float16 holding exactly the same values.
      parts: static output widths of the weights fused into this one (``model._fused`` splits
        the product back), or (N,).
    """

    w: jax.Array
    panels: jax.Array
    # output widths of the weights concatenated into this one (q|k|v, gate|up), or (N,)
    parts: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    @property
    def shape(self):
        return self.w.shape

    @property
    def dtype(self):
        return self.w.dtype

    @property
    def ndim(self):
        return 2

    def __rmatmul__(self, x):  # x [..., K] -> [..., N]
        rows = int(np.prod(x.shape[:-1]))
        if rows > MAX_ROWS or x.dtype != jnp.float32:
            return x @ self.w
        y = skinny_matmul(x.reshape(rows, x.shape[-1]), self.panels, self.w.shape[1])
        return y.reshape(*x.shape[:-1], self.w.shape[1])


def quant_matmul(x, q, qtype: str):
    """x [M, K] float32 @ W -> [M, N] float32, W's column n being GGUF row n held as the file's
    blocks ``q`` [N, K / block * bytes] uint8 of type ``qtype`` (``QTARGETS``: "Q4_0", "Q4_1",
    "Q5_0", "Q8_0" over 32 weights; the K-quants "Q4_K", "Q6_K" over 256).

    The native kernel (``available()`` must be True): each 32 weights are dequantized in
    registers with gguf's float32 arithmetic (every weight equals ``gguf.quants.dequantize``'s
    value), once per call for up to 8 rows; a row's sum runs in k order whatever M is.
    """
    if qtype not in QTARGETS:
        raise ValueError(f"quant_matmul: qtype must be one of {sorted(QTARGETS)}, got {qtype!r}")
    _, _, nbytes, block = QTARGETS[qtype]
    if x.ndim != 2 or q.ndim != 2 or x.shape[1] % block or \
            q.shape[1] != x.shape[1] // block * nbytes:
        raise ValueError(f"quant_matmul: x must be [M, K] (K % {block} == 0) and q [N, K / "
                         f"{block} * {nbytes}], got {x.shape} and {q.shape}")
    if x.dtype != jnp.float32 or q.dtype != jnp.uint8:
        raise TypeError(f"quant_matmul takes float32 x and uint8 q, got {x.dtype} and {q.dtype}")
    call = jax.ffi.ffi_call(QTARGETS[qtype][0],
                            jax.ShapeDtypeStruct((x.shape[0], q.shape[0]), jnp.float32),
                            vmap_method="sequential")
    return call(x, q)


def dequantize_reference(q, qtype: str) -> np.ndarray:
    """GGUF blocks ``q`` [N, K / block * bytes] uint8 -> the float32 weight [K, N] in plain
    numpy: the integer weights and sub-block scales read from the published formats
    (``native_q8.integer_weights``), then ``scale * w`` (``- dmin * m`` / ``+ m``) in float32,
    gguf's operation order; the kernel's twin (it must equal ``gguf.quants.dequantize``)."""
    if qtype not in QTARGETS:
        raise ValueError(f"dequantize_reference: qtype must be one of {sorted(QTARGETS)}, "
                         f"got {qtype!r}")
    w, scale, mins = integer_weights(q, qtype)
    out = np.repeat(scale.astype(np.float32), w.shape[1] // scale.shape[1], axis=1) \
        * w.astype(np.float32)
    if mins is not None:
        out = out - np.repeat(mins.astype(np.float32), 32, axis=1)
    return np.ascontiguousarray(out.T)


def quant_matmul_reference(x, q, qtype: str):
    """The plain twin of ``quant_matmul``: ``dequantize_reference``, then a float32 ``x @ w``."""
    return jnp.dot(x, jnp.asarray(dequantize_reference(q, qtype)),
                   precision=jax.lax.Precision.HIGHEST)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantWeight:
    """A linear weight as float32 and as the GGUF file's quantized blocks (the same values).

    Fields:
      w: [K, N] the canonical float32 weight (XLA's dot, for more than MAX_ROWS rows).
      q: [N, K / block * bytes] uint8: row n = column n of ``w`` in ``qtype``'s blocks.
      qtype: static GGUF block type (a key of ``QTARGETS``).
      parts: static output widths of the weights fused into this one, or (N,).
    """

    w: jax.Array
    q: jax.Array
    qtype: str = dataclasses.field(default="Q8_0", metadata=dict(static=True))
    parts: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    shape = PackedWeight.shape
    dtype = PackedWeight.dtype
    ndim = PackedWeight.ndim

    def __rmatmul__(self, x):  # x [..., K] -> [..., N]
        rows = int(np.prod(x.shape[:-1]))
        if rows > MAX_ROWS or x.dtype != jnp.float32:
            return x @ self.w
        y = quant_matmul(x.reshape(rows, x.shape[-1]), self.q, self.qtype)
        return y.reshape(*x.shape[:-1], self.w.shape[1])


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Q8Weight:
    """A linear weight as float32 and as ``native_q8.q8_layout`` rows of the GGUF file's blocks,
    multiplied with 8-bit activations (``load_model(activations="int8")``, specjax.native_q8).

    Fields:
      w: [K, N] the canonical float32 weight (XLA's dot, for more than MAX_ROWS rows).
      q8: [N, K / per * bytes] uint8 (per = 32, or 256 for the K-quants), row n = column n of ``w``.
      qtype: static GGUF block type (a key of ``native_q8.Q8TARGETS``).
      parts: static output widths of the weights fused into this one, or (N,).
    """

    w: jax.Array
    q8: jax.Array
    qtype: str = dataclasses.field(default="Q8_0", metadata=dict(static=True))
    parts: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    shape = PackedWeight.shape
    dtype = PackedWeight.dtype
    ndim = PackedWeight.ndim

    def __rmatmul__(self, x):  # x [..., K] -> [..., N]
        rows = int(np.prod(x.shape[:-1]))
        if rows > MAX_ROWS or x.dtype != jnp.float32:
            return x @ self.w
        y = q8_matmul(x.reshape(rows, x.shape[-1]), self.q8, self.qtype)
        return y.reshape(*x.shape[:-1], self.w.shape[1])


def quant_weight(ws, blocks, activations: str = "float32") -> QuantWeight | Q8Weight | PackedWeight:
    """[K, N_i] float32 weights and their GGUF blocks ``(qtype, q_i [N_i, bytes])`` -> one
    QuantWeight [K, sum N_i] (a ``Q8Weight`` with ``activations="int8"`` for the
    types it covers); a PackedWeight when the blocks are missing or of mixed types."""
    if any(b is None for b in blocks) or len({b[0] for b in blocks}) != 1:
        return pack_weight(*ws)
    w = ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=1)
    q = np.concatenate([np.asarray(b[1]) for b in blocks], axis=0)
    if blocks[0][0] not in QTARGETS or q.shape[0] != w.shape[1]:
        raise ValueError(f"quant_weight: blocks {blocks[0][0]} {q.shape} do not fit {w.shape}")
    parts = tuple(int(a.shape[1]) for a in ws)
    if activations == "int8" and blocks[0][0] in Q8TARGETS:
        return Q8Weight(w=w, q8=jnp.asarray(q8_layout(q, blocks[0][0])), qtype=blocks[0][0],
                        parts=parts)
    return QuantWeight(w=w, q=jnp.asarray(q, jnp.uint8), qtype=blocks[0][0], parts=parts)


def attach_gguf(model, path, activations: str = "float32") -> None:
    """Marks ``model`` (loaded from the GGUF file ``path``) to run on the file's own quantized
    blocks: ``inference_params`` then builds QuantWeights for the linear weights whose type the
    kernel streams (float32 panels for the rest). Read lazily, when the kernel is available.
    ``activations="int8"``: Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K weights run as ``native_q8.Q8Weight``s
    (8-bit activations, integer dots: llama.cpp's arithmetic, not the float32 path's)."""
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {ACTIVATIONS}, got {activations!r}")
    object.__setattr__(model, "_gguf_path", os.fspath(path))
    object.__setattr__(model, "_activations", activations)
    model.__dict__.pop("_inference_params", None)


def _gguf_blocks(model):
    path = model.__dict__.get("_gguf_path")
    if path is None or model.params["embed"].dtype != jnp.float32:
        return None

    return gguf.load_gguf_blocks(path, model.config, tuple(QTARGETS))


def pack_weight(*ws) -> PackedWeight:
    """One or more [K, N_i] weights that multiply the same input -> one PackedWeight [K, sum N_i]
    (panels in the narrowest dtype that holds the weight exactly, ``panel_dtype``)."""
    w = ws[0] if len(ws) == 1 else jnp.concatenate(ws, axis=1)
    return PackedWeight(w=w, panels=pack(w, panel_dtype(w)),
                        parts=tuple(int(a.shape[1]) for a in ws))


# ----------------------------------------------------------------------------- params

def _pack_layer(lp: dict, blocks=None, activations: str = "float32") -> dict:
    """One decoder layer's dict with its linear weights packed (q|k|v, gate|up fused); those in
    ``blocks`` (name -> (qtype, GGUF blocks)) as QuantWeights (a group whose blocks differ in
    type, e.g. Gemma's Q5_0 q/k with a Q8_0 v, stays unfused)."""
    lp, blocks = dict(lp), blocks or {}

    def one(names):
        ws = [lp.pop(n) for n in names]
        return (quant_weight(ws, [blocks.get(n) for n in names], activations) if blocks
                else pack_weight(*ws))

    for group in FUSED:  # q|k|v and gate|up read the same input: one product each
        types = {(blocks.get(n) or (None,))[0] for n in group}
        if all(n in lp and _packable(lp[n]) for n in group) and (not blocks or len(types) == 1):
            lp["+".join(group)] = one(group)  # (mixed block types: one QuantWeight each)
    for name in [n for n in lp if n in LINEAR_KEYS and _packable(lp[n])]:
        lp[name] = one((name,))
    return lp


def pack_params(params: dict, blocks=None, activations: str = "float32") -> dict:
    """A copy of a Llama-family params pytree for inference with the native kernel: the dense
    layers' float32 [K, N] linear weights (``LINEAR_KEYS``) become ``PackedWeight``s (q/k/v and
    gate/up fused into one each, ``FUSED``, which ``model._fused`` splits back) and
    ``"lm_head_packed"`` holds the output projection (``embed.T`` when tied). Other tensors
    (norms, biases, MoE experts, the embedding) are shared, not copied. ``blocks``
    (``io.gguf.load_gguf_blocks``): the weights it holds become QuantWeights instead
    (``native_q8.Q8Weight``s with ``activations="int8"`` where that kernel covers the type)."""
    blocks = blocks or {}
    layer_blocks = blocks.get("layers") or [None] * len(params["layers"])
    out = dict(params, layers=[_pack_layer(lp, b, activations)
                               for lp, b in zip(params["layers"], layer_blocks)])
    head = params.get("lm_head")
    head = params["embed"].T if head is None else head
    if head.dtype == jnp.float32:
        out["lm_head_packed"] = (quant_weight([head], [blocks["lm_head"]], activations)
                                 if blocks.get("lm_head") else pack_weight(head))
    return out


def inference_params(model, target=None):
    """The params to run ``model`` with, packed for the native kernel when it is available:

    * a ``specjax.model.Model`` (target or draft LLM): ``pack_params(model.params)``;
    * a ``specjax.heads.Head`` (pass its ``target``): its block, ``eh_proj`` / ``fc`` packed, and
      ``"lm_head_packed"`` = its output projection over its (draft) vocabulary, precomputed
      (``heads.output_matrix`` would otherwise gather the target's rows every draft step).

    Built on first use and kept on the object (params are immutable). ``model.params`` as they
    are when the kernel is off, the params are sharded over several devices, or the family is
    marked "native"-unsupported in the registry. None passes through.
    """
    params = getattr(model, "params", None)
    if not isinstance(params, dict) or not available():
        return params
    sharding = getattr(params.get("embed", params.get("layer", {}).get("wo")), "sharding", None)
    if sharding is not None and len(sharding.device_set) != 1:  # sharded: XLA's SPMD dots
        return params
    is_head = "layer" in params and "layers" not in params
    if is_head and target is None:
        return params
    key = (params, target.params if is_head else None)  # a head's packing reads its target
    cached = model.__dict__.get("_inference_params")
    if cached is not None and cached[0] is key[0] and cached[1] is key[1]:
        return cached[2]
    if is_head:
        packed = _pack_head(params, model.config, target)
    elif "layers" in params and "embed" in params:  # a Model
        packed = params if _unsupported(model.config) else pack_params(
            params, _gguf_blocks(model), model.__dict__.get("_activations", "float32"))
    else:
        return params
    object.__setattr__(model, "_inference_params", (*key, packed))  # a cache, not model state
    return packed


def _unsupported(cfg) -> bool:
    return "native" in dict(registry.family_of(cfg).unsupported)


def _packable(a) -> bool:
    return getattr(a, "ndim", 0) == 2 and getattr(a, "dtype", None) == jnp.float32


def _pack_head(params: dict, cfg, target) -> dict:
    cfg = getattr(cfg, "head", cfg)  # a P-EAGLE head packs as its EAGLE-3 head
    if _unsupported(cfg.layer):
        return params
    out = dict(params, layer=_pack_layer(params["layer"]))
    for name in ("eh_proj", "fc"):
        if name in params and _packable(params[name]):
            out[name] = pack_weight(params[name])
    vocab = params.get("draft_vocab")
    if cfg.kind == "eagle3":
        w = params["lm_head"]
    elif "lm_head" in params:  # own full-vocabulary head (a loaded DeepSeek MTP layer)
        w = params["lm_head"] if vocab is None else jnp.take(params["lm_head"], vocab, axis=1)
    elif vocab is None and "lm_head_packed" in inference_params(target):
        out["lm_head_packed"] = inference_params(target)["lm_head_packed"]  # shared, not copied
        return out
    else:
        w = heads.output_matrix(target.params, target.config, vocab)
    if _packable(w):
        out["lm_head_packed"] = pack_weight(w)
    return out
