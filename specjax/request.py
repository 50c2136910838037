"""Validation of one generation request, shared by ``sj.generate`` and the serving engine.

A request is a prompt (token ids), a number of new tokens, sampling settings (temperature, top-k,
top-p), a seed and stop ids. Each check raises ValueError / TypeError naming the argument and
its allowed range, and returns the value normalised to plain Python ints / tuples. Pure host code.
"""

from __future__ import annotations

import numbers
from typing import Sequence

SEED_RANGE = "[-2**31, 2**31)"


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_tokens(ids: Sequence[int], vocab: int, what: str) -> list[int]:
    """A non-empty 1-D sequence of token ids in [0, vocab) -> list[int]; ``what`` names it."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
        raise TypeError(f"{what} must be a list of token ids, got {type(ids).__name__}")
    if hasattr(ids, "ndim") and hasattr(ids, "tolist"):  # numpy / jax arrays
        if ids.ndim != 1:
            raise ValueError(f"{what} must be 1-D token ids, got an array of shape {ids.shape}")
        ids = ids.tolist()
    bad = [t for t in ids if not _is_int(t)]
    if bad:
        raise TypeError(f"{what} must contain integer token ids, got {bad[0]!r}")
    ids = [int(t) for t in ids]
    if not ids:
        raise ValueError(f"{what} is empty: a prompt needs at least one token")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what} has token id {bad[0]} outside the vocabulary [0, {vocab})")
    return ids


def check_sampling(temperature, top_k, top_p) -> None:
    """temperature: finite >= 0 (0 = greedy); top_k: int >= 0 (0 = off); top_p: in (0, 1]."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not temperature >= 0.0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if not _is_int(top_k) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def check_seed(seed, *, allow_none: bool = False) -> int | None:
    """An int in [-2**31, 2**31) (or None when ``allow_none``)."""
    if seed is None and allow_none:
        return None
    if not _is_int(seed) or not -2**31 <= seed < 2**31:
        either = "None or " if allow_none else ""
        raise ValueError(f"seed must be {either}an int in {SEED_RANGE}, got {seed!r}")
    return int(seed)


def check_stop_ids(stop, vocab: int, default: Sequence[int], what: str) -> tuple[int, ...]:
    """Stop ids: None -> ``default`` (the model's EOS ids); an int or an iterable of ints in
    [0, vocab); () never stops early."""
    if stop is None:
        return tuple(default)
    if isinstance(stop, (str, bytes)):
        raise TypeError(f"{what} must be an int or a list of ints, got {stop!r}")
    ids = [stop] if isinstance(stop, numbers.Integral) else stop
    try:
        ids = list(ids)
    except TypeError:
        raise TypeError(f"{what} must be an int or a list of ints, got {stop!r}") from None
    for e in ids:
        if not _is_int(e):
            raise TypeError(f"{what} must contain ints, got {e!r}")
        if not 0 <= e < vocab:
            raise ValueError(f"{what} {e} is outside the vocabulary [0, {vocab})")
    return tuple(int(e) for e in ids)


def check_request(prompt, vocab: int, max_len: int, max_new, temperature=0.0, top_k=0,
                  top_p=1.0, *, what: str = "prompt", max_new_name: str = "max_new_tokens",
                  max_len_name: str = "the model's max length") -> list[int]:
    """Validates one request's prompt, length budget and sampling settings.

    Args:
      prompt: token ids, each in [0, vocab); max_len: the most tokens (prompt + new) allowed;
      max_new: new tokens requested, an int >= 1; temperature / top_k / top_p: as check_sampling;
      what / max_new_name / max_len_name: how error messages name the prompt, max_new, max_len.
    Returns:
      the prompt as list[int].
    """
    ids = check_tokens(prompt, vocab, what)
    check_sampling(temperature, top_k, top_p)
    if not _is_int(max_new) or max_new < 1:
        raise ValueError(f"{max_new_name} must be an int >= 1, got {max_new!r}")
    if len(ids) + max_new > max_len:
        raise ValueError(f"{what} of {len(ids)} tokens + {max_new_name} {max_new} exceeds "
                         f"{max_len_name} {max_len}")
    return ids
