"""Integer-dot matmuls over GGUF blocks with 8-bit activations: llama.cpp's arithmetic, opt-in.

``specjax.native``'s exact kernel dequantizes every weight to float32 (the value ``gguf`` gives)
and multiplies in float. llama.cpp instead quantizes each matmul's input row to 8 bits per 32
values (its Q8_0 / Q8_1 blocks) and multiplies the 4-/8-bit weights with integer dot-product
instructions: several times fewer instructions per weight, so a decode step that was compute
bound on a small CPU streams its weights at memory speed. ``sj.load_model(...,
activations="int8")`` runs the Q4_0 / Q4_1 / Q8_0 weights of a GGUF that way
(``specjax/csrc/q8_dot.cc``; the other block types keep the exact kernel).

What changes: the activation rounding (each input value to the nearest of 255 levels of its
block's largest magnitude; the integer sums are exact), so logits move by ~1e-3 relative and
greedy text can differ from the exact path; decode and verify still give a row the same result
whatever the other rows are, so speculative decoding stays lossless with respect to this
arithmetic (tests/test_native_q8.py). The weights are the file's blocks with the same bytes,
rearranged per row (``q8_layout``: nibbles, then scales, then mins) so that four blocks load as
one 512-bit register.

Pieces: ``q8_layout`` (GGUF blocks -> the kernel's row layout, numpy), ``q8_matmul`` (the custom
call, registered by ``specjax.native.available()``), ``q8_matmul_reference`` (its plain numpy
twin, from the published semantics: quantize the rows, exact integer block dots, float scales).
``native.Q8Weight`` is the pytree ``x @ w`` dispatches on (beside ``native.QuantWeight``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# GGUF block type -> (custom-call target, symbol in the built library, bytes per 32 weights)
Q8TARGETS = {
    "Q4_0": ("specjax_q8_dot_q4_0", "SpecjaxQ8DotQ4_0", 18),
    "Q4_1": ("specjax_q8_dot_q4_1", "SpecjaxQ8DotQ4_1", 20),
    "Q8_0": ("specjax_q8_dot_q8_0", "SpecjaxQ8DotQ8_0", 34),
}
ACTIVATIONS = ("float32", "int8")


def _check(qtype: str, what: str):
    if qtype not in Q8TARGETS:
        raise ValueError(f"{what}: qtype must be one of {sorted(Q8TARGETS)}, got {qtype!r}")
    return Q8TARGETS[qtype][2]


def q8_layout(q, qtype: str) -> np.ndarray:
    """GGUF blocks ``q`` [N, B * bytes] uint8 (B = K / 32 blocks per row) -> the same bytes per
    row as [all B blocks' quants][B f16 scales d] (+ [B f16 mins m] for Q4_1)."""
    nbytes = _check(qtype, "q8_layout")
    q = np.asarray(q, np.uint8)
    if q.ndim != 2 or q.shape[1] % nbytes:
        raise ValueError(f"q8_layout: q must be [N, blocks * {nbytes}], got {q.shape}")
    b = q.reshape(q.shape[0], -1, nbytes)  # [N, B, bytes]
    head = 4 if qtype == "Q4_1" else 2  # d (and m) lead each GGUF block
    parts = [b[..., head:], b[..., 0:2]] + ([b[..., 2:4]] if qtype == "Q4_1" else [])
    return np.ascontiguousarray(np.concatenate([p.reshape(q.shape[0], -1) for p in parts], axis=1))


def quantize_rows(x) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 -> (q [M, K / 32, 32] int8, d [M, K / 32] float32): per 32 values
    ``d = max|x| / 127`` and ``q = round-half-even(x / d)`` (0 where d = 0), llama.cpp's Q8_0."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0).astype(np.float32)
    return np.rint(xb * inv[..., None]).astype(np.int8), d


def q8_matmul_reference(x, q, qtype: str) -> np.ndarray:
    """The plain numpy twin of ``q8_matmul`` from GGUF blocks ``q`` [N, B * bytes]: quantize the
    rows (``quantize_rows``), exact integer dots of each block with the signed weights (nibble -
    8 for Q4_0, nibble for Q4_1, int8 for Q8_0), scaled by ``d * dx`` (+ ``m * dx * sum(q)``
    for Q4_1) and summed in float64 (the kernel's float32 sums agree to ~1e-6 relative)."""
    nbytes = _check(qtype, "q8_matmul_reference")
    xq, dx = quantize_rows(x)  # [M, B, 32], [M, B]
    b = np.asarray(q, np.uint8).reshape(q.shape[0], -1, nbytes)  # [N, B, bytes]
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float64)  # [N, B]
    if qtype == "Q8_0":
        w = b[..., 2:34].view(np.int8).astype(np.int64)
    else:
        qs = b[..., 4 if qtype == "Q4_1" else 2:][..., :16].astype(np.int64)
        w = np.concatenate([qs & 15, qs >> 4], axis=-1) - (8 if qtype == "Q4_0" else 0)
    isum = np.einsum("mbj,nbj->mnb", xq.astype(np.int64), w)  # exact
    y = np.einsum("mnb,nb,mb->mn", isum.astype(np.float64), d, dx.astype(np.float64))
    if qtype == "Q4_1":
        m = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)
        sx = dx.astype(np.float64) * xq.astype(np.int64).sum(-1)  # [M, B]
        y = y + sx @ m.T
    return y.astype(np.float32)


def q8_matmul(x, q8, qtype: str):
    """x [M, K] float32 @ W -> [M, N] float32 with 8-bit activations, W given as ``q8_layout``
    rows [N, K / 32 * bytes] (the native kernel must be available: ``native.available()``)."""
    nbytes = _check(qtype, "q8_matmul")
    if x.ndim != 2 or q8.ndim != 2 or x.shape[1] % 32 or q8.shape[1] != x.shape[1] // 32 * nbytes:
        raise ValueError(f"q8_matmul: x must be [M, K] (K % 32 == 0) and q8 [N, K / 32 * {nbytes}],"
                         f" got {x.shape} and {q8.shape}")
    if x.dtype != jnp.float32 or q8.dtype != jnp.uint8:
        raise TypeError(f"q8_matmul takes float32 x and uint8 q8, got {x.dtype} and {q8.dtype}")
    call = jax.ffi.ffi_call(Q8TARGETS[qtype][0],
                            jax.ShapeDtypeStruct((x.shape[0], q8.shape[0]), jnp.float32),
                            vmap_method="sequential")
    return call(x, q8)
