"""Integer-dot matmuls over GGUF blocks with 8-bit activations: llama.cpp's arithmetic, opt-in.

``specjax.native``'s exact kernel dequantizes every weight to float32 (the value ``gguf`` gives)
and multiplies in float. llama.cpp instead quantizes each matmul's input row to 8 bits per 32
values (its Q8_0 / Q8_1 blocks) and multiplies the 4-/8-bit weights with integer dot-product
instructions: several times fewer instructions per weight, so a decode step that was compute
bound on a small CPU streams its weights at memory speed. ``sj.load_model(...,
activations="int8")`` runs the Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q6_K weights of a GGUF that way
(``specjax/csrc/q8_dot.cc``): every block type the exact kernel streams, the
K-quants' 256-weight super-blocks included (32-value input blocks, finer than llama.cpp's Q8_K).

What changes: the activation rounding (each input value to the nearest of 255 levels of its
block's largest magnitude; the integer sums are exact), so logits move by ~1e-3 relative and
greedy text can differ from the exact path; decode and verify still give a row the same result
whatever the other rows are, so speculative decoding stays lossless with respect to this
arithmetic (tests/test_native_q8.py). The weights are the file's blocks with the same bytes,
rearranged per row for the 32-weight types (``q8_layout``: quants, then scales, then mins or
high bits) so that four blocks load as one 512-bit register; the K-quants' super-blocks as they
are.

Pieces: ``q8_layout`` (GGUF blocks -> the kernel's row layout, numpy), ``q8_matmul`` (the custom
call, registered by ``specjax.native.available()``), ``q8_matmul_reference`` (its plain numpy
twin, from the published semantics: quantize the rows, exact integer sub-block dots with
``integer_weights``, float scales).
``native.Q8Weight`` is the pytree ``x @ w`` dispatches on (beside ``native.QuantWeight``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# GGUF block type -> (custom-call target, symbol in the built library, bytes per block,
# weights per block along K: 32, or 256 for the K-quant super-blocks)
Q8TARGETS = {
    "Q4_0": ("specjax_q8_dot_q4_0", "SpecjaxQ8DotQ4_0", 18, 32),
    "Q4_1": ("specjax_q8_dot_q4_1", "SpecjaxQ8DotQ4_1", 20, 32),
    "Q5_0": ("specjax_q8_dot_q5_0", "SpecjaxQ8DotQ5_0", 22, 32),
    "Q8_0": ("specjax_q8_dot_q8_0", "SpecjaxQ8DotQ8_0", 34, 32),
    "Q4_K": ("specjax_q8_dot_q4_k", "SpecjaxQ8DotQ4_K", 144, 256),
    "Q6_K": ("specjax_q8_dot_q6_k", "SpecjaxQ8DotQ6_K", 210, 256),
}
ACTIVATIONS = ("float32", "int8")
_HEAD = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q8_0": 2}  # bytes of scales (and min / qh) ahead of
# the quants in each 32-weight GGUF block


def _check(qtype: str, what: str) -> tuple[int, int]:
    if qtype not in Q8TARGETS:
        raise ValueError(f"{what}: qtype must be one of {sorted(Q8TARGETS)}, got {qtype!r}")
    return Q8TARGETS[qtype][2:4]


def q8_layout(q, qtype: str) -> np.ndarray:
    """GGUF blocks ``q`` [N, B * bytes] uint8 -> the kernel's rows, the same bytes: for the
    32-weight types [all B blocks' quants][B f16 scales d] (+ [B f16 mins m] for Q4_1, + [B
    uint32 high bits qh] for Q5_0); the K-quants' super-blocks as they are."""
    nbytes, _ = _check(qtype, "q8_layout")
    q = np.asarray(q, np.uint8)
    if q.ndim != 2 or q.shape[1] % nbytes:
        raise ValueError(f"q8_layout: q must be [N, blocks * {nbytes}], got {q.shape}")
    if qtype not in _HEAD:
        return np.ascontiguousarray(q)
    b = q.reshape(q.shape[0], -1, nbytes)  # [N, B, bytes]
    head = _HEAD[qtype]  # d (and m, or qh) lead each GGUF block
    parts = [b[..., head:], b[..., 0:2]] + ([b[..., 2:head]] if head > 2 else [])
    return np.ascontiguousarray(np.concatenate([p.reshape(q.shape[0], -1) for p in parts], axis=1))


def quantize_rows(x) -> tuple[np.ndarray, np.ndarray]:
    """x [M, K] float32 -> (q [M, K / 32, 32] int8, d [M, K / 32] float32): per 32 values
    ``d = max|x| / 127`` and ``q = round-half-even(x / d)`` (0 where d = 0), llama.cpp's Q8_0."""
    x = np.asarray(x, np.float32)
    xb = x.reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0).astype(np.float32)
    return np.rint(xb * inv[..., None]).astype(np.int8), d


def _half(b) -> np.ndarray:  # [..., 2] uint8 little-endian halves -> [...] float64
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float64)


def integer_weights(q, qtype: str):
    """GGUF blocks [N, B * bytes] -> ``(w, scale, mins)`` from the published formats: integer
    weights w [N, K] and per-sub-block float scales [N, K / S] (S = 32, 16 for Q6_K) so that the
    weight is ``scale * w - mins`` (mins [N, K / 32] or None): gguf's dequantized value, with
    the scale products rounded to float32 as gguf rounds them."""
    nbytes, _ = _check(qtype, "integer_weights")
    q = np.asarray(q, np.uint8)
    b = q.reshape(q.shape[0], -1, nbytes)  # [N, blocks, bytes]
    n = b.shape[0]
    f32 = lambda a: a.astype(np.float32).astype(np.float64)  # noqa: E731
    nib = lambda qs: np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int64)  # noqa: E731
    if qtype == "Q8_0":
        return b[..., 2:].view(np.int8).astype(np.int64).reshape(n, -1), _half(b[..., :2]), None
    if qtype in ("Q4_0", "Q4_1"):
        w = nib(b[..., _HEAD[qtype]:]) - (8 if qtype == "Q4_0" else 0)
        mins = -_half(b[..., 2:4]) if qtype == "Q4_1" else None
        return w.reshape(n, -1), _half(b[..., :2]), mins
    if qtype == "Q5_0":
        qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)  # [N, B, 1]
        hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.int64)  # bit j: weight j
        return (nib(b[..., _HEAD[qtype]:]) + 16 * hi - 16).reshape(n, -1), _half(b[..., :2]), None
    if qtype == "Q4_K":  # [d][dmin][scales 12][qs 128]; 8 sub-blocks of 32
        d, dmin, sc = _half(b[..., 0:2]), _half(b[..., 2:4]), b[..., 4:16].astype(np.int64)
        lo = sc[..., :4]
        s = np.concatenate([lo & 63, (sc[..., 8:] & 15) | ((lo >> 6) << 4)], axis=-1)
        m = np.concatenate([sc[..., 4:8] & 63, (sc[..., 8:] >> 4) | ((sc[..., 4:8] >> 6) << 4)],
                           axis=-1)
        qs = b[..., 16:].reshape(n, -1, 4, 32)  # chunk c: sub-blocks 2c (low), 2c + 1 (high)
        w = np.stack([qs & 15, qs >> 4], axis=3).astype(np.int64)  # [N, S, 4, 2, 32]
        return (w.reshape(n, -1), f32(d[..., None] * s).reshape(n, -1),
                f32(dmin[..., None] * m).reshape(n, -1))
    # Q6_K: [ql 128][qh 64][scales 16 int8][d]; 16 sub-blocks of 16
    ql = b[..., :128].reshape(n, -1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(2, 1)
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)
    w = ((ql & 15).reshape(n, -1, 2, 128).astype(np.int64)
         | ((qh & 3).reshape(n, -1, 2, 128).astype(np.int64) << 4)) - 32
    sc = b[..., 192:208].view(np.int8).astype(np.float32)  # [N, S, 16]
    d = b[..., 208:210].copy().view(np.float16).astype(np.float32)  # [N, S, 1]
    return w.reshape(n, -1), (d * sc).astype(np.float64).reshape(n, -1), None


def q8_matmul_reference(x, q, qtype: str) -> np.ndarray:
    """The plain numpy twin of ``q8_matmul`` from GGUF blocks ``q`` [N, B * bytes]: quantize the
    rows (``quantize_rows``), exact integer dots of each sub-block with the integer weights
    (``integer_weights``), scaled by ``scale * dx`` (minus ``mins * dx * sum(q)`` for Q4_1 /
    Q4_K) and summed in float64 (the kernel's float32 sums agree to ~1e-6 relative)."""
    xq, dx = quantize_rows(x)  # [M, B, 32], [M, B]
    w, scale, mins = integer_weights(q, qtype)  # [N, K], [N, K / S], [N, B] | None
    m, k = xq.shape[0], xq.shape[1] * 32
    sub = k // scale.shape[1]
    isum = np.einsum("msj,nsj->mns", xq.reshape(m, -1, sub).astype(np.int64),
                     w.reshape(w.shape[0], -1, sub))  # exact
    dxs = np.repeat(dx.astype(np.float64), 32 // sub, axis=1)  # [M, K / S]
    y = np.einsum("mns,ns,ms->mn", isum.astype(np.float64), scale, dxs)
    if mins is not None:
        sx = dx.astype(np.float64) * xq.astype(np.int64).sum(-1)  # [M, B]
        y = y - sx @ mins.T
    return y.astype(np.float32)


def q8_matmul(x, q8, qtype: str):
    """x [M, K] float32 @ W -> [M, N] float32 with 8-bit activations, W given as ``q8_layout``
    rows [N, K / per * bytes] (per = 32, or 256 for the K-quants; the native kernel must be
    available: ``native.available()``)."""
    nbytes, per = _check(qtype, "q8_matmul")
    if x.ndim != 2 or q8.ndim != 2 or x.shape[1] % per or q8.shape[1] != x.shape[1] // per * nbytes:
        raise ValueError(f"q8_matmul: x must be [M, K] (K % {per} == 0) and q8 "
                         f"[N, K / {per} * {nbytes}], got {x.shape} and {q8.shape}")
    if x.dtype != jnp.float32 or q8.dtype != jnp.uint8:
        raise TypeError(f"q8_matmul takes float32 x and uint8 q8, got {x.dtype} and {q8.dtype}")
    call = jax.ffi.ffi_call(Q8TARGETS[qtype][0],
                            jax.ShapeDtypeStruct((x.shape[0], q8.shape[0]), jnp.float32),
                            vmap_method="sequential")
    return call(x, q8)
