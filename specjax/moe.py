"""Mixture-of-experts FFN: routing-agnostic grouped dispatch, expert parallelism, dense twin.

Every MoE family (DeepSeek-V2/V3, Qwen3-MoE) routes its own way (``softmax_topk`` is the
Qwen3-MoE / Mixtral rule; DeepSeek's grouped sigmoid routing stays in ``specjax.deepseek``) and
hands this module the result: ``topk_ids`` [T, K] int32 expert ids and ``topk_weights`` [T, K] combine weights per
token. The routed experts are SwiGLU MLPs with stacked weights (X experts, E model dim, F expert
hidden)::

    w_gate, w_up [X, E, F]    w_down [X, F, E]        out_t = sum_k w_tk * FFN_{id_tk}(x_t)

Shared experts, biases of the router and the scaling factor belong to the caller.

``moe_ffn`` (grouped dispatch): the T*K (token, expert) assignments are sorted by expert, so
each expert's rows are contiguous; the three projections run as grouped matmuls over the sorted
[T*K, E] rows (group sizes traced, every shape static); each row's output is weighted by its
router weight, unsorted, and the K rows of a token summed. Work grows with T*K, not T*X.
Two grouped-matmul implementations compute the same thing:

- ``"ragged_dot"``: ``jax.lax.ragged_dot`` per projection, the grouped GEMM that GPU/TPU
  backends lower to a real grouped kernel. On CPU XLA expands it into a masked matmul against
  every expert (X times the work of the dense path), so it is not used there by default.
- ``"tiled"``: the sorted rows are cut into tiles of ``tile`` rows that each belong to one
  expert (an expert with g rows owns ceil(g / tile) tiles; a tile's rows past its expert's
  group are computed and discarded); a ``lax.while_loop`` runs the whole SwiGLU of one tile per
  iteration, for only the tiles that exist (a traced count: experts with no rows cost nothing).
  This is the CPU default.

``moe_ffn_expert_parallel``: experts split over an ``ep`` mesh axis (device i owns experts
[i*X/ep, (i+1)*X/ep)); under ``jax.shard_map`` each device takes T/ep tokens, sends each
assignment's row to the device owning its expert with one ``all_to_all``, runs the grouped FFN
on what it received, and sends the results back with a second ``all_to_all``. The send buffer
holds T/ep * K rows per destination by default: the worst case (every assignment of a device to
one destination), so no token is ever dropped and the result equals one device's. Padding rows
cost memory, not compute (the tiled loop skips them). ``ExpertParallel.capacity_factor`` trades
that guarantee for smaller buffers (overflowing assignments are dropped; documented there). An optional ``tp`` axis splits each expert's
hidden dim F (gate/up columns, down rows; one ``psum`` over tp).

``moe_dense_reference``: every expert on every token, weighted by the sparse combine matrix;
the slow twin the tests compare against.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

IMPLS = ("auto", "tiled", "ragged_dot")


@dataclasses.dataclass(frozen=True)
class ExpertParallel:
    """Where the routed experts live: a mesh and its expert axis (hashable, a static config value).

    mesh: a jax Mesh with an ``axis`` axis (and optionally a ``tp_axis``, over which each
    expert's hidden dim F is split); expert weights are placed P(axis, None, tp_axis) for
    w_gate / w_up and P(axis, tp_axis, None) for w_down.
    """

    mesh: Mesh
    axis: str = "ep"
    tp_axis: str | None = None
    # None: each (source, destination) buffer holds the worst case (T/ep * K rows), exact. A
    # float c: ceil(c * T/ep * K / ep) rows (c = 1: the mean load), smaller buffers and
    # all-to-alls, but assignments past a full buffer are DROPPED (contribute 0), as in
    # capacity-factor MoE training; exact only while no buffer overflows.
    capacity_factor: float | None = None

    def __post_init__(self):
        if not isinstance(self.mesh, Mesh):
            raise TypeError(f"ExpertParallel.mesh must be a jax.sharding.Mesh, "
                            f"got {type(self.mesh).__name__}")
        names = tuple(self.mesh.axis_names)
        for what, ax in (("axis", self.axis), ("tp_axis", self.tp_axis)):
            if ax is not None and ax not in names:
                raise ValueError(f"ExpertParallel.{what}={ax!r} is not an axis of the mesh {names}")
        c = self.capacity_factor
        if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or c <= 0):
            raise ValueError(f"ExpertParallel.capacity_factor must be None or a number > 0, got {c!r}")

    def capacity(self, rows: int) -> int:
        """Rows per (source, destination) buffer for ``rows`` = T/ep * K assignments per device."""
        if self.capacity_factor is None:
            return rows
        return max(1, min(rows, math.ceil(self.capacity_factor * rows / self.size)))

    @property
    def size(self) -> int:
        return self.mesh.shape[self.axis]


# ------------------------------------------------------------------------------- routing

def softmax_topk(router_logits, k: int, norm_topk_prob: bool = False):
    """Qwen3-MoE / Mixtral routing: softmax over all experts in float32, the k largest kept.

    Args:
      router_logits: [T, X]; k: experts per token; norm_topk_prob: renormalise the k kept
        probabilities to sum to 1 (Qwen3-MoE's flag).
    Returns:
      (topk_ids [T, k] int32, topk_weights [T, k] float32), ids by descending probability.
    """
    if not isinstance(k, int) or not 1 <= k <= router_logits.shape[-1]:
        raise ValueError(f"k must be an int in [1, {router_logits.shape[-1]}], got {k!r}")
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    weights, ids = lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


# -------------------------------------------------------------------------------- checks

def _check(x, topk_ids, topk_weights, w_gate, w_up, w_down):
    if x.ndim != 2:
        raise ValueError(f"x must be [T, E], got shape {x.shape}")
    t, e = x.shape
    if topk_ids.ndim != 2 or topk_ids.shape[0] != t or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_ids and topk_weights must both be [T={t}, K], got "
                         f"{topk_ids.shape} and {topk_weights.shape}")
    if w_gate.ndim != 3 or w_gate.shape[1] != e or w_up.shape != w_gate.shape:
        raise ValueError(f"w_gate and w_up must be [X, E={e}, F], got {w_gate.shape}, {w_up.shape}")
    xg, _, f = w_gate.shape
    if w_down.shape != (xg, f, e):
        raise ValueError(f"w_down must be [X={xg}, F={f}, E={e}], got {w_down.shape}")


# ------------------------------------------------------------------------- dense reference

def moe_dense_reference(x, topk_ids, topk_weights, w_gate, w_up, w_down):
    """Every expert on every token (X times the work): the test reference.

    Args: x [T, E]; topk_ids [T, K] int; topk_weights [T, K]; w_gate, w_up [X, E, F];
      w_down [X, F, E]. Returns [T, E] in x's dtype.
    """
    _check(x, topk_ids, topk_weights, w_gate, w_up, w_down)
    combine = jnp.sum(jax.nn.one_hot(topk_ids, w_gate.shape[0], dtype=jnp.float32)
                      * topk_weights.astype(jnp.float32)[..., None], axis=1)  # [T, X]
    gate = jnp.einsum("te,xef->txf", x, w_gate)
    up = jnp.einsum("te,xef->txf", x, w_up)
    return jnp.einsum("txf,xfe,tx->te", jax.nn.silu(gate) * up, w_down, combine.astype(x.dtype))


# ------------------------------------------------------------------------- grouped matmuls

def _resolve(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if impl == "auto":  # the backend jit compiles for: ragged_dot is a real grouped GEMM off CPU
        return "tiled" if jax.default_backend() == "cpu" else "ragged_dot"
    return impl


def default_tile(rows: int, num_experts: int) -> int:
    """Rows per tile of the tiled grouped matmul: about the mean group size, in [8, 128]."""
    return int(min(128, max(8, 2 ** math.ceil(math.log2(max(1, rows // max(1, num_experts)))))))


def _grouped_swiglu_ragged(xs, group_sizes, w_gate, w_up, w_down):
    gate = lax.ragged_dot(xs, w_gate, group_sizes)
    up = lax.ragged_dot(xs, w_up, group_sizes)
    return lax.ragged_dot(jax.nn.silu(gate) * up, w_down, group_sizes)


def _grouped_swiglu_tiled(xs, group_sizes, w_gate, w_up, w_down, tile: int):
    """xs [M, E] sorted by expert, group_sizes [X] (sum <= M) -> [M, E]; rows past the groups
    are zero."""
    m, e = xs.shape
    xg = w_gate.shape[0]
    gs = group_sizes.astype(jnp.int32)
    starts = jnp.cumsum(gs) - gs  # [X] first sorted row of each expert
    tiles_per = (gs + tile - 1) // tile  # [X]
    tile_end = jnp.cumsum(tiles_per)  # [X]
    max_tiles = m // tile + min(xg, m) + 1  # static bound on sum(ceil(g / tile))
    j = jnp.arange(max_tiles, dtype=jnp.int32)
    t_expert = jnp.minimum(jnp.searchsorted(tile_end, j, side="right"), xg - 1).astype(jnp.int32)
    t_start = starts[t_expert] + (j - (tile_end[t_expert] - tiles_per[t_expert])) * tile
    t_end = starts[t_expert] + gs[t_expert]  # rows of this tile's expert end here
    padded = jnp.concatenate([xs, jnp.zeros((tile, e), xs.dtype)])  # a tile may overrun M
    out0 = jnp.zeros((m + tile, e), xs.dtype)

    def body(i, out):
        ex, s = t_expert[i], t_start[i]
        rows = lax.dynamic_slice_in_dim(padded, s, tile)  # [tile, E]
        h = jax.nn.silu(rows @ w_gate[ex]) * (rows @ w_up[ex])  # [tile, F]
        y = h @ w_down[ex]  # [tile, E]
        mine = (s + jnp.arange(tile)) < t_end[i]  # rows of the next expert are left alone
        old = lax.dynamic_slice_in_dim(out, s, tile)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(mine[:, None], y, old), s, 0)

    return lax.fori_loop(0, tile_end[-1], body, out0)[:m]


def grouped_swiglu(xs, group_sizes, w_gate, w_up, w_down, *, impl: str = "auto",
                   tile: int | None = None):
    """SwiGLU of expert g over its rows: rows sorted by expert, ``group_sizes[g]`` rows each.

    Args:
      xs: [M, E] rows sorted by expert; group_sizes: [X] int, sum <= M (rows past the groups
        give zeros); w_gate, w_up [X, E, F]; w_down [X, F, E].
      impl: "auto" | "tiled" | "ragged_dot" (module docstring); tile: rows per tile ("tiled").
    Returns:
      [M, E].
    """
    impl = _resolve(impl)
    if impl == "ragged_dot":
        return _grouped_swiglu_ragged(xs, group_sizes, w_gate, w_up, w_down)
    tile = default_tile(xs.shape[0], w_gate.shape[0]) if tile is None else tile
    if not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile must be an int >= 1, got {tile!r}")
    return _grouped_swiglu_tiled(xs, group_sizes, w_gate, w_up, w_down, tile)


# ---------------------------------------------------------------------------- the MoE FFN

def _sort_by_expert(ids, num_experts: int):
    """ids [M] (values in [0, X], X = "no expert") -> (order [M], group_sizes [X])."""
    order = jnp.argsort(ids, stable=True)
    group_sizes = jnp.bincount(ids, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return order, group_sizes


def moe_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, *, expert_parallel=None,
            impl: str = "auto", tile: int | None = None):
    """Routed experts by grouped dispatch (module docstring). Exact: equals the dense reference
    up to float summation order.

    Args:
      x: [T, E]; topk_ids: [T, K] int expert ids in [0, X); topk_weights: [T, K] combine
        weights; w_gate, w_up: [X, E, F]; w_down: [X, F, E].
      expert_parallel: an ``ExpertParallel`` to split the experts over its mesh axis (the
        weights placed as it says), or None for one device / the SPMD partitioner.
      impl, tile: the grouped matmul (``grouped_swiglu``).
    Returns:
      [T, E] in x's dtype.
    """
    _check(x, topk_ids, topk_weights, w_gate, w_up, w_down)
    if expert_parallel is not None:
        return moe_ffn_expert_parallel(x, topk_ids, topk_weights, w_gate, w_up, w_down,
                                       expert_parallel, impl=impl, tile=tile)
    t, k = topk_ids.shape
    ids = topk_ids.reshape(t * k).astype(jnp.int32)
    order, group_sizes = _sort_by_expert(ids, w_gate.shape[0])
    xs = jnp.take(x, order // k, axis=0)  # [T*K, E] row r = token order[r] // K
    ys = grouped_swiglu(xs, group_sizes, w_gate, w_up, w_down, impl=impl, tile=tile)
    y = jnp.zeros_like(ys).at[order].set(ys)  # unsort: row t*K + j = token t, choice j
    w = topk_weights.astype(jnp.float32).reshape(t, k, 1)
    return jnp.sum(y.reshape(t, k, -1).astype(jnp.float32) * w, axis=1).astype(x.dtype)


# --------------------------------------------------------------------- expert parallelism

def moe_ffn_expert_parallel(x, topk_ids, topk_weights, w_gate, w_up, w_down,
                            ep: ExpertParallel, *, impl: str = "auto", tile: int | None = None):
    """``moe_ffn`` with the experts split over ``ep.axis`` and two all-to-alls (module docstring).

    Same args and result as ``moe_ffn``; X must be a multiple of the ep size. T is padded to a
    multiple of it (padding tokens route nowhere).
    """
    n = ep.size
    t, k = topk_ids.shape
    xg, e, f = w_gate.shape
    if xg % n:
        raise ValueError(f"the {xg} experts do not split over {ep.axis}={n}: X must be a multiple")
    tp = ep.mesh.shape[ep.tp_axis] if ep.tp_axis is not None else 1
    if f % tp:
        raise ValueError(f"the expert hidden dim F={f} does not split over {ep.tp_axis}={tp}")
    x_loc_experts = xg // n
    pad = -t % n
    if pad:  # padding tokens get expert id X: sent nowhere, combined with weight 0
        x = jnp.pad(x, ((0, pad), (0, 0)))
        topk_ids = jnp.pad(topk_ids, ((0, pad), (0, 0)), constant_values=xg)
        topk_weights = jnp.pad(topk_weights, ((0, pad), (0, 0)))
    t_loc = (t + pad) // n
    cap = ep.capacity(t_loc * k)  # rows per (source, destination); worst case by default

    def local(x, ids, wts, wg, wu, wd):  # x [t_loc, E]; ids, wts [t_loc, K]; wg [X/ep, E, F/tp]
        ids = ids.reshape(t_loc * k).astype(jnp.int32)
        dest = jnp.where(ids < xg, ids // x_loc_experts, n)  # [t_loc*K], n = nowhere
        order = jnp.argsort(dest, stable=True)
        counts = jnp.bincount(dest, length=n + 1)
        first = jnp.cumsum(counts) - counts  # [n+1] first sorted assignment per destination
        sd = dest[order]
        slot = jnp.arange(t_loc * k) - first[sd]  # position within its destination's buffer
        # n*cap: not sent (padding tokens; and overflow only under a capacity_factor)
        flat = jnp.where((sd < n) & (slot < cap), sd * cap + slot, n * cap)
        send_x = jnp.zeros((n * cap + 1, e), x.dtype).at[flat].set(jnp.take(x, order // k, 0))
        send_e = jnp.full((n * cap + 1,), x_loc_experts, jnp.int32).at[flat].set(
            ids[order] % x_loc_experts)
        recv_x = lax.all_to_all(send_x[:-1].reshape(n, cap, e), ep.axis, 0, 0, tiled=False)
        recv_e = lax.all_to_all(send_e[:-1].reshape(n, cap), ep.axis, 0, 0, tiled=False)
        # Received rows: n * cap, local expert id or x_loc_experts for empty slots.
        r_ids = recv_e.reshape(n * cap)
        r_order, gs = _sort_by_expert(r_ids, x_loc_experts)
        ys = grouped_swiglu(jnp.take(recv_x.reshape(n * cap, e), r_order, 0), gs, wg, wu, wd,
                            impl=impl, tile=tile)
        if ep.tp_axis is not None:
            ys = lax.psum(ys, ep.tp_axis)  # down rows were split over tp: partial sums
        ys = jnp.zeros_like(ys).at[r_order].set(ys).reshape(n, cap, e)
        back = lax.all_to_all(ys, ep.axis, 0, 0, tiled=False).reshape(n * cap, e)
        mine = jnp.take(jnp.concatenate([back, jnp.zeros((1, e), back.dtype)]), flat, 0)
        y = jnp.zeros((t_loc * k, e), x.dtype).at[order].set(mine)  # unsort to (token, choice)
        w = wts.astype(jnp.float32).reshape(t_loc, k, 1)
        return jnp.sum(y.reshape(t_loc, k, e).astype(jnp.float32) * w, axis=1).astype(x.dtype)

    rows = P(ep.axis, None)
    wspec_in, wspec_out = P(ep.axis, None, ep.tp_axis), P(ep.axis, ep.tp_axis, None)
    axes = {ep.axis} | ({ep.tp_axis} if ep.tp_axis is not None else set())
    out = jax.shard_map(local, mesh=ep.mesh, in_specs=(rows, rows, rows, wspec_in, wspec_in,
                                                        wspec_out),
                        out_specs=rows, axis_names=axes, check_vma=False)(
        x, topk_ids, topk_weights, w_gate, w_up, w_down)
    return out[:t]
