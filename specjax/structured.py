"""Structured outputs: a request's constraint, compiled against the tokenizer, and its matcher.

The grammar engine is xgrammar (``pip install specjax[serve]``): it compiles JSON schemas,
regexes and EBNF grammars into a pushdown automaton over the tokenizer's vocabulary and gives
the token bitmask of a state (int32 words, bit ``v % 32`` of word ``v // 32`` = token v allowed;
the stop tokens are allowed exactly where the grammar may end). specjax writes no grammar code.

* ``Constraint``: a frozen, hashable description (json_schema / json_object / regex / choice /
  grammar). ``Constraint.key`` identifies the compiled grammar.
* ``GrammarCompiler``: one per tokenizer; ``compile(constraint)`` raises ValueError naming what
  is wrong (an invalid schema, regex or grammar, or one whose output no token of the
  vocabulary can start) and caches compiled grammars by key.
* ``Matcher``: one per request, on the engine's thread. ``mask()`` is the bitmask at the current
  state; ``accept(tokens)`` advances over the longest valid prefix of ``tokens`` and returns its
  length; ``rollback(n)`` undoes n tokens; ``chain_masks`` / ``tree_masks`` give the masks a
  speculative verify pass needs (below).

Speculation stays lossless with respect to the constrained target distribution
p'(x) = p(x) m(x) / Z (m = the grammar's mask at that position). For a chain d_1..d_K the masks
at positions 0..K are the grammar states after x_{<n}, d_1, .., d_j (``chain_masks``: accept the
valid prefix d_1..d_c, fill a mask after each token, roll back). The target's logits at verify
position j are set to -inf outside mask j before temperature, top-k / top-p and the acceptance
rule, so the acceptance rule sees exactly p'. A draft the grammar rejects (d_{c+1}) has
p'(d_{c+1}) = 0 and is rejected with probability 1 (``u * q < p'`` is false; greedy: it is not
the argmax), i.e. the chain is cut there and the residual max(p' - q, 0) lies inside the mask;
positions after the cut are never reached (their masks repeat mask c). The bonus position K
uses the state after all K drafts. Trees: node i's mask is the state after its root-to-node
path (``tree_masks``).
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
from typing import Any

import jax.numpy as jnp
import numpy as np

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class Constraint:
    """What a request's output must match (frozen, hashable).

    kind: one of ``KINDS``. value: the schema as canonical JSON text (json_schema), None
    (json_object: any JSON object), the regex, a tuple of strings (choice: exactly one of them),
    or an EBNF grammar with a ``root`` rule (xgrammar's / GBNF syntax).
    any_whitespace: JSON only: allow any whitespace between tokens (xgrammar's default) instead
    of the compact ``json.dumps`` layout; off by default because models (random ones in tests,
    real ones too: vLLM's ``disable_any_whitespace``) can loop on whitespace.
    """

    kind: str
    value: Any = None
    any_whitespace: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"constraint kind must be one of {KINDS}, got {self.kind!r}")
        v = self.value
        if self.kind == "json_object":
            if v is not None:
                raise ValueError("a json_object constraint takes no value")
        elif self.kind == "choice":
            if not isinstance(v, tuple) or not v or not all(isinstance(s, str) and s for s in v):
                raise ValueError(f"choice must be a non-empty tuple of non-empty strings, got {v!r}")
        elif not isinstance(v, str) or not v:
            raise ValueError(f"a {self.kind} constraint needs a non-empty string, got {v!r}")
        if not isinstance(self.any_whitespace, bool):
            raise TypeError(f"any_whitespace must be a bool, got {self.any_whitespace!r}")

    @classmethod
    def json_schema(cls, schema, **kw) -> "Constraint":
        """From a schema dict (or its JSON text), stored as JSON text (key order kept: it is
        the order the properties are generated in)."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")
        return cls("json_schema", json.dumps(schema), **kw)

    @classmethod
    def json_object(cls, **kw) -> "Constraint":
        return cls("json_object", None, **kw)

    @classmethod
    def regex(cls, pattern: str) -> "Constraint":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options) -> "Constraint":
        return cls("choice", tuple(options))

    @classmethod
    def grammar(cls, ebnf: str) -> "Constraint":
        return cls("grammar", ebnf)

    @property
    def key(self) -> tuple:
        """The compiled grammar's cache key."""
        return (self.kind, self.value, self.any_whitespace)


def _choice_ebnf(options: tuple) -> str:
    # EBNF string literals take JSON's escapes (\" \\ \n \t \uXXXX)
    return "root ::= " + " | ".join(json.dumps(s, ensure_ascii=True) for s in options)


class GrammarCompiler:
    """Compiles constraints against one tokenizer (thread-safe; results cached by key).

    Args:
      tokenizer: a specjax Tokenizer or a transformers tokenizer.
      vocab_size: V of the model's logits (may exceed the tokenizer's: padding ids never allowed).
      stop_token_ids: the ids that end a generation (EOS): allowed exactly where the grammar ends.
      max_threads: xgrammar's compile threads.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, *, max_threads: int = 2,
                 cache_size: int = 256):
        import xgrammar as xgr  # noqa: PLC0415 - xgrammar (+ torch) ~2 s, only for structured outputs

        hf = getattr(tokenizer, "hf", tokenizer)
        stop = sorted({int(t) for t in stop_token_ids})
        if not stop:
            raise ValueError("structured outputs need a stop token (EOS) to end a grammar")
        self._xgr = xgr
        self.vocab_size = int(vocab_size)
        self.stop_token_ids = tuple(stop)
        self.info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                       stop_token_ids=stop)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        self.words = int(xgr.get_bitmask_shape(1, self.vocab_size)[1])  # W int32 words per mask
        self._cache: dict = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint):
        """The compiled grammar of ``constraint`` (cached). Raises ValueError if xgrammar
        rejects it (the message says which kind and why)."""
        if not isinstance(constraint, Constraint):
            raise TypeError(f"constraint must be a specjax.structured.Constraint, got "
                            f"{type(constraint).__name__}")
        with self._lock:
            hit = self._cache.get(constraint.key)
        if hit is not None:
            return hit
        c, kind = self._compiler, constraint.kind
        ws = {"any_whitespace": constraint.any_whitespace}
        if not constraint.any_whitespace:
            ws["separators"] = (",", ":")
        try:
            if kind == "json_schema":
                compiled = c.compile_json_schema(constraint.value, strict_mode=True, **ws)
            elif kind == "json_object":
                compiled = c.compile_json_schema('{"type": "object"}', strict_mode=False, **ws)
            elif kind == "regex":
                compiled = c.compile_regex(constraint.value)
            elif kind == "choice":
                compiled = c.compile_grammar(_choice_ebnf(constraint.value))
            else:
                compiled = c.compile_grammar(constraint.value)
        except (RuntimeError, ValueError, TypeError) as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            msg = re.sub(r"^\[[0-9:.]+\]\s+\S+:\d+:\s*", "", msg)  # xgrammar's "[time] file:line:"
            raise ValueError(f"invalid {kind}: {msg}") from None
        first = np.zeros((1, self.words), np.int32)
        self._xgr.GrammarMatcher(compiled).fill_next_token_bitmask(first, 0)
        if not first.any():  # else every request with it would end at once, unanswered
            raise ValueError(f"invalid {kind}: no token of the vocabulary can start an output "
                             "that matches it")
        with self._lock:
            if len(self._cache) >= self._cache_size:
                self._cache.pop(next(iter(self._cache)))  # oldest first
            self._cache[constraint.key] = compiled
        return compiled

    def matcher(self, constraint: Constraint) -> "Matcher":
        """A fresh matcher for one request."""
        return Matcher(self, self.compile(constraint))


class Matcher:
    """One request's grammar state (not thread-safe: the engine's thread only).

    Attributes: ``words`` (W int32 words per mask), ``vocab_size``.
    """

    def __init__(self, compiler: GrammarCompiler, compiled):
        self._m = compiler._xgr.GrammarMatcher(compiled)  # rollback is unlimited in xgrammar
        self.words, self.vocab_size = compiler.words, compiler.vocab_size

    def mask(self, out: np.ndarray | None = None, index: int = 0) -> np.ndarray:
        """The bitmask at the current state: writes row ``index`` of ``out`` [R, W] int32
        (a fresh [1, W] array if None) and returns ``out``."""
        if out is None:
            out = np.zeros((1, self.words), np.int32)
        self._m.fill_next_token_bitmask(out, index)
        return out

    def accept(self, tokens) -> int:
        """Advances over the longest prefix of ``tokens`` the grammar accepts; returns its
        length (the state is after that prefix)."""
        n = 0
        for t in tokens:
            if self._m.is_terminated() or not self._m.accept_token(int(t)):
                break
            n += 1
        return n

    def rollback(self, n: int) -> None:
        """Undoes the last ``n`` accepted tokens."""
        if n:
            self._m.rollback(int(n))

    def is_terminated(self) -> bool:
        """Whether the grammar ended (its stop token was accepted): nothing more may follow."""
        return self._m.is_terminated()

    def chain_masks(self, drafts, out: np.ndarray) -> int:
        """Masks for verifying the chain d_1..d_K: ``out`` [K+1, W] row j = the state after the
        valid prefix up to d_j (rows past the first rejected draft repeat the last valid one).
        A draft that ends the grammar (its stop token) ends the request: the rows after it
        allow everything (whatever follows is discarded by the host, and no row is all zeros).
        The state is unchanged afterwards. Returns c, the length of the valid prefix."""
        self.mask(out, 0)
        c = 0
        for j, t in enumerate(drafts):  # a draft outside the mask is not even tried
            if not allowed(out[j], t) or not self._m.accept_token(int(t)):
                break
            c = j + 1
            if self._m.is_terminated():
                out[c:] = -1
                self.rollback(c)
                return c
            self.mask(out, c)
        out[c + 1:] = out[c]
        self.rollback(c)
        return c

    def tree_masks(self, tokens, parents, out: np.ndarray) -> None:
        """Masks for verifying a token tree: ``out`` [N+1, W] row 0 = the current state (the
        root x_{n-1}), row i = the state after node i's root-to-node path. ``tokens`` [N] are
        nodes 1..N, ``parents`` [N+1] the parent index of each node (-1 or 0 for the root).
        A node whose path the grammar rejects gets its parent's row (it is never reached: its
        own probability under its parent's mask is 0). The state is unchanged afterwards."""
        self.mask(out, 0)
        valid = [True] + [False] * len(tokens)  # node i's path is accepted (parents come first)
        for i in range(1, len(tokens) + 1):
            p = int(parents[i])
            valid[i] = valid[p] and allowed(out[p], tokens[i - 1])
            if not valid[i]:
                out[i] = out[p]
                continue
            path, j = [], i
            while j > 0:
                path.append(int(tokens[j - 1]))
                j = int(parents[j])
            c = self.accept(path[::-1])
            if c == len(path) and self._m.is_terminated():
                out[i] = -1  # the path ended the grammar: what follows is discarded
            elif c == len(path):
                self.mask(out, i)
            else:  # the mask allowed it but the matcher did not: treat as rejected
                valid[i], out[i] = False, out[p]
            self.rollback(c)


def allowed(mask: np.ndarray, token) -> bool:
    """Whether ``mask`` [W] int32 allows ``token``."""
    t = int(token)
    return 0 <= t < 32 * mask.shape[-1] and bool((int(mask[t >> 5]) >> (t & 31)) & 1)


def all_allowed(rows: int, words: int) -> np.ndarray:
    """[rows, W] int32 masks allowing every token (rows without a constraint)."""
    return np.full((rows, words), -1, np.int32)


def apply_bitmask(logits, bitmask):
    """Device side: logits [..., V] with -inf where ``bitmask`` [..., W] int32 has a 0 bit."""
    v = logits.shape[-1]
    idx = jnp.arange(v, dtype=jnp.int32)
    words = jnp.take(bitmask, idx // 32, axis=-1)  # [..., V]
    allowed = ((words >> (idx % 32)) & 1).astype(bool)
    return jnp.where(allowed, logits, -jnp.inf)
