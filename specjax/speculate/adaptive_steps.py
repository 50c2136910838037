"""Adaptive k on device (SpecConfig.adaptive; the policy is specjax.adaptive).

``history_step`` picks the step's k in {0..K} from the acceptance observed over recent steps
and runs that compiled variant (specjax.control.switch keeps the KV pools in place where
lax.switch would copy every pool each step); k = 0 is a plain step that leaves the drafter
behind (lazy upkeep, specjax.speculate.steps).

``confidence_step`` (adaptive_by="confidence") follows each step's own drafts: the drafter is
caught up first (its carried logits must be fresh), drafts are made one at a time while one
more can pay (a while_loop; specjax.adaptive.extend), and k in {0..drafted} is picked from the
drafts' calibrated confidence; the chosen variant verifies the drafts already made. It needs an
autoregressive drafter (``Drafter.autoregressive``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from specjax import adaptive, sampling
from specjax.speculate import steps
from specjax.speculate.state import DecodeState, Drafts, Models, Plan, RowParams, process, step_keys


def history_step(models: Models, state: DecodeState, rp: RowParams, plan: Plan):
    """Chooses k in {0..K} from recent acceptance and runs that variant -> (state, a, verified)."""
    kmax = plan.lc.k_eff
    lagging = False if state.lag is None else jnp.any((state.lag > 0) & ~state.done)
    k = adaptive.choose_k(state.acc_hits, state.acc_obs, state.cost, state.plain_run, lagging)
    # Branch k: the static k-variant (branch 0: a plain step that keeps the drafter current).
    fixed = plan.with_spec(adaptive=False)
    branches = [lambda s: steps.plain_step(models, s, rp, fixed)]
    branches += [lambda s, kv=kv: steps.fixed_step(models, s, rp, fixed.with_spec(num_draft_tokens=kv))
                 for kv in range(1, kmax + 1)]
    new, a, verified = steps.switch_steps(k, branches, state)
    k_used = jnp.max(jnp.where(~state.done, verified, 0))  # 0 when n-gram fell back to plain
    hits, obs, plain_run = adaptive.update(state.acc_hits, state.acc_obs, state.plain_run, a,
                                           k_used, ~state.done & (verified > 0))
    return (dataclasses.replace(new, acc_hits=hits, acc_obs=obs, plain_run=plain_run,
                                k_hist=state.k_hist.at[k].add(1)),
            a, verified)


def _confident_rollout(models: Models, state: DecodeState, rp: RowParams, plan: Plan):
    """Drafts up to K tokens, stopping as soon as one more cannot pay (adaptive.extend).

    d_1 comes from the carried logits; each further draft costs one drafter forward
    (``Drafter.advance``), taken only while ``adaptive.extend`` says so. Hybrid n-gram rows keep
    their whole proposal. Drafts are picked exactly as ``Autoregressive.propose`` picks them
    (argmax, or a sample from q with the same keys), so the verified tokens do not depend on
    where drafting stopped.

    Returns (Drafts with [B, K] tokens (entries past ``drafted`` unused), bins [B, K] int32
    calibration-table columns, drafted [] int32 in [1, K]).
    """
    drafter, lc = plan.drafter, plan.lc
    b, kmax = state.lengths.shape[0], lc.k_eff
    active = ~state.done
    keys = step_keys(state.row_keys, state.step, 1)
    first = drafter.first_logits(state.carry)
    vocab = first.shape[-1]

    def pick(logits, i):  # -> d [B], q [B, V] or None, confidence [B] (of q, not of d)
        if not lc.draft_sampling:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None, adaptive.max_prob(logits)
        q = process(logits, rp)
        ki = jax.vmap(lambda k: jax.random.fold_in(k, i))(keys)
        # max_v q(v), not q(d): choosing k by the sampled token's own probability would bias
        # which drafts get verified, and the acceptance rule would no longer be exact.
        return sampling.sample(ki, q), q, jnp.max(q, axis=-1)

    hybrid = drafter.ngram_rows(state, kmax)
    ng, from_ngram = hybrid if hybrid is not None else (jnp.zeros((b, kmax), jnp.int32),
                                                         jnp.zeros((b,), bool))
    model_rows = active & ~from_ngram

    d1, q1, c1 = pick(first, 0)
    tokens = jnp.zeros((b, kmax), jnp.int32).at[:, 0].set(d1)
    conf = jnp.zeros((b, kmax), jnp.float32).at[:, 0].set(c1)
    probs = None if q1 is None else jnp.zeros((b, kmax, vocab), q1.dtype).at[:, 0].set(q1)

    def alpha_of(conf):
        return adaptive.calibrated(state.acc_hits, state.acc_obs,
                                   adaptive.confidence_bins(conf, from_ngram))

    def go_on(carry):
        i, conf = carry[0], carry[4]
        return jnp.any(model_rows) & adaptive.extend(state.acc_hits, state.acc_obs,
                                                    alpha_of(conf), i, active, from_ngram,
                                                    state.cost)

    def body(carry):  # draft d_{i+1} from d_i (i drafted so far)
        i, kv, sc, tokens, conf, probs = carry
        kv, sc, logits = drafter.advance(models, state, kv, sc, tokens[:, i - 1], i - 1)
        d, q, c = pick(logits, i)
        tokens = tokens.at[:, i].set(d)
        conf = conf.at[:, i].set(c)
        if probs is not None:
            probs = probs.at[:, i].set(q)
        return i + 1, kv, sc, tokens, conf, probs

    init = (jnp.ones((), jnp.int32), state.draft_kv, drafter.step_carry(state.carry), tokens,
            conf, probs)
    i, kv, _, tokens, conf, probs = lax.while_loop(go_on, body, init)
    drafted = jnp.where(jnp.any(model_rows), i, kmax)  # n-gram rows alone: the whole proposal
    dr = Drafts(tokens=tokens, probs=probs, draft_kv=kv, carry=state.carry,
                proposing=jnp.ones((b,), bool))
    if hybrid is not None:
        dr = drafter.merge(dr, ng, from_ngram)
    return dr, adaptive.confidence_bins(conf, from_ngram), drafted


def confidence_step(models: Models, state: DecodeState, rp: RowParams, plan: Plan):
    """Adaptive k by the drafts' own confidence (module docstring) -> (state, a, verified)."""
    kmax = plan.lc.k_eff
    active = ~state.done
    state = steps.caught_up(models, plan, state)
    dr, bins, n_drafted = _confident_rollout(models, state, rp, plan)
    alpha = adaptive.calibrated(state.acc_hits, state.acc_obs, bins)
    k = adaptive.choose_confident(alpha, active, n_drafted, state.cost, state.plain_run)
    fixed = plan.with_spec(adaptive=False, adaptive_by="history")

    def variant(kv):
        def run(s):
            probs = None if dr.probs is None else dr.probs[:, :kv]
            d = dataclasses.replace(dr, tokens=dr.tokens[:, :kv], probs=probs)
            return steps.chain_step(models, s, rp, fixed.with_spec(num_draft_tokens=kv), drafts=d)
        return run

    branches = [lambda s: steps.plain_step(models, s, rp, fixed)]
    branches += [variant(kv) for kv in range(1, kmax + 1)]
    # The rollout's cache writes sit at or past the committed length: stale, overwritten later.
    new, a, verified = steps.switch_steps(k, branches, dataclasses.replace(state, draft_kv=dr.draft_kv))
    k_used = jnp.max(jnp.where(active, verified, 0))
    hits, obs, plain_run = adaptive.update_table(state.acc_hits, state.acc_obs, state.plain_run,
                                                 bins, a, k_used, active & (verified > 0))
    return (dataclasses.replace(new, acc_hits=hits, acc_obs=obs, plain_run=plain_run,
                                k_hist=state.k_hist.at[k].add(1)),
            a, verified)
