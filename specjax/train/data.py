"""Training data for draft heads and draft LLMs: self-distilled chat text + target hidden states.

Stage 1 (``build_corpus``): chat prompts from the *train* split of the Wikipedia intros, answered
by the target itself (self-distillation, as EAGLE does: no chat corpus exists offline), plus wiki
extracts framed as assistant answers to "Tell me about <title>."-style prompts. Written as JSONL
shards of token ids; finished shards are skipped on restart.

Stage 2 (``collect_hidden``): the target's *inference* forward (specjax.model.forward, the same
code that serves) over every sequence; stores tokens, lengths and pre-norm final hidden states
(float16) per shard as .npz. Teacher logits are recomputed from the hidden states through the
frozen lm_head at training time, so nothing V-sized is stored.
"""

from __future__ import annotations

import glob
import json
import os
import logging
import time

import jax
import jax.numpy as jnp
import numpy as np

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
    import specjax as sj  # noqa: PLC0415

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
    with open(path) as f:
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


def load_hidden(paths: list[str]):
    """Concatenates hidden-state shards -> dict of arrays (tokens, lengths, prompt_lens, hidden)."""
    parts = [np.load(p) for p in paths]
    return {k: np.concatenate([p[k] for p in parts]) for k in ("tokens", "lengths", "prompt_lens", "hidden")}


def draft_vocab(data, size: int, vocab_size: int, always=()) -> np.ndarray:
    """The ``size`` most frequent answer tokens of a hidden-state set (tokens at positions
    >= prompt_len), plus ``always`` (e.g. EOS), as sorted unique int32 ids: a reduced draft
    vocabulary (EAGLE-3) for a head. Ties and unused slots go to the lowest ids."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be in [1, {vocab_size}], got {size}")
    tokens, lengths, plens = data["tokens"], data["lengths"], data["prompt_lens"]
    pos = np.arange(tokens.shape[1])[None, :]
    answer = (pos >= plens[:, None]) & (pos < lengths[:, None])
    counts = np.bincount(tokens[answer].ravel(), minlength=vocab_size).astype(np.int64)
    keep = [int(t) for t in always if 0 <= int(t) < vocab_size][:size]
    counts[keep] = -1  # chosen already
    rest = np.argsort(-counts, kind="stable")[:size - len(keep)]
    return np.unique(np.concatenate([np.asarray(keep, np.int64), rest])).astype(np.int32)
