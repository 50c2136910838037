"""Lossless speculative acceptance for a linear draft chain, batched.

The maths (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling"):

The draft proposes ``d_1..d_K``, ``d_i ~ q_i``. The target scores them in one pass and gives
``p_0..p_K``: ``p_{i-1}`` is its distribution for the token at draft position ``i`` and ``p_K`` the
distribution after all K drafts. Walking ``i = 1..K``:

* accept ``d_i`` with probability ``min(1, p(d_i) / q(d_i))``  (here: ``u * q(d_i) < p(d_i)``,
  ``u ~ U[0, 1)``, so nothing is ever divided);
* at the first rejection emit a token from the residual ``normalize(max(0, p − q))`` and stop;
* if all K are accepted emit a bonus token from ``p_K``.

For the first position, with ``α = Σ_y min(p(y), q(y))`` and ``1 − α = Σ_y max(0, p(y) − q(y))``:

    P(emit x) = q(x)·min(1, p(x)/q(x)) + (1 − α)·max(0, p(x) − q(x)) / (1 − α)
              = min(p(x), q(x)) + max(0, p(x) − q(x)) = p(x),

and, by induction along the chain, every emitted token is distributed exactly as the target
would have sampled it: speculation is lossless. (A zero-mass residual means p == q, where
rejection has probability 0; we then fall back to ``p``.)

Point-mass drafts (``draft_probs=None``, e.g. the draft's argmax, the production default) are the
case ``q = one_hot(d)``: accept with probability ``p(d)``, residual = ``p`` with ``d`` zeroed,
renormalized. This holds for *any* draft token chosen independently of the acceptance randomness.

Greedy rows (one-hot ``p`` and one-hot or any ``q``) reduce exactly to "accept while the target's
argmax equals the draft token, then emit the target's argmax": ``p(d) ∈ {0, 1}`` and ``u < 1``.

RNG per row ``i``: ``u = uniform(fold_in(keys[i], 0), [K])`` and the residual/bonus draw uses
``fold_in(keys[i], 1)``; row ``i``'s result depends only on ``keys[i]`` and row ``i``'s inputs.

Shapes: B batch, K draft length, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from specjax.sampling import categorical


def _accept_row(key, draft_tokens, target_probs, draft_probs):
    """One row: key [], draft_tokens [K], target_probs [K+1, V], draft_probs [K, V] | None."""
    k = draft_tokens.shape[0]
    u = jax.random.uniform(jax.random.fold_in(key, 0), (k,), jnp.float32)  # [K] in [0, 1)
    p_d = jnp.take_along_axis(target_probs[:k], draft_tokens[:, None], axis=-1)[:, 0]  # [K]
    if draft_probs is None:
        accept = u < p_d  # q(d) = 1
    else:
        q_d = jnp.take_along_axis(draft_probs, draft_tokens[:, None], axis=-1)[:, 0]  # [K]
        accept = u * q_d < p_d  # u < p/q without dividing; q == p always accepts since u < 1
    num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32)))  # accepted prefix length

    # Residual at the first rejection (position num_accepted < K) or the bonus p_K.
    p = target_probs[num_accepted]  # [V]
    rejected = num_accepted < k
    j = jnp.minimum(num_accepted, k - 1)
    if draft_probs is None:
        residual = jnp.where(jnp.arange(p.shape[-1]) == draft_tokens[j], 0.0, p)
    else:
        residual = jnp.maximum(p - draft_probs[j], 0.0)
    weights = jnp.where(rejected & (jnp.sum(residual) > 0), residual, p)  # zero mass: fall back
    next_token = categorical(jax.random.fold_in(key, 1), weights)  # unnormalized is fine
    return num_accepted.astype(jnp.int32), next_token


@jax.jit
def accept_chain(keys: jax.Array, draft_tokens: jax.Array, target_probs: jax.Array,
                 draft_probs: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Speculative-sampling acceptance of a K-token draft chain (see the module docstring).

    Args:
      keys: [B] typed PRNG keys, one per row.
      draft_tokens: [B, K] int32 draft tokens d_1..d_K.
      target_probs: [B, K+1, V] processed target probabilities p_0..p_K (``process_logits``
        output: temperature / top-k / top-p already applied, so the bonus honours them too).
      draft_probs: [B, K, V] processed q_1..q_K the drafts were *sampled* from, or None for
        point-mass drafts (argmax or any draft chosen independently of ``keys``).

    Returns:
      num_accepted: [B] int32 in [0, K], length of the accepted draft prefix.
      next_token: [B] int32, the residual sample at the first rejection, or the bonus token
        sampled from p_K when all K drafts were accepted. The step emits
        ``draft_tokens[:num_accepted] + [next_token]``.
    """
    b, k = draft_tokens.shape
    if target_probs.ndim != 3 or target_probs.shape[:2] != (b, k + 1):
        raise ValueError(f"target_probs must be [B, K+1, V] = [{b}, {k + 1}, V], "
                         f"got {target_probs.shape}")
    if draft_probs is not None and draft_probs.shape != (b, k, target_probs.shape[-1]):
        raise ValueError(f"draft_probs must be [B, K, V] = {(b, k, target_probs.shape[-1])}, "
                         f"got {draft_probs.shape}")
    if keys.shape != (b,):
        raise ValueError(f"keys must be [B] = ({b},), got {keys.shape}")
    draft_tokens = draft_tokens.astype(jnp.int32)
    target_probs = target_probs.astype(jnp.float32)
    if draft_probs is None:
        return jax.vmap(lambda key, d, p: _accept_row(key, d, p, None))(
            keys, draft_tokens, target_probs)
    return jax.vmap(_accept_row)(keys, draft_tokens, target_probs,
                                 draft_probs.astype(jnp.float32))


@jax.jit
def accept_greedy(draft_tokens: jax.Array, target_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy acceptance: accept while the target's argmax equals the draft token.

    Args:
      draft_tokens: [B, K] int32.
      target_logits: [B, K+1, V] target logits (or probabilities) at every draft position.

    Returns:
      num_accepted: [B] int32 in [0, K]; next_token: [B] int32, the target's argmax right after
      the accepted prefix (correction at the first mismatch, or the bonus).
    """
    b, k = draft_tokens.shape
    if target_logits.ndim != 3 or target_logits.shape[:2] != (b, k + 1):
        raise ValueError(f"target_logits must be [B, K+1, V] = [{b}, {k + 1}, V], "
                         f"got {target_logits.shape}")
    target = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K+1]
    match = (target[:, :k] == draft_tokens).astype(jnp.int32)  # [B, K]
    num_accepted = jnp.sum(jnp.cumprod(match, axis=-1), axis=-1).astype(jnp.int32)  # [B]
    next_token = jnp.take_along_axis(target, num_accepted[:, None], axis=-1)[:, 0]
    return num_accepted, next_token


@jax.jit
def emitted_tokens(draft_tokens: jax.Array, num_accepted: jax.Array, next_token: jax.Array,
                   fill_value: int = -1) -> jax.Array:
    """The tokens a step emits in the fixed [B, K+1] layout.

    Args:
      draft_tokens: [B, K] int32; num_accepted: [B] int32; next_token: [B] int32.
      fill_value: written after the emitted tokens.

    Returns:
      [B, K+1] int32: ``draft_tokens[:n]``, then ``next_token`` at index ``n``, then
      ``fill_value``; row ``i`` emits ``num_accepted[i] + 1`` tokens.
    """
    b, k = draft_tokens.shape
    idx = jnp.arange(k + 1)[None, :]  # [1, K+1]
    n = num_accepted[:, None]  # [B, 1]
    drafts = jnp.pad(draft_tokens.astype(jnp.int32), ((0, 0), (0, 1)))  # [B, K+1]
    out = jnp.where(idx < n, drafts, jnp.where(idx == n, next_token[:, None], fill_value))
    return out.astype(jnp.int32)
