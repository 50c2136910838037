"""GPU benchmark of the Pallas attention kernels (H100 / H200; Triton lowering): correctness, then speed.

Sections, in order (each config is guarded: a failure is recorded and the run goes on; configs
that would start after the time budget are recorded as skipped; the JSON is rewritten after
every section, so a run cut short still reports):

1. env          jax version, device.
2. bandwidth    HBM copy bandwidth: y = x + 1 over a 2 GiB bf16 array, (bytes read + written)
                / time. The ceiling every decode number is compared with.
3. correctness  every kernel against its jnp reference on random never-zero inputs (uniform
                magnitude in [0.5, 1.5), random sign) with NaN in every page slot no sequence
                may read, bf16 and fp32, lengths that are not multiples of a tile, split-K on
                and off, GQA groups 1 / 4 / 8: max abs error vs a dtype tolerance.
4. decode       paged multi-query attention (decode Q = 1, verify Q = 4, 8), Llama-3-8B heads
                (32 query / 8 KV heads, D = 128, bf16, page size 16), batch 1-64, prefix
                512-32k: time per call and achieved bandwidth = K/V bytes actually read (only
                each sequence's own length) + q + out, against the measured copy bandwidth.
5. tree         tree attention (N = 16, 64 nodes of a random draft tree, ancestor mask built
                once per step as in a model, so per call only the kernel runs) vs plain chain
                verification of the same N tokens: the same kernel with the causal mask, and the
                prefill kernel that ``dispatch`` picks for causal T >= 16. The ancestor-mask
                build is timed on its own.
6. tuning       B = 1 and 8 at a 32k prefix (Q = 1), B = 32 at 8k (Q = 8): pages per step,
                warps and split-K variants of the same call.
7. prefill      causal prefill over the paged cache, batch 1-8, prompts 1k-16k: TFLOP/s (the
                causal half only) and time vs the jnp reference where that fits in memory;
                then the prefill tile variants (last: the first thing the budget drops).

Timing: each measured call is chained ``reps`` times inside one jitted ``lax.fori_loop`` (the
output is the next iteration's q: same shape, a real dependency, no dispatch gaps), the loop is
compiled and run once, then timed ``trials`` times; the median / reps is reported.

Usage (the GPU machine; $OUT is where JSON lands, default ./out):
  python benchmarks/gpu_kernels.py [--quick] [--budget-s 210] [--out DIR]
  python benchmarks/gpu_kernels.py --cpu-smoke        # tiny shapes, Pallas interpreter on CPU
From Python (benchmarks/gpu_check.py): ``main(out_dir, quick=False)``; on a machine without a
GPU main runs the CPU smoke mode.
"""

import argparse
import dataclasses
import functools
import json
import os
import platform
import statistics
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

from pallas_kernels import paged_attention as pa  # noqa: E402
from pallas_kernels import prefill_attention as pf  # noqa: E402
from pallas_kernels import tree_attention as ta  # noqa: E402
from specjax.provenance import provenance  # noqa: E402

TOLERANCE = {"float32": 2e-5, "bfloat16": 3e-2}  # max abs error (outputs are O(1))


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Everything a run measures; FULL / QUICK on the GPU, SMOKE on CPU (interpreter)."""

    heads: int  # H query heads
    kv_heads: int  # Hkv
    head_dim: int  # D
    page_size: int  # S
    dtype: str
    copy_bytes: int
    correctness: tuple  # (kernel, B, prefix, T, G, dtype, num_splits)
    decode: tuple  # (B, prefix, Q)
    tuning_decode: tuple  # (B, prefix, Q, pages_per_block, num_warps, num_splits)
    tuning_prefill: tuple  # (B, T, block_rows, block_keys, num_warps)
    tree: tuple  # (B, prefix, N)
    prefill: tuple  # (B, T)
    reps: int
    trials: int
    reference_max_elems: int  # time the jnp reference only below this many score elements


FULL = Sizes(
    heads=32, kv_heads=8, head_dim=128, page_size=16, dtype="bfloat16", copy_bytes=2 << 30,
    correctness=(
        ("paged", 3, 1029, 1, 4, "bfloat16", 1), ("paged", 3, 1029, 8, 4, "bfloat16", None),
        ("paged", 2, 4099, 5, 8, "float32", 7), ("paged", 5, 513, 4, 1, "bfloat16", 3),
        ("tree", 2, 2051, 16, 4, "bfloat16", None), ("tree", 2, 777, 64, 4, "float32", 1),
        ("prefill", 3, 0, 1023, 4, "bfloat16", None), ("prefill", 2, 300, 257, 8, "float32", None),
    ),
    decode=tuple((b, n, q) for b, n in ((1, 512), (1, 32768), (8, 4096), (8, 32768), (32, 8192),
                                        (64, 2048), (64, 16384)) for q in (1, 4, 8)),
    tuning_decode=((1, 32768, 1, 2, 4, None), (1, 32768, 1, 4, 4, None),
                   (1, 32768, 1, 8, 4, None), (1, 32768, 1, 8, 8, None), (1, 32768, 1, 4, 4, 1),
                   (1, 32768, 1, 4, 4, 16), (1, 32768, 1, 4, 4, 64), (8, 32768, 1, 2, 4, None),
                   (8, 32768, 1, 8, 8, None), (8, 32768, 1, 4, 4, 1), (32, 8192, 8, 4, 4, None),
                   (32, 8192, 8, 8, 8, None)),
    tuning_prefill=((2, 4096, 64, 64, 4), (2, 4096, 128, 64, 8), (2, 4096, 128, 32, 4),
                    (2, 4096, 64, 32, 4), (2, 4096, 128, 128, 8)),
    tree=((1, 4096, 16), (1, 4096, 64), (16, 4096, 16), (16, 4096, 64), (64, 2048, 64)),
    prefill=((1, 1024), (1, 4096), (4, 4096), (1, 16384), (8, 2048)),
    reps=10, trials=5, reference_max_elems=1 << 31,
)
QUICK = dataclasses.replace(
    FULL,
    correctness=FULL.correctness[::2] + (FULL.correctness[5],),
    decode=((1, 32768, 1), (8, 32768, 1), (32, 8192, 4), (64, 2048, 8), (1, 4096, 8)),
    tuning_decode=(), tuning_prefill=(),
    tree=((1, 4096, 16), (16, 4096, 64)),
    prefill=((1, 4096), (4, 4096)),
    trials=3,
)
SMOKE = Sizes(
    heads=4, kv_heads=2, head_dim=16, page_size=8, dtype="float32", copy_bytes=1 << 20,
    # Shapes and block sizes repeat across sections so the interpreter compiles each kernel once.
    correctness=(("paged", 2, 37, 3, 2, "float32", None), ("tree", 2, 37, 8, 2, "float32", None),
                 ("prefill", 2, 0, 24, 2, "float32", None)),
    decode=((2, 37, 3),), tuning_decode=((2, 37, 3, None, 4, None),),
    tuning_prefill=((2, 24, 64, 64, 4),), tree=((2, 37, 8),), prefill=((2, 24),),
    reps=1, trials=1, reference_max_elems=0,
)


# ------------------------------------------------------------------------------ inputs


def _nonzero(seed: int, shape, dtype):
    """Magnitude in [0.5, 1.5) with a pseudo-random sign: never zero, never tiny. A counter hash
    (murmur3's finaliser) instead of jax.random: cheap to compile, one pass over HBM."""
    n = int(np.prod(shape))
    assert n < 2 ** 32, shape
    h = lax.iota(jnp.uint32, n) * jnp.uint32(0x9E3779B1) + jnp.uint32((seed * 0x85EBCA6B + 1) % (1 << 32))
    for shift, mul in ((16, 0x85EBCA6B), (13, 0xC2B2AE35), (16, None)):
        h = h ^ (h >> shift)
        if mul is not None:
            h = h * jnp.uint32(mul)
    mag = 0.5 + (h >> 9).astype(jnp.float32) * (1.0 / (1 << 23))
    return jnp.where((h & 1) == 1, mag, -mag).astype(dtype).reshape(shape)


def _case(sz: Sizes, b, prefix, t, g=None, dtype=None, seed=0, poison=False, num_new=None):
    """q [B, T, Hkv*G, D], pools [Hkv, P, S, D] with scattered pages, page table, lengths.

    Sequence i has ``prefix - 7*i`` (>= 0) cached tokens (ragged batches) plus ``num_new[i]``
    (default T) new ones. With ``poison`` every slot no sequence may read holds NaN.
    """
    g = g or sz.heads // sz.kv_heads
    starts = np.maximum(prefix - 7 * np.arange(b), 0).astype(np.int32)
    nnew = np.full(b, t, np.int32) if num_new is None else np.asarray(num_new, np.int32)
    per_seq = -(-(int(starts.max()) + t) // sz.page_size)
    table = np.random.default_rng(seed).permutation(b * per_seq).astype(np.int32)
    table = jnp.asarray(table.reshape(b, per_seq))
    start, nnew = jnp.asarray(starts), jnp.asarray(nnew)
    q, k, v = _build(table, start, nnew, seed=seed, t=t, hkv=sz.kv_heads, g=g, s=sz.page_size,
                     d=sz.head_dim, dtype=jnp.dtype(dtype or sz.dtype).name, poison=poison)
    return q, k, v, table, start, nnew


@functools.partial(jax.jit, static_argnames=("seed", "t", "hkv", "g", "s", "d", "dtype", "poison"))
def _build(table, start, nnew, *, seed, t, hkv, g, s, d, dtype, poison):
    """One compiled program makes a case on the device (no host round trip for GBs of pages)."""
    b, per_seq = table.shape
    num_pages = b * per_seq
    q = _nonzero(3 * seed, (b, t, hkv * g, d), dtype)
    k = _nonzero(3 * seed + 1, (hkv, num_pages, s, d), dtype)
    v = _nonzero(3 * seed + 2, (hkv, num_pages, s, d), dtype)
    if poison:
        live = jnp.arange(per_seq * s)[None, :] < (start + nnew)[:, None]  # [B, per_seq*S]
        flat = (table[:, :, None] * s + jnp.arange(s)[None, None, :]).reshape(-1)
        readable = jnp.zeros((num_pages * s,), bool).at[flat].set(live.reshape(-1))
        readable = readable.reshape(1, num_pages, s, 1)
        k, v = jnp.where(readable, k, jnp.nan), jnp.where(readable, v, jnp.nan)
    return q, k, v


def _parents(b, n, seed=0):
    """[B, N] random draft trees: node j's parent is one of the previous 8 nodes (depth ~N/4);
    node 0 is the root (a child of the committed prefix)."""
    rng = np.random.default_rng(seed)
    par = np.full((b, n), -1, np.int32)
    for j in range(1, n):
        par[:, j] = rng.integers(max(0, j - 8), j, size=b)
    return jnp.asarray(par)


# ------------------------------------------------------------------------------ timing


def _time_chain(fn, q, *rest, reps: int, trials: int) -> float:
    """Seconds per call of fn(q, *rest) -> like q, chained reps times in one jitted loop."""
    if reps == 1:  # the kernels are jitted already: no wrapper, no second compilation
        run = fn
    else:
        run = jax.jit(lambda q, *r: lax.fori_loop(0, reps, lambda i, x: fn(x, *r), q))
    jax.block_until_ready(run(q, *rest))  # compile + warm up
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(run(q, *rest))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / reps


def copy_bandwidth(sz: Sizes) -> dict:
    n = sz.copy_bytes // 2
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda x: x + 1)
    jax.block_until_ready(f(x))
    times = []
    for _ in range(max(3, sz.trials * 2)):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    t = statistics.median(times)
    return {"bytes_moved": 2 * n * 2, "seconds": t, "GBps": 2 * n * 2 / t / 1e9}


# ------------------------------------------------------------------------------ sections


def _kv_bytes(k, start, nnew, sz: Sizes):
    """K and V bytes a kernel must read: each sequence's own slots only."""
    tokens = int(jnp.sum(start + nnew))
    return 2 * tokens * sz.kv_heads * sz.head_dim * k.dtype.itemsize


def _exact(ref, *args):
    """The jnp reference with full-float32 matmuls (XLA's GPU default for f32 is TF32)."""
    with jax.default_matmul_precision("highest"):
        return jax.jit(ref)(*args)


def correctness(sz: Sizes, interpret: bool) -> list:
    rows = []
    for kind, b, prefix, t, g, dtype, splits in sz.correctness:
        row = {"kernel": kind, "B": b, "prefix": prefix, "T": t, "G": g, "dtype": dtype,
               "num_splits": splits}
        try:
            nnew = [t] + [max(1, t - 3 * i) for i in range(1, b)]  # ragged new-token counts
            q, k, v, pt, start, nn = _case(sz, b, prefix, t, g, dtype, seed=1, poison=True,
                                           num_new=nnew)
            if kind == "paged":
                got = pa.paged_attention(q, k, v, pt, start, nn, interpret=interpret,
                                         block_sizes=pa.BlockSizes(num_splits=splits))
                want = _exact(pa.paged_attention_reference, q, k, v, pt, start, nn)
            elif kind == "tree":
                par = _parents(b, t, seed=2)
                got = ta.tree_attention(q, k, v, pt, start, par, nn, interpret=interpret,
                                        block_sizes=ta.BlockSizes(num_splits=splits))
                want = _exact(ta.tree_attention_reference, q, k, v, pt, start, par, nn)
            else:
                got = pf.prefill_attention(q, k, v, pt, start, nn, interpret=interpret,
                                           block_sizes=pf.BlockSizes())
                want = _exact(pf.prefill_attention_reference, q, k, v, pt, start, nn)
            got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
            err = float(np.abs(got - want).max())
            row.update(max_abs_err=err, finite=bool(np.isfinite(got).all()),
                       ok=bool(np.isfinite(got).all() and err <= TOLERANCE[dtype]))
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            row.update(ok=False, error=_err(e))
        rows.append(row)
    return rows


def decode(sz: Sizes, interpret: bool, bw: float, deadline: float, configs=None,
           tuning=False) -> list:
    rows = []
    for cfg in (configs if configs is not None else sz.decode):
        b, prefix, t = cfg[:3]
        sizes = pa.BlockSizes()
        if tuning:
            ppb, warps, splits = cfg[3:6]
            sizes = pa.BlockSizes(pages_per_block=ppb, num_warps=warps, num_splits=splits)
        row = {"B": b, "prefix": prefix, "Q": t}
        if tuning:
            row.update(pages_per_block=ppb, num_warps=warps, num_splits=splits)
        if time.monotonic() > deadline:
            rows.append({**row, "skipped": "time budget"})
            continue
        try:
            q, k, v, pt, start, nn = _case(sz, b, prefix, t)
            fn = lambda q, k, v, pt, st, nn: pa.paged_attention(  # noqa: E731
                q, k, v, pt, st, nn, block_sizes=sizes, interpret=interpret)
            sec = _time_chain(fn, q, k, v, pt, start, nn, reps=sz.reps, trials=sz.trials)
            nbytes = _kv_bytes(k, start, nn, sz) + 2 * q.size * q.dtype.itemsize
            rows_per_kv = t * sz.heads // sz.kv_heads  # folded (query head, token) rows
            row_blocks = -(-rows_per_kv // min(sizes.block_rows, max(16, rows_per_kv)))
            row.update(us=sec * 1e6, GBps=nbytes / sec / 1e9,
                       pct_of_copy=100 * nbytes / sec / 1e9 / bw,
                       auto_splits=pa.auto_num_splits(b * sz.kv_heads * row_blocks,
                                                      pt.shape[1] * sz.page_size))
            del q, k, v
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e)
        rows.append(row)
    return rows


def tree(sz: Sizes, interpret: bool, deadline: float, with_prefill: bool = True) -> list:
    rows = []
    for b, prefix, n in sz.tree:
        row = {"B": b, "prefix": prefix, "N": n}
        if time.monotonic() > deadline:
            rows.append({**row, "skipped": "time budget"})
            continue
        try:
            q, k, v, pt, start, nn = _case(sz, b, prefix, n)
            mask = ta.ancestor_mask(_parents(b, n))
            kw = dict(reps=sz.reps, trials=sz.trials)

            def paged(q, k, v, pt, st, nn, m):
                return pa.paged_attention(q, k, v, pt, st, nn, m, interpret=interpret)

            def causal_paged(q, k, v, pt, st, nn):
                return pa.paged_attention(q, k, v, pt, st, nn, interpret=interpret)

            def causal_prefill(q, k, v, pt, st, nn):
                return pf.prefill_attention(q, k, v, pt, st, nn, interpret=interpret)

            t_tree = _time_chain(paged, q, k, v, pt, start, nn, mask, **kw)
            t_chain = _time_chain(causal_paged, q, k, v, pt, start, nn, **kw)
            t_prefill = (_time_chain(causal_prefill, q, k, v, pt, start, nn, **kw)
                         if with_prefill else float("inf"))
            par = _parents(b, n)
            build = jax.jit(ta.ancestor_mask)
            jax.block_until_ready(build(par))
            t0 = time.perf_counter()
            for _ in range(sz.reps):
                m = build(par)
            jax.block_until_ready(m)
            t_mask = (time.perf_counter() - t0) / sz.reps
            best_verify = min(t_chain, t_prefill)
            row.update(tree_us=t_tree * 1e6, verify_same_kernel_us=t_chain * 1e6,
                       verify_prefill_kernel_us=t_prefill * 1e6 if with_prefill else None,
                       mask_build_us=t_mask * 1e6,
                       tree_over_same_kernel_pct=100 * (t_tree / t_chain - 1),
                       tree_over_best_verify_pct=100 * (t_tree / best_verify - 1))
            del q, k, v
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e)
        rows.append(row)
    return rows


def prefill(sz: Sizes, interpret: bool, deadline: float, configs=None, tuning=False) -> list:
    rows = []
    g = sz.heads // sz.kv_heads
    for cfg in (configs if configs is not None else sz.prefill):
        b, t = cfg[:2]
        sizes = pf.BlockSizes()
        row = {"B": b, "T": t}
        if tuning:
            sizes = pf.BlockSizes(block_rows=cfg[2], block_keys=cfg[3], num_warps=cfg[4])
            row.update(block_rows=cfg[2], block_keys=cfg[3], num_warps=cfg[4])
        if time.monotonic() > deadline:
            rows.append({**row, "skipped": "time budget"})
            continue
        try:
            q, k, v, pt, start, nn = _case(sz, b, 0, t)
            fn = lambda q, k, v, pt, st, nn: pf.prefill_attention(  # noqa: E731
                q, k, v, pt, st, nn, block_sizes=sizes, interpret=interpret)
            sec = _time_chain(fn, q, k, v, pt, start, nn, reps=max(1, sz.reps // 3),
                              trials=sz.trials)
            flops = 4 * b * sz.heads * sz.head_dim * t * (t + 1) / 2  # QK and PV, causal half
            row.update(us=sec * 1e6, TFLOPs=flops / sec / 1e12)
            if not tuning and b * sz.heads * t * t <= sz.reference_max_elems:
                ref = jax.jit(pf.prefill_attention_reference)
                row["reference_us"] = 1e6 * _time_chain(ref, q, k, v, pt, start, nn, reps=1,
                                                        trials=sz.trials)
            del q, k, v
        except Exception as e:  # noqa: BLE001
            row["error"] = _err(e)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------ report


def _err(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e)[:300]} | {traceback.format_exc(limit=-3)[-700:]}"


def _fmt(rows, cols) -> str:
    lines = ["  " + " ".join(f"{c:>14}" for c in cols)]
    for r in rows:
        cells = []
        for c in cols:
            x = r.get(c, "")
            if isinstance(x, float):
                cells.append(f"{x:>14.1f}" if abs(x) >= 100 else f"{x:>14.3g}")
            else:
                cells.append(f"{str(x):>14}")
        extra = r.get("error") or r.get("skipped") or ""
        lines.append("  " + " ".join(cells) + (f"  {extra[:120]}" if extra else ""))
    return "\n".join(lines)


def report(res: dict) -> str:
    out = [f"env: {res['env']}"]
    if "bandwidth" in res:
        out.append(f"copy bandwidth: {res['bandwidth'].get('GBps', 0):.0f} GB/s")
    for name, cols in (
        ("correctness", ("kernel", "B", "prefix", "T", "G", "dtype", "num_splits",
                         "max_abs_err", "ok")),
        ("decode", ("B", "prefix", "Q", "us", "GBps", "pct_of_copy", "auto_splits")),
        ("tuning_decode", ("B", "prefix", "pages_per_block", "num_warps", "num_splits", "us",
                           "pct_of_copy")),
        ("tree", ("B", "prefix", "N", "tree_us", "verify_same_kernel_us",
                  "verify_prefill_kernel_us", "mask_build_us", "tree_over_same_kernel_pct",
                  "tree_over_best_verify_pct")),
        ("prefill", ("B", "T", "us", "TFLOPs", "reference_us")),
        ("tuning_prefill", ("B", "T", "block_rows", "block_keys", "num_warps", "us", "TFLOPs")),
    ):
        if res.get(name):
            out.append(f"{name}:\n" + _fmt(res[name], cols))
    out.append(f"total {res.get('seconds', 0):.0f} s; all correct: {res.get('all_correct')}")
    return "\n".join(out)


def main(out_dir: str | None = None, quick: bool = False, cpu_smoke: bool | None = None,
         budget_s: float | None = None) -> dict:
    """Runs every section, prints the table, writes ``out_dir/gpu_kernels.json``.

    Args:
      out_dir: where the JSON and the table go (default $OUT or ./out).
      quick: fewer shapes, no tuning sweep (~1-2 min on an H200).
      cpu_smoke: tiny shapes through the Pallas interpreter; None = "when there is no GPU".
      budget_s: no config starts after this many seconds (default 210, quick 100, smoke 60).
    Returns:
      the results dict (also in the JSON); ``all_correct`` is False if any kernel was off.
    """
    t_start = time.monotonic()
    out_dir = out_dir or os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    on_gpu = jax.default_backend() == "gpu"
    if cpu_smoke is None:
        cpu_smoke = not on_gpu
    sz = SMOKE if cpu_smoke else (QUICK if quick else FULL)
    interpret = not on_gpu
    budget = budget_s or (60 if cpu_smoke else 100 if quick else 210)
    deadline = t_start + budget
    dev = jax.devices()[0]
    res = {"env": {"jax": jax.__version__, "backend": jax.default_backend(),
                   "device": getattr(dev, "device_kind", str(dev)), "python": platform.python_version(),
                   "mode": "cpu-smoke" if cpu_smoke else "quick" if quick else "full",
                   "interpret": interpret},
           "sizes": {k: v for k, v in dataclasses.asdict(sz).items() if not isinstance(v, tuple)},
           "provenance": provenance()}
    path = os.path.join(out_dir, "gpu_kernels.json")

    def save():
        res["seconds"] = time.monotonic() - t_start
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)

    def section(name, fn):
        t0, c0 = time.monotonic(), time.process_time()
        try:
            res[name] = fn()
        except Exception as e:  # noqa: BLE001
            res[name] = [{"error": _err(e)}]
        print(f"[{name}] {time.monotonic() - t0:.1f} s ({time.process_time() - c0:.1f} s CPU)",
              flush=True)
        save()

    section("bandwidth", lambda: copy_bandwidth(sz))
    bw = res["bandwidth"].get("GBps", float("nan")) if isinstance(res["bandwidth"], dict) else 1.0
    section("correctness", lambda: correctness(sz, interpret))
    section("decode", lambda: decode(sz, interpret, bw, deadline))
    # (interpreter timings mean nothing: the smoke run skips the third compile of each tree row)
    section("tree", lambda: tree(sz, interpret, deadline, with_prefill=not cpu_smoke))
    section("tuning_decode", lambda: decode(sz, interpret, bw, deadline, sz.tuning_decode, True))
    section("prefill", lambda: prefill(sz, interpret, deadline))
    section("tuning_prefill", lambda: prefill(sz, interpret, deadline, sz.tuning_prefill, True))
    res["all_correct"] = all(r.get("ok") for r in res["correctness"])
    save()
    table = report(res)
    with open(os.path.join(out_dir, "gpu_kernels.txt"), "w") as f:
        f.write(table + "\n")
    print(table, flush=True)
    return res


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--quick", action="store_true", help="fewer shapes, no tuning sweep")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, Pallas interpreter")
    ap.add_argument("--budget-s", type=float, default=None)
    a = ap.parse_args()
    r = main(a.out, quick=a.quick, cpu_smoke=True if a.cpu_smoke else None, budget_s=a.budget_s)
    sys.exit(0 if r["all_correct"] else 1)
