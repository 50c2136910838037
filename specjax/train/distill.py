"""Self-distilled answers at scale: the target answers broad-domain prompts, in resumable shards.

``generate_corpus`` takes the prompts of ``specjax.train.prompts.broad_prompts`` in their fixed
order, cuts them into shards of ``shard_size``, and for each missing shard runs the target's
fused decoding loop (``sj.generate``) at a high batch size: prompts sorted by length inside the
shard (less padding), half of each batch greedy and half sampled at ``temperature``, so a head
sees both the target's argmax continuations and its spread. A shard is written atomically as
``answers-XXXXX.jsonl.gz`` (gzip, one JSON row per prompt: ids, prompt_len, domain, source,
temperature; ~30k answer tokens in ~100 KB), so the job can be stopped at any time and restarted
with the same command; it runs for days if need be, a few shards per session. The shards are
small enough to commit (``checkpoints/corpus/``), which is how a corpus outlives the machine it
was generated on. Progress (answers, new tokens, tokens/s) goes to stderr.

Run it in the background, at low priority so it only takes idle CPU::

    nice -n 19 python -m specjax.train.distill --out checkpoints/corpus/broad --split train

The prompt list depends on the interpreter (code prompts come from the running CPython's
standard library), so a machine with another Python would number the shards differently. For
such a machine (the GPU one: Python 3.12) the prompts travel pre-encoded:
``--export-prompts FILE`` writes a split's chat-templated ids, domains and sources here
(``save_prompts``, a compressed npz), and ``--prompts-file FILE`` answers exactly those there,
shard i holding the same prompts as shard i here. ``--budget-s`` stops starting shards after
that many seconds (a run inside a time-limited call ends with whole shards only).
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import logging
import os
import time

import numpy as np

import specjax as sj
from specjax.engine import Engine, EngineConfig, RequestParams
from specjax.train.prompts import broad_prompts

log = logging.getLogger("specjax.distill")


def shard_path(out_dir: str, i: int) -> str:
    return os.path.join(out_dir, f"answers-{i:05d}.jsonl.gz")


def shard_files(out_dir: str) -> list[str]:
    """The finished shards of a corpus directory in shard order (``.jsonl.gz``, or plain
    ``.jsonl`` written by older versions)."""
    paths = glob.glob(os.path.join(out_dir, "answers-*.jsonl")) + glob.glob(
        os.path.join(out_dir, "answers-*.jsonl.gz"))
    return sorted(paths, key=lambda p: os.path.basename(p).split(".")[0])


def read_rows(path: str) -> list[dict]:
    """The rows of one shard (``.jsonl`` or ``.jsonl.gz``)."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_shards(out_dir: str) -> list[dict]:
    """Every finished row of a corpus directory, in shard order."""
    return [r for path in shard_files(out_dir) for r in read_rows(path)]


def encode_prompts(tok, split: str = "train") -> list[dict]:
    """The split's broad prompts in corpus order, chat-templated: dicts {ids, domain, source}."""
    return [{"ids": tok.apply_chat_template(p["messages"]), "domain": p["domain"],
             "source": p["source"]} for p in broad_prompts(split)]


def save_prompts(path: str, rows: list[dict]) -> None:
    """Writes encoded prompts (``encode_prompts``) as a compressed npz: ids [Ntok] int32,
    offsets [N+1] int64, domain / source [N] str (no pickled objects)."""
    ids = [np.asarray(r["ids"], np.int32) for r in rows]
    np.savez_compressed(path, ids=np.concatenate(ids) if ids else np.zeros((0,), np.int32),
                        offsets=np.concatenate([[0], np.cumsum([len(x) for x in ids])]).astype(np.int64),
                        domain=np.array([r["domain"] for r in rows]),
                        source=np.array([r["source"] for r in rows]))


def load_prompts(path: str) -> list[dict]:
    """The rows ``save_prompts`` wrote, in order."""
    with np.load(path) as z:
        ids, off = z["ids"], z["offsets"]
        return [{"ids": ids[off[i]:off[i + 1]].tolist(), "domain": str(d), "source": str(s)}
                for i, (d, s) in enumerate(zip(z["domain"], z["source"]))]


def generate_corpus(target, tok, out_dir: str, *, split: str = "train", num_shards: int | None = None,
                    first_shard: int = 0, shard_size: int = 256, batch_size: int = 64,
                    max_new_tokens: int = 192, temperature: float = 0.7, max_prompt_tokens: int = 448,
                    seed: int = 0, engine_slots: int = 0, prompts: list[dict] | None = None,
                    budget_s: float | None = None) -> list[str]:
    """Writes missing answer shards ``first_shard .. first_shard + num_shards - 1``.

    Args:
      target, tok: the target Model and its tokenizer (chat template, EOS).
      split: prompt split ("train" or "held_out").
      num_shards: how many shards (None: all the split's prompts).
      shard_size, batch_size: prompts per shard / per ``sj.generate`` call.
      max_new_tokens: answer length cap; temperature: the sampled half's temperature.
      max_prompt_tokens: longer prompts are skipped (recorded as skipped in the log).
      engine_slots: > 0: answer through ``specjax.engine.Engine`` with that many slots (a
        request's sampled stream is seeded per prompt, so a shard is reproducible).
      prompts: pre-encoded prompts (``encode_prompts`` / ``load_prompts``) instead of building
        ``split``'s here.
      budget_s: no shard starts once this many seconds have passed (None: no limit).
    Returns:
      the shard paths written or found (finished ones included; not those the budget skipped).
    """
    if shard_size < 1 or batch_size < 1 or max_new_tokens < 1:
        raise ValueError("shard_size, batch_size and max_new_tokens must be >= 1")
    os.makedirs(out_dir, exist_ok=True)
    started = time.perf_counter()
    prompts = encode_prompts(tok, split) if prompts is None else prompts
    total_shards = -(-len(prompts) // shard_size)
    last = total_shards if num_shards is None else min(total_shards, first_shard + num_shards)
    eos = tok.eos_token_id
    engine = None
    if engine_slots > 0:
        engine = Engine(target, config=EngineConfig(
            max_slots=engine_slots, max_model_len=max_prompt_tokens + max_new_tokens,
            token_buckets=(64, 256), max_prefill_tokens=1024))
    paths = []
    for s in range(first_shard, last):
        path = shard_path(out_dir, s)
        if os.path.exists(path) or os.path.exists(path[:-len(".gz")]):
            paths.append(path)
            continue
        if budget_s is not None and time.perf_counter() - started > budget_s:
            log.warning("time budget of %.0f s spent: stopping before shard %d", budget_s, s)
            break
        paths.append(path)
        chunk = prompts[s * shard_size:(s + 1) * shard_size]
        kept = [(p, p["ids"]) for p in chunk if len(p["ids"]) <= max_prompt_tokens]
        kept.sort(key=lambda r: len(r[1]))
        rows, t0, new_tokens = [], time.perf_counter(), 0
        if engine is not None:
            temps = [0.0 if i % 2 == 0 else temperature for i in range(len(kept))]
            handles = [engine.submit(ids, RequestParams(
                max_tokens=max_new_tokens, temperature=t, seed=seed + s * shard_size + i,
                stop_token_ids=(eos,))) for i, ((_, ids), t) in enumerate(zip(kept, temps))]
            engine.run()
            for (p, ids), h, t in zip(kept, handles, temps):
                ans = h.result()
                rows.append({"ids": ids + ans, "prompt_len": len(ids), "domain": p["domain"],
                             "source": p["source"], "temperature": t})
                new_tokens += len(ans)
        for b0 in range(0, len(kept) if engine is None else 0, batch_size):
            batch = kept[b0:b0 + batch_size]
            temps = [0.0 if (b0 + i) % 2 == 0 else temperature for i in range(len(batch))]
            out = sj.generate(target, [ids for _, ids in batch], max_new_tokens=max_new_tokens,
                              temperature=temps, seed=seed + s * shard_size + b0, eos_token_id=eos)
            for (p, ids), ans, t in zip(batch, out.tokens, temps):
                rows.append({"ids": ids + ans, "prompt_len": len(ids), "domain": p["domain"],
                             "source": p["source"], "temperature": t})
                new_tokens += len(ans)
        with open(path + ".tmp", "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
        os.replace(path + ".tmp", path)
        dt = time.perf_counter() - t0
        log.warning("%s: %d answers (%d prompts too long), %d new tokens in %.0fs (%.0f tokens/s, "
                    "load %.1f)", path, len(rows), len(chunk) - len(kept), new_tokens, dt,
                    new_tokens / dt, os.getloadavg()[0])
    return paths


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None, help="corpus directory (answers-XXXXX.jsonl.gz shards)")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--split", default="train", choices=("train", "held_out"))
    ap.add_argument("--shards", type=int, default=None, help="how many shards (default: all)")
    ap.add_argument("--first-shard", type=int, default=0)
    ap.add_argument("--shard-size", type=int, default=256)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--engine-slots", type=int, default=0,
                    help="> 0: continuous batching through the serving engine with that many slots")
    ap.add_argument("--prompts-file", default=None,
                    help="answer these pre-encoded prompts (written by --export-prompts) instead "
                         "of building --split's here")
    ap.add_argument("--export-prompts", default=None, metavar="FILE",
                    help="only write --split's encoded prompts to FILE (.npz) and exit")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no shard after this many seconds")
    args = ap.parse_args(argv)
    if not args.out and not args.export_prompts:
        ap.error("--out is required (or --export-prompts FILE)")
    logging.basicConfig(format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")

    tok = sj.load_tokenizer(args.model)
    if args.export_prompts:
        rows = encode_prompts(tok, args.split)
        save_prompts(args.export_prompts, rows)
        log.warning("%s: %d %s prompts", args.export_prompts, len(rows), args.split)
        return
    target = sj.load_model(args.model)
    generate_corpus(target, tok, args.out, split=args.split, num_shards=args.shards,
                    first_shard=args.first_shard, shard_size=args.shard_size,
                    batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                    temperature=args.temperature, engine_slots=args.engine_slots,
                    prompts=load_prompts(args.prompts_file) if args.prompts_file else None,
                    budget_s=args.budget_s)


if __name__ == "__main__":
    main()
