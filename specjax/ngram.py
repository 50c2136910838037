"""On-device n-gram (prompt lookup) drafting: a vectorised suffix match over each row's history.

Each row keeps its whole history x_0..x_{n-1} (prompt + generated tokens) in a fixed-width
buffer ``history [B, L]`` (slots >= n are stale). A step looks for the longest earlier occurrence
of the history's suffix, of length m in [ngram_min, ngram_max], and proposes the tokens that
followed it as point-mass drafts:

* candidate end j (0 <= j <= n-2): m_j = the number of consecutive i = 0, 1, ... with
  history[j - i] == history[n - 1 - i] (capped at ngram_max, and at j + 1 / n going backwards);
* the chosen j maximises (m_j, j): the longest match, ties to the most recent occurrence;
  a row matches when m_j >= ngram_min;
* the proposal is d_i = history[j + 1 + (i mod p)] for i = 0..K-1, p = n - 1 - j: the tokens
  after the match, continued periodically when they run into the suffix itself (a repeated
  pattern keeps repeating). Any point-mass draft is lossless, so the guess only changes speed.

Everything is a few [B, L] comparisons per step (ngram_max of them) and one argmax: no
per-token Python, no data-dependent shapes. ``search_reference`` is the plain-Python twin the
tests compare against.

Shapes: B batch, L history width, K draft length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def search(history: jax.Array, lengths: jax.Array, ngram_min: int, ngram_max: int):
    """Longest (then most recent) earlier occurrence of each row's suffix.

    Args:
      history: [B, L] int32 tokens x_0..x_{n-1} per row (slots >= n ignored).
      lengths: [B] int32 n, the committed tokens (>= 1).
      ngram_min, ngram_max: static match-length range, 1 <= ngram_min <= ngram_max.
    Returns:
      match_len: [B] int32 m in [ngram_min, ngram_max], or 0 where the row has no match.
      end: [B] int32 j, the index of the match's last token (meaningless where match_len == 0).
    """
    b, width = history.shape
    j = jnp.arange(width, dtype=jnp.int32)[None, :]  # [1, L]
    run = jnp.ones((b, width), jnp.int32)  # still matching after i steps back
    m = jnp.zeros((b, width), jnp.int32)
    for i in range(ngram_max):  # static, small
        shifted = jnp.pad(history, ((0, 0), (i, 0)), constant_values=-1)[:, :width]  # [B, L] h[j-i]
        tail_idx = lengths - 1 - i  # [B]
        tail = jnp.take_along_axis(history, jnp.maximum(tail_idx, 0)[:, None], axis=1)  # [B, 1]
        eq = (shifted == tail) & (j >= i) & (tail_idx >= 0)[:, None]
        run = run * eq.astype(jnp.int32)
        m = m + run
    ok = (j <= (lengths - 2)[:, None]) & (m >= ngram_min)  # [B, L]
    score = jnp.where(ok, m * width + j, -1)
    best = jnp.argmax(score, axis=1).astype(jnp.int32)  # [B]
    top = jnp.max(score, axis=1)
    match_len = jnp.where(top >= 0, top // width, 0).astype(jnp.int32)
    return match_len, best


def propose(history: jax.Array, lengths: jax.Array, k: int, ngram_min: int, ngram_max: int):
    """K point-mass draft tokens per row from its longest suffix match.

    Returns (tokens [B, K] int32, match_len [B] int32; 0 = no match, tokens then repeat x_{n-1}).
    """
    match_len, end = search(history, lengths, ngram_min, ngram_max)
    period = jnp.maximum(lengths - 1 - end, 1)  # [B] tokens between the match and the suffix end
    i = jnp.arange(k, dtype=jnp.int32)[None, :]
    idx = end[:, None] + 1 + i % period[:, None]  # [B, K] < n
    idx = jnp.where(match_len[:, None] > 0, idx, (lengths - 1)[:, None])
    return jnp.take_along_axis(history, idx, axis=1), match_len


def write(history: jax.Array, tokens: jax.Array, start: jax.Array) -> jax.Array:
    """Writes tokens [B, T] at history[b, start[b]:start[b] + T] (the caller keeps start + T <= L)."""
    return jax.vmap(lambda h, t, s: jax.lax.dynamic_update_slice(h, t, (s,)))(history, tokens, start)


def search_reference(history: list, ngram_min: int, ngram_max: int) -> tuple[int, int]:
    """Plain-Python twin of ``search`` for one row: (match_len, end), (0, -1) without a match."""
    n = len(history)
    best = (0, -1)
    for j in range(n - 1):
        m = 0
        while m < ngram_max and j - m >= 0 and history[j - m] == history[n - 1 - m]:
            m += 1
        if m >= ngram_min and (m, j) > best:
            best = (m, j)
    return best


def propose_reference(history: list, k: int, ngram_min: int, ngram_max: int) -> tuple[list, int]:
    """Plain-Python twin of ``propose`` for one row."""
    m, j = search_reference(history, ngram_min, ngram_max)
    n = len(history)
    if m == 0:
        return [history[-1]] * k, 0
    p = n - 1 - j
    return [history[j + 1 + i % p] for i in range(k)], m
