"""Builds and registers the native CPU kernels (specjax/csrc/*.cc) as XLA FFI targets, once.

The kernels (``specjax.native``'s few-row and GGUF-block matmuls, ``specjax.native_q8``'s
int8-activation dots, ``specjax.native_attention``'s paged attention) are compiled together on
first use with the system C++ compiler for this CPU (``-march=native``) into
``~/.cache/specjax/native`` (``SPECJAX_CACHE`` moves it; the file name hashes the sources,
compiler, flags, jax version and CPU) and registered with ``jax.ffi``. Without a compiler, on
another default backend, or with ``SPECJAX_NATIVE=0``, ``available()`` is False and every caller
keeps XLA's ops. A module of its own, below the model code, so that the attention (imported by
``specjax.model``) and the matmuls (importing ``specjax.heads``) share one build.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp

from specjax.native_q8 import Q8TARGETS

log = logging.getLogger("specjax.native")

NB = 32  # panel width (columns); must match kNB in skinny_matmul.cc
MAX_ROWS = 128  # x @ packed runs the kernel up to this many rows, XLA's dot above (prefill)
TARGET = "specjax_skinny_matmul"
# panel dtype -> (custom-call target, symbol in the built library)
TARGETS = {
    jnp.dtype(jnp.float32): (TARGET, "SpecjaxSkinnyMatmul"),
    jnp.dtype(jnp.bfloat16): (TARGET + "_bf16", "SpecjaxSkinnyMatmulBF16"),
    jnp.dtype(jnp.float16): (TARGET + "_f16", "SpecjaxSkinnyMatmulF16"),
}
# GGUF block types the quantized kernel streams -> (custom-call target, symbol, bytes per block,
# weights per block along K: 32, or 256 for the K-quant super-blocks)
QTARGETS = {
    "Q4_0": (TARGET + "_q4_0", "SpecjaxQuantMatmulQ4_0", 18, 32),
    "Q4_1": (TARGET + "_q4_1", "SpecjaxQuantMatmulQ4_1", 20, 32),
    "Q5_0": (TARGET + "_q5_0", "SpecjaxQuantMatmulQ5_0", 22, 32),
    "Q8_0": (TARGET + "_q8_0", "SpecjaxQuantMatmulQ8_0", 34, 32),
    "Q4_K": (TARGET + "_q4_k", "SpecjaxQuantMatmulQ4_K", 144, 256),
    "Q6_K": (TARGET + "_q6_k", "SpecjaxQuantMatmulQ6_K", 210, 256),
}
QBLOCK = 32  # weights per GGUF block (along K) of the 32-weight types
ATTENTION_TARGET = ("specjax_paged_attention", "SpecjaxPagedAttention")
# compiled into one library: the float / exact-dequant matmuls, the int8-activation dots, attention
_SOURCES = [os.path.join(os.path.dirname(__file__), "csrc", f)
            for f in ("skinny_matmul.cc", "q8_dot.cc", "paged_attention.cc")]
_HEADERS = [os.path.join(os.path.dirname(__file__), "csrc", "common.h")]  # hashed, not compiled


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model name and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor()


def _build(cxx: str) -> str:
    """Compiles the kernel (once per source, compiler, jax and CPU) and returns the .so path."""
    src = b""
    for name in _SOURCES + _HEADERS:
        with open(name, "rb") as f:
            src += f.read()
    # -ffp-contract=off: the quantized kernels dequantize as gguf does (d * q + m, two roundings)
    # SPECJAX_NATIVE_CFLAGS: extra compiler flags, after ours (tests build the other code paths
    # on an AVX-512 host with "-march=haswell" = AVX2 and "-DSPECJAX_Q8_PORTABLE")
    flags = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w", "-ffp-contract=off",
             *os.environ.get("SPECJAX_NATIVE_CFLAGS", "").split()]
    key = hashlib.sha256(b"\0".join([
        src, cxx.encode(), " ".join(flags).encode(), jax.__version__.encode(),
        _cpu_signature().encode()])).hexdigest()[:16]
    cache = os.path.join(os.environ.get("SPECJAX_CACHE", os.path.expanduser("~/.cache/specjax")),
                         "native")
    path = os.path.join(cache, f"skinny_matmul-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
    os.close(fd)
    try:
        subprocess.run([cxx, *flags, f"-I{jax.ffi.include_dir()}", *_SOURCES, "-o", tmp],
                       check=True, capture_output=True, timeout=300)
        os.replace(tmp, path)  # atomic: a concurrent build never sees half a library
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


@functools.cache
def available() -> bool:
    """True when the kernel is built and registered for the CPU backend (decided once).

    False on a non-CPU default backend, without a C++ compiler, or with ``SPECJAX_NATIVE=0``.
    """
    if os.environ.get("SPECJAX_NATIVE", "1") == "0" or jax.default_backend() != "cpu":
        return False
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        log.info("no C++ compiler: the native skinny matmul is off")
        return False
    try:
        lib = ctypes.cdll.LoadLibrary(_build(cxx))
        for name, symbol in [*TARGETS.values(), *(t[:2] for t in QTARGETS.values()),
                             *(t[:2] for t in Q8TARGETS.values()), ATTENTION_TARGET]:
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(lib, symbol)),
                                        platform="cpu")
    except (OSError, subprocess.SubprocessError) as e:
        log.warning("native skinny matmul unavailable (%s); using XLA's dot", e)
        return False
    return True
