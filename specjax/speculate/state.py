"""What decoding carries between steps, and the pieces every step shares.

``DecodeState`` is the whole carried state of a generation (a pytree; the KV pools are donated).
Per row b, with n = lengths[b] committed tokens x_0..x_{n-1}:
  * the target cache holds valid K/V for x_0..x_{n-2}; x_{n-1} = last_token[b] is pending;
  * the drafter's pool (``draft_kv``) and per-row carry (``carry``) are the drafter's own
    (specjax.speculate.drafters): the loop never looks inside them;
  * cache slots at or beyond those counts are stale and never read.

The pytrees are ``flax.struct`` dataclasses (frozen, registered with JAX, every field a
pytree node), as gemma's sampler state is. ``Models`` (params) and ``Plan`` (static) are what every step function takes:
``step(models, state, rp, plan)``. ``RowParams`` are the per-row sampling settings (traced, so
one compile serves every request mix). ``commit`` appends a step's tokens and advances the
invariants; ``emit`` truncates at EOS / max_new.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from flax import struct
import jax.numpy as jnp
from jax import lax

from specjax import acceptance, kv_cache, ngram, registry, sampling, tree
from specjax.config import SpecConfig
from specjax.sampling import step_keys  # noqa: F401 - re-exported to the steps

LAG_WINDOW = 16  # W: plain steps a drafter may fall behind before it is caught up


@struct.dataclass
class Models:
    """The params of one decoding setup (traced)."""

    target: Any  # the target's params pytree
    draft: Any = None  # the drafter's params pytree (None for n-gram drafting)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The static description of one decoding setup (a jit static argument)."""

    target_cfg: Any  # the target's config (a registry family config)
    drafter: Any  # a specjax.speculate.drafters.Drafter (NoDrafter for plain decoding)
    lc: SpecConfig

    def with_spec(self, **changes) -> "Plan":
        """The same plan with SpecConfig fields replaced (k-variants of adaptive steps)."""
        return dataclasses.replace(self, lc=dataclasses.replace(self.lc, **changes))


@struct.dataclass
class DecodeState:
    """Everything a generation carries between steps (a pytree; the caches are donated)."""

    target_kv: kv_cache.KVCache
    draft_kv: Any  # the drafter's page pool (None for drafters without one)
    page_table: jax.Array  # [B, Pmax] int32, shared by target and drafter
    lengths: jax.Array  # [B] int32 committed tokens n (prompt + generated)
    last_token: jax.Array  # [B] int32 x_{n-1}, not yet in the target cache
    carry: dict  # the drafter's per-row carry: every leaf [B, ...] (e.g. logits [B, V])
    out_tokens: jax.Array  # [B, Nbuf] int32 generated tokens
    num_out: jax.Array  # [B] int32 valid entries of out_tokens
    done: jax.Array  # [B] bool
    step: jax.Array  # [] int32 speculative steps taken
    row_keys: jax.Array  # [B] typed PRNG keys, one stream per row
    accepted_per_pos: jax.Array  # [K] int32 row-steps whose draft i was accepted *and emitted*
    row_steps: jax.Array  # [] int32 active row-steps (target verify passes per row)
    drafted: jax.Array  # [] int32 draft tokens verified by active rows (all steps; trees: nodes)
    spec_steps: jax.Array  # [] int32 active row-steps that verified at least one draft
    # n-gram drafting (SpecConfig.uses_history): x_0..x_{n-1} per row, slots >= n stale.
    history: jax.Array | None = None  # [B, L] int32
    # adaptive k (SpecConfig.adaptive; specjax.adaptive):
    acc_hits: jax.Array | None = None  # [K] float32 decayed accepted counts per draft position
    acc_obs: jax.Array | None = None  # [K] float32 decayed reached counts per draft position
    # (adaptive_by="confidence": [K, NB] per position and confidence bin, the calibration table)
    plain_run: jax.Array | None = None  # [] int32 consecutive steps that drafted nothing
    cost: jax.Array | None = None  # [K+1..K+3] float32 k-step costs (+ catch-up, draft step)
    k_hist: jax.Array | None = None  # [K+1] int32 steps that chose each k
    # lazy drafter upkeep over plain steps (adaptive with a model drafter; speculate.steps):
    lag: jax.Array | None = None  # [B] int32 pending drafter positions (carry stale if > 0)
    lag_tokens: jax.Array | None = None  # [B, W] int32 token of pending position p at p % W
    lag_feats: jax.Array | None = None  # [B, W, E] drafter input feature of position p (heads)

    # Row-indexed fields (leading dim B): what the engine gathers / scatters per slot.
    PER_ROW = ("lengths", "last_token", "carry", "history", "lag", "lag_tokens", "lag_feats")

    @property
    def draft_logits(self):
        """[B, V] the drafter's carried logits for position n (None if it carries none)."""
        return self.carry.get("logits")

    @property
    def head_hidden(self):
        """[B, E] a head's carried output at position n-2 (None for other drafters)."""
        return self.carry.get("hidden")


@struct.dataclass
class RowParams:
    """Per-row request parameters (traced, so one compile serves every request mix)."""

    temperature: jax.Array  # [B] float32
    top_k: jax.Array  # [B] int32
    top_p: jax.Array  # [B] float32
    max_new: jax.Array  # [B] int32
    eos_ids: jax.Array  # [NE] int32 stop tokens (-1 = unused slot)


@struct.dataclass
class Drafts:
    """One step's chain proposal (what ``Drafter.propose`` returns)."""

    tokens: jax.Array  # [B, K] int32 d_1..d_K
    probs: jax.Array | None  # [B, K, V] q the drafts were sampled from, None for point masses
    draft_kv: Any  # the drafter's pool after proposing
    carry: dict  # the drafter's per-row carry after proposing (absorb reads it)
    proposing: jax.Array  # [B] bool rows with a real proposal (n-gram: a match)
    from_ngram: jax.Array | None = None  # [B] bool hybrid rows that took the n-gram proposal


@struct.dataclass
class Verified:
    """What a verify pass and acceptance tell the drafter (``Drafter.absorb``)."""

    tokens: jax.Array  # [B, T] int32 the verified tokens [x_{n-1}, d_1..] (trees: the path)
    emitted: jax.Array  # [B, T] int32 x_n..: a accepted drafts, then y at index a
    positions: jax.Array  # [B, T] int32 positions of ``tokens`` (n-1..)
    hidden: jax.Array  # [B, T, E] the target's final hidden states over ``tokens``
    aux: jax.Array | None  # [B, T, A*E] target states at the drafter's aux layers, or None
    a: jax.Array  # [B] int32 accepted drafts
    y: jax.Array  # [B] int32 residual / bonus token


def target_forward(params, cfg, *args, aux_layers: tuple = (), **kw):
    """forward plus the hidden states entering ``aux_layers`` (drafter features):
    (logits, hidden, kv, aux [B, T, A*E] or None when aux_layers is empty)."""
    if not aux_layers:
        return (*registry.forward(params, cfg, *args, **kw), None)
    return registry.forward(params, cfg, *args, aux_layers=aux_layers, **kw)


def process(logits, rp: RowParams):
    """Target / draft probabilities with the rows' temperature, top-k and top-p."""
    return sampling.process_logits(logits, rp.temperature, rp.top_k, rp.top_p)


def sample(keys, logits, rp: RowParams):
    """[B] tokens from [B, V] logits with the rows' settings (sampling.sample_logits)."""
    return sampling.sample_logits(keys, logits, rp.temperature, rp.top_k, rp.top_p)


def pick_draft(logits, i, keys, rp: RowParams, sampled: bool):
    """Draft i from the drafter's logits: argmax (point mass, q None) or a sample from q."""
    if not sampled:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
    q = process(logits, rp)
    ki = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)
    return sampling.sample(ki, q), q


def accept(keys, d, logits, q, rp: RowParams):
    """Chain acceptance; an all-greedy batch takes the argmax comparison directly."""
    def general():
        return acceptance.accept_chain(keys, d, process(logits, rp), q)

    def greedy():
        a, y = acceptance.accept_greedy(d, logits)
        return a.astype(jnp.int32), y.astype(jnp.int32)

    return lax.cond(jnp.all(rp.temperature <= 0.0), greedy, general)


def accept_tree(keys, tokens, parents, depth, logits, rp: RowParams, max_depth: int):
    """Tree acceptance; an all-greedy batch follows the target's argmax directly."""
    def general():
        return tree.accept_tree(keys, tokens, parents, depth, process(logits, rp),
                                max_depth=max_depth)

    def greedy():
        return tree.accept_tree(keys, tokens, parents, depth, None, logits, max_depth=max_depth)

    return lax.cond(jnp.all(rp.temperature <= 0.0), greedy, general)


def emit(state: DecodeState, emitted, count_raw, rp: RowParams):
    """Appends emitted[:, :count_raw] per active row, truncated at EOS and max_new."""
    b, width = emitted.shape
    idx = jnp.arange(width, dtype=jnp.int32)[None, :]
    eos = jnp.any(emitted[..., None] == rp.eos_ids, axis=-1) & (idx < count_raw[:, None])
    first_eos = jnp.where(jnp.any(eos, axis=1), jnp.argmax(eos, axis=1), width)
    count = jnp.minimum(jnp.minimum(count_raw, first_eos + 1), rp.max_new - state.num_out)
    count = jnp.where(state.done, 0, count)
    out = jax.vmap(lambda o, e, s: lax.dynamic_update_slice(o, e, (s,)))(
        state.out_tokens, emitted, state.num_out)
    num_out = state.num_out + count
    done = state.done | (first_eos < count_raw) | (num_out >= rp.max_new)
    return out, num_out, done


def emitted_tokens(d, a, y):
    """[B, K+1]: the accepted drafts d[:, :a] then y at index a (entries past a unused)."""
    idx = jnp.arange(d.shape[1] + 1, dtype=jnp.int32)[None, :]
    return jnp.where(idx == a[:, None], y[:, None], jnp.pad(d, ((0, 0), (0, 1))))


def commit(state: DecodeState, rp: RowParams, a, y, emitted, *, verified, **updates):
    """Appends a step's tokens and advances the per-row invariants.

    a: [B] accepted drafts; y: [B] residual / bonus token; emitted: [B, K+1] (a + 1 valid);
    verified: [B] int32 draft tokens the target verified per row (0 for a plain step; every
    tree node for a tree); updates: new caches / carried drafter state.
    """
    active = ~state.done
    n = state.lengths
    out, num_out, done = emit(state, emitted, a + 1, rp)
    kbuf = state.accepted_per_pos.shape[0]
    # Only drafts that were emitted count (EOS / max_new may cut accepted ones; inactive rows emit 0).
    kept = jnp.minimum(a, num_out - state.num_out)
    accepted = jnp.sum(jnp.arange(kbuf)[None, :] < kept[:, None], axis=0)
    verifying = active & (verified > 0)
    new = dict(
        lengths=jnp.where(active, n + a + 1, n), last_token=jnp.where(active, y, state.last_token),
        out_tokens=out, num_out=num_out, done=done, step=state.step + 1,
        accepted_per_pos=state.accepted_per_pos + accepted.astype(jnp.int32),
        row_steps=state.row_steps + jnp.sum(active, dtype=jnp.int32),
        drafted=state.drafted + jnp.sum(jnp.where(active, verified, 0), dtype=jnp.int32),
        spec_steps=state.spec_steps + jnp.sum(verifying, dtype=jnp.int32))
    if state.history is not None:  # x_n.. = emitted (stale beyond a + 1, never read)
        new["history"] = ngram.write(state.history, emitted, n)
    new.update(updates)
    return dataclasses.replace(state, **new)


def where_rows(active, new: dict, old: dict) -> dict:
    """Per-row carry: ``new`` where ``active`` [B], else ``old`` (leaves [B, ...])."""
    def pick(x, o):
        return jnp.where(active.reshape(active.shape + (1,) * (x.ndim - 1)), x, o)
    return jax.tree_util.tree_map(pick, new, old)
