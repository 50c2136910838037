"""The jitted steps: prefill, the fused speculative step, and the on-device decode loop.

Invariant between steps (per row b), with n = lengths[b] committed tokens x_0..x_{n-1}:
  * the target cache holds valid K/V for x_0..x_{n-2}; x_{n-1} = last_token[b] is pending;
  * the draft cache (method "draft") holds valid K/V for x_0..x_{n-1}, and draft_logits[b]
    are its carried logits for position n (the next draft token);
  * slots at or beyond those counts are stale and never read.

One speculative step (method "draft", k = num_draft_tokens), all on device:
  1. draft rollout: d_1 from the carried logits, d_2..d_k from k-1 one-token draft forwards;
  2. verify: one target forward over [x_{n-1}, d_1..d_k] at positions n-1..n+k-1;
  3. acceptance (specjax.acceptance.accept_chain): a accepted drafts and the residual/bonus y;
  4. draft catch-up: one two-token draft forward over [x_{n+a-1}, y] whose last logits are
     carried into the next step (it also writes d_k's K/V when every draft was accepted);
  5. n += a + 1, last_token = y; tokens go into the output buffer, stopping at EOS/max_new.
Method "none" is the same loop with a one-token target forward and ordinary sampling.

Methods "mtp", "eagle" and "eagle3" draft with a head fed by target features (specjax.heads;
EAGLE-3's features are fc(hidden states entering three target layers), collected by the same
target forward through its ``aux_layers`` argument, no extra pass). Head
position j consumes (x_{j+1}, f_j) and predicts x_{j+2}; its cache holds positions j <= n-2
(as many entries as the target's), draft_logits come from position n-2 and predict x_n, and
head_hidden is the head's own output there. Rollout: d_1 from the carried logits, then d_i from
the head at position n-2+i-1 fed its *own* previous output (k-1 one-token head runs). After
verification the device shifts the verify tokens one left, inserts y at index a, and re-runs the
head over all k+1 positions j = n-1..n+k-1 with the *target's* features (the one-token MTP
schedule: no host sync; work on rejected positions is wasted but keeps shapes static). That
re-run rewrites the head's K/V with the accurate features and gives the next carried logits.

Method "eagle-tree" drafts a tree with the head (specjax.tree: static or EAGLE-2 dynamic),
verifies its N + 1 tokens (root x_{n-1} first) in one target forward with the ancestor mask among
them (the prefix is unmasked), accepts a root-to-node path of depth a (greedy or lossless
recursive rejection over siblings), moves the path's target K/V from tree-node slots into cache
order (slot n-1+i <- slot n-1+node_i), and re-runs the head over the accepted path with the
target's features exactly like the chain's shift: same invariants afterwards.

Method "ngram" drafts without a model (specjax.ngram): each row's history x_0..x_{n-1} is kept in
an on-device buffer, the tokens that followed the longest earlier match of its suffix are the
point-mass drafts, rows without a match take an ordinary sample from p_0 (they accept nothing),
and when no row matches the step is a plain one-token step instead of the verify.
With ``hybrid_min`` > 0 the draft/head methods use the n-gram proposal for rows with a match
that long (a draft LLM then re-runs over every emitted token, since it never saw those drafts;
heads re-run over the verified span anyway).

``adaptive`` picks the step's k in {0..K} on device (specjax.adaptive) and runs that compiled
variant (specjax.control.switch, which keeps the KV pools in place where lax.switch would copy
every pool each step); k = 0 is a plain step that leaves the drafter behind (lazy upkeep): the
new token (and, for heads, the target feature the head will consume with it) goes into a small
per-row window (``lag_tokens`` / ``lag_feats``, W = ``LAG_WINDOW`` slots indexed by position mod W)
and ``lag`` counts the positions the drafter has not seen. ``catch_up`` runs the drafter once over
the whole backlog (one W-token forward instead of one forward per plain step) when the row next
speculates, or when the window fills (then the newest position stays pending, so no lm_head is
computed for logits that would be stale again a step later).

With ``adaptive_by="confidence"`` the choice follows each step's own drafts instead: the drafter
is caught up first (its carried logits must be fresh), drafts are made one at a time while one
more can pay (a while_loop; specjax.adaptive.extend), and k in {0..drafted} is picked from the
drafts' calibrated confidence; the chosen variant verifies the drafts already made.

Drafting is a function per method (``_DRAFTERS``: tokens, optional q, the drafter's cache);
``_chain_step`` verifies and accepts whatever it proposes; ``_plain_step`` / ``_commit`` are
shared by every path.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from specjax import acceptance, adaptive, control, heads, kv_cache, ngram, registry, sampling, tree
from specjax.config import SpecConfig
from specjax.model import lm_head
from specjax.sampling import step_keys as _step_keys


# The model family's forward and paged cache, chosen by the static config type (specjax.registry).
forward = registry.forward
init_cache = registry.init_cache


LAG_WINDOW = 16  # W: plain steps a drafter may fall behind before it is caught up


def target_forward(params, cfg, *args, aux_layers: tuple = (), **kw):
    """forward plus the hidden states entering ``aux_layers`` (EAGLE-3 features):
    (logits, hidden, kv, aux [B, T, A*E] or None when aux_layers is empty)."""
    if not aux_layers:
        return (*forward(params, cfg, *args, **kw), None)
    return forward(params, cfg, *args, aux_layers=aux_layers, **kw)


def aux_layers_for(lc, draft_cfg) -> tuple:
    """The target layers a head's features need (EAGLE-3), else ()."""
    return draft_cfg.aux_layers if lc.uses_head else ()


# The methods this decode loop implements (config.METHODS lists every name SpecConfig accepts).
METHODS = ("none", "draft", "mtp", "eagle", "eagle3", "eagle-tree", "ngram")
HEAD_METHODS = ("mtp", "eagle", "eagle3", "eagle-tree")  # methods drafting with a specjax.heads.Head



@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Everything a generation carries between steps (a pytree; the caches are donated)."""

    target_kv: kv_cache.KVCache
    draft_kv: kv_cache.KVCache | None
    page_table: jax.Array  # [B, Pmax] int32, shared by target and draft
    lengths: jax.Array  # [B] int32 committed tokens n (prompt + generated)
    last_token: jax.Array  # [B] int32 x_{n-1}, not yet in the target cache
    draft_logits: jax.Array | None  # [B, V] float32 draft logits carried for position n
    head_hidden: jax.Array | None  # [B, E] head output h' at position n-2 (MTP/EAGLE heads)
    out_tokens: jax.Array  # [B, Nbuf] int32 generated tokens
    num_out: jax.Array  # [B] int32 valid entries of out_tokens
    done: jax.Array  # [B] bool
    step: jax.Array  # [] int32 speculative steps taken
    row_keys: jax.Array  # [B] typed PRNG keys, one stream per row
    accepted_per_pos: jax.Array  # [K] int32 row-steps whose draft i was accepted *and emitted*
    row_steps: jax.Array  # [] int32 active row-steps (target verify passes per row)
    # n-gram drafting (SpecConfig.uses_history): x_0..x_{n-1} per row, slots >= n stale.
    history: jax.Array | None = None  # [B, L] int32
    drafted: jax.Array | None = None  # [] int32 draft tokens proposed by active rows (all steps)
    # adaptive k (SpecConfig.adaptive; specjax.adaptive):
    acc_hits: jax.Array | None = None  # [K] float32 decayed accepted counts per draft position
    acc_obs: jax.Array | None = None  # [K] float32 decayed reached counts per draft position
    # (adaptive_by="confidence": [K, NB] per position and confidence bin, the calibration table)
    plain_run: jax.Array | None = None  # [] int32 consecutive steps that drafted nothing
    cost: jax.Array | None = None  # [K+1..K+3] float32 k-step costs (+ catch-up, draft step)
    k_hist: jax.Array | None = None  # [K+1] int32 steps that chose each k
    # lazy drafter upkeep over plain steps (adaptive, methods with a drafter; module docstring):
    lag: jax.Array | None = None  # [B] int32 pending drafter positions (draft_logits stale if > 0)
    lag_tokens: jax.Array | None = None  # [B, W] int32 token of pending position p at p % W
    lag_feats: jax.Array | None = None  # [B, W, E] head feature f_p of pending position p (heads)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RowParams:
    """Per-row request parameters (traced, so one compile serves every request mix)."""

    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] float32
    max_new: jax.Array  # [B] int32
    eos_ids: jax.Array  # [NE] int32 stop tokens (-1 = unused slot)


def _process(logits, rp: RowParams):
    return sampling.process_logits(logits, rp.temperature, rp.top_k, rp.top_p)


def _sample(keys, logits, rp: RowParams):
    """[B] tokens from [B, V] logits with the rows' settings (sampling.sample_logits)."""
    return sampling.sample_logits(keys, logits, rp.temperature, rp.top_k, rp.top_p)


def _accept(keys, d, logits, q, rp: RowParams):
    """Chain acceptance; an all-greedy batch takes the argmax comparison directly."""
    def general():
        return acceptance.accept_chain(keys, d, _process(logits, rp), q)

    def greedy():
        a, y = acceptance.accept_greedy(d, logits)
        return a.astype(jnp.int32), y.astype(jnp.int32)

    return lax.cond(jnp.all(rp.temperature <= 0.0), greedy, general)


def _accept_tree(keys, tokens, parents, depth, logits, rp: RowParams, max_depth: int):
    """Tree acceptance; an all-greedy batch follows the target's argmax directly."""
    def general():
        return tree.accept_tree(keys, tokens, parents, depth, _process(logits, rp),
                                max_depth=max_depth)

    def greedy():
        return tree.accept_tree(keys, tokens, parents, depth, None, logits, max_depth=max_depth)

    return lax.cond(jnp.all(rp.temperature <= 0.0), greedy, general)


def _is_eos(tokens, eos_ids):
    return jnp.any(tokens[..., None] == eos_ids, axis=-1)


def _emit(state: DecodeState, emitted, count_raw, rp: RowParams):
    """Appends emitted[:, :count_raw] per active row, truncated at EOS and max_new."""
    b, width = emitted.shape
    idx = jnp.arange(width, dtype=jnp.int32)[None, :]
    eos = _is_eos(emitted, rp.eos_ids) & (idx < count_raw[:, None])
    first_eos = jnp.where(jnp.any(eos, axis=1), jnp.argmax(eos, axis=1), width)
    count = jnp.minimum(jnp.minimum(count_raw, first_eos + 1), rp.max_new - state.num_out)
    count = jnp.where(state.done, 0, count)
    out = jax.vmap(lambda o, e, s: lax.dynamic_update_slice(o, e, (s,)))(
        state.out_tokens, emitted, state.num_out)
    num_out = state.num_out + count
    done = state.done | (first_eos < count_raw) | (num_out >= rp.max_new)
    return out, num_out, done


def extend_draft(target_params, target_cfg, draft_params, draft_cfg, tokens, hidden, start,
                 num_new, after, draft_kv, page_table, lc: SpecConfig, aux=None):
    """Advances the draft LLM or head over a span the target has just processed (a prompt, a
    prefill chunk, or one decode token), restoring the invariant in the module docstring.

    Args:
      tokens: [B, T] int32 the span, row b's valid part ``tokens[b, :num_new[b]]`` at positions
        ``start[b]..``; hidden: [B, T, E] the target's final hidden states over it; aux:
        [B, T, A*E] the states entering the head's aux layers (EAGLE-3) or None.
      start, num_new: [B] int32; after: [B] int32 the token following the span (the one just
        sampled, or the next prefill chunk's first token).
      draft_kv: the draft / head cache (None for methods without one); page_table: [B, Pmax].
    Returns:
      (draft_kv, draft_logits [B, V] carried for the next draft token or None, head_hidden
      [B, E] the head's output at the span's last position or None).
    """
    b, t = tokens.shape
    positions = start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    if lc.uses_head:
        # Head position j consumes (x_{j+1}, f_j): the span shifted left, `after` at its end.
        shifted = jnp.concatenate([tokens[:, 1:], jnp.zeros((b, 1), jnp.int32)], axis=1)
        shifted = jax.vmap(lambda row, i, v: row.at[i].set(v))(shifted, num_new - 1, after)
        feats = heads.head_features(draft_params, draft_cfg, target_params, target_cfg, hidden, aux)
        hh, draft_kv = heads.head_forward(draft_params, draft_cfg, target_params, shifted, feats,
                                          positions, draft_kv, page_table, start, num_new,
                                          attn_impl=lc.attn_impl)
        head_hidden = jnp.take_along_axis(hh, (num_new - 1)[:, None, None], axis=1)[:, 0]
        draft_logits = heads.head_logits(draft_params, draft_cfg, target_params, target_cfg,
                                         head_hidden)
        return draft_kv, draft_logits, head_hidden
    if lc.method == "draft":
        # The draft sees the span plus the token after it; its last logits are carried, not sampled.
        ext = jnp.concatenate([tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
        ext = jax.vmap(lambda row, i, v: row.at[i].set(v))(ext, num_new, after)
        ext_pos = start[:, None] + jnp.arange(t + 1, dtype=jnp.int32)[None, :]
        _, dh, draft_kv = forward(draft_params, draft_cfg, ext, ext_pos, draft_kv, page_table, start,
                                  num_new + 1, attn_impl=lc.attn_impl, return_logits=False)
        dh_last = jnp.take_along_axis(dh, num_new[:, None, None], axis=1)[:, 0]
        return draft_kv, lm_head(draft_params, draft_cfg, dh_last), None
    return draft_kv, None, None


def prefill(target_params, target_cfg, draft_params, draft_cfg, tokens, prompt_lens, rp: RowParams,
            seed, lc: SpecConfig, num_pages_per_seq: int, out_len: int, kv_dtype=jnp.float32,
            cost=None, lag_window: int = LAG_WINDOW):
    """Fills both caches over the prompts and samples the first token.

    Args:
      tokens: [B, Tp] int32 right-padded prompts; prompt_lens: [B] int32 (>= 1).
      seed: [] int32; row b's stream is fold_in(key(seed), b).
      cost: [K+1..K+3] float32 relative k-step costs (adaptive only; specjax.cost_model).
      lag_window: static W of the lazy drafter upkeep (adaptive only).
    Returns:
      the initial DecodeState (the first generated token is already in out_tokens).
    """
    b, tp = tokens.shape
    page_table = kv_cache.contiguous_page_table(b, num_pages_per_seq)
    num_pages = b * num_pages_per_seq
    row_keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(jnp.arange(b))
    zeros = jnp.zeros((b,), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tp, dtype=jnp.int32), (b, tp))

    target_kv = init_cache(target_cfg, num_pages, lc.page_size, kv_dtype)
    _, hidden, target_kv, aux = target_forward(target_params, target_cfg, tokens, positions,
                                               target_kv, page_table, zeros, prompt_lens,
                                               attn_impl=lc.attn_impl, return_logits=False,
                                               aux_layers=aux_layers_for(lc, draft_cfg))
    last_h = jnp.take_along_axis(hidden, (prompt_lens - 1)[:, None, None], axis=1)[:, 0]  # [B, E]
    logits = lm_head(target_params, target_cfg, last_h)  # [B, V]
    first = _sample(_step_keys(row_keys, 0, 0), logits, rp)  # [B]

    draft_kv = None
    if lc.uses_head:
        draft_kv = init_cache(draft_cfg.layer, num_pages, lc.page_size, kv_dtype)
    elif lc.method == "draft":
        draft_kv = init_cache(draft_cfg, num_pages, lc.page_size, kv_dtype)
    draft_kv, draft_logits, head_hidden = extend_draft(
        target_params, target_cfg, draft_params, draft_cfg, tokens, hidden, zeros, prompt_lens,
        first, draft_kv, page_table, lc, aux)

    state = DecodeState(
        target_kv=target_kv, draft_kv=draft_kv, page_table=page_table, lengths=prompt_lens + 1,
        last_token=first, draft_logits=draft_logits, head_hidden=head_hidden,
        out_tokens=jnp.zeros((b, out_len), jnp.int32), num_out=zeros, done=jnp.zeros((b,), bool),
        step=jnp.ones((), jnp.int32), row_keys=row_keys,
        accepted_per_pos=jnp.zeros((max(lc.k_eff, 1),), jnp.int32), row_steps=jnp.zeros((), jnp.int32),
        drafted=jnp.zeros((), jnp.int32))
    if lc.uses_history:  # x_0..x_{n-1}: the prompt, then the first token at n - 1
        history = jnp.pad(tokens, ((0, 0), (0, out_len)))  # [B, Tp + out_len]
        history = ngram.write(history, first[:, None], prompt_lens)
        state = dataclasses.replace(state, history=history)
    if lc.adaptive:
        kk = lc.k_eff
        if cost is None:
            raise ValueError("adaptive speculation needs the cost model (cost=[K+1..K+3] array)")
        cost = jnp.asarray(cost, jnp.float32).reshape(-1)
        if cost.shape[0] not in (kk + 1, kk + 2, kk + 3):
            raise ValueError(f"cost must have K+1 = {kk + 1}, K+2 or K+3 entries, got {cost.shape[0]}")
        extra = init_lag(lc, draft_cfg, b, lag_window, kv_dtype)
        state = dataclasses.replace(
            state, cost=cost, **adaptive.init_counts(kk, lc.adaptive_by == "confidence"), **extra)
    out, num_out, done = _emit(state, first[:, None], jnp.ones((b,), jnp.int32), rp)
    return dataclasses.replace(state, out_tokens=out, num_out=num_out, done=done)


def _draft_rollout(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
                   rp: RowParams, lc: SpecConfig):
    """k draft tokens from the carried logits and k-1 one-token draft (or head) forwards.

    Returns (draft_kv, tokens [B, K], probs [B, K, V] or None).
    """
    n = state.lengths
    keys = _step_keys(state.row_keys, state.step, 1)

    def pick(logits, i):
        if not lc.draft_sampling:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        q = _process(logits, rp)
        ki = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)
        return sampling.sample(ki, q), q

    def body(carry, i):
        kv, logits, feat = carry
        d, q = pick(logits, i)
        if lc.uses_head:  # head position n-2+i+1 fed its own previous output
            pos = n - 1 + i
            hh, kv = heads.head_forward(draft_params, draft_cfg, target_params,
                                        d[:, None], feat[:, None], pos[:, None], kv,
                                        state.page_table, pos, attn_impl=lc.attn_impl)
            feat = hh[:, 0]
            new_logits = heads.head_logits(draft_params, draft_cfg, target_params, target_cfg, feat)
        else:
            pos = n + i
            new_logits, _, kv = forward(draft_params, draft_cfg, d[:, None], pos[:, None], kv,
                                        state.page_table, pos, attn_impl=lc.attn_impl)
            new_logits = new_logits[:, 0]
        return (kv, new_logits, feat), (d, q)

    feat0 = state.head_hidden if lc.uses_head else jnp.zeros((n.shape[0], 1), jnp.float32)
    (kv, last_logits, _), (ds, qs) = lax.scan(body, (state.draft_kv, state.draft_logits, feat0),
                                              jnp.arange(lc.k - 1, dtype=jnp.int32))
    d_k, q_k = pick(last_logits, lc.k - 1)
    tokens = jnp.concatenate([ds.T, d_k[:, None]], axis=1)  # [B, K]
    probs = None
    if lc.draft_sampling:
        probs = jnp.concatenate([qs.transpose(1, 0, 2), q_k[:, None]], axis=1)  # [B, K, V]
    return kv, tokens, probs


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Drafts:
    """One step's proposal (what a drafting function returns)."""

    tokens: jax.Array  # [B, K] int32 d_1..d_K
    probs: jax.Array | None  # [B, K, V] q the drafts were sampled from, None for point masses
    draft_kv: object  # the drafter's cache after the rollout (None for n-gram drafting)
    proposing: jax.Array  # [B] bool rows with a real proposal (n-gram: a match)
    from_ngram: jax.Array | None  # [B] bool hybrid rows that use the n-gram proposal


def _draft_model(target_params, target_cfg, draft_params, draft_cfg, state, rp, lc) -> Drafts:
    """Drafting with a draft LLM or head (methods draft/mtp/eagle), optionally hybrid."""
    b = state.lengths.shape[0]
    if state.lag is not None:  # plain steps left the drafter behind: catch it up first
        state = control.cond(jnp.any((state.lag > 0) & ~state.done),
                             lambda s: _catch_up_state(target_params, target_cfg, draft_params,
                                                       draft_cfg, s, lc, keep=0),
                             state)
    kv, tokens, probs = _draft_rollout(target_params, target_cfg, draft_params, draft_cfg, state,
                                       rp, lc)
    from_ngram = None
    if lc.hybrid_min > 0:  # rows with a long enough match take the n-gram proposal instead
        ng, match_len = ngram.propose(state.history, state.lengths, lc.k, lc.ngram_min, lc.ngram_max)
        from_ngram = match_len >= max(lc.hybrid_min, lc.ngram_min)
        tokens = jnp.where(from_ngram[:, None], ng, tokens)
        if probs is not None:  # point masses for the n-gram rows
            one_hot = jax.nn.one_hot(tokens, probs.shape[-1], dtype=probs.dtype)
            probs = jnp.where(from_ngram[:, None, None], one_hot, probs)
    return Drafts(tokens=tokens, probs=probs, draft_kv=kv, proposing=jnp.ones((b,), bool),
                  from_ngram=from_ngram)


def _draft_ngram(target_params, target_cfg, draft_params, draft_cfg, state, rp, lc) -> Drafts:
    """Prompt-lookup drafting from the on-device history (specjax.ngram)."""
    tokens, match_len = ngram.propose(state.history, state.lengths, lc.k, lc.ngram_min,
                                      lc.ngram_max)
    return Drafts(tokens=tokens, probs=None, draft_kv=state.draft_kv, proposing=match_len > 0,
                  from_ngram=None)


_DRAFTERS = {"draft": _draft_model, "mtp": _draft_model, "eagle": _draft_model, "eagle3": _draft_model,
             "ngram": _draft_ngram}


def _commit(state: DecodeState, rp: RowParams, a, y, emitted, *, drafted, **updates):
    """Appends a step's tokens and advances the per-row invariants.

    a: [B] accepted drafts; y: [B] residual / bonus token; emitted: [B, K+1] (a + 1 valid);
    drafted: [B] int32 drafts proposed per row; updates: new caches / carried draft state.
    """
    active = ~state.done
    n = state.lengths
    out, num_out, done = _emit(state, emitted, a + 1, rp)
    kbuf = state.accepted_per_pos.shape[0]
    # Only drafts that were emitted count (EOS / max_new may cut accepted ones; inactive rows emit 0).
    kept = jnp.minimum(a, num_out - state.num_out)
    accepted = jnp.sum(jnp.arange(kbuf)[None, :] < kept[:, None], axis=0)
    new = dict(
        lengths=jnp.where(active, n + a + 1, n), last_token=jnp.where(active, y, state.last_token),
        out_tokens=out, num_out=num_out, done=done, step=state.step + 1,
        accepted_per_pos=state.accepted_per_pos + accepted.astype(jnp.int32),
        row_steps=state.row_steps + jnp.sum(active, dtype=jnp.int32))
    if state.history is not None:  # x_n.. = emitted (stale beyond a + 1, never read)
        new["history"] = ngram.write(state.history, emitted, n)
    if state.drafted is not None:
        new["drafted"] = state.drafted + jnp.sum(jnp.where(active, drafted, 0), dtype=jnp.int32)
    new.update(updates)
    return dataclasses.replace(state, **new)


def init_lag(lc: SpecConfig, draft_cfg, rows: int, window: int, dtype) -> dict:
    """Zeroed lazy-upkeep fields (lag, lag_tokens, lag_feats) for ``rows`` rows; {} for n-gram."""
    if lc.method == "ngram":
        return {}
    out = {"lag": jnp.zeros((rows,), jnp.int32), "lag_tokens": jnp.zeros((rows, window), jnp.int32)}
    if lc.uses_head:
        out["lag_feats"] = jnp.zeros((rows, window, draft_cfg.layer.hidden_size), dtype)
    return out


def catch_up(target_params, target_cfg, draft_params, draft_cfg, draft_kv, page_table, lengths,
             num, lag_tokens, lag_feats, lc: SpecConfig, keep: int = 0):
    """Runs the draft LLM / head over ``num`` pending positions, the oldest first, leaving the
    newest ``keep`` pending (one forward of W = lag_tokens.shape[1] slots), writing their K/V.

    Pending positions end one before ``lengths`` (draft LLM: it has consumed x_0..x_{n-1} when
    level) or two before (head: positions up to n-2). Draft LLM: position p consumes x_p; head:
    position p consumes (x_{p+1}, f_p). Both are read from the window at slot p % W.

    Args:
      lengths: [B] int32 committed tokens n; num: [B] int32 in [0, W] positions to process
        (0 = row untouched).
    Returns:
      (draft_kv, hidden [B, E] the drafter's output at the last processed position, valid where
      num > 0).
    """
    w = lag_tokens.shape[1]
    start = lengths - (1 if lc.uses_head else 0) - keep - num
    pos = start[:, None] + jnp.arange(w, dtype=jnp.int32)[None, :]  # [B, W] (beyond num: unused)
    slots = pos % w
    tokens = jnp.take_along_axis(lag_tokens, slots, axis=1)
    if lc.uses_head:
        feats = jnp.take_along_axis(lag_feats, slots[:, :, None], axis=1)
        hh, draft_kv = heads.head_forward(draft_params, draft_cfg, target_params, tokens, feats,
                                          pos, draft_kv, page_table, start, num,
                                          attn_impl=lc.attn_impl)
    else:
        _, hh, draft_kv = forward(draft_params, draft_cfg, tokens, pos, draft_kv, page_table, start,
                                  num, attn_impl=lc.attn_impl, return_logits=False)
    last = jnp.take_along_axis(hh, jnp.maximum(num - 1, 0)[:, None, None], axis=1)[:, 0]
    return draft_kv, last


def _catch_up_state(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
                    lc: SpecConfig, keep: int) -> DecodeState:
    """Catches active rows' drafters up to all but ``keep`` pending positions. keep = 0 also
    refreshes the carried draft logits (and a head's carried output); keep = 1 leaves the
    newest position pending, so the logits stay stale and no lm_head is computed."""
    active = ~state.done
    num = jnp.where(active, jnp.maximum(state.lag - keep, 0), 0)
    draft_kv, last = catch_up(target_params, target_cfg, draft_params, draft_cfg, state.draft_kv,
                              state.page_table, state.lengths, num, state.lag_tokens,
                              state.lag_feats, lc, keep)
    updates = {"draft_kv": draft_kv, "lag": state.lag - num}
    if keep == 0:
        fresh = num > 0
        if lc.uses_head:
            logits = heads.head_logits(draft_params, draft_cfg, target_params, target_cfg, last)
            updates["head_hidden"] = jnp.where(fresh[:, None], last, state.head_hidden)
        else:
            logits = lm_head(draft_params, draft_cfg, last)
        updates["draft_logits"] = jnp.where(fresh[:, None], logits, state.draft_logits)
    return dataclasses.replace(state, **updates)


def _plain_step(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
                rp: RowParams, lc: SpecConfig):
    """A one-token target step. A drafter that must follow (adaptive k = 0) is not run: the new
    token (and a head's feature) goes into the lag window, caught up later (module docstring).

    Returns (state, a [B] zeros, drafted [B] zeros).
    """
    b = state.lengths.shape[0]
    n = state.lengths
    active = ~state.done
    acc_keys = _step_keys(state.row_keys, state.step, 2)
    logits, hidden, target_kv, aux = target_forward(
        target_params, target_cfg, state.last_token[:, None], (n - 1)[:, None], state.target_kv,
        state.page_table, n - 1, attn_impl=lc.attn_impl,
        aux_layers=aux_layers_for(lc, draft_cfg) if state.lag is not None else ())
    y = _sample(acc_keys, logits[:, 0], rp)
    zeros = jnp.zeros((b,), jnp.int32)
    updates = {"target_kv": target_kv}
    if state.lag is not None:
        # The drafter's new pending position p: head position n-1 consumes (x_n = y, f_{n-1});
        # the draft LLM's position n consumes x_n = y.
        rows = jnp.arange(b)
        slot = ((n - 1) if lc.uses_head else n) % state.lag_tokens.shape[1]
        updates["lag_tokens"] = state.lag_tokens.at[rows, slot].set(
            jnp.where(active, y, state.lag_tokens[rows, slot]))
        if lc.uses_head:
            feats = heads.head_features(draft_params, draft_cfg, target_params, target_cfg, hidden,
                                        aux)[:, 0]  # [B, E]
            updates["lag_feats"] = state.lag_feats.at[rows, slot].set(
                jnp.where(active[:, None], feats.astype(state.lag_feats.dtype),
                          state.lag_feats[rows, slot]))
        updates["lag"] = state.lag + active.astype(jnp.int32)
    new = _commit(state, rp, zeros, y, y[:, None], drafted=zeros, **updates)
    if state.lag is not None:  # a full window: catch up all but the newest position
        new = control.cond(jnp.any((new.lag >= new.lag_tokens.shape[1]) & ~new.done),
                           lambda s: _catch_up_state(target_params, target_cfg, draft_params,
                                                     draft_cfg, s, lc, keep=1),
                           new)
    return new, zeros, zeros


def _chain_step(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
                rp: RowParams, lc: SpecConfig, drafts: "Drafts | None" = None):
    """One chain step: draft (per method, unless ``drafts`` holds this step's k drafts already),
    verify k+1 tokens, accept, catch up the drafter.

    Returns (state, a [B] accepted drafts, drafted [B] drafts proposed per row).
    """
    b = state.lengths.shape[0]
    n = state.lengths
    k = lc.k_eff
    active = ~state.done
    acc_keys = _step_keys(state.row_keys, state.step, 2)
    dr = drafts if drafts is not None else _DRAFTERS[lc.method](
        target_params, target_cfg, draft_params, draft_cfg, state, rp, lc)
    d, draft_kv = dr.tokens, dr.draft_kv
    verify_tokens = jnp.concatenate([state.last_token[:, None], d], axis=1)  # [B, K+1]
    positions = (n - 1)[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    logits, hidden, target_kv, aux = target_forward(
        target_params, target_cfg, verify_tokens, positions, state.target_kv, state.page_table,
        n - 1, attn_impl=lc.attn_impl, aux_layers=aux_layers_for(lc, draft_cfg))
    a, y = _accept(acc_keys, d, logits, dr.probs, rp)  # logits [B, K+1, V]
    if lc.method == "ngram":  # rows without a match take an ordinary sample from p_0 (lossless)
        y0 = _sample(_step_keys(state.row_keys, state.step, 3), logits[:, 0], rp)
        a = jnp.where(dr.proposing, a, 0)
        y = jnp.where(dr.proposing, y, y0)
    idx = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    emitted = jnp.where(idx == a[:, None], y[:, None], jnp.pad(d, ((0, 0), (0, 1))))  # [B, K+1]
    updates = {"target_kv": target_kv}
    if lc.uses_head:
        # Shifted verify tokens with y inserted at a, re-run over all k+1 positions with the
        # target's features (static shapes; positions past a are stale and overwritten later).
        feats = heads.head_features(draft_params, draft_cfg, target_params, target_cfg, hidden, aux)
        hh, draft_kv = heads.head_forward(draft_params, draft_cfg, target_params,
                                          emitted, feats, positions, draft_kv, state.page_table,
                                          n - 1, a + 1, attn_impl=lc.attn_impl)
        h_a = jnp.take_along_axis(hh, a[:, None, None], axis=1)[:, 0]  # [B, E]
        new_logits = heads.head_logits(draft_params, draft_cfg, target_params, target_cfg, h_a)
        updates["head_hidden"] = jnp.where(active[:, None], h_a, state.head_hidden)
    elif lc.method == "draft":
        if dr.from_ngram is None:
            # Catch-up over [x_{n+a-1}, y]: writes y (and d_k if all were accepted); the rollout
            # already wrote d_1..d_{k-1}.
            prev = jnp.take_along_axis(verify_tokens, a[:, None], axis=1)[:, 0]
            cu_tokens = jnp.stack([prev, y], axis=1)
            cu_start, cu_num, pick = n + a - 1, jnp.full((b,), 2, jnp.int32), jnp.ones_like(a)
        else:
            # Hybrid: n-gram rows' accepted drafts were never written by the draft, so re-run it
            # over every emitted token x_n..x_{n+a} (a + 1 valid of k + 1; the rest stale).
            cu_tokens, cu_start, cu_num, pick = emitted, n, a + 1, a
        cu_pos = cu_start[:, None] + jnp.arange(cu_tokens.shape[1], dtype=jnp.int32)[None, :]
        _, dh, draft_kv = forward(draft_params, draft_cfg, cu_tokens, cu_pos, draft_kv,
                                  state.page_table, cu_start, cu_num, attn_impl=lc.attn_impl,
                                  return_logits=False)
        dh_last = jnp.take_along_axis(dh, pick[:, None, None], axis=1)[:, 0]  # [B, E]
        new_logits = lm_head(draft_params, draft_cfg, dh_last)
    if lc.method != "ngram":
        updates.update(draft_kv=draft_kv,
                       draft_logits=jnp.where(active[:, None], new_logits, state.draft_logits))
        if state.lag is not None:  # drafting caught the drafter up (_draft_model): level again
            updates["lag"] = jnp.where(active, 0, state.lag)
    drafted = jnp.where(dr.proposing, k, 0).astype(jnp.int32)
    return _commit(state, rp, a, y, emitted, drafted=drafted, **updates), a, drafted


def _fixed_step(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
                rp: RowParams, lc: SpecConfig):
    """A step with the static draft length lc.k_eff (0 = plain); n-gram drafting falls back to
    a plain step when no active row has a match. Returns (state, a [B], drafted [B])."""
    args = (target_params, target_cfg, draft_params, draft_cfg, state, rp, lc)
    if lc.k_eff == 0:
        return _plain_step(*args)
    if lc.method == "ngram":
        _, match_len = ngram.search(state.history, state.lengths, lc.ngram_min, lc.ngram_max)
        any_match = jnp.any((match_len > 0) & ~state.done)
        head = (target_params, target_cfg, draft_params, draft_cfg)
        return _switch_steps(any_match.astype(jnp.int32),
                             [lambda s: _plain_step(*head, s, rp, lc),
                              lambda s: _chain_step(*head, s, rp, lc)], state)
    return _chain_step(*args)


def _switch_steps(index, steps, state: DecodeState):
    """Runs ``steps[index](state)`` -> (state, a [B], drafted [B]) without copying the KV pools
    (specjax.control: a lax.switch here would copy every pool on every step)."""
    zeros = jnp.zeros(state.lengths.shape, jnp.int32)
    return control.switch(index, [lambda op, f=f: f(op[0]) for f in steps], (state, zeros, zeros))


def _adaptive_step(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
                   rp: RowParams, lc: SpecConfig):
    """Chooses k in {0..K} on device (specjax.adaptive) and runs that compiled variant.

    Returns (state, a [B], drafted [B])."""
    kmax = lc.k_eff
    lagging = False if state.lag is None else jnp.any((state.lag > 0) & ~state.done)
    k = adaptive.choose_k(state.acc_hits, state.acc_obs, state.cost, state.plain_run, lagging)
    # Branch k: the static k-variant (branch 0: a plain step that keeps the drafter current).
    branches = [functools.partial(_fixed_step, target_params, target_cfg, draft_params, draft_cfg,
                                  rp=rp, lc=dataclasses.replace(lc, num_draft_tokens=max(kv, 1), adaptive=False))
                for kv in range(kmax + 1)]
    branches[0] = functools.partial(_plain_step, target_params, target_cfg, draft_params,
                                    draft_cfg, rp=rp, lc=dataclasses.replace(lc, adaptive=False))
    new, a, drafted = _switch_steps(k, branches, state)
    k_used = jnp.max(jnp.where(~state.done, drafted, 0))  # 0 when n-gram fell back to plain
    hits, obs, plain_run = adaptive.update(state.acc_hits, state.acc_obs, state.plain_run, a,
                                           k_used, ~state.done & (drafted > 0))
    return (dataclasses.replace(new, acc_hits=hits, acc_obs=obs, plain_run=plain_run,
                                k_hist=state.k_hist.at[k].add(1)),
            a, drafted)


def _confident_rollout(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
                       rp: RowParams, lc: SpecConfig):
    """Drafts up to K tokens, stopping as soon as one more cannot pay (adaptive.extend).

    d_1 comes from the carried logits; each further draft costs one drafter forward, taken only
    while ``adaptive.extend`` says so (a while_loop: no forward is spent past the stop). Rows
    with a hybrid n-gram match keep their whole proposal (no forward needed for it). Drafts are
    picked exactly as ``_draft_rollout`` picks them (argmax, or a sample from q with the same
    keys), so the verified tokens do not depend on where drafting stopped.

    Returns (Drafts with [B, K] tokens (entries past ``drafted`` unused), bins [B, K] int32
    calibration-table columns, alpha [B, K] acceptance estimates, drafted [] int32 in [1, K]).
    """
    b, kmax = state.lengths.shape[0], lc.k_eff
    n = state.lengths
    active = ~state.done
    keys = _step_keys(state.row_keys, state.step, 1)
    vocab = state.draft_logits.shape[-1]

    def pick(logits, i):  # -> d [B], q [B, V] or None, confidence [B] (of q, not of d)
        if not lc.draft_sampling:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None, adaptive.max_prob(logits)
        q = _process(logits, rp)
        ki = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)
        # max_v q(v), not q(d): choosing k by the sampled token's own probability would bias
        # which drafts get verified, and the acceptance rule would no longer be exact.
        return sampling.sample(ki, q), q, jnp.max(q, axis=-1)

    from_ngram = jnp.zeros((b,), bool)
    ng = jnp.zeros((b, kmax), jnp.int32)
    if lc.hybrid_min > 0:
        ng, match_len = ngram.propose(state.history, n, kmax, lc.ngram_min, lc.ngram_max)
        from_ngram = match_len >= max(lc.hybrid_min, lc.ngram_min)
    head_rows = active & ~from_ngram

    d1, q1, c1 = pick(state.draft_logits, 0)
    tokens = jnp.zeros((b, kmax), jnp.int32).at[:, 0].set(d1)
    conf = jnp.zeros((b, kmax), jnp.float32).at[:, 0].set(c1)
    probs = None if q1 is None else jnp.zeros((b, kmax, vocab), q1.dtype).at[:, 0].set(q1)
    feat0 = state.head_hidden if lc.uses_head else jnp.zeros((b, 1), jnp.float32)

    def alpha_of(conf):
        return adaptive.calibrated(state.acc_hits, state.acc_obs,
                                   adaptive.confidence_bins(conf, from_ngram))

    def go_on(carry):
        i, _, _, _, _, conf, _ = carry
        return jnp.any(head_rows) & adaptive.extend(state.acc_hits, state.acc_obs, alpha_of(conf),
                                                   i, active, from_ngram, state.cost)

    def body(carry):  # draft d_{i+1} from d_i (i drafted so far)
        i, kv, logits, feat, tokens, conf, probs = carry
        d = tokens[:, i - 1]
        if lc.uses_head:  # head position n-2+i fed its own previous output
            pos = n - 2 + i
            hh, kv = heads.head_forward(draft_params, draft_cfg, target_params, d[:, None],
                                        feat[:, None], pos[:, None], kv, state.page_table, pos,
                                        attn_impl=lc.attn_impl)
            feat = hh[:, 0]
            logits = heads.head_logits(draft_params, draft_cfg, target_params, target_cfg, feat)
        else:
            pos = n + i - 1
            logits, _, kv = forward(draft_params, draft_cfg, d[:, None], pos[:, None], kv,
                                    state.page_table, pos, attn_impl=lc.attn_impl)
            logits = logits[:, 0]
        d, q, c = pick(logits, i)
        tokens = tokens.at[:, i].set(d)
        conf = conf.at[:, i].set(c)
        if probs is not None:
            probs = probs.at[:, i].set(q)
        return i + 1, kv, logits, feat, tokens, conf, probs

    i, kv, _, _, tokens, conf, probs = lax.while_loop(
        go_on, body, (jnp.ones((), jnp.int32), state.draft_kv, state.draft_logits, feat0, tokens,
                      conf, probs))
    drafted = jnp.where(jnp.any(head_rows), i, kmax)  # n-gram rows alone: the whole proposal
    tokens = jnp.where(from_ngram[:, None], ng, tokens)
    if probs is not None:  # point masses for the n-gram rows
        probs = jnp.where(from_ngram[:, None, None], jax.nn.one_hot(tokens, vocab, dtype=probs.dtype),
                          probs)
    bins = adaptive.confidence_bins(conf, from_ngram)
    alpha = adaptive.calibrated(state.acc_hits, state.acc_obs, bins)
    dr = Drafts(tokens=tokens, probs=probs, draft_kv=kv, proposing=jnp.ones((b,), bool),
                from_ngram=from_ngram if lc.hybrid_min > 0 else None)
    return dr, bins, alpha, drafted


def _confident_step(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
                    rp: RowParams, lc: SpecConfig):
    """Adaptive k by the drafts' own confidence (adaptive_by="confidence"; specjax.adaptive):
    catch a lagging drafter up (its logits must be fresh), draft until one more draft cannot
    pay, pick k in {0..drafted} from the calibrated estimates, and run that compiled variant
    on the drafts already made (k = 0: a plain step).

    Returns (state, a [B], drafted [B])."""
    kmax = lc.k_eff
    active = ~state.done
    state = control.cond(jnp.any((state.lag > 0) & active),
                         lambda s: _catch_up_state(target_params, target_cfg, draft_params,
                                                   draft_cfg, s, lc, keep=0),
                         state)
    dr, bins, alpha, n_drafted = _confident_rollout(target_params, target_cfg, draft_params,
                                                    draft_cfg, state, rp, lc)
    k = adaptive.choose_confident(alpha, active, n_drafted, state.cost, state.plain_run)
    fixed = dataclasses.replace(lc, adaptive=False, adaptive_by="history")

    def variant(kv):
        def run(s):
            probs = None if dr.probs is None else dr.probs[:, :kv]
            d = dataclasses.replace(dr, tokens=dr.tokens[:, :kv], probs=probs)
            return _chain_step(target_params, target_cfg, draft_params, draft_cfg, s, rp,
                               dataclasses.replace(fixed, num_draft_tokens=kv), drafts=d)
        return run

    branches = [lambda s: _plain_step(target_params, target_cfg, draft_params, draft_cfg, s, rp,
                                      fixed)]
    branches += [variant(kv) for kv in range(1, kmax + 1)]
    # The rollout's cache writes sit at or past the committed length: stale, overwritten later.
    new, a, drafted = _switch_steps(k, branches, dataclasses.replace(state, draft_kv=dr.draft_kv))
    k_used = jnp.max(jnp.where(active, drafted, 0))
    hits, obs, plain_run = adaptive.update_table(state.acc_hits, state.acc_obs, state.plain_run,
                                                 bins, a, k_used, active & (drafted > 0))
    return (dataclasses.replace(new, acc_hits=hits, acc_obs=obs, plain_run=plain_run,
                                k_hist=state.k_hist.at[k].add(1)),
            a, drafted)


def spec_step_counted(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
                      rp: RowParams, lc: SpecConfig):
    """One fused speculative (or plain) decoding step for the whole batch.

    Returns (state, drafted [B] int32 drafts each row proposed: 0 for rows without an n-gram
    match, for adaptive k = 0 steps and for finished rows; the tree's depth bound for trees).
    """
    args = (target_params, target_cfg, draft_params, draft_cfg, state, rp, lc)
    if lc.method == "eagle-tree":
        return _tree_step(*args), jnp.where(state.done, 0, lc.k_eff).astype(jnp.int32)
    step = _fixed_step
    if lc.adaptive:
        step = _confident_step if lc.adaptive_by == "confidence" else _adaptive_step
    new, _, drafted = step(*args)
    return new, jnp.where(state.done, 0, drafted).astype(jnp.int32)


def spec_step(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
              rp: RowParams, lc: SpecConfig) -> DecodeState:
    """One fused speculative (or plain) decoding step for the whole batch."""
    return spec_step_counted(target_params, target_cfg, draft_params, draft_cfg, state, rp, lc)[0]


def _tree_step(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
               rp: RowParams, lc: SpecConfig) -> DecodeState:
    """One tree-drafting step (method "eagle-tree"); see the module docstring."""
    tc = lc.tree
    n = state.lengths
    active = ~state.done
    d_max = tc.max_depth
    page_table = state.page_table
    draft_kv = [state.draft_kv]  # threaded through the level-by-level head runs

    def head_run(tokens, feats, positions, mask, num_new):
        hh, draft_kv[0] = heads.head_forward(draft_params, draft_cfg, target_params,
                                             tokens, feats, positions, draft_kv[0], page_table,
                                             n - 1, num_new, mask, attn_impl=lc.attn_impl)
        return hh

    def head_logits(h):
        return heads.head_logits(draft_params, draft_cfg, target_params, target_cfg, h)

    tokens, parents, depth = tree.draft_tree(tc, state.draft_logits, state.head_hidden, n,
                                             head_run, head_logits)  # [B,N], [B,N+1], [B,N+1]
    verify_tokens = jnp.concatenate([state.last_token[:, None], tokens], axis=1)  # [B, N+1]
    positions = (n - 1)[:, None] + depth
    logits, hidden, target_kv, aux = target_forward(
        target_params, target_cfg, verify_tokens, positions, state.target_kv, page_table, n - 1,
        new_mask=tree.ancestor_mask(parents), attn_impl=lc.attn_impl,
        aux_layers=aux_layers_for(lc, draft_cfg))
    acc_keys = _step_keys(state.row_keys, state.step, 2)
    a, y, path = _accept_tree(acc_keys, tokens, parents, depth, logits, rp, d_max)  # path [B, D+1]
    path_tokens = jnp.take_along_axis(verify_tokens, path[:, 1:], axis=1)  # [B, D]
    idx = jnp.arange(d_max + 1, dtype=jnp.int32)[None, :]
    emitted = jnp.where(idx == a[:, None], y[:, None], jnp.pad(path_tokens, ((0, 0), (0, 1))))
    # The accepted path's K/V into cache order (root already sits at n - 1).
    target_kv = tree.copy_slots(target_kv, page_table, n - 1, path, jnp.where(active, a + 1, 0))
    # Head re-run over the accepted path with the target's features (as the chain's shift).
    def on_path(x):  # [B, N+1, .] -> [B, D+1, .] the accepted path's rows
        return None if x is None else jnp.take_along_axis(x, path[:, :, None], axis=1)

    feats = heads.head_features(draft_params, draft_cfg, target_params, target_cfg,
                                on_path(hidden), on_path(aux))
    hh, new_draft_kv = heads.head_forward(draft_params, draft_cfg, target_params,
                                          emitted, feats, (n - 1)[:, None] + idx, draft_kv[0],
                                          page_table, n - 1, a + 1, attn_impl=lc.attn_impl)
    h_a = jnp.take_along_axis(hh, a[:, None, None], axis=1)[:, 0]  # [B, E]
    new_logits = head_logits(h_a)
    out, num_out, done = _emit(state, emitted, a + 1, rp)
    kept = jnp.minimum(a, num_out - state.num_out)  # emitted drafts only (see _commit)
    accepted = jnp.sum(jnp.arange(d_max)[None, :] < kept[:, None], axis=0)
    return dataclasses.replace(
        state, target_kv=target_kv, draft_kv=new_draft_kv,
        lengths=jnp.where(active, n + a + 1, n),
        last_token=jnp.where(active, y, state.last_token),
        draft_logits=jnp.where(active[:, None], new_logits, state.draft_logits),
        head_hidden=jnp.where(active[:, None], h_a, state.head_hidden),
        out_tokens=out, num_out=num_out, done=done, step=state.step + 1,
        accepted_per_pos=state.accepted_per_pos + accepted.astype(jnp.int32),
        row_steps=state.row_steps + jnp.sum(active, dtype=jnp.int32))


def decode_loop(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
                rp: RowParams, lc: SpecConfig) -> DecodeState:
    """Runs spec_step under lax.while_loop until every row is done: no host sync inside."""
    max_steps = state.out_tokens.shape[1] + 1

    def cond(s):
        return jnp.any(~s.done) & (s.step <= max_steps)

    def body(s):
        return spec_step(target_params, target_cfg, draft_params, draft_cfg, s, rp, lc)

    return lax.while_loop(cond, body, state)


def _generate_device(target_params, draft_params, tokens, prompt_lens, rp, seed, cost=None, *,
                     target_cfg, draft_cfg, lc, num_pages_per_seq, out_len):
    state = prefill(target_params, target_cfg, draft_params, draft_cfg, tokens, prompt_lens, rp, seed,
                    lc, num_pages_per_seq, out_len, kv_dtype=target_params["embed"].dtype, cost=cost)
    state = decode_loop(target_params, target_cfg, draft_params, draft_cfg, state, rp, lc)
    extra = {"drafted": state.drafted}
    if state.k_hist is not None:
        extra["k_hist"] = state.k_hist
    if lc.adaptive and lc.adaptive_by == "confidence":  # the calibration table at the end
        extra["table"] = (state.acc_hits, state.acc_obs)
    return (state.out_tokens, state.num_out, state.accepted_per_pos, state.row_steps, state.step,
            extra)


generate_device = jax.jit(
    _generate_device,
    static_argnames=("target_cfg", "draft_cfg", "lc", "num_pages_per_seq", "out_len"))
