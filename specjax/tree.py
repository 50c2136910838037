"""Draft trees: static and EAGLE-2 dynamic trees, their masks, and lossless tree acceptance.

A tree of N draft nodes hangs below a root, the pending token x_{n-1} of each row. Node indices
run 0..N with 0 = root; nodes are topologically ordered (``parents[j] < j``), and siblings are
ordered by the draft's preference (the order acceptance tries them in). A node at depth d sits at
sequence position ``n - 1 + d``. Verification runs the target once over the N + 1 tree tokens: they
attend to the committed prefix with no mask and to each other through the [N+1, N+1] ancestor
mask (``ancestor_mask``), so the prefix never carries a mask.

Drafting with a head (``specjax.heads``; head position j consumes (x_{j+1}, f_j)):
* static tree (``TreeConfig.parents``): a node that is child number r of its parent takes the
  parent's r-th most likely head token; the head runs level by level over the tree;
* dynamic tree (EAGLE-2, Li et al. 2024): level 1 holds the top-K tokens of the carried root
  logits; at every level the K candidates with the highest path probability (product of the head's
  probabilities along the path) are expanded into their top-K children; after ``depth`` levels all
  candidates are re-ranked by path probability and the best N are kept. Path scores never increase
  along a path and ``lax.top_k`` breaks ties toward the lower index (parents come first), so the
  kept set always contains every kept node's ancestors.
Both run the one-layer head over a fixed slot buffer with an ancestor mask, level by level, so
every shape is static.

Acceptance (``accept_tree``), per row, walking nodes in index order from the root u = 0: a child j
of u with token t is accepted with probability ``p_u(t)`` where p_u is the target's residual
distribution at u; on acceptance u = j and the residual restarts from the target distribution at
j; on rejection t is removed from the residual (zeroed, renormalized). At the end the bonus token
is drawn from the residual at u. This is recursive rejection sampling with point-mass proposals
(the tree's tokens are chosen by the draft independently of the acceptance randomness): for the
children t_1, t_2, ... of u, P(emit t_1) = p(t_1), P(emit t_2) = (1 - p(t_1)) p(t_2) / (1 - p(t_1))
= p(t_2), ..., and the residual gives every other token its target probability, so the emitted
sequence is distributed exactly as the target's. Greedy rows (one-hot p) reduce to "follow the
child equal to the target's argmax".

Shapes: B batch, N draft nodes (N + 1 with the root), V vocab, E hidden, D max depth.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.tree_attention import ancestor_mask  # noqa: F401 - the one mask builder
from specjax import kv_cache
from specjax.sampling import categorical

KINDS = ("dynamic", "static")


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """Static tree parameters (hashable: part of the jit-static loop config).

    Attributes:
      kind: "dynamic" (EAGLE-2) or "static" (the ``parents`` tree).
      depth: dynamic: draft levels (the most drafts one step can accept). Static: derived.
      top_k: dynamic: children per expanded node and nodes expanded per level.
      num_nodes: dynamic: draft nodes N kept after re-ranking (verified tokens = N + 1).
      parents: static: tuple of N ints, ``parents[j - 1]`` is the parent of node j (0 = root),
        each in [0, j - 1]. Siblings are taken in the draft's preference order.
    """

    kind: str = "dynamic"
    depth: int = 4
    top_k: int = 4
    num_nodes: int = 16
    parents: tuple | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"TreeConfig.kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "static":
            if not self.parents:
                raise ValueError("TreeConfig.parents must be a non-empty tuple for kind='static'")
            for j, p in enumerate(self.parents, start=1):
                if not isinstance(p, (int, np.integer)) or not 0 <= p < j:
                    raise ValueError(f"TreeConfig.parents[{j - 1}] (parent of node {j}) must be "
                                     f"an int in [0, {j - 1}], got {p!r}")
            if len(self.parents) > 256:
                raise ValueError(f"static trees have at most 256 nodes, got {len(self.parents)}")
            object.__setattr__(self, "parents", tuple(int(p) for p in self.parents))
            return
        for name, lo, hi in (("depth", 1, 16), ("top_k", 1, 16), ("num_nodes", 1, 256)):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
                raise ValueError(f"TreeConfig.{name} must be an int in [{lo}, {hi}], got {v!r}")
        if self.num_nodes > self.num_candidates:
            raise ValueError(f"TreeConfig.num_nodes={self.num_nodes} exceeds the "
                             f"{self.num_candidates} candidates of depth={self.depth}, "
                             f"top_k={self.top_k} (top_k + (depth - 1) * top_k**2)")
        if self.parents is not None:
            raise ValueError("TreeConfig.parents is only for kind='static'")

    @property
    def n(self) -> int:
        """Draft nodes N (the root not counted)."""
        return len(self.parents) if self.kind == "static" else self.num_nodes

    @property
    def max_depth(self) -> int:
        """Deepest node's depth D: at most D drafts are accepted per step."""
        if self.kind == "static":
            return int(static_structure(self.parents)[0].max())
        return min(self.depth, self.num_nodes)

    @property
    def num_candidates(self) -> int:
        return self.top_k + (self.depth - 1) * self.top_k ** 2

    @property
    def draft_slots(self) -> int:
        """Head cache slots the drafting uses beyond the committed prefix."""
        if self.kind == "static":
            return self.n
        return max(1, (self.depth - 1) * self.top_k)


def static_structure(parents):
    """Numpy facts of a static tree given N parent indices (node j's parent is parents[j-1]).

    Returns:
      depth [N+1] int (root 0), rank [N+1] int (index among siblings, root 0),
      parents_full [N+1] int (root -1), ancestors [N+1, N+1] bool (row j: j and its ancestors).
    """
    n = len(parents)
    par = np.array([-1] + [int(p) for p in parents], np.int32)
    depth = np.zeros(n + 1, np.int32)
    rank = np.zeros(n + 1, np.int32)
    anc = np.eye(n + 1, dtype=bool)
    seen = {}
    for j in range(1, n + 1):
        depth[j] = depth[par[j]] + 1
        rank[j] = seen.get(par[j], 0)
        seen[par[j]] = rank[j] + 1
        anc[j] |= anc[par[j]]
    return depth, rank, par, anc


def root_to_leaf_paths(parents):
    """Every root-to-leaf path of a static tree as a list of node-index lists (root first)."""
    depth, _, par, _ = static_structure(parents)
    leaves = sorted(set(range(len(par))) - set(par[1:].tolist()))
    paths = []
    for leaf in leaves:
        path = [leaf]
        while par[path[-1]] >= 0:
            path.append(int(par[path[-1]]))
        paths.append(path[::-1])
    return paths


def _take(x, idx):
    """Row-wise gather along axis 1: x [B, M, ...], idx [B, ...idx] -> [B, ...idx, ...]."""
    return jax.vmap(lambda xr, ir: xr[ir])(x, idx)


def draft_static(tc: TreeConfig, root_logits, root_hidden, n, head_run, head_logits):
    """Fills a static tree with head tokens, level by level.

    Args:
      root_logits: [B, V] carried head logits for position n (the root's children).
      root_hidden: [B, E] the head's output at the root (feature for depth-1 nodes).
      n: [B] committed lengths.
      head_run: (tokens [B,T], features [B,T,E], positions [B,T], mask [B,T,T], num_new [B])
        -> hidden [B,T,E], with T = tc.draft_slots; the head's own cache threads through it.
      head_logits: hidden [..., E] -> logits [..., V].
    Returns:
      tokens [B, N] int32, parents [B, N+1] int32 (root -1), depth [B, N+1] int32.
    """
    depth, rank, par, anc = static_structure(tc.parents)
    n_nodes = tc.n
    b = root_logits.shape[0]
    max_rank = int(rank.max()) + 1
    # slot s holds node s + 1; mask among slots excludes the root (it sits in the head's prefix)
    slot_mask = jnp.broadcast_to(jnp.asarray(anc[1:, 1:]), (b, n_nodes, n_nodes))
    positions = (n - 2)[:, None] + jnp.asarray(depth[1:])[None, :]  # head position of depth d
    _, top = lax.top_k(root_logits, max_rank)  # [B, R]
    tokens = jnp.zeros((b, n_nodes), jnp.int32)
    level1 = np.nonzero(depth[1:] == 1)[0]
    tokens = tokens.at[:, level1].set(top[:, rank[level1 + 1]].astype(jnp.int32))
    feats = jnp.broadcast_to(root_hidden[:, None, :], (b, n_nodes, root_hidden.shape[-1]))
    num_new = jnp.full((b,), n_nodes, jnp.int32)
    for d in range(1, int(depth.max())):
        hh = head_run(tokens, feats, positions, slot_mask, num_new)  # [B, N, E]
        parents_d = np.unique(par[1:][depth[1:] == d + 1])  # nodes at depth d with children
        _, top = lax.top_k(head_logits(hh[:, parents_d - 1]), max_rank)  # [B, Pd, R]
        for i, node in enumerate(parents_d.tolist()):
            kids = np.nonzero(par[1:] == node)[0]  # slots of node's children
            tokens = tokens.at[:, kids].set(top[:, i, rank[kids + 1]].astype(jnp.int32))
            feats = feats.at[:, kids].set(hh[:, node - 1][:, None, :])
    parents = jnp.broadcast_to(jnp.asarray(par), (b, n_nodes + 1))
    return tokens, parents, jnp.broadcast_to(jnp.asarray(depth), (b, n_nodes + 1))


def draft_dynamic(tc: TreeConfig, root_logits, root_hidden, n, head_run, head_logits):
    """EAGLE-2 dynamic tree: expand the top-K paths level by level, keep the best N overall.

    Arguments and returns as ``draft_static``.
    """
    k, d_max, n_keep = tc.top_k, tc.depth, tc.num_nodes
    b, _ = root_logits.shape
    e = root_hidden.shape[-1]
    t = tc.draft_slots
    lp = jax.nn.log_softmax(root_logits.astype(jnp.float32), axis=-1)
    score, tok = lax.top_k(lp, k)  # [B, K] level-1 candidates
    cand_tok, cand_score = [tok.astype(jnp.int32)], [score]
    cand_parent = [jnp.full((b, k), -1, jnp.int32)]  # candidate index of the parent (-1: root)
    cand_depth = [np.ones(k, np.int32)]
    level_tok, level_score, level_base = tok.astype(jnp.int32), score, 0
    level_parent_slot = jnp.full((b, k), -1, jnp.int32)  # expansion slot of each candidate's parent
    slot_tok = jnp.zeros((b, t), jnp.int32)
    slot_feat = jnp.zeros((b, t, e), root_hidden.dtype)
    slot_pos = jnp.zeros((b, t), jnp.int32)
    slot_mask = jnp.zeros((b, t, t), bool)
    hh = jnp.zeros((b, t, e), root_hidden.dtype)
    for d in range(1, d_max):
        if d == 1:
            sel = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))
        else:
            _, sel = lax.top_k(level_score, k)  # the K most probable paths of this level
        sel_cand = level_base + sel  # [B, K] candidate indices
        tok_d = _take(level_tok, sel)
        score_d = _take(level_score, sel)
        pslot = _take(level_parent_slot, sel)  # [B, K]
        feat_d = jnp.where((pslot >= 0)[..., None], _take(hh, jnp.maximum(pslot, 0)),
                           root_hidden[:, None, :])
        slots = np.arange((d - 1) * k, d * k)
        inherited = jnp.where((pslot >= 0)[..., None], _take(slot_mask, jnp.maximum(pslot, 0)), False)
        slot_mask = slot_mask.at[:, slots].set(inherited | jnp.asarray(np.eye(t, dtype=bool)[slots]))
        slot_tok = slot_tok.at[:, slots].set(tok_d)
        slot_feat = slot_feat.at[:, slots].set(feat_d)
        slot_pos = slot_pos.at[:, slots].set(jnp.broadcast_to((n - 2 + d)[:, None], (b, k)))
        hh = head_run(slot_tok, slot_feat, slot_pos, slot_mask, jnp.full((b,), d * k, jnp.int32))
        lp = jax.nn.log_softmax(head_logits(hh[:, slots]).astype(jnp.float32), axis=-1)  # [B,K,V]
        child_lp, child_tok = lax.top_k(lp, k)  # [B, K, K]
        # min(): a zero log-prob must not make a child outrank its parent
        child_score = jnp.minimum(score_d[..., None], score_d[..., None] + child_lp)
        level_base = sum(x.shape[1] for x in cand_tok)
        level_tok = child_tok.reshape(b, k * k).astype(jnp.int32)
        level_score = child_score.reshape(b, k * k)
        level_parent_slot = jnp.repeat(jnp.asarray(slots, jnp.int32)[None, :], k, axis=1)
        level_parent_slot = jnp.broadcast_to(level_parent_slot, (b, k * k))
        cand_tok.append(level_tok)
        cand_score.append(level_score)
        cand_parent.append(jnp.repeat(sel_cand, k, axis=1))
        cand_depth.append(np.full(k * k, d + 1, np.int32))
    cand_tok = jnp.concatenate(cand_tok, axis=1)  # [B, C]
    cand_score = jnp.concatenate(cand_score, axis=1)
    cand_parent = jnp.concatenate(cand_parent, axis=1)
    cand_depth = jnp.asarray(np.concatenate(cand_depth))  # [C]
    _, keep = lax.top_k(cand_score, n_keep)  # [B, N]; ancestors outrank (or tie and precede) kids
    keep = jnp.sort(keep, axis=1)  # topological order: parents have lower candidate indices
    tokens = _take(cand_tok, keep)
    pc = _take(cand_parent, keep)  # parent candidate index or -1
    pnode = jax.vmap(jnp.searchsorted)(keep, jnp.maximum(pc, 0)) + 1
    parents = jnp.concatenate([jnp.full((b, 1), -1, jnp.int32),
                               jnp.where(pc >= 0, pnode, 0).astype(jnp.int32)], axis=1)
    depth = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), cand_depth[keep]], axis=1)
    return tokens, parents, depth


def draft_tree(tc: TreeConfig, root_logits, root_hidden, n, head_run, head_logits):
    """Dispatches on ``tc.kind``; see ``draft_static`` / ``draft_dynamic``."""
    fn = draft_static if tc.kind == "static" else draft_dynamic
    return fn(tc, root_logits, root_hidden, n, head_run, head_logits)


def _accept_tree_row(key, tokens, parents, depth, target_probs, greedy_tokens, max_depth):
    """One row: tokens [N], parents/depth [N+1], target_probs [N+1, V] or None, greedy_tokens
    [N+1] (target argmax per node, used when target_probs is None)."""
    n = tokens.shape[0]
    path0 = jnp.zeros((max_depth + 1,), jnp.int32)
    if target_probs is None:
        def body(j, carry):
            u, path = carry
            acc = (parents[j] == u) & (tokens[j - 1] == greedy_tokens[u])
            return jnp.where(acc, j, u), jnp.where(acc, path.at[depth[j]].set(j), path)

        u, path = lax.fori_loop(1, n + 1, body, (jnp.int32(0), path0))
        return depth[u], greedy_tokens[u], path

    u_draws = jax.random.uniform(jax.random.fold_in(key, 0), (n + 1,), jnp.float32)
    vocab = target_probs.shape[-1]

    def body(j, carry):
        u, w, path = carry  # w: [V] unnormalized residual at u
        child = parents[j] == u
        t = tokens[j - 1]
        mass = jnp.sum(w)
        acc = child & (u_draws[j] * mass < w[t])  # probability w[t] / mass
        rej = child & ~acc
        w = jnp.where(acc, target_probs[j], jnp.where(rej & (jnp.arange(vocab) == t), 0.0, w))
        return jnp.where(acc, j, u), w, jnp.where(acc, path.at[depth[j]].set(j), path)

    u, w, path = lax.fori_loop(1, n + 1, body, (jnp.int32(0), target_probs[0], path0))
    w = jnp.where(jnp.sum(w) > 0, w, target_probs[u])  # zero-mass residual: fall back to p_u
    y = categorical(jax.random.fold_in(key, 1), w)
    return depth[u], y, path


def accept_tree(keys, tokens, parents, depth, target_probs=None, target_logits=None, *,
                max_depth: int):
    """Lossless tree acceptance, batched (see the module docstring).

    Args:
      keys: [B] typed PRNG keys (row i's result depends only on keys[i] and row i's inputs).
      tokens: [B, N] int32 draft tokens of nodes 1..N.
      parents: [B, N+1] int32 (root -1, ``parents[:, j] < j``); depth: [B, N+1] int32.
      target_probs: [B, N+1, V] processed target probabilities at every node (``process_logits``),
        or None for the greedy rule on ``target_logits`` [B, N+1, V].
      max_depth: static bound D on ``depth``.
    Returns:
      num_accepted [B] int32 (the accepted path's depth a), next_token [B] int32 (residual or
      bonus), path [B, D+1] int32 node index at each depth of the accepted path (entries beyond
      a are 0).
    """
    b, n = tokens.shape
    if parents.shape != (b, n + 1) or depth.shape != (b, n + 1):
        raise ValueError(f"parents and depth must be [B, N+1] = {(b, n + 1)}, got "
                         f"{parents.shape} and {depth.shape}")
    if keys.shape != (b,):
        raise ValueError(f"keys must be [B] = ({b},), got {keys.shape}")
    if target_probs is None:
        if target_logits is None or target_logits.shape[:2] != (b, n + 1):
            raise ValueError("accept_tree needs target_probs or target_logits of shape [B, N+1, V]")
        greedy = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)
        return jax.vmap(lambda key, t, p, d, g: _accept_tree_row(key, t, p, d, None, g, max_depth))(
            keys, tokens.astype(jnp.int32), parents, depth, greedy)
    if target_probs.shape[:2] != (b, n + 1):
        raise ValueError(f"target_probs must be [B, N+1, V] = [{b}, {n + 1}, V], "
                         f"got {target_probs.shape}")
    return jax.vmap(lambda key, t, p, d, q: _accept_tree_row(key, t, p, d, q, None, max_depth))(
        keys, tokens.astype(jnp.int32), parents, depth, target_probs.astype(jnp.float32))


def copy_slots(kv, page_table, base, src, count, windows=None):
    """Moves cache entries of every layer: slot ``base + src[b, i]`` -> slot ``base + i`` for
    ``i < count[b]`` (the accepted tree path into cache order). All reads happen before writes.

    Args:
      kv: KVCache with pools [Hkv, P, S, Dh]; page_table [B, Pmax], or a grouped [B, 2, Pmax]
        (the engine's window page release: ``kv_cache.group_table``) with ``windows``, each
        layer's window (``kv_cache.layer_windows``); base [B] int32;
      src: [B, L] int32 node offsets; count: [B] int32 entries to move.
    Returns:
      the updated KVCache (donate it for an in-place update).
    """
    s = kv.k[0].shape[2]
    length = src.shape[1]
    i = jnp.arange(length, dtype=jnp.int32)[None, :]
    move = (i < count[:, None]) & (src != i)

    def locate(table, num_pages):
        src_page, src_off = kv_cache.locate_slots(table, base[:, None] + src, num_pages, s)
        dst_page, dst_off = kv_cache.locate_slots(table, base[:, None] + i, num_pages, s)
        dst_page = jnp.where(move, dst_page, num_pages)  # not moved -> dropped write
        return jnp.minimum(src_page, num_pages - 1), src_off, dst_page, dst_off

    shared = locate(page_table, kv.k[0].shape[1]) if page_table.ndim == 2 else None

    def apply(j, pool):
        src_page, src_off, dst_page, dst_off = shared or locate(
            kv_cache.group_table(page_table, windows[j]), pool.shape[1])
        rows = pool[:, src_page, src_off]  # [Hkv, B, L, Dh]
        return pool.at[:, dst_page, dst_off].set(rows, mode="drop")

    return type(kv)(k=tuple(apply(j, p) for j, p in enumerate(kv.k)),
                    v=tuple(apply(j, p) for j, p in enumerate(kv.v)))
