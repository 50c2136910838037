"""Training data for draft heads and draft LLMs: self-distilled chat text + target hidden states.

Stage 1 (``build_corpus``): chat prompts from the *train* split of the Wikipedia intros, answered
by the target itself (self-distillation, as EAGLE does: no chat corpus exists offline), plus wiki
extracts framed as assistant answers to "Tell me about <title>."-style prompts. Written as JSONL
shards of token ids; finished shards are skipped on restart.

Stage 2 (``collect_hidden``): the target's *inference* forward (specjax.model.forward, the same
code that serves) over every sequence; stores tokens, lengths and pre-norm final hidden states
(float16) per shard as .npz. Teacher logits are recomputed from the hidden states through the
frozen lm_head at training time, so nothing V-sized is stored.

Broad corpus (``specjax.train.distill`` shards, ``answers-XXXXX.jsonl.gz``): ``collect_features``
stores each shard *ragged* (no padding: tokens [Ntok], offsets [N+1], hidden [Ntok, F] float16,
one .npy each, so they are memory-mapped, not loaded) with the domain of every row, and
``RaggedSet`` serves training batches from many such shards: ``take(idx, seq_len)`` pads each
row to ``seq_len``, cropping a longer row from the front (its answer is kept whole, the head
loses the start of a long prompt).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import shutil
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax as sj
from specjax import kv_cache, speculate
from specjax.model import Model
from specjax.train.corpora import chat_prompts, wiki_entries


logger = logging.getLogger(__name__)
_progress = logger.info  # shard-level progress (the CLI shows INFO on stderr)


def build_corpus(target: Model, tok, out_dir: str, *, num_prompts: int = 1024,
                 num_wiki: int = 2048, max_new_tokens: int = 128, batch_size: int = 32,
                 split: str = "train", shard_size: int = 128, seed: int = 0) -> list[str]:
    """Writes ``out_dir/corpus-XXXXX.jsonl`` shards of {"ids": [...], "prompt_len": int}.

    Self-distilled shards alternate greedy and temperature-0.7 answers. Resumable.
    """
    os.makedirs(out_dir, exist_ok=True)
    prompts = chat_prompts(split, limit=num_prompts)
    shards = []
    for s0 in range(0, len(prompts), shard_size):
        path = os.path.join(out_dir, f"corpus-{s0 // shard_size:05d}.jsonl")
        shards.append(path)
        if os.path.exists(path):
            continue
        rows = []
        t0 = time.perf_counter()
        for b0 in range(s0, min(s0 + shard_size, len(prompts)), batch_size):
            batch = [tok.apply_chat_template(m) for m in prompts[b0:b0 + batch_size]]
            temp = 0.0 if (b0 // batch_size) % 2 == 0 else 0.7
            out = sj.generate(target, batch, max_new_tokens=max_new_tokens, temperature=temp,
                              seed=seed + b0, eos_token_id=tok.eos_token_id)
            rows += [{"ids": p + o, "prompt_len": len(p)} for p, o in zip(batch, out.tokens)]
        with open(path + ".tmp", "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
        os.replace(path + ".tmp", path)
        n_tok = sum(len(r["ids"]) - r["prompt_len"] for r in rows)
        _progress(f"{path}: {len(rows)} answers, {n_tok} new tokens in {time.perf_counter() - t0:.0f}s")
    # wiki extracts framed as answers (no generation needed)
    path = os.path.join(out_dir, "corpus-wiki.jsonl")
    shards.append(path)
    if not os.path.exists(path):
        templates = ("Tell me about {t}.", "What is {t}?", "Give me a short summary of {t}.")
        entries = wiki_entries(split)[-num_wiki:]
        with open(path + ".tmp", "w") as f:
            for i, e in enumerate(entries):
                msgs = [{"role": "user", "content": templates[i % 3].format(t=e["title"])}]
                p = tok.apply_chat_template(msgs)
                a = tok.encode(e["extract"]) + [tok.eos_token_id]
                f.write(json.dumps({"ids": p + a, "prompt_len": len(p)}) + "\n")
        os.replace(path + ".tmp", path)
    return shards


def _read_jsonl(path):
    """Rows of a ``.jsonl`` or gzipped ``.jsonl.gz`` file."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [json.loads(line) for line in f if line.strip()]


def collect_hidden(target: Model, corpus_dir: str, out_dir: str, *, seq_len: int = 256,
                   batch_size: int = 8, aux_layers: tuple = ()) -> list[str]:
    """Runs the target's inference forward over the corpus; writes hidden-state .npz shards.

    Each shard: tokens [N, T] int32 (right-padded), lengths [N], prompt_lens [N],
    hidden [N, T, E] float16 (pre-norm final hidden states; with ``aux_layers`` (EAGLE-3)
    [N, T, E + A*E]: the states entering those layers appended, same pass). Resumable per shard.
    """
    os.makedirs(out_dir, exist_ok=True)
    cfg = target.config

    @jax.jit
    def run(params, tokens, lens):
        b = tokens.shape[0]
        kv = speculate.init_cache(cfg, b * kv_cache.pages_needed(seq_len, 16), 16,
                                  params["embed"].dtype)
        page_table = kv_cache.contiguous_page_table(b, kv_cache.pages_needed(seq_len, 16))
        pos = jnp.broadcast_to(jnp.arange(seq_len, dtype=jnp.int32), (b, seq_len))
        _, hidden, _, aux = speculate.target_forward(
            params, cfg, tokens, pos, kv, page_table, jnp.zeros((b,), jnp.int32), lens,
            return_logits=False, aux_layers=tuple(aux_layers))
        if aux is not None:
            hidden = jnp.concatenate([hidden, aux], axis=-1)
        return hidden.astype(jnp.float16)

    outs = []
    for src in sorted(glob.glob(os.path.join(corpus_dir, "corpus-*.jsonl"))):
        dst = os.path.join(out_dir, os.path.basename(src).replace(".jsonl", ".npz"))
        outs.append(dst)
        if os.path.exists(dst):
            continue
        rows = _read_jsonl(src)
        n = len(rows)
        tokens = np.zeros((n, seq_len), np.int32)
        lens = np.array([min(len(r["ids"]), seq_len) for r in rows], np.int32)
        plens = np.array([min(r["prompt_len"], seq_len) for r in rows], np.int32)
        for i, r in enumerate(rows):
            tokens[i, :lens[i]] = r["ids"][:seq_len]
        hidden = np.zeros((n, seq_len, cfg.hidden_size * (1 + len(aux_layers))), np.float16)
        t0 = time.perf_counter()
        for b0 in range(0, n, batch_size):
            tb, lb = tokens[b0:b0 + batch_size], lens[b0:b0 + batch_size]
            pad = batch_size - len(tb)
            if pad:
                tb = np.concatenate([tb, np.zeros((pad, seq_len), np.int32)])
                lb = np.concatenate([lb, np.ones((pad,), np.int32)])
            h = np.asarray(run(target.params, jnp.asarray(tb), jnp.asarray(lb)))
            hidden[b0:b0 + batch_size] = h[:batch_size - pad]
        np.savez(dst + ".tmp.npz", tokens=tokens, lengths=lens, prompt_lens=plens, hidden=hidden)
        os.replace(dst + ".tmp.npz", dst)
        _progress(f"{dst}: {n} sequences, {int(lens.sum())} tokens in {time.perf_counter() - t0:.0f}s")
    return outs


def collect_features(target: Model, corpus_files: list[str], out_dir: str, *,
                     aux_layers: tuple = (), buckets: tuple = (128, 256, 384, 512, 640),
                     batch_tokens: int = 4096) -> list[str]:
    """Target hidden states of distill shards, ragged; one directory per shard, resumable.

    Each ``out_dir/<shard>/`` holds tokens.npy [Ntok] int32, offsets.npy [N+1] int64,
    prompt_lens.npy [N] int32, hidden.npy [Ntok, E + A*E] float16 (pre-norm final hidden states,
    then the states entering ``aux_layers``), meta.json (domain / source / temperature per row).
    Rows are run sorted by length, padded to the smallest of ``buckets`` that fits (a row longer
    than the largest is cut to it), ``batch_tokens // bucket`` rows per call.
    """
    os.makedirs(out_dir, exist_ok=True)
    cfg = target.config
    runs = {}

    def run_fn(t):
        @jax.jit
        def run(params, tokens, lens):
            b = tokens.shape[0]
            pages = kv_cache.pages_needed(t, 16)
            kv = speculate.init_cache(cfg, b * pages, 16, params["embed"].dtype)
            pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
            _, hidden, _, aux = speculate.target_forward(
                params, cfg, tokens, pos, kv, kv_cache.contiguous_page_table(b, pages),
                jnp.zeros((b,), jnp.int32), lens, return_logits=False, aux_layers=tuple(aux_layers))
            if aux is not None:
                hidden = jnp.concatenate([hidden, aux], axis=-1)
            return hidden.astype(jnp.float16)
        return run

    outs = []
    for src in corpus_files:
        dst = os.path.join(out_dir, os.path.basename(src).split(".")[0])
        outs.append(dst)
        if os.path.exists(os.path.join(dst, "meta.json")):
            continue
        rows = _read_jsonl(src)
        ids = [r["ids"][:buckets[-1]] for r in rows]
        lens = np.array([len(x) for x in ids], np.int64)
        offsets = np.concatenate([[0], np.cumsum(lens)])
        hidden = np.zeros((int(offsets[-1]), cfg.hidden_size * (1 + len(aux_layers))), np.float16)
        t0 = time.perf_counter()
        order = np.argsort(lens, kind="stable")
        i = 0
        while i < len(order):
            t = next(b for b in buckets if b >= lens[order[i]])
            bsz = max(1, batch_tokens // t)
            group = [j for j in order[i:i + bsz] if lens[j] <= t]
            tokens = np.zeros((bsz, t), np.int32)
            lb = np.ones((bsz,), np.int32)
            for r, j in enumerate(group):
                tokens[r, :lens[j]] = ids[j]
                lb[r] = lens[j]
            if t not in runs:
                runs[t] = run_fn(t)
            h = np.asarray(runs[t](target.params, jnp.asarray(tokens), jnp.asarray(lb)))
            for r, j in enumerate(group):
                hidden[offsets[j]:offsets[j + 1]] = h[r, :lens[j]]
            i += len(group)
        tmp = dst + ".tmp"
        os.makedirs(tmp, exist_ok=True)
        np.save(os.path.join(tmp, "tokens.npy"), np.concatenate([np.asarray(x, np.int32) for x in ids]))
        np.save(os.path.join(tmp, "offsets.npy"), offsets)
        np.save(os.path.join(tmp, "prompt_lens.npy"),
                np.array([min(r["prompt_len"], len(x)) for r, x in zip(rows, ids)], np.int32))
        np.save(os.path.join(tmp, "hidden.npy"), hidden)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({k: [r.get(k) for r in rows] for k in ("domain", "source", "temperature")}, f)
        if os.path.exists(dst):
            shutil.rmtree(dst)
        os.replace(tmp, dst)
        _progress(f"{dst}: {len(rows)} sequences, {int(offsets[-1])} tokens in "
                  f"{time.perf_counter() - t0:.0f}s")
    return outs


class RaggedSet:
    """Training / evaluation rows from ``collect_features`` shard directories (memory-mapped).

    ``len(s)`` rows; ``take(idx, seq_len)`` -> (tokens [B, T] int32, lengths [B], hidden
    [B, T, F] float16, prompt_lens [B]) with rows longer than T cropped from the front;
    ``domains`` [N] str; ``subset(mask)`` a view on some rows; ``answer_tokens()`` every answer
    token (for the draft vocabulary).
    """

    def __init__(self, dirs: list[str], rows=None):
        self.dirs = list(dirs)
        if not self.dirs:
            raise FileNotFoundError("no feature shards given")
        self._tok = [np.load(os.path.join(d, "tokens.npy"), mmap_mode="r") for d in self.dirs]
        self._hid = [np.load(os.path.join(d, "hidden.npy"), mmap_mode="r") for d in self.dirs]
        off = [np.load(os.path.join(d, "offsets.npy")) for d in self.dirs]
        plens = [np.load(os.path.join(d, "prompt_lens.npy")) for d in self.dirs]
        doms = []
        for d in self.dirs:
            with open(os.path.join(d, "meta.json")) as f:
                doms += json.load(f)["domain"]
        self._shard = np.concatenate([np.full(len(o) - 1, i) for i, o in enumerate(off)])
        self._start = np.concatenate([o[:-1] for o in off])
        self._len = np.concatenate([np.diff(o) for o in off]).astype(np.int32)
        self._plen = np.concatenate(plens).astype(np.int32)
        self._dom = np.asarray(doms, dtype=object)
        self.rows = np.arange(len(self._len)) if rows is None else np.asarray(rows)
        self.feature_size = int(self._hid[0].shape[1])

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def domains(self) -> np.ndarray:
        return self._dom[self.rows]

    @property
    def lengths(self) -> np.ndarray:
        return self._len[self.rows]

    @property
    def prompt_lens(self) -> np.ndarray:
        return self._plen[self.rows]

    def subset(self, mask) -> "RaggedSet":
        view = object.__new__(RaggedSet)
        view.__dict__.update(self.__dict__)
        view.rows = self.rows[np.asarray(mask)]
        return view

    def answer_tokens(self) -> np.ndarray:
        out = []
        for r in self.rows:
            s = self._start[r]
            out.append(np.asarray(self._tok[self._shard[r]][s + self._plen[r]:s + self._len[r]]))
        return np.concatenate(out) if out else np.zeros((0,), np.int32)

    def take(self, idx, seq_len: int):
        b = len(idx)
        tokens = np.zeros((b, seq_len), np.int32)
        hidden = np.zeros((b, seq_len, self.feature_size), np.float16)
        lengths = np.ones((b,), np.int32)
        plens = np.zeros((b,), np.int32)
        for i, j in enumerate(idx):
            r = self.rows[j]
            n, p = int(self._len[r]), int(self._plen[r])
            cut = max(0, n - seq_len)
            s, sh = int(self._start[r]) + cut, self._shard[r]
            m = n - cut
            tokens[i, :m] = self._tok[sh][s:s + m]
            hidden[i, :m] = self._hid[sh][s:s + m]
            lengths[i], plens[i] = max(m, 1), max(p - cut, 0)
        return tokens, lengths, hidden, plens


def take(data, idx, seq_len: int):
    """A batch (tokens, lengths, hidden, prompt_lens) of rows ``idx`` from a padded hidden-state
    dict (``load_hidden``) or a ``RaggedSet``."""
    if isinstance(data, RaggedSet):
        return data.take(idx, seq_len)
    plens = (np.asarray(data["prompt_lens"], np.int32)[idx] if "prompt_lens" in data
             else np.zeros((len(idx),), np.int32))
    return (data["tokens"][idx, :seq_len], data["lengths"][idx].clip(1, seq_len),
            data["hidden"][idx, :seq_len], plens)


def load_hidden(paths: list[str]):
    """Concatenates hidden-state shards -> dict of arrays (tokens, lengths, prompt_lens, hidden)."""
    parts = [np.load(p) for p in paths]
    return {k: np.concatenate([p[k] for p in parts]) for k in ("tokens", "lengths", "prompt_lens", "hidden")}


def draft_vocab(data, size: int, vocab_size: int, always=()) -> np.ndarray:
    """The ``size`` most frequent answer tokens of a hidden-state set (dict or ``RaggedSet``;
    tokens at positions >= prompt_len), plus ``always`` (e.g. EOS), as sorted unique int32 ids: a reduced draft
    vocabulary (EAGLE-3) for a head. Ties and unused slots go to the lowest ids."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    if isinstance(data, RaggedSet):
        answer_tokens = data.answer_tokens()
    else:
        tokens, lengths, plens = data["tokens"], data["lengths"], data["prompt_lens"]
        pos = np.arange(tokens.shape[1])[None, :]
        answer_tokens = tokens[(pos >= plens[:, None]) & (pos < lengths[:, None])].ravel()
    counts = np.bincount(answer_tokens, minlength=vocab_size).astype(np.int64)
    keep = [int(t) for t in always if 0 <= int(t) < vocab_size][:size]
    counts[keep] = -1  # chosen already
    rest = np.argsort(-counts, kind="stable")[:size - len(keep)]
    return np.unique(np.concatenate([np.asarray(keep, np.int64), rest])).astype(np.int32)
