"""The engine's jitted device steps over a fixed set of request slots.

Device state (``SlotState`` = a ``speculate.DecodeState`` over S+1 rows, donated every step):
the target and draft page pools, plus per-slot rows (``DecodeState.PER_ROW``: lengths,
last_token, the drafter's carry, history, lag window) for ``S`` slots and one dummy slot ``S``
that padding rows read and write. A step gathers its rows' slots into a DecodeState of the
batch, runs the speculative core on it, and scatters the rows back (no field-by-field copy).
Between steps a decoding slot satisfies ``specjax.speculate``'s invariant (n = lengths[slot]
committed tokens, x_{n-1} = last_token[slot] not yet in the target cache, the drafter's carry
for position n). Lengths live on the device, so a step can be dispatched before the host has
read how many drafts the previous one accepted (the one-token MTP schedule: see
specjax.engine.engine, "async").

Every step takes one int32 metadata buffer ``meta [B, W]`` (B = a static batch bucket), packed on
the host (``pack``) and copied to the device in one transfer. Row layout (``COL_*``)::

    kind | slot | start | num_new | final | next_token | seed | temperature | top_k | top_p |
    page_table [G * Pmax] | tokens [T]

* kind: 0 padding (slot S, pages -1: nothing is written), 1 prefill chunk, 2 decode row.
* prefill chunk: ``tokens[:num_new]`` at positions ``start..``; ``final`` chunks end the prompt
  (sample the first token and commit); other chunks carry ``next_token`` = the next chunk's first
  token, which the draft / head needs at the chunk's end.
* decode row: start, token and length come from the device's slot state.
* temperature and top_p are float32 bit patterns.
* page_table: G = ``StepConfig.groups`` tables of Pmax ids: the global pages, then (G = 2) the
  sliding-window layers' pages (-1 = released), unpacked as a grouped table [B, 2, Pmax]
  (``kv_cache.group_table`` picks each layer's row).

Two step functions (different static shapes, each jitted once per bucket):

* ``extend_step``: ordinary sampling for prefill chunks and one-token decode rows (prefill and
  mixed batches; also plain decoding). The drafter absorbs the same tokens
  (``Drafter.extend``) so decode rows keep the speculative invariant.
* ``spec_decode_step``: a decode-only batch through ``speculate.loop.step_counted`` (propose,
  verify, acceptance, absorb, fused).

Structured outputs (specjax.engine.grammar) split the speculative step in two,
``spec_propose_step`` and ``spec_verify_step`` (the host builds the grammar masks from the drafts
in between), and give ``extend_step`` a mask of its sampled position.

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

from specjax import adaptive, control, ngram, registry, sampling, speculate
from specjax.config import SpecConfig
from specjax.model import lm_head
from specjax.structured import apply_bitmask

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
    groups: int = 1  # KV groups: 2 = global + sliding-window pages (specjax.engine.kv_groups)

    @property
    def table_cols(self) -> int:
        """Page-table columns of a metadata row (groups x Pmax)."""
        return self.groups * self.pages_per_seq

    def width(self, t: int) -> int:
        """Metadata row width W for T tokens per row."""
        return NUM_COLS + self.table_cols + t


def init_state(target_cfg, draft_cfg, sc: StepConfig, num_pages, dtype) -> speculate.DecodeState:
    """Zeroed pools of ``num_pages`` pages for target and draft, and S+1 empty slots
    (``num_pages`` = (P, P_window) with two KV groups: ``kv_cache.init_cache``).

    The slot state is a ``speculate.DecodeState`` over S+1 rows: its per-row fields
    (``DecodeState.PER_ROW``: lengths, last_token, the drafter's carry, history, lag window)
    are the slots', its pools are the engine's; the per-generation fields (page_table,
    out_tokens, keys, counters) are placeholders that each step replaces for its own rows.
    """
    lc = sc.lc
    s1 = sc.num_slots + 1
    plan = speculate.make_plan(target_cfg, draft_cfg, lc)
    target_kv = registry.init_cache(target_cfg, num_pages, lc.page_size, dtype)
    draft_kv, carry = plan.drafter.init(s1, num_pages, lc.page_size, dtype)
    def zeros(shape=(s1,), dtype=jnp.int32):  # a fresh buffer per field: they are donated
        return jnp.zeros(shape, dtype)

    state = speculate.DecodeState(
        target_kv=target_kv, draft_kv=draft_kv, page_table=zeros((s1, 1)),
        lengths=jnp.ones((s1,), jnp.int32), last_token=zeros(), carry=carry,
        out_tokens=zeros((s1, 1)), num_out=zeros(), done=jnp.ones((s1,), bool), step=zeros(()),
        row_keys=_row_keys(zeros(), zeros()), accepted_per_pos=zeros((max(lc.k_eff, 1),)),
        row_steps=zeros(()), drafted=zeros(()), spec_steps=zeros(()))
    if plan.drafter.uses_history:
        state = dataclasses.replace(state, history=jnp.zeros((s1, sc.history_len), jnp.int32))
    if lc.adaptive:
        state = dataclasses.replace(
            state, **adaptive.init_counts(lc.k_eff, lc.adaptive_by == "confidence"),
            **speculate.steps.init_lag(plan.drafter, s1, speculate.LAG_WINDOW, dtype))
    return state


SlotState = speculate.DecodeState  # the engine's device state (see init_state)


# ------------------------------------------------------------------------------ host packing

def pack(rows, sc: StepConfig, batch: int, t: int) -> np.ndarray:
    """Packs row dicts into one int32 metadata buffer [batch, W] (missing rows are padding).

    Each row: kind, slot, seed, temperature, top_k, top_p, pages (list of ids) and, for prefill
    chunks, start, tokens (list), final, next_token.
    """
    meta = np.zeros((batch, sc.width(t)), np.int32)
    meta[:, COL_SLOT] = sc.num_slots
    meta[:, COL_NUM_NEW] = 1
    p = sc.pages_per_seq
    meta[:, NUM_COLS:NUM_COLS + sc.table_cols] = -1
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
        if sc.groups == 2:
            window_pages = r["window_pages"]
            meta[i, NUM_COLS + p:NUM_COLS + p + len(window_pages)] = window_pages
        if r["kind"] == KIND_PREFILL:
            toks = r["tokens"]
            meta[i, COL_START] = r["start"]
            meta[i, COL_NUM_NEW] = len(toks)
            meta[i, COL_FINAL] = int(r["final"])
            meta[i, COL_NEXT] = r.get("next_token", 0)
            meta[i, NUM_COLS + sc.table_cols:NUM_COLS + sc.table_cols + len(toks)] = toks
    meta[:, COL_TEMP] = fbits[:, 0].view(np.int32)
    meta[:, COL_TOP_P] = fbits[:, 1].view(np.int32)
    return meta


# ----------------------------------------------------------------------------- device steps

def _unpack(meta, sc: StepConfig):
    """Splits meta [B, W] into named columns; returns (cols dict, page_table [B, Pmax] or
    grouped [B, 2, Pmax], tokens [B, T])."""
    p = sc.table_cols
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
    table = meta[:, NUM_COLS:NUM_COLS + p]
    if sc.groups == 2:
        table = table.reshape(table.shape[0], 2, sc.pages_per_seq)
    return cols, table, meta[:, NUM_COLS + p:]


def _row_params(cols, max_new: int) -> speculate.RowParams:
    b = cols["kind"].shape[0]
    return speculate.RowParams(temperature=cols["temperature"], top_k=cols["top_k"],
                               top_p=cols["top_p"], max_new=jnp.full((b,), max_new, jnp.int32),
                               eos_ids=jnp.full((1,), -1, jnp.int32))  # stops are host-side


def _row_keys(seed, position):
    """[B] typed keys fold_in(key(seed_b), position_b)."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed, position)


def _rows_of(state: speculate.DecodeState, slot) -> dict:
    """The per-row fields of ``slot`` [B]'s rows (a dict of DecodeState fields)."""
    return {name: jax.tree_util.tree_map(lambda x: x[slot], getattr(state, name))
            for name in speculate.DecodeState.PER_ROW if getattr(state, name) is not None}


def _scatter(state: speculate.DecodeState, slot, commit, **updates) -> speculate.DecodeState:
    """Writes per-row values (pytrees of [B, ...]) into their slots where ``commit`` (others
    keep the slot's value)."""
    def put(old, value):
        mask = commit.reshape(commit.shape + (1,) * (value.ndim - 1))
        return old.at[slot].set(jnp.where(mask, value.astype(old.dtype), old[slot]))

    new = {name: jax.tree_util.tree_map(put, getattr(state, name), value)
           for name, value in updates.items() if getattr(state, name) is not None}
    return dataclasses.replace(state, **new)


def _extend(target_params, draft_params, state, meta, masks=None, *, target_cfg, draft_cfg,
            sc: StepConfig):
    """Ordinary-sampling step over prefill chunks and one-token decode rows. ``masks`` [B, W]
    int32: structured-output token bitmasks of the sampled position (None: no constraint).

    Returns (state, sampled [B] int32): the sampled token of decode rows and final chunks.
    """
    lc = sc.lc
    plan = speculate.make_plan(target_cfg, draft_cfg, lc)
    drafter, models = plan.drafter, speculate.Models(target_params, draft_params)
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
        attn_impl=lc.attn_impl, return_logits=False, aux_layers=drafter.aux_layers)
    last_h = jnp.take_along_axis(hidden, (num_new - 1)[:, None, None], axis=1)[:, 0]  # [B, E]
    logits = lm_head(target_params, target_cfg, last_h)  # [B, V]
    if masks is not None:
        logits = apply_bitmask(logits, masks)
    pos_new = start + num_new  # position of the sampled token
    keys = sampling.step_keys(_row_keys(cols["seed"], pos_new), jnp.zeros((), jnp.int32), 0)
    y = sampling.sample_logits(keys, logits, cols["temperature"], cols["top_k"],
                               cols["top_p"])  # [B]
    commit = cols["valid"] & (is_dec | cols["final"])
    after = jnp.where(commit, y, cols["next"])  # the token following the processed span

    # The drafter over the same span plus the token after it (for decode rows a draft LLM
    # rewrites x_{n-1} with identical K/V and writes y). Decode rows whose drafter adaptive plain
    # steps left behind are caught up first (speculate.steps.catch_up).
    draft_kv = state.draft_kv
    if state.lag is not None:
        num = jnp.where(is_dec & cols["valid"], state.lag[slot], 0)
        feats = None if state.lag_feats is None else state.lag_feats[slot]
        draft_kv = control.cond(  # in place (a lax.cond would copy the draft pools)
            jnp.any(num > 0),
            lambda kv: speculate.steps.catch_up(models, drafter, kv, page_table, n_dev, num,
                                                state.lag_tokens[slot], feats)[0],
            draft_kv)
    draft_kv, carry = drafter.extend(models, draft_kv, speculate.Span(
        tokens, hidden, aux, start, num_new, after, page_table))

    state = dataclasses.replace(state, target_kv=target_kv, draft_kv=draft_kv)
    if state.history is not None:
        # The span and the token after it at start..start+num_new (later slots: stale).
        span = jnp.concatenate([tokens, jnp.zeros((tokens.shape[0], 1), jnp.int32)], axis=1)
        span = jax.vmap(lambda row, i, v: row.at[i].set(v))(span, num_new, after)
        rows = ngram.write(state.history[slot], span, start)
        state = _scatter(state, slot, cols["valid"], history=rows)
    # fresh carry: the drafter is level again
    updates = dict(lengths=pos_new + 1, last_token=y, carry=carry, lag=jnp.zeros_like(slot))
    return _scatter(state, slot, commit, **updates), y


def _spec_decode(target_params, draft_params, state, meta, cost=None, *, target_cfg, draft_cfg,
                 sc: StepConfig):
    """Decode-only speculative step (speculate's step on the gathered slots' DecodeState).

    cost: [K+1..K+3] float32 relative k-step costs at this batch bucket (adaptive k only).

    Returns (state, emitted [B, K+1] int32, counts [B] int32, verified [B] int32): row b emitted
    ``emitted[b, :counts[b]]`` (accepted drafts then the residual / bonus token) after the
    target verified ``verified[b]`` draft tokens (0: no n-gram match or an adaptive plain step).
    """
    plan, cols, ds = _gathered(state, meta, sc, target_cfg, draft_cfg, cost)
    ds, verified = speculate.loop.step_counted(speculate.Models(target_params, draft_params), ds,
                                               _row_params(cols, sc.lc.k_eff + 1), plan)
    return _scattered(state, ds, cols), ds.out_tokens, ds.num_out, verified


def _gathered(state, meta, sc: StepConfig, target_cfg, draft_cfg, cost=None):
    """(plan, cols, the batch's DecodeState gathered from its rows' slots)."""
    lc = sc.lc
    plan = speculate.make_plan(target_cfg, draft_cfg, lc)
    cols, page_table, _ = _unpack(meta, sc)
    b = page_table.shape[0]
    i0 = jnp.zeros((), jnp.int32)
    rows = _rows_of(state, cols["slot"])
    ds = dataclasses.replace(
        state, **rows, page_table=page_table, out_tokens=jnp.zeros((b, lc.k_eff + 1), jnp.int32),
        num_out=jnp.zeros((b,), jnp.int32), done=~cols["valid"], step=i0,
        row_keys=_row_keys(cols["seed"], rows["lengths"]),
        accepted_per_pos=jnp.zeros((max(lc.k_eff, 1),), jnp.int32), row_steps=i0, drafted=i0,
        spec_steps=i0, cost=cost)
    return plan, cols, ds


def _scattered(state, ds, cols):
    """The slot state with the batch state ``ds``'s pools, shared counts and rows written back."""
    new = dataclasses.replace(state, target_kv=ds.target_kv, draft_kv=ds.draft_kv,
                              acc_hits=ds.acc_hits, acc_obs=ds.acc_obs, plain_run=ds.plain_run,
                              k_hist=ds.k_hist)
    return _scatter(new, cols["slot"], cols["valid"], **_rows_of_all(ds))


# Structured outputs split a speculative step in two so the host can read the drafts and build
# the grammar's per-position masks in between (specjax.structured): ``spec_propose_step`` drafts
# (catching lagging drafters up first) and keeps the drafter's pool in the slot state;
# ``spec_verify_step`` verifies those drafts with the masks applied to the target's logits. Both
# use the fused step's keys, so an unconstrained row (all-ones mask) gets the fused step's tokens.

def _spec_propose(target_params, draft_params, state, meta, *, target_cfg, draft_cfg,
                  sc: StepConfig):
    """Returns (state, proposal): a chain's ``Drafts`` without its pool (tokens [B, K], probs,
    proposing, ...) or a tree's (tokens [B, N], parents [B, N+1], depth [B, N+1])."""
    lc = sc.lc
    plan, cols, ds = _gathered(state, meta, sc, target_cfg, draft_cfg)
    models = speculate.Models(target_params, draft_params)
    drafter = plan.drafter
    if lc.tree is not None:
        tokens, parents, depth, draft_kv = drafter.propose_tree(models, ds, lc.tree)
        ds, proposal = dataclasses.replace(ds, draft_kv=draft_kv), (tokens, parents, depth)
    else:
        ds = speculate.steps.caught_up(models, plan, ds)
        drafts = drafter.propose(models, ds, _row_params(cols, lc.k_eff + 1), lc.k_eff,
                                 sampling.step_keys(ds.row_keys, ds.step, 1), lc.draft_sampling)
        ds, proposal = (dataclasses.replace(ds, draft_kv=drafts.draft_kv),
                        dataclasses.replace(drafts, draft_kv=None))
    return _scattered(state, ds, cols), proposal


def _spec_verify(target_params, draft_params, state, meta, proposal, masks, *, target_cfg,
                 draft_cfg, sc: StepConfig):
    """Verifies ``proposal`` (from spec_propose_step) with ``masks`` [B, K+1, W] (trees:
    [B, N+1, W]) int32 token bitmasks on the target's logits. Returns what spec_decode_step
    returns."""
    lc = sc.lc
    plan, cols, ds = _gathered(state, meta, sc, target_cfg, draft_cfg)
    models = speculate.Models(target_params, draft_params)
    rp = _row_params(cols, lc.k_eff + 1)
    if lc.tree is not None:
        ds, _, verified = speculate.steps.tree_step(models, ds, rp, plan, proposal=proposal,
                                                    masks=masks)
    else:
        drafts = dataclasses.replace(proposal, draft_kv=ds.draft_kv)
        ds, _, verified = speculate.steps.chain_step(models, ds, rp, plan, drafts=drafts,
                                                     masks=masks)
    verified = jnp.where(cols["valid"], verified, 0).astype(jnp.int32)
    return _scattered(state, ds, cols), ds.out_tokens, ds.num_out, verified


def _rows_of_all(ds) -> dict:
    return {name: getattr(ds, name) for name in speculate.DecodeState.PER_ROW
            if getattr(ds, name) is not None}


def _seed_history(history, slot, tokens):
    """history [S+1, L] with tokens [T] (T <= L) written at row ``slot``, columns 0..T-1: the
    token history of a prefix the prefix cache supplied (n-gram drafting; extend writes only
    the span it prefills). Columns past the prefix are rewritten by the slot's next extend."""
    return jax.lax.dynamic_update_slice(history, tokens[None].astype(history.dtype), (slot, 0))


seed_history = jax.jit(_seed_history, donate_argnums=(0,))
_STATIC = ("target_cfg", "draft_cfg", "sc")
extend_step = jax.jit(_extend, static_argnames=_STATIC, donate_argnums=(2,))
spec_decode_step = jax.jit(_spec_decode, static_argnames=_STATIC, donate_argnums=(2,))
spec_propose_step = jax.jit(_spec_propose, static_argnames=_STATIC, donate_argnums=(2,))
spec_verify_step = jax.jit(_spec_verify, static_argnames=_STATIC, donate_argnums=(2,))
