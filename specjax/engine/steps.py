"""The engine's jitted device steps over a fixed set of request slots.

Device state (``SlotState``, donated every step): the target and draft page pools, plus per-slot
carried values for ``S`` slots and one dummy slot ``S`` that padding rows read and write.
Between steps a decoding slot satisfies ``specjax.speculate``'s invariant (n = lengths[slot]
committed tokens, x_{n-1} = last_token[slot] not yet in the target cache, the draft's carried
logits / head hidden state for position n). Lengths live on the device, so a step can be
dispatched before the host has read how many drafts the previous one accepted (the one-token
MTP schedule: see specjax.engine.engine, "async").

Every step takes one int32 metadata buffer ``meta [B, W]`` (B = a static batch bucket), packed on
the host (``pack``) and copied to the device in one transfer. Row layout (``COL_*``)::

    kind | slot | start | num_new | final | next_token | seed | temperature | top_k | top_p |
    page_table [Pmax] | tokens [T]

* kind: 0 padding (slot S, pages -1: nothing is written), 1 prefill chunk, 2 decode row.
* prefill chunk: ``tokens[:num_new]`` at positions ``start..``; ``final`` chunks end the prompt
  (sample the first token and commit); other chunks carry ``next_token`` = the next chunk's first
  token, which the draft / head needs at the chunk's end.
* decode row: start, token and length come from the device's slot state.
* temperature and top_p are float32 bit patterns.

Two step functions (different static shapes, each jitted once per bucket):

* ``extend_step``: ordinary sampling for prefill chunks and one-token decode rows (prefill and
  mixed batches; also plain decoding). The draft / head is advanced over the same tokens so
  decode rows keep the speculative invariant.
* ``spec_decode_step``: a decode-only batch through ``speculate.spec_step`` (draft rollout,
  verify, acceptance, catch-up / MTP shift, fused).

Randomness: the token sampled at position p of a request (ordinary step) uses
``fold_in(key(seed), p)``; a speculative step starting at length n uses row key
``fold_in(key(seed), n)`` with spec_step's salts. Keys never repeat within a request (positions
only grow) and never depend on the slot, the batch or the step counter.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from specjax import adaptive, control, kv_cache, ngram, registry, sampling, speculate
from specjax.config import SpecConfig
from specjax.model import lm_head
from specjax.registry import forward

(COL_KIND, COL_SLOT, COL_START, COL_NUM_NEW, COL_FINAL, COL_NEXT, COL_SEED, COL_TEMP, COL_TOP_K,
 COL_TOP_P) = range(10)
NUM_COLS = 10
KIND_PAD, KIND_PREFILL, KIND_DECODE = 0, 1, 2


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static shape of the engine's device state (a jit static argument)."""

    lc: SpecConfig  # method, k, draft_sampling, tree, attn_impl, page_size, ...
    num_slots: int  # S request slots (slot S is the padding dummy)
    pages_per_seq: int  # Pmax page-table width
    history_len: int = 0  # L of the per-slot token history (n-gram drafting; 0 = none)

    def width(self, t: int) -> int:
        """Metadata row width W for T tokens per row."""
        return NUM_COLS + self.pages_per_seq + t


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """Everything the device carries between engine steps (donated each step)."""

    target_kv: kv_cache.KVCache
    draft_kv: kv_cache.KVCache | None
    lengths: jax.Array  # [S+1] int32 committed tokens n per slot
    last_token: jax.Array  # [S+1] int32 x_{n-1}
    draft_logits: jax.Array | None  # [S+1, V] float32 carried draft logits (speculative methods)
    head_hidden: jax.Array | None  # [S+1, E] head output at position n-2 (MTP / EAGLE)
    history: jax.Array | None = None  # [S+1, L] int32 x_0..x_{n-1} per slot (n-gram drafting)
    # adaptive k (one running estimate for the engine; speculate.DecodeState has the meaning):
    acc_hits: jax.Array | None = None  # [K] float32 ([K, NB] adaptive_by="confidence")
    acc_obs: jax.Array | None = None  # [K] float32 (same)
    plain_run: jax.Array | None = None  # [] int32
    k_hist: jax.Array | None = None  # [K+1] int32
    lag: jax.Array | None = None  # [S+1] int32 pending drafter positions (lazy upkeep)
    lag_tokens: jax.Array | None = None  # [S+1, W] int32
    lag_feats: jax.Array | None = None  # [S+1, W, E] (heads)


def init_state(target_cfg, draft_cfg, sc: StepConfig, num_pages: int, dtype) -> SlotState:
    """Zeroed pools of ``num_pages`` pages for target and draft, and S+1 empty slots."""
    lc = sc.lc
    s1 = sc.num_slots + 1
    target_kv = registry.init_cache(target_cfg, num_pages, lc.page_size, dtype)
    draft_kv = draft_logits = head_hidden = None
    if lc.method == "draft":
        draft_kv = registry.init_cache(draft_cfg, num_pages, lc.page_size, dtype)
    elif lc.uses_head:
        draft_kv = registry.init_cache(draft_cfg.layer, num_pages, lc.page_size, dtype)
        head_hidden = jnp.zeros((s1, draft_cfg.layer.hidden_size), dtype)
    if lc.method not in ("none", "ngram"):
        draft_logits = jnp.zeros((s1, target_cfg.vocab_size), jnp.float32)
    extra = {}
    if lc.uses_history:
        extra["history"] = jnp.zeros((s1, sc.history_len), jnp.int32)
    if lc.adaptive:
        kk = lc.k_eff
        extra.update(adaptive.init_counts(kk, lc.adaptive_by == "confidence"))
        extra.update(speculate.init_lag(lc, draft_cfg, s1, speculate.LAG_WINDOW, dtype))
    return SlotState(target_kv=target_kv, draft_kv=draft_kv, lengths=jnp.ones((s1,), jnp.int32),
                     last_token=jnp.zeros((s1,), jnp.int32), draft_logits=draft_logits,
                     head_hidden=head_hidden, **extra)


# ------------------------------------------------------------------------------ host packing

def pack(rows, sc: StepConfig, batch: int, t: int) -> np.ndarray:
    """Packs row dicts into one int32 metadata buffer [batch, W] (missing rows are padding).

    Each row: kind, slot, seed, temperature, top_k, top_p, pages (list of ids) and, for prefill
    chunks, start, tokens (list), final, next_token.
    """
    meta = np.zeros((batch, sc.width(t)), np.int32)
    meta[:, COL_SLOT] = sc.num_slots
    meta[:, COL_NUM_NEW] = 1
    meta[:, NUM_COLS:NUM_COLS + sc.pages_per_seq] = -1
    fbits = np.zeros((batch, 2), np.float32)
    fbits[:, 1] = 1.0  # top_p of padding rows
    for i, r in enumerate(rows):
        meta[i, COL_KIND] = r["kind"]
        meta[i, COL_SLOT] = r["slot"]
        meta[i, COL_SEED] = r["seed"]
        meta[i, COL_TOP_K] = r["top_k"]
        fbits[i] = (r["temperature"], r["top_p"])
        pages = r["pages"]
        meta[i, NUM_COLS:NUM_COLS + len(pages)] = pages
        if r["kind"] == KIND_PREFILL:
            toks = r["tokens"]
            meta[i, COL_START] = r["start"]
            meta[i, COL_NUM_NEW] = len(toks)
            meta[i, COL_FINAL] = int(r["final"])
            meta[i, COL_NEXT] = r.get("next_token", 0)
            meta[i, NUM_COLS + sc.pages_per_seq:NUM_COLS + sc.pages_per_seq + len(toks)] = toks
    meta[:, COL_TEMP] = fbits[:, 0].view(np.int32)
    meta[:, COL_TOP_P] = fbits[:, 1].view(np.int32)
    return meta


# ----------------------------------------------------------------------------- device steps

def _unpack(meta, sc: StepConfig):
    """Splits meta [B, W] into named columns; returns (cols dict, page_table [B, Pmax], tokens [B, T])."""
    p = sc.pages_per_seq
    cols = {
        "kind": meta[:, COL_KIND], "slot": meta[:, COL_SLOT], "start": meta[:, COL_START],
        "num_new": meta[:, COL_NUM_NEW], "final": meta[:, COL_FINAL] > 0,
        "next": meta[:, COL_NEXT], "seed": meta[:, COL_SEED], "top_k": meta[:, COL_TOP_K],
        "temperature": jax.lax.bitcast_convert_type(meta[:, COL_TEMP], jnp.float32),
        "top_p": jax.lax.bitcast_convert_type(meta[:, COL_TOP_P], jnp.float32),
    }
    valid = cols["kind"] != KIND_PAD
    cols["valid"] = valid
    cols["slot"] = jnp.where(valid, cols["slot"], sc.num_slots)  # padding -> the dummy slot
    return cols, meta[:, NUM_COLS:NUM_COLS + p], meta[:, NUM_COLS + p:]


def _row_params(cols, max_new: int) -> speculate.RowParams:
    b = cols["kind"].shape[0]
    return speculate.RowParams(temperature=cols["temperature"], top_k=cols["top_k"],
                               top_p=cols["top_p"], max_new=jnp.full((b,), max_new, jnp.int32),
                               eos_ids=jnp.full((1,), -1, jnp.int32))  # stops are host-side


def _row_keys(seed, position):
    """[B] typed keys fold_in(key(seed_b), position_b)."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)


def _scatter(state: SlotState, slot, commit, **updates) -> SlotState:
    """Writes per-row values into their slots where ``commit`` (others keep the slot's value)."""
    new = {}
    for name, value in updates.items():
        old = getattr(state, name)
        if old is None:
            continue
        cur = old[slot]
        mask = commit.reshape(commit.shape + (1,) * (value.ndim - 1))
        new[name] = old.at[slot].set(jnp.where(mask, value.astype(old.dtype), cur))
    return dataclasses.replace(state, **new)


def _extend(target_params, draft_params, state: SlotState, meta, *, target_cfg, draft_cfg,
            sc: StepConfig):
    """Ordinary-sampling step over prefill chunks and one-token decode rows.

    Returns (state, sampled [B] int32): the sampled token of decode rows and final chunks.
    """
    lc = sc.lc
    cols, page_table, tokens = _unpack(meta, sc)  # tokens [B, T]
    t = tokens.shape[1]
    slot = cols["slot"]
    is_dec = cols["kind"] == KIND_DECODE
    n_dev = state.lengths[slot]
    start = jnp.where(is_dec, n_dev - 1, cols["start"])
    num_new = jnp.where(is_dec, 1, cols["num_new"])
    tokens = tokens.at[:, 0].set(jnp.where(is_dec, state.last_token[slot], tokens[:, 0]))
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]

    _, hidden, target_kv, aux = speculate.target_forward(
        target_params, target_cfg, tokens, positions, state.target_kv, page_table, start, num_new,
        attn_impl=lc.attn_impl, return_logits=False,
        aux_layers=speculate.aux_layers_for(lc, draft_cfg))
    last_h = jnp.take_along_axis(hidden, (num_new - 1)[:, None, None], axis=1)[:, 0]  # [B, E]
    logits = lm_head(target_params, target_cfg, last_h)  # [B, V]
    pos_new = start + num_new  # position of the sampled token
    keys = sampling.step_keys(_row_keys(cols["seed"], pos_new), jnp.zeros((), jnp.int32), 0)
    y = sampling.sample_logits(keys, logits, cols["temperature"], cols["top_k"],
                               cols["top_p"])  # [B]
    commit = cols["valid"] & (is_dec | cols["final"])
    after = jnp.where(commit, y, cols["next"])  # the token following the processed span

    # The draft / head over the same span plus the token after it (for decode rows the draft
    # rewrites x_{n-1} with identical K/V and writes y). Decode rows whose drafter adaptive plain
    # steps left behind are caught up first (speculate.catch_up).
    draft_kv = state.draft_kv
    if state.lag is not None:
        num = jnp.where(is_dec & cols["valid"], state.lag[slot], 0)
        draft_kv = control.cond(  # in place (a lax.cond would copy the draft pools)
            jnp.any(num > 0),
            lambda kv: speculate.catch_up(target_params, target_cfg, draft_params, draft_cfg, kv,
                                          page_table, n_dev, num, state.lag_tokens[slot],
                                          None if state.lag_feats is None else state.lag_feats[slot],
                                          lc)[0],
            draft_kv)
    draft_kv, draft_logits, head_hidden = speculate.extend_draft(
        target_params, target_cfg, draft_params, draft_cfg, tokens, hidden, start, num_new, after,
        draft_kv, page_table, lc, aux)

    state = dataclasses.replace(state, target_kv=target_kv, draft_kv=draft_kv)
    if state.history is not None:
        # The span and the token after it at start..start+num_new (later slots: stale).
        span = jnp.concatenate([tokens, jnp.zeros((tokens.shape[0], 1), jnp.int32)], axis=1)
        span = jax.vmap(lambda row, i, v: row.at[i].set(v))(span, num_new, after)
        rows = ngram.write(state.history[slot], span, start)
        state = _scatter(state, slot, cols["valid"], history=rows)
    updates = dict(lengths=pos_new + 1, last_token=y)
    if draft_logits is not None:  # fresh carried logits: the drafter is level again
        updates["draft_logits"] = draft_logits
        updates["lag"] = jnp.zeros_like(slot)
    if head_hidden is not None:
        updates["head_hidden"] = head_hidden
    return _scatter(state, slot, commit, **updates), y


def _spec_decode(target_params, draft_params, state: SlotState, meta, cost=None, *, target_cfg,
                 draft_cfg, sc: StepConfig):
    """Decode-only speculative step (speculate.spec_step on the gathered rows).

    cost: [K+1..K+3] float32 relative k-step costs at this batch bucket (adaptive k only).

    Returns (state, emitted [B, K+1] int32, counts [B] int32, drafted [B] int32): row b emitted
    ``emitted[b, :counts[b]]`` (accepted drafts then the residual / bonus token) after proposing
    ``drafted[b]`` drafts (0: no n-gram match or an adaptive plain step).
    """
    lc = sc.lc
    cols, page_table, _ = _unpack(meta, sc)
    b = page_table.shape[0]
    slot, valid = cols["slot"], cols["valid"]
    n = state.lengths[slot]
    k1 = lc.k_eff + 1
    def rows(x):
        return None if x is None else x[slot]

    ds = speculate.DecodeState(
        target_kv=state.target_kv, draft_kv=state.draft_kv, page_table=page_table, lengths=n,
        last_token=state.last_token[slot], draft_logits=rows(state.draft_logits),
        head_hidden=rows(state.head_hidden),
        out_tokens=jnp.zeros((b, k1), jnp.int32), num_out=jnp.zeros((b,), jnp.int32),
        done=~valid, step=jnp.zeros((), jnp.int32), row_keys=_row_keys(cols["seed"], n),
        accepted_per_pos=jnp.zeros((lc.k_eff,), jnp.int32), row_steps=jnp.zeros((), jnp.int32),
        history=rows(state.history), acc_hits=state.acc_hits, acc_obs=state.acc_obs,
        plain_run=state.plain_run, cost=cost, k_hist=state.k_hist, lag=rows(state.lag), lag_tokens=rows(state.lag_tokens),
        lag_feats=rows(state.lag_feats))
    ds, drafted = speculate.spec_step_counted(target_params, target_cfg, draft_params, draft_cfg,
                                              ds, _row_params(cols, k1), lc)
    state = dataclasses.replace(state, target_kv=ds.target_kv, draft_kv=ds.draft_kv,
                                acc_hits=ds.acc_hits, acc_obs=ds.acc_obs,
                                plain_run=ds.plain_run, k_hist=ds.k_hist)
    updates = dict(lengths=ds.lengths, last_token=ds.last_token, draft_logits=ds.draft_logits,
                   head_hidden=ds.head_hidden, history=ds.history, lag=ds.lag,
                   lag_tokens=ds.lag_tokens, lag_feats=ds.lag_feats)
    updates = {name: v for name, v in updates.items() if v is not None}
    return _scatter(state, slot, valid, **updates), ds.out_tokens, ds.num_out, drafted


_STATIC = ("target_cfg", "draft_cfg", "sc")
extend_step = jax.jit(_extend, static_argnames=_STATIC, donate_argnums=(2,))
spec_decode_step = jax.jit(_spec_decode, static_argnames=_STATIC, donate_argnums=(2,))


def compiled_variants() -> int:
    """Compiled executables held by the engine's step functions (all engines in the process)."""
    return extend_step._cache_size() + spec_decode_step._cache_size()

