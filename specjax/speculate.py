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

Methods "mtp" and "eagle" draft with a head fed by target features (specjax.heads). Head
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
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from specjax import acceptance, heads, kv_cache, registry, sampling, tree
from specjax.config import SpecConfig
from specjax.model import lm_head
from specjax.sampling import step_keys as _step_keys

# The model family's forward and paged cache, chosen by the static config type (specjax.registry).
forward = registry.forward
init_cache = registry.init_cache


# The methods this decode loop implements (config.METHODS lists every name SpecConfig accepts).
METHODS = ("none", "draft", "mtp", "eagle", "eagle-tree")


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
    accepted_per_pos: jax.Array  # [K] int32 active row-steps whose draft i was accepted
    row_steps: jax.Array  # [] int32 active row-steps (target verify passes per row)


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
                 num_new, after, draft_kv, page_table, lc: SpecConfig):
    """Advances the draft LLM or head over a span the target has just processed (a prompt, a
    prefill chunk, or one decode token), restoring the invariant in the module docstring.

    Args:
      tokens: [B, T] int32 the span, row b's valid part ``tokens[b, :num_new[b]]`` at positions
        ``start[b]..``; hidden: [B, T, E] the target's final hidden states over it.
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
        feats = heads.head_features(target_params, target_cfg, hidden, draft_cfg)
        hh, draft_kv = heads.head_forward(draft_params, draft_cfg, target_params, target_cfg, shifted,
                                          feats, positions, draft_kv, page_table, start, num_new,
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
            seed, lc: SpecConfig, num_pages_per_seq: int, out_len: int, kv_dtype=jnp.float32):
    """Fills both caches over the prompts and samples the first token.

    Args:
      tokens: [B, Tp] int32 right-padded prompts; prompt_lens: [B] int32 (>= 1).
      seed: [] int32; row b's stream is fold_in(key(seed), b).
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
    _, hidden, target_kv = forward(target_params, target_cfg, tokens, positions, target_kv,
                                   page_table, zeros, prompt_lens, attn_impl=lc.attn_impl,
                                   return_logits=False)
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
        first, draft_kv, page_table, lc)

    state = DecodeState(
        target_kv=target_kv, draft_kv=draft_kv, page_table=page_table, lengths=prompt_lens + 1,
        last_token=first, draft_logits=draft_logits, head_hidden=head_hidden,
        out_tokens=jnp.zeros((b, out_len), jnp.int32), num_out=zeros, done=jnp.zeros((b,), bool),
        step=jnp.ones((), jnp.int32), row_keys=row_keys,
        accepted_per_pos=jnp.zeros((max(lc.k_eff, 1),), jnp.int32), row_steps=jnp.zeros((), jnp.int32))
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
            hh, kv = heads.head_forward(draft_params, draft_cfg, target_params, target_cfg,
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


def spec_step(target_params, target_cfg, draft_params, draft_cfg, state: DecodeState,
              rp: RowParams, lc: SpecConfig) -> DecodeState:
    """One fused speculative (or plain) decoding step for the whole batch."""
    b = state.lengths.shape[0]
    n = state.lengths
    k = lc.k_eff
    active = ~state.done
    acc_keys = _step_keys(state.row_keys, state.step, 2)

    if lc.method == "eagle-tree":
        return _tree_step(target_params, target_cfg, draft_params, draft_cfg, state, rp, lc)
    if k == 0:  # plain decoding through the same machinery
        logits, _, target_kv = forward(target_params, target_cfg, state.last_token[:, None],
                                       (n - 1)[:, None], state.target_kv, state.page_table, n - 1,
                                       attn_impl=lc.attn_impl)
        y = _sample(acc_keys, logits[:, 0], rp)
        a = jnp.zeros((b,), jnp.int32)
        emitted = y[:, None]
        draft_kv, draft_logits, head_hidden = state.draft_kv, state.draft_logits, state.head_hidden
    else:
        draft_kv, d, q = _draft_rollout(target_params, target_cfg, draft_params, draft_cfg, state,
                                        rp, lc)
        verify_tokens = jnp.concatenate([state.last_token[:, None], d], axis=1)  # [B, K+1]
        positions = (n - 1)[:, None] + jnp.arange(k + 1, dtype=jnp.int32)[None, :]
        logits, hidden, target_kv = forward(target_params, target_cfg, verify_tokens, positions,
                                            state.target_kv, state.page_table, n - 1,
                                            attn_impl=lc.attn_impl)
        a, y = _accept(acc_keys, d, logits, q, rp)  # logits [B, K+1, V]
        idx = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
        emitted = jnp.where(idx == a[:, None], y[:, None], jnp.pad(d, ((0, 0), (0, 1))))  # [B, K+1]
        head_hidden = state.head_hidden
        if lc.uses_head:
            # Shifted verify tokens with y inserted at a, re-run over all k+1 positions with the
            # target's features (static shapes; positions past a are stale and overwritten later).
            feats = heads.head_features(target_params, target_cfg, hidden, draft_cfg)
            hh, draft_kv = heads.head_forward(draft_params, draft_cfg, target_params, target_cfg,
                                              emitted, feats, positions, draft_kv, state.page_table,
                                              n - 1, a + 1, attn_impl=lc.attn_impl)
            h_a = jnp.take_along_axis(hh, a[:, None, None], axis=1)[:, 0]  # [B, E]
            new_logits = heads.head_logits(draft_params, draft_cfg, target_params, target_cfg, h_a)
            head_hidden = jnp.where(active[:, None], h_a, state.head_hidden)
        else:
            # Draft catch-up over [x_{n+a-1}, y]: writes y (and d_k if all were accepted).
            prev = jnp.take_along_axis(verify_tokens, a[:, None], axis=1)[:, 0]
            cu_tokens = jnp.stack([prev, y], axis=1)
            cu_pos = (n + a - 1)[:, None] + jnp.arange(2, dtype=jnp.int32)[None, :]
            cu_logits, _, draft_kv = forward(draft_params, draft_cfg, cu_tokens, cu_pos, draft_kv,
                                             state.page_table, n + a - 1, attn_impl=lc.attn_impl)
            new_logits = cu_logits[:, 1]
        draft_logits = jnp.where(active[:, None], new_logits, state.draft_logits)

    out, num_out, done = _emit(state, emitted, a + 1, rp)
    accepted = jnp.sum((jnp.arange(max(k, 1))[None, :] < a[:, None]) & active[:, None], axis=0)
    return dataclasses.replace(
        state, target_kv=target_kv, draft_kv=draft_kv,
        lengths=jnp.where(active, n + a + 1, n),
        last_token=jnp.where(active, y, state.last_token),
        draft_logits=draft_logits, head_hidden=head_hidden, out_tokens=out, num_out=num_out, done=done,
        step=state.step + 1,
        accepted_per_pos=state.accepted_per_pos + accepted.astype(jnp.int32),
        row_steps=state.row_steps + jnp.sum(active, dtype=jnp.int32))


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
        hh, draft_kv[0] = heads.head_forward(draft_params, draft_cfg, target_params, target_cfg,
                                             tokens, feats, positions, draft_kv[0], page_table,
                                             n - 1, num_new, mask, attn_impl=lc.attn_impl)
        return hh

    def head_logits(h):
        return heads.head_logits(draft_params, draft_cfg, target_params, target_cfg, h)

    tokens, parents, depth = tree.draft_tree(tc, state.draft_logits, state.head_hidden, n,
                                             head_run, head_logits)  # [B,N], [B,N+1], [B,N+1]
    verify_tokens = jnp.concatenate([state.last_token[:, None], tokens], axis=1)  # [B, N+1]
    positions = (n - 1)[:, None] + depth
    logits, hidden, target_kv = forward(target_params, target_cfg, verify_tokens, positions,
                                        state.target_kv, page_table, n - 1,
                                        new_mask=tree.ancestor_mask(parents), attn_impl=lc.attn_impl)
    acc_keys = _step_keys(state.row_keys, state.step, 2)
    a, y, path = _accept_tree(acc_keys, tokens, parents, depth, logits, rp, d_max)  # path [B, D+1]
    path_tokens = jnp.take_along_axis(verify_tokens, path[:, 1:], axis=1)  # [B, D]
    idx = jnp.arange(d_max + 1, dtype=jnp.int32)[None, :]
    emitted = jnp.where(idx == a[:, None], y[:, None], jnp.pad(path_tokens, ((0, 0), (0, 1))))
    # The accepted path's K/V into cache order (root already sits at n - 1).
    target_kv = tree.copy_slots(target_kv, page_table, n - 1, path, jnp.where(active, a + 1, 0))
    # Head re-run over the accepted path with the target's features (as the chain's shift).
    feats = heads.head_features(target_params, target_cfg,
                                jnp.take_along_axis(hidden, path[:, :, None], axis=1), draft_cfg)
    hh, new_draft_kv = heads.head_forward(draft_params, draft_cfg, target_params, target_cfg,
                                          emitted, feats, (n - 1)[:, None] + idx, draft_kv[0],
                                          page_table, n - 1, a + 1, attn_impl=lc.attn_impl)
    h_a = jnp.take_along_axis(hh, a[:, None, None], axis=1)[:, 0]  # [B, E]
    new_logits = head_logits(h_a)
    out, num_out, done = _emit(state, emitted, a + 1, rp)
    accepted = jnp.sum((jnp.arange(d_max)[None, :] < a[:, None]) & active[:, None], axis=0)
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


def _generate_device(target_params, draft_params, tokens, prompt_lens, rp, seed, *, target_cfg,
                     draft_cfg, lc, num_pages_per_seq, out_len):
    state = prefill(target_params, target_cfg, draft_params, draft_cfg, tokens, prompt_lens, rp, seed,
                    lc, num_pages_per_seq, out_len, kv_dtype=target_params["embed"].dtype)
    state = decode_loop(target_params, target_cfg, draft_params, draft_cfg, state, rp, lc)
    return state.out_tokens, state.num_out, state.accepted_per_pos, state.row_steps, state.step


generate_device = jax.jit(
    _generate_device,
    static_argnames=("target_cfg", "draft_cfg", "lc", "num_pages_per_seq", "out_len"))
