"""DFlash block drafter (z-lab, arXiv 2602.06036) as pure functions over a params pytree.

A small stack of Qwen3-style decoder layers that drafts a whole block of B-1 tokens in one
forward, conditioned on the target's features rather than on its own drafts::

    c_t    = hidden_norm(fc(concat_l h_t^(l)))          # per context token t; h^(l): output of
                                                        # target layer l (HF hidden_states[l + 1])
    x      = embed_target([tok_n, mask, ..., mask]) * input_embedding_scale   # block, n..n+B-1
    layer: y = input_norm(x); Q = q_norm(y Wq); K = k_norm([c; y] Wk); V = [c; y] Wv (RoPE at
           the context positions 0..n-1 and block positions n..n+B-1); the block attends to all
           context and bidirectionally to itself; x += o_proj(attn); x += SwiGLU(post_norm(x))
    logits = (norm(x) @ W_out_target) * output_multiplier   (optional tanh soft-capping)

No embedding or lm_head of its own (the target's). Rows 1..B-1 are the drafts of positions
n+1..n+B-1. The context K/V of a layer depend only on c_t and t, so they live in a paged cache
(``specjax.kv_cache``, one slot per position, sharing the target's page table) written once per
committed token (``write_context``) with no catch-up pass; ``draft_block`` writes the block's own
K/V at slots n..n+B-1 (stale afterwards, overwritten by the next context write) through
``specjax.model.decoder_layer`` with an all-true ``new_mask``.

Params layout (weights [in, out], Q/K columns in the rotate-half order, as in specjax.model)::

    {"fc": [A*E_t, H], "hidden_norm": [H], "norm": [H],
     "layers": [{"attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm",
                 "w_gate", "w_up", "w_down"}, ...]}        # model.decoder_layer's names

Training (``specjax.train.dflash_train``) runs ``train_logits``: many blocks per sequence in one
dense pass, each seeing the context strictly before its anchor and only its own block.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import kv_cache, registry
from specjax.config import ModelConfig
from specjax.heads import output_matrix
from specjax.model import apply_rope, decoder_layer, rms_norm, rope_inv_freq

_LAYER_KEYS = ("attn_norm", "wq", "wk", "wv", "wo", "q_norm", "k_norm", "mlp_norm", "w_gate",
               "w_up", "w_down")


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    """A DFlash drafter's static config (hashable). Sizes: H hidden, A = len(target_layer_ids)."""

    num_layers: int
    hidden_size: int  # H (the published heads: = the target's hidden size)
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int  # B: anchor + B-1 masks
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # target layers whose *outputs* are fused (HF hs[l + 1])
    target_hidden_size: int  # E_t
    vocab_size: int  # the target's V (logits come from its output matrix)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1000000.0
    max_position_embeddings: int = 40960
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # None / <= 0: off

    def __post_init__(self):
        for name in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                     "intermediate_size", "target_hidden_size", "vocab_size",
                     "max_position_embeddings"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"DFlashConfig.{name} must be a positive int, got {v!r}")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) \
                or self.block_size < 2:
            raise ValueError(f"DFlashConfig.block_size must be an int >= 2, got {self.block_size!r}")
        if not isinstance(self.mask_token_id, int) or not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DFlashConfig.mask_token_id must be an int in [0, {self.vocab_size}), "
                             f"got {self.mask_token_id!r}")
        ids = self.target_layer_ids
        if not isinstance(ids, tuple) or not ids or any(
                isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
            raise ValueError(f"DFlashConfig.target_layer_ids must be a non-empty tuple of ints "
                             f">= 0, got {ids!r}")
        if self.num_heads % self.num_kv_heads or self.head_dim % 2:
            raise ValueError(f"DFlashConfig: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads}) and head_dim ({self.head_dim}) even")

    @property
    def layer(self) -> ModelConfig:
        """The Qwen3-style block config that ``model.decoder_layer`` runs (q/k norm, no bias)."""
        return ModelConfig(vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=self.num_layers,
                           num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                           head_dim=self.head_dim, rope_theta=self.rope_theta,
                           rms_norm_eps=self.rms_norm_eps,
                           max_position_embeddings=self.max_position_embeddings, qk_norm=True)

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """``registry.forward``'s taps (hidden states *entering* layer i) for the outputs of
        ``target_layer_ids``: output of layer l = entering layer l + 1."""
        return tuple(i + 1 for i in self.target_layer_ids)

    def check_target(self, target_cfg) -> None:
        """ValueError unless this drafter fits ``target_cfg`` (hidden size, vocabulary, layers)."""
        if target_cfg.hidden_size != self.target_hidden_size:
            raise ValueError(f"DFlash target_hidden_size {self.target_hidden_size} != the target's "
                             f"hidden_size {target_cfg.hidden_size}")
        if target_cfg.vocab_size != self.vocab_size:
            raise ValueError(f"DFlash vocab_size {self.vocab_size} != the target's vocab_size "
                             f"{target_cfg.vocab_size}")
        if self.hidden_size != target_cfg.hidden_size:
            raise ValueError(f"DFlash hidden_size {self.hidden_size} != the target's hidden_size "
                             f"{target_cfg.hidden_size} (the block is the target's embedding)")
        bad = [i for i in self.target_layer_ids if i > target_cfg.num_layers - 2]
        if bad:  # HF's last hidden_states entry is post-norm: refuse the ambiguous tap
            raise ValueError(f"DFlash target_layer_ids {bad} out of range for a "
                             f"{target_cfg.num_layers}-layer target (must be <= "
                             f"{target_cfg.num_layers - 2})")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DFlashHead:
    """A DFlash drafter: params (pytree data) plus its static config."""

    params: dict
    config: DFlashConfig = dataclasses.field(metadata={"static": True})


# ----------------------------------------------------------------------------------- params

def init_params(cfg: DFlashConfig, key, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random params (normal * scale, norms at 1)."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, nkv, a = cfg.num_heads, cfg.num_kv_heads, len(cfg.target_layer_ids)
    keys = iter(jax.random.split(key, 8 * cfg.num_layers + 2))

    def w(*shape):
        return (scale * jax.random.normal(next(keys), shape)).astype(dtype)

    ones = lambda n: jnp.ones((n,), dtype)
    layers = [{"attn_norm": ones(h), "wq": w(h, nh * d), "wk": w(h, nkv * d), "wv": w(h, nkv * d),
               "wo": w(nh * d, h), "q_norm": ones(d), "k_norm": ones(d), "mlp_norm": ones(h),
               "w_gate": w(h, f), "w_up": w(h, f), "w_down": w(f, h)}
              for _ in range(cfg.num_layers)]
    return {"fc": w(a * cfg.target_hidden_size, h), "hidden_norm": ones(h), "norm": ones(h),
            "layers": layers}


def expected_shapes(cfg: DFlashConfig) -> dict:
    """{path tuple: shape} of every tensor of the layout (loaders check against it)."""
    want = {("fc",): (len(cfg.target_layer_ids) * cfg.target_hidden_size, cfg.hidden_size),
            ("hidden_norm",): (cfg.hidden_size,), ("norm",): (cfg.hidden_size,)}
    lp = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))["layers"][0]
    for i in range(cfg.num_layers):
        want.update({("layers", i, k): tuple(lp[k].shape) for k in _LAYER_KEYS})
    return want


# ------------------------------------------------------------------------------ the forward

def fuse(params, cfg: DFlashConfig, target_feats):
    """c = hidden_norm(fc(feats)) per token. target_feats: [B, T, A*E_t] -> c [B, T, H]."""
    x = target_feats.astype(params["fc"].dtype) @ params["fc"]
    return rms_norm(x, params["hidden_norm"], cfg.rms_norm_eps)


def _context_kv(lp, cfg: DFlashConfig, c, positions):
    """One layer's context keys/values: k_norm(c Wk) with RoPE, c Wv. c: [B, T, H] (not
    input-normed); positions: [B, T] -> (k, v) [B, T, Hkv, D]."""
    b, t, _ = c.shape
    k = (c @ lp["wk"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    v = (c @ lp["wv"]).reshape(b, t, cfg.num_kv_heads, cfg.head_dim)
    k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    return apply_rope(k, positions, jnp.asarray(rope_inv_freq(cfg.layer))), v


def init_cache(cfg: DFlashConfig, num_pages: int, page_size: int, dtype=jnp.float32):
    """The drafter's paged context cache (one K/V pool per drafter layer)."""
    return kv_cache.init_cache(cfg.layer, num_pages, page_size, dtype)


def write_context(params, cfg: DFlashConfig, cache: kv_cache.KVCache, c, page_table, cache_start,
                  num_new=None) -> kv_cache.KVCache:
    """Writes the context K/V of fused features c [B, T, H] at positions (= slots)
    cache_start[b] + t, t < num_new[b] (default T), in every layer. page_table: [B, Pmax]."""
    b, t, _ = c.shape
    positions = cache_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
    valid = jnp.arange(t)[None, :] < (jnp.full((b,), t, jnp.int32) if num_new is None
                                      else num_new)[:, None]
    ks, vs = [], []
    for lp, kp, vp in zip(params["layers"], cache.k, cache.v):
        k, v = _context_kv(lp, cfg, c, positions)
        kp, vp = kv_cache.write_layer(kp, vp, k, v, page_table, cache_start, valid)
        ks.append(kp)
        vs.append(vp)
    return kv_cache.KVCache(k=tuple(ks), v=tuple(vs))


def _block_embeddings(cfg: DFlashConfig, target_params, anchor):
    """[anchor, mask x (B-1)] embedded with the target's table: anchor [N] -> [N, B, E]."""
    ids = jnp.concatenate([anchor[:, None].astype(jnp.int32),
                           jnp.full((anchor.shape[0], cfg.block_size - 1), cfg.mask_token_id,
                                    jnp.int32)], axis=1)
    x = jnp.take(target_params["embed"], ids, axis=0)
    return x if cfg.input_embedding_scale == 1.0 else x * cfg.input_embedding_scale


def _logits(params, cfg: DFlashConfig, target_params, target_cfg, x):
    """norm, the target's output matrix, output_multiplier, soft-capping: [..., H] -> [..., V]."""
    x = rms_norm(x, params["norm"], cfg.rms_norm_eps)
    logits = (x @ output_matrix(target_params, target_cfg).astype(x.dtype)).astype(jnp.float32)
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    if cfg.final_logit_softcapping is not None and cfg.final_logit_softcapping > 0:
        cap = cfg.final_logit_softcapping
        logits = jnp.tanh(logits / cap) * cap
    return logits


def draft_block(params, cfg: DFlashConfig, target_params, target_cfg, cache: kv_cache.KVCache,
                page_table, anchor_token, start, *, attn_impl="reference",
                return_cache: bool = False):
    """One forward over the block [anchor, mask x (B-1)] at positions start..start+B-1.

    Args:
      cache: the context cache holding positions < start[b] (``write_context``).
      page_table: [N, Pmax] int32 (the target's); anchor_token: [N] int32 (the last committed
        token, position start); start: [N] int32.
      return_cache: also return the cache with the block's K/V written at slots start.. (stale
        entries; lets a caller donate the pools instead of copying them).
    Returns:
      logits [N, B-1, V] float32 (the drafts for positions start+1..start+B-1), and the cache
      with ``return_cache``.
    """
    n, bs = anchor_token.shape[0], cfg.block_size
    x = _block_embeddings(cfg, target_params, anchor_token).astype(params["norm"].dtype)
    positions = start[:, None] + jnp.arange(bs, dtype=jnp.int32)[None, :]
    valid = jnp.ones((n, bs), bool)
    full = jnp.ones((n, bs, bs), bool)  # bidirectional within the block
    ks, vs = [], []
    for lp, kp, vp in zip(params["layers"], cache.k, cache.v):
        x, kp, vp = decoder_layer(lp, cfg.layer, x, positions, kp, vp, page_table, start, valid,
                                  full, attn_impl)
        ks.append(kp)
        vs.append(vp)
    logits = _logits(params, cfg, target_params, target_cfg, x[:, 1:])
    return (logits, kv_cache.KVCache(k=tuple(ks), v=tuple(vs))) if return_cache else logits


# ------------------------------------------------------------------ target features, reference

def target_features(target_params, target_cfg, cfg: DFlashConfig, tokens, lengths=None):
    """The fused target layers' outputs of ``tokens`` [B, T] (one prefill from position 0) ->
    [B, T, A*E_t], concatenated in ``target_layer_ids`` order."""
    b, t = tokens.shape
    pages = kv_cache.pages_needed(t, 16)
    kv = registry.init_cache(target_cfg, b * pages, 16, target_params["embed"].dtype)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    out = registry.forward(target_params, target_cfg, tokens, pos, kv,
                           kv_cache.contiguous_page_table(b, pages), jnp.zeros((b,), jnp.int32),
                           lengths, return_logits=False, aux_layers=cfg.aux_layers)
    return out[3]


def block_logits(target, head: DFlashHead, ids) -> np.ndarray:
    """[B-1, V] float32 logits of the block drafted after ``ids`` (1-D, length >= 2): context =
    the target features of ids[:-1], block anchored at ids[-1] (position len(ids) - 1)."""
    ids = np.asarray(ids, np.int32).reshape(-1)
    if ids.shape[0] < 2:
        raise ValueError(f"ids must hold at least 2 tokens (context + anchor), got {ids.shape[0]}")
    cfg = head.config
    cfg.check_target(target.config)
    return np.asarray(_block_logits_jit(target.params, target.config, head.params, cfg,
                                        jnp.asarray(ids)))[0]


def _block_logits_fn(tparams, tcfg, hparams, cfg, ids):
    t = ids.shape[0] - 1
    feats = target_features(tparams, tcfg, cfg, ids[None, :t])
    c = fuse(hparams, cfg, feats)
    pages = kv_cache.pages_needed(t + cfg.block_size, 16)
    table = kv_cache.contiguous_page_table(1, pages)
    cache = init_cache(cfg, pages, 16, hparams["norm"].dtype)
    zero = jnp.zeros((1,), jnp.int32)
    cache = write_context(hparams, cfg, cache, c, table, zero)
    return draft_block(hparams, cfg, tparams, tcfg, cache, table, ids[None, t], zero + t)


_block_logits_jit = jax.jit(_block_logits_fn, static_argnums=(1, 3))


# ---------------------------------------------------------------------- dense training pass

def _attend(q, k, v, mask):
    """q [N, Q, H, D], k/v [N, K, Hkv, D], mask [N, Q, K] bool -> [N, Q, H, D] (GQA)."""
    n, nq, h, d = q.shape
    hkv = k.shape[2]
    qg = q.reshape(n, nq, hkv, h // hkv, d).astype(jnp.float32) * d ** -0.5
    s = jnp.einsum("nqkgd,nskd->nkgqs", qg, k.astype(jnp.float32))
    s = jnp.where(mask[:, None, None], s, jnp.finfo(jnp.float32).min)
    p = jax.nn.softmax(s, axis=-1)
    o = jnp.einsum("nkgqs,nskd->nqkgd", p, v.astype(jnp.float32))
    return o.reshape(n, nq, h, d).astype(q.dtype)


def train_logits(params, cfg: DFlashConfig, target_params, target_cfg, tokens, feats, anchors):
    """Many blocks per sequence in one dense pass (training and tests).

    Args:
      tokens: [N, T] int32; feats: [N, T, A*E_t] target features of every token;
      anchors: [N, M] int32 anchor positions a (block j = [tok[a_j], mask x (B-1)] at
        a_j..a_j+B-1, seeing context positions < a_j and its own block only).
    Returns:
      logits [N, M, B-1, V] float32: row k-1 of block j predicts tok[a_j + k].
    """
    n, t = tokens.shape
    m, bs = anchors.shape[1], cfg.block_size
    lc = cfg.layer
    inv = jnp.asarray(rope_inv_freq(lc))
    c = fuse(params, cfg, feats)  # [N, T, H]
    ctx_pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (n, t))
    anchor_tok = jnp.take_along_axis(tokens, anchors, axis=1)  # [N, M]
    x = _block_embeddings(cfg, target_params, anchor_tok.reshape(-1)).astype(c.dtype)
    x = x.reshape(n, m * bs, -1)  # [N, M*B, H]
    pos = (anchors[:, :, None] + jnp.arange(bs, dtype=jnp.int32)).reshape(n, m * bs)
    blk = jnp.repeat(jnp.arange(m), bs)  # [M*B] block of each query
    ctx_ok = ctx_pos[:, None, :] < jnp.repeat(anchors, bs, axis=1)[:, :, None]  # [N, M*B, T]
    own = jnp.broadcast_to(blk[:, None] == blk[None, :], (n, m * bs, m * bs))
    mask = jnp.concatenate([ctx_ok, own], axis=2)
    h, hkv, d = lc.num_heads, lc.num_kv_heads, lc.head_dim
    for lp in params["layers"]:
        kc, vc = _context_kv(lp, cfg, c, ctx_pos)
        y = rms_norm(x, lp["attn_norm"], lc.rms_norm_eps)
        q = rms_norm((y @ lp["wq"]).reshape(n, m * bs, h, d), lp["q_norm"], lc.rms_norm_eps)
        kb = rms_norm((y @ lp["wk"]).reshape(n, m * bs, hkv, d), lp["k_norm"], lc.rms_norm_eps)
        vb = (y @ lp["wv"]).reshape(n, m * bs, hkv, d)
        q, kb = apply_rope(q, pos, inv), apply_rope(kb, pos, inv)
        o = _attend(q, jnp.concatenate([kc, kb], 1), jnp.concatenate([vc, vb], 1), mask)
        x = x + o.reshape(n, m * bs, h * d) @ lp["wo"]
        y = rms_norm(x, lp["mlp_norm"], lc.rms_norm_eps)
        x = x + (jax.nn.silu(y @ lp["w_gate"]) * (y @ lp["w_up"])) @ lp["w_down"]
    x = x.reshape(n, m, bs, -1)[:, :, 1:]
    return _logits(params, cfg, target_params, target_cfg, x)
