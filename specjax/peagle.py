"""P-EAGLE: an EAGLE-3 head that drafts all K tokens in one forward (parallel drafting).

P-EAGLE (Hui et al., AWS, "P-EAGLE: Parallel-Drafting EAGLE with Scalable Training",
arXiv 2602.01469) keeps the EAGLE-3 head unchanged (``specjax.heads``, kind "eagle3": ``fc`` over
the concatenated hidden states of 3 target layers, a midlayer attending over
``concat(enorm(embed(x)), hnorm(f))`` with ``f`` as the residual, its own ``final_norm`` and
``lm_head`` over a reduced draft vocabulary) and adds one learned vector, ``mask_hidden``
[A*E_t] (in the *pre-fc* space of the concatenated target features), plus a placeholder token id
``mask_token_id``. With head position j consuming (x_{j+1}, f_j) and predicting x_{j+2}
(specjax.heads' alignment), a step with committed x_0..x_{n-1} (x_{n-1} pending in the target)::

    depth 0: head position n-2, (x_{n-1}, f_{n-2})              -> d_1 (predicts x_n)
    depth d: head position n-2+d, (mask_token_id, fc(mask_hidden)) -> d_{d+1} (x_{n+d}), d < K

Every position attends causally: depth d sees the head's context K/V (positions <= n-2, the
usual EAGLE-3 cache written with the target's features) and depths 1..d of its own block. So one
causal pass over the K-1 placeholder slots yields d_2..d_K; d_1 is the usual EAGLE-3 first draft.

What this follows (read 2026-12-07):
  * vLLM speculators ``src/speculators/models/peagle/core.py`` (PEagleDraftModel.forward): for
    depth > 0 the input id is ``mask_token_id`` and the hidden state is ``mask_hidden``
    ([1, 1, num_aux * hidden]) *before* ``fc``; positions anchor + depth; ``attention.py``
    (create_peagle_mask_mod): a query attends to depth-0 entries with anchor <= its anchor and
    to its own rollout's depths <= its depth; ``data.py``: COD sampling (depth d keeps ~n r^d
    anchors). https://github.com/vllm-project/speculators/tree/main/src/speculators/models/peagle
  * vLLM ``v1/spec_decode/llm_base_proposer.py`` (parallel_drafting): the first drafter pass
    holds the verified tokens with the target's features plus K-1 slots of the parallel-drafting
    token with ``parallel_drafting_hidden_state_tensor = fc(mask_hidden)``, sequential positions,
    one forward, all K drafts sampled from it; ``models/llama_eagle3.py`` loads ``mask_hidden``.
    https://github.com/vllm-project/vllm/blob/main/vllm/v1/spec_decode/llm_base_proposer.py
  * NVIDIA NeMo AutoModel ``components/speculative/eagle/peagle_draft`` (same forward as mixins
    over its EAGLE-3 draft).

What this assumes / does not cover (stated, not hidden):
  * One decoder layer (the EAGLE-3 midlayer): published P-EAGLE heads use 4 (layers 1.. are plain
    Llama blocks on the residual stream); ``specjax.heads`` holds one, so deeper heads are refused
    by the loader (specjax.io.peagle_io) by name.
  * ``norm_before_residual=False`` (our midlayer's residual is the un-normed feature; the
    speculators trainer defaults to True, its P-EAGLE example passes --no-norm-before-residual).
  * The depth-0 position is computed by the drafter's absorb / extend (the chain head's re-run
    with the target's features), the K-1 slots by ``propose``: two forwards per step where vLLM
    fuses them into one; the numbers are identical (same inputs, same mask).
  * Training uses cross-entropy on the target-regenerated corpus' tokens (as our DFlash trainer),
    where speculators uses KL to the verifier's logits; anchors are drawn uniformly among answer
    positions, all depths per anchor (no COD down-sampling: our sequences are short).

Params: an EAGLE-3 head's (``heads.init_head``) plus ``mask_hidden`` [A*E_t].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import heads, kv_cache
from specjax.dflash import target_features


@dataclasses.dataclass(frozen=True)
class PEagleConfig:
    """A P-EAGLE head's static config: its EAGLE-3 head plus the placeholder token and the
    number of drafts K it was trained to emit per pass."""

    head: heads.HeadConfig  # kind "eagle3" (one midlayer)
    mask_token_id: int
    num_depths: int = 4  # K: d_1 from depth 0, d_2..d_K from the K-1 placeholder slots

    kind = "peagle"  # what the CLI picks as the method for such a draft (not a field)

    def __post_init__(self):
        if not isinstance(self.head, heads.HeadConfig) or self.head.kind != "eagle3":
            raise ValueError(f"PEagleConfig.head must be an EAGLE-3 HeadConfig, got {self.head!r}")
        v = self.head.layer.vocab_size
        if isinstance(self.mask_token_id, bool) or not isinstance(self.mask_token_id, int) \
                or not 0 <= self.mask_token_id < v:
            raise ValueError(f"PEagleConfig.mask_token_id must be an int in [0, {v}), got "
                             f"{self.mask_token_id!r}")
        if isinstance(self.num_depths, bool) or not isinstance(self.num_depths, int) \
                or self.num_depths < 1:
            raise ValueError(f"PEagleConfig.num_depths must be an int >= 1, got "
                             f"{self.num_depths!r}")

    @property
    def layer(self):
        return self.head.layer

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self.head.aux_layers

    @property
    def feature_width(self) -> int:
        """A*E_t: the width of ``mask_hidden`` (the concatenated target features)."""
        return len(self.head.aux_layers) * self.head.feature_size


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PEagleHead:
    """A P-EAGLE head: params (an EAGLE-3 head's + ``mask_hidden``) and its static config."""

    params: dict
    config: PEagleConfig = dataclasses.field(metadata={"static": True})

    @property
    def eagle3(self) -> heads.Head:
        """The same weights as a plain EAGLE-3 head (chain drafting, ``method="eagle3"``)."""
        return heads.Head({k: v for k, v in self.params.items() if k != "mask_hidden"},
                          self.config.head)


def init_params(cfg: PEagleConfig, key, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random params: ``heads.init_head`` plus ``mask_hidden`` ~ N(0, 1) (speculators' init)."""
    k1, k2 = jax.random.split(key)
    params = heads.init_head(cfg.head, k1, dtype, scale)
    params["mask_hidden"] = jax.random.normal(k2, (cfg.feature_width,)).astype(dtype)
    return params


def from_eagle3(head: heads.Head, mask_token_id: int, num_depths: int = 4, key=None) -> PEagleHead:
    """A P-EAGLE head starting from an EAGLE-3 head's weights (``--init-from``): fc, midlayer,
    norms, lm_head and draft vocabulary kept; ``mask_hidden`` new (N(0, 1), or zeros without a
    key)."""
    cfg = PEagleConfig(head=head.config, mask_token_id=mask_token_id, num_depths=num_depths)
    dt = head.params["fc"].dtype
    mh = (jnp.zeros((cfg.feature_width,), dt) if key is None
          else jax.random.normal(key, (cfg.feature_width,)).astype(dt))
    return PEagleHead(dict(head.params, mask_hidden=mh), cfg)


# ------------------------------------------------------------------------------ the forward

def mask_feature(params, cfg: PEagleConfig, target_params, target_cfg):
    """fc(mask_hidden): the placeholder slots' feature [E] (vLLM's
    ``parallel_drafting_hidden_state_tensor``)."""
    mh = params["mask_hidden"].reshape(1, 1, -1)
    return heads.head_features(params, cfg.head, target_params, target_cfg, None, mh)[0, 0]


def mask_block(params, cfg: PEagleConfig, target_params, target_cfg, kv: kv_cache.KVCache,
               page_table, start, num: int, *, attn_impl="reference"):
    """One causal forward over ``num`` placeholder slots at head positions start..start+num-1.

    Args:
      kv: the head's cache holding positions < start[b] (depth 0 at start - 1 included).
      page_table: [B, Pmax]; start: [B] int32 (n - 1: the slot after the last depth-0 entry).
    Returns:
      (hidden [B, num, E] the head's outputs (before final_norm), kv with the slots' K/V written
      at start.. (stale after the step: the next absorb overwrites them)).
    """
    b = start.shape[0]
    tokens = jnp.full((b, num), cfg.mask_token_id, jnp.int32)
    f = mask_feature(params, cfg, target_params, target_cfg)
    feats = jnp.broadcast_to(f, (b, num, f.shape[-1]))
    positions = start[:, None] + jnp.arange(num, dtype=jnp.int32)[None, :]
    return heads.head_forward(params, cfg.head, target_params, tokens, feats, positions, kv,
                              page_table, start, attn_impl=attn_impl)


def block_logits(target, head: PEagleHead, ids, k: int | None = None) -> np.ndarray:
    """[k, V] float32 logits of the k drafts one P-EAGLE pass proposes after ``ids`` (1-D,
    length >= 2, all committed; k defaults to K): row 0 = depth 0 (head position len(ids) - 2,
    fed ids[-1] and the target feature of ids[-2]), rows 1.. = the placeholder slots."""
    ids = np.asarray(ids, np.int32).reshape(-1)
    if ids.shape[0] < 2:
        raise ValueError(f"ids must hold at least 2 tokens, got {ids.shape[0]}")
    k = head.config.num_depths if k is None else k
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k must be an int >= 1, got {k!r}")
    return np.asarray(_block_logits_jit(target.params, target.config, head.params, head.config,
                                        jnp.asarray(ids), k))[0]


def _block_logits_fn(tparams, tcfg, hparams, cfg: PEagleConfig, ids, k):
    t = ids.shape[0] - 1  # head positions 0..t-1 consume (ids[j+1], f_j)
    aux = target_features(tparams, tcfg, cfg, ids[None, :t])  # [1, t, A*E_t]
    feats = heads.head_features(hparams, cfg.head, tparams, tcfg, None, aux)
    pages = kv_cache.pages_needed(t + k, 16)
    table = kv_cache.contiguous_page_table(1, pages)
    kv = kv_cache.init_cache(cfg.head.layer, pages, 16, hparams["fc"].dtype)
    pos = jnp.arange(t, dtype=jnp.int32)[None]
    zero = jnp.zeros((1,), jnp.int32)
    hh, kv = heads.head_forward(hparams, cfg.head, tparams, ids[None, 1:], feats, pos, kv, table,
                                zero)
    first = hh[:, -1:]
    if k > 1:
        rest, _ = mask_block(hparams, cfg, tparams, tcfg, kv, table, zero + t, k - 1)
        first = jnp.concatenate([first, rest], axis=1)
    return heads.head_logits(hparams, cfg.head, tparams, tcfg, first)


_block_logits_jit = jax.jit(_block_logits_fn, static_argnums=(1, 3, 5))


# ---------------------------------------------------------------------- dense training pass

def train_logits(params, cfg: PEagleConfig, target_params, target_cfg, tokens, aux, anchors,
                 depths: int | None = None, *, compact: bool = False):
    """Depth 0 at every position and K-1 placeholder slots per anchor, in one dense pass.

    Args:
      tokens: [N, T] int32; aux: [N, T, A*E_t] the fused target layers' states of every token;
      anchors: [N, M] int32 head positions a in [0, T-2] (block j: slots a_j+1..a_j+K-1, seeing
        head positions <= a_j and its own earlier slots only); depths: K (default cfg's).
      compact: logits over the draft vocabulary ([..., Vd]) instead of the full one.
    Returns:
      (ctx [N, T-1, V]: head position j predicts tokens[j+2]; blk [N, M, K-1, V]: slot d of block
      j predicts tokens[a_j + d + 2]).
    """
    n, t = tokens.shape
    m = anchors.shape[1]
    kd = (cfg.num_depths if depths is None else depths) - 1
    c = t - 1
    feats = heads.head_features(params, cfg.head, target_params, target_cfg, None, aux[:, :-1])
    f = mask_feature(params, cfg, target_params, target_cfg)
    q = c + m * kd
    toks = jnp.concatenate([tokens[:, 1:], jnp.full((n, m * kd), cfg.mask_token_id, jnp.int32)], 1)
    fe = jnp.concatenate([feats, jnp.broadcast_to(f.astype(feats.dtype), (n, m * kd, f.shape[-1]))],
                         axis=1)
    d = jnp.arange(1, kd + 1, dtype=jnp.int32)
    blk_pos = (anchors[:, :, None] + d).reshape(n, m * kd)
    pos = jnp.concatenate([jnp.broadcast_to(jnp.arange(c, dtype=jnp.int32), (n, c)), blk_pos], 1)
    # mask [N, Q, Q]: context causal; slot (j, d) sees context <= a_j and slots (j, <= d)
    ci = jnp.arange(c)
    ctx_ctx = jnp.broadcast_to(ci[None, :] <= ci[:, None], (n, c, c))
    top = jnp.concatenate([ctx_ctx, jnp.zeros((n, c, m * kd), bool)], axis=2)
    a_of = jnp.repeat(anchors, kd, axis=1)  # [N, M*kd] anchor of each slot
    blk_ctx = ci[None, None, :] <= a_of[:, :, None]
    bj, bd = jnp.repeat(jnp.arange(m), kd), jnp.tile(d, m)
    blk_blk = (bj[:, None] == bj[None, :]) & (bd[None, :] <= bd[:, None])
    bottom = jnp.concatenate([blk_ctx, jnp.broadcast_to(blk_blk, (n, m * kd, m * kd))], axis=2)
    mask = jnp.concatenate([top, bottom], axis=1)
    kv, table = kv_cache.init_contiguous(cfg.head.layer, n, q, dtype=feats.dtype)
    hh, _ = heads.head_forward(params, cfg.head, target_params, toks, fe, pos, kv, table,
                               jnp.zeros((n,), jnp.int32), new_mask=mask)
    logits = heads.head_logits(params, cfg.head, target_params, target_cfg, hh, compact=compact)
    return logits[:, :c], logits[:, c:].reshape(n, m, kd, -1)
