"""End-to-end head / draft training for a target: corpus -> hidden states -> train -> validate.

Every stage is resumable (finished shards and training checkpoints are kept under ``work``), so
a long run can be interrupted and restarted with the same command. Used by
``specjax train-head`` and ``specjax train-draft``; checkpoints/README.md has the exact commands.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

import specjax as sj
from specjax import timing
from specjax.api import load_draft
from specjax.heads import Head, HeadConfig, default_aux_layers, init_head, output_matrix
from specjax.io.checkpoint import save_checkpoint
from specjax.io.heads_io import save_eagle3, save_head
from specjax.model import Model
from specjax.train import data as data_lib
from specjax.train import distill
from specjax.train import trainer
from specjax.train.corpora import chat_prompts


def _hidden_dir(work: str, split: str, aux_layers: tuple = ()) -> str:
    """hidden-<split> (final hidden states), hidden-<split>-aux2_4_5 (+ EAGLE-3 features)."""
    suffix = "-aux" + "_".join(map(str, aux_layers)) if aux_layers else ""
    return os.path.join(work, f"hidden-{split}{suffix}")


def prepare(target, tok, work: str, num_prompts: int, num_wiki: int, held_out_prompts: int,
            max_new_tokens: int, seq_len: int, aux_layers: tuple = ()):
    """Builds train + held-out corpora and their hidden states under ``work`` (with the states
    entering ``aux_layers`` too, for EAGLE-3 heads)."""
    for split, n_prompts, n_wiki in (("train", num_prompts, num_wiki),
                                     ("held_out", held_out_prompts, held_out_prompts)):
        cdir = os.path.join(work, f"corpus-{split}")
        data_lib.build_corpus(target, tok, cdir, num_prompts=n_prompts, num_wiki=n_wiki,
                              max_new_tokens=max_new_tokens, split=split)
        data_lib.collect_hidden(target, cdir, _hidden_dir(work, split, aux_layers),
                                seq_len=seq_len, aux_layers=aux_layers)


def prepare_broad(target, corpus_dir: str, held_out_dir: str, work: str, aux_layers: tuple = (),
                  shards: int | None = None):
    """Features of a broad distilled corpus (``specjax.train.distill`` shards): the first
    ``shards`` train shards (None: all; the data-scale knob) and every held-out shard, stored
    ragged under ``work/features[-auxA_B_C]/{train,held_out}``. Returns (train, held_out)
    ``data.RaggedSet``s; held-out rows keep their domain for per-domain metrics."""
    suffix = "-aux" + "_".join(map(str, aux_layers)) if aux_layers else ""
    sets = []
    for split, src, n in (("train", corpus_dir, shards), ("held_out", held_out_dir, None)):
        files = distill.shard_files(src)
        if not files:
            raise FileNotFoundError(f"no answers-*.jsonl[.gz] shards in {src}: run specjax.train.distill")
        if n is not None:
            if not 1 <= n <= len(files):
                raise ValueError(f"shards must be in [1, {len(files)}] (shards in {src}), got {n}")
            files = files[:n]
        dirs = data_lib.collect_features(target, files, os.path.join(work, f"features{suffix}", split),
                                         aux_layers=aux_layers)
        sets.append(data_lib.RaggedSet(dirs))
    return tuple(sets)


def load_split(work: str, split: str, pattern: str = "*.npz", aux_layers: tuple = ()):
    paths = sorted(glob.glob(os.path.join(_hidden_dir(work, split, aux_layers), pattern)))
    if not paths:
        raise FileNotFoundError(f"no hidden-state shards in {work}/hidden-{split}: run the data stage")
    return data_lib.load_hidden(paths)


def held_out_eval(loss_fn, trainable, frozen, work: str, tc: trainer.TrainConfig,
                  aux_layers: tuple = (), held=None):
    """Teacher-forced held-out metrics (answer tokens only with ``tc.answer_only``): over all
    held-out sequences, and separately over the self-distilled chat answers (what acceptance is
    measured on) and the wiki extracts; with ``held`` (a broad-corpus ``RaggedSet``) over all of
    it, its greedy answers, and each domain's greedy answers."""
    out = {}
    if held is not None:
        greedy = np.array([t == 0 for t in _temperatures(held)])
        parts = {"all": held, "greedy": held.subset(greedy)}
        parts.update({f"domain:{d}": held.subset(greedy & (held.domains == d))
                      for d in sorted(set(held.domains))})
        for name, part in parts.items():
            if len(part) >= tc.batch_size:
                out[name] = trainer.evaluate(loss_fn, trainable, frozen, part, tc.batch_size,
                                             tc.seq_len)
        return out
    for name, pattern in (("all", "*.npz"), ("chat", "corpus-0*.npz"), ("wiki", "corpus-wiki.npz")):
        try:
            data = load_split(work, "held_out", pattern, aux_layers)
        except FileNotFoundError:
            continue
        out[name] = trainer.evaluate(loss_fn, trainable, frozen, data, tc.batch_size, tc.seq_len)
    return out


def _temperatures(data) -> list:
    temps = []
    for d in data.dirs:
        with open(os.path.join(d, "meta.json")) as f:
            temps += json.load(f)["temperature"]
    return [temps[r] for r in data.rows]


def acceptance_eval(target, tok, draft, method: str, ks=(1, 3), num_prompts: int = 8,
                    max_new_tokens: int = 96, rounds: int = 3):
    """Mean accepted length and speedup by actually running speculative decoding (greedy) on
    held-out chat prompts. Timing (specjax.timing.interleaved_rounds): a pass runs every prompt
    once at batch 1; plain and each k are warmed up, then timed in ``rounds`` interleaved rounds.
    ``speedup`` is the median per-round plain / speculative ratio, ``speedup_spread`` its median,
    min and max, ``max_foreign_cpu`` the largest CPU share other processes used meanwhile."""
    prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=num_prompts)]
    kw = dict(max_new_tokens=max_new_tokens, eos_token_id=[])

    def one_pass(**extra):
        return [sj.generate(target, [p], **kw, **extra) for p in prompts]

    runs = {"plain": one_pass}
    runs.update({k: (lambda k=k: one_pass(draft=draft, method=method, num_draft_tokens=k))
                 for k in ks})
    timed = timing.interleaved_rounds(runs, rounds=rounds)
    plain = timed["plain"]
    want = [o.tokens[0] for o in plain["result"]]
    res = {}
    for k in ks:
        outs = timed[k]["result"]
        sp = timing.paired_speedup(plain["wall_s"], timed[k]["wall_s"])
        res[f"k={k}"] = {"mean_accepted_length": float(np.mean([o.stats["mean_accepted_length"]
                                                                 for o in outs])),
                         "speedup": sp["median"], "speedup_spread": sp,
                         "max_foreign_cpu": timing.max_foreign(plain, timed[k]),
                         "identical_to_plain": [o.tokens[0] for o in outs] == want}
    return res


def init_trainable_head(target, hcfg, seed: int = 0, vocab=None) -> dict:
    """A head's starting params (without ``draft_vocab``): the block from the target's last layer
    (a strong start for a next-token predictor). EAGLE-3: the feature half of the midlayer's
    [2E, .] q/k/v from that layer too (the embedding half random), and its own lm_head starts as
    the target's output projection on the draft vocabulary ``vocab`` ([Vd] ids, None = all)."""
    params = init_head(hcfg, jax.random.key(seed), dtype=target.dtype)
    params.pop("draft_vocab", None)
    last = target.params["layers"][-1]
    e = hcfg.layer.hidden_size
    layer = {}
    for k, v in params["layer"].items():
        if k in last and last[k].shape == v.shape:
            layer[k] = last[k]
        elif k in ("wq", "wk", "wv") and k in last and v.shape[0] == 2 * last[k].shape[0]:
            layer[k] = v.at[e:].set(last[k])  # rows: [embedding half; feature half]
        else:
            layer[k] = v
    params["layer"] = layer
    if hcfg.kind == "eagle3":
        params["lm_head"] = output_matrix(target.params, target.config, vocab).astype(target.dtype)
    return params


def _start_head(target, hcfg, path: str, draft_vocab: int):
    """The head at ``path`` in the target's dtype, to start a run from; ValueError naming
    ``init_from`` when it is not a head of ``hcfg``'s kind and features, or its draft vocabulary
    size is not ``draft_vocab`` (0: whatever it has)."""
    start = load_draft(path, target)
    if not isinstance(start, Head):
        raise ValueError(f"init_from {path!r} is a draft LLM, not a {hcfg.kind} head")
    for field in ("kind", "norms", "fc_bias", "aux_layers"):
        got, want = getattr(start.config, field), getattr(hcfg, field)
        if got != want:
            raise ValueError(f"init_from {path!r} has {field}={got!r}; this run trains {want!r}")
    size = start.config.draft_vocab_size
    if draft_vocab and size != draft_vocab:
        raise ValueError(f"init_from {path!r} has a draft vocabulary of {size or 'all'} tokens; "
                         f"draft_vocab asks for {draft_vocab} (0 keeps the head's)")
    return start


def _params_like(start, template: dict, path: str) -> dict:
    """``start``'s trainable params (no ``draft_vocab``), ValueError unless shaped like
    ``template``."""
    params = {k: v for k, v in start.params.items() if k != "draft_vocab"}
    got, want = (jax.tree.map(lambda x: x.shape, t) for t in (params, template))
    if got != want:
        raise ValueError(f"init_from {path!r}: parameter shapes {got} differ from this run's {want}")
    return params


def train_head(target, tok, work: str, out: str, kind: str, norms: bool, tc: trainer.TrainConfig,
               eval_prompts: int = 8, draft_vocab: int = 0, run_name: str | None = None,
               data=None, aux_layers: tuple | None = None, init_from: str | None = None):
    """Trains a head; ``draft_vocab`` > 0 restricts it to that many of the most frequent answer
    tokens of the training data (plus EOS). ``data``: (train, held_out) ``RaggedSet``s from
    ``prepare_broad`` (default: the hidden states ``prepare`` left under ``work``);
    ``eval_prompts`` = 0 skips the decoding-based acceptance check. An EAGLE-3 head (``kind="eagle3"``, hidden states
    from ``prepare(..., aux_layers=default_aux_layers(L))``) is saved in the reference layout
    (``save_eagle3``: vLLM / SGLang load it); the others in specjax's format. ``aux_layers``
    (EAGLE-3): the layers it fuses, default ``default_aux_layers(L)``; any subset of those and
    L (the final hidden state), read from the stored default features (the features ablation).
    ``init_from``: start from this head checkpoint (any ``load_draft`` head path of the same kind,
    features and shapes; its draft vocabulary too) instead of the target's last layer: continue
    or fine-tune a head, e.g. teacher-forced first, then with the training-time test.
    """
    hcfg = HeadConfig.for_target(target.config, kind, norms=norms, aux_layers=aux_layers)
    stored = default_aux_layers(target.config.num_layers) if kind == "eagle3" else ()
    if stored:
        trainer.feature_blocks(hcfg, target.config.num_layers, stored)  # ValueError early
    train, held = data if data is not None else (load_split(work, "train", aux_layers=stored), None)
    n_train = len(train) if held is not None else len(train["tokens"])
    vocab, start = None, None
    if init_from is not None:
        start = _start_head(target, hcfg, init_from, draft_vocab)
        vocab = start.params.get("draft_vocab")
    elif draft_vocab:
        eos = tok.eos_token_id if isinstance(tok.eos_token_id, int) else None
        vocab = jnp.asarray(data_lib.draft_vocab(train, draft_vocab, target.config.vocab_size,
                                                 always=() if eos is None else (eos,)))
    if vocab is not None:
        hcfg = dataclasses.replace(hcfg, draft_vocab_size=int(vocab.shape[0]))
    params = init_trainable_head(target, hcfg, tc.seed, vocab)
    if start is not None:
        params = _params_like(start, params, init_from)
    name = f"{kind}-{'norms' if norms else 'nonorms'}" + (f"-v{draft_vocab or len(vocab)}" if vocab is not None else "")
    if stored and hcfg.aux_layers != stored:
        name += "-aux" + "_".join(map(str, hcfg.aux_layers))

    def with_vocab(p):
        return p if vocab is None else dict(p, draft_vocab=vocab)

    def loss_fn(p, tp, tokens, lengths, hidden, plens):
        return trainer.head_loss(with_vocab(p), hcfg, tp, target.config, tokens, lengths, hidden,
                                 tc, plens, stored_layers=stored)

    def eval_fn(p, tp, tokens, lengths, hidden, plens):
        return trainer.head_loss(with_vocab(p), hcfg, tp, target.config, tokens, lengths, hidden,
                                 tc, plens, exact_top1=True, stored_layers=stored)

    t0 = time.perf_counter()
    run_dir = os.path.join(work, run_name or f"run-{name}")
    params = trainer.fit(loss_fn, params, target.params, train, tc, run_dir, describe=name,
                         signature={"head": hcfg.to_dict(), "sequences": n_train,
                                    **({"init_from": os.path.abspath(init_from)}
                                       if init_from is not None else {})})
    train_time = time.perf_counter() - t0
    metrics = held_out_eval(eval_fn, params, target.params, work, tc, stored, held)
    head = Head(params=with_vocab(params), config=hcfg)
    accept = (acceptance_eval(target, tok, head, kind, num_prompts=eval_prompts)
              if eval_prompts else None)
    if held is not None:
        lens, plens = train.lengths, train.prompt_lens
    else:
        lens, plens = train["lengths"], train["prompt_lens"]
    report = {"name": name, "kind": kind, "norms": norms, "draft_vocab": draft_vocab,
              "train_config": dataclasses.asdict(tc),
              "train_tokens": int(lens.sum()), "train_answer_tokens": int((lens - plens).sum()),
              "train_sequences": n_train, "train_time_s": train_time, "init_from": init_from,
              "held_out": metrics, "acceptance": accept}
    (save_eagle3 if kind == "eagle3" else save_head)(head, out)
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=float)
    print(json.dumps(report, indent=2, default=float), flush=True)
    return report


def train_draft(target, tok, work: str, out: str, num_layers: int, tc: trainer.TrainConfig,
                eval_prompts: int = 8, run_name: str | None = None):
    # student layers start from evenly spaced target layers; embedding + lm_head shared, frozen
    picks = np.linspace(0, target.config.num_layers - 1, num_layers).round().astype(int).tolist()
    cfg = target.config.with_layers(picks)
    trainable = {"layers": [dict(target.params["layers"][i]) for i in picks],
                 "norm": target.params["norm"]}
    frozen = {k: v for k, v in target.params.items() if k not in ("layers", "norm")}
    train = load_split(work, "train")

    def loss_fn(p, tp, tokens, lengths, hidden, plens):
        return trainer.draft_loss(p, tp, target.config, cfg, tokens, lengths, hidden, tc, plens)

    t0 = time.perf_counter()
    run_dir = os.path.join(work, run_name or f"run-draft{num_layers}")
    trainable = trainer.fit(loss_fn, trainable, target.params, train, tc, run_dir,
                            describe=f"draft{num_layers}",
                            signature={"layers": num_layers, "sequences": len(train["tokens"])})
    train_time = time.perf_counter() - t0
    metrics = held_out_eval(loss_fn, trainable, target.params, work, tc)
    params = dict(frozen, **trainable)
    draft = Model(params=params, config=cfg, source=out)
    accept = acceptance_eval(target, tok, draft, "draft", num_prompts=eval_prompts)
    # ship only what was trained (float16): the embedding/lm_head are the target's
    save_checkpoint(out, jax.tree.map(lambda a: np.asarray(a, np.float16), trainable), cfg,
                    kind="draft_llm", extra={"init_layers": picks, "shares": sorted(frozen)})
    report = {"name": f"draft{num_layers}", "init_layers": picks, "train_tokens": int(train["lengths"].sum()),
              "train_answer_tokens": int((train["lengths"] - train["prompt_lens"]).sum()),
              "train_time_s": train_time, "held_out": metrics, "acceptance": accept}
    with open(os.path.join(out, "report.json"), "w") as f:
        json.dump(report, f, indent=2, default=float)
    print(json.dumps(report, indent=2, default=float), flush=True)
    return report
