"""Gemma 3 270M KV memory in the engine, with and without window page release, *measured* from the
engine's allocators (specjax.engine.kv_groups) on one long greedy generation.

One request (held-out Wikipedia intros concatenated into a ``--prompt-tokens`` prompt, then
``--max-new-tokens`` greedy tokens, plain decoding) runs through an ``Engine`` twice: window page
release on (the default) and off (``window_page_release=False``: one KV group, every page of every
layer kept). After every step the request's callback reads the pages in use of the global pool and
of the sliding layers' pool; KV bytes in use = pages in use x page bytes of the layers each pool
serves (K and V, the pools' dtype). Also the pools' allocated bytes (the arrays the engine holds)
and ``bench_gemma.kv_bytes``'s prediction beside the measurement. The two outputs must be equal
token for token (release is exact).

  python benchmarks/bench_gemma_kv.py --json benchmarks/results/gemma3_270m_kv.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import specjax as sj
from specjax.config import SpecConfig
from specjax.engine import Engine, EngineConfig, RequestParams
from specjax.provenance import with_provenance
from specjax.train.corpora import wiki_entries


def kv_bytes(cfg, context: int, page_size: int = 16, release: bool = False,
             itemsize: int = 4) -> int:
    """Predicted KV bytes of one ``context``-token sequence (pages of ``page_size``); with
    ``release`` a sliding layer keeps only the pages its window (plus the page being written)
    still reads (the formula of benchmarks/bench_gemma.py, computed from the config)."""
    per_token = 2 * cfg.num_kv_heads * cfg.head_dim * itemsize  # K and V
    total = 0
    for i in range(cfg.num_layers):
        w = cfg.window(i)
        tokens = context if (w is None or not release) else min(context, w + page_size)
        total += -(-tokens // page_size) * page_size * per_token
    return total


def prompt_tokens(tok, n: int) -> list:
    ids = []
    for e in wiki_entries("held_out"):
        ids += tok.encode(e["extract"] + "\n\n", add_special_tokens=not ids)
        if len(ids) >= n:
            return ids[:n]
    raise ValueError(f"the held-out intros hold fewer than {n} tokens")


def measure(target, prompt, max_new: int, release: bool, page_size: int) -> dict:
    cfg = target.config
    engine = Engine(target, None, EngineConfig(
        SpecConfig(method="none", page_size=page_size), max_slots=1,
        max_model_len=len(prompt) + max_new, window_page_release=release))
    kv = engine._state.target_kv
    sliding = [cfg.window(i) is not None for i in range(cfg.num_layers)]
    itemsize = kv.k[0].dtype.itemsize
    page_bytes = 2 * cfg.num_kv_heads * page_size * cfg.head_dim * itemsize  # one layer's K+V page
    n_global = sum(not s for s in sliding) if engine.window is not None else cfg.num_layers
    n_window = cfg.num_layers - n_global
    samples = []

    def observe(handle, new):
        occ = engine.occupancy()
        used_w = occ.get("kv_window_pages_in_use", 0)
        samples.append(dict(
            tokens=len(prompt) + len(handle.tokens), global_pages=occ["kv_pages_in_use"],
            window_pages=used_w,
            bytes=(occ["kv_pages_in_use"] * n_global + used_w * n_window) * page_bytes))

    h = engine.submit(prompt, RequestParams(max_tokens=max_new, stop_token_ids=()),
                      callback=observe)
    engine.run()
    pool_bytes = sum(int(np.prod(x.shape)) * itemsize for x in kv.k + kv.v)
    last = [s for s in samples if s["global_pages"]][-1]  # the last step before the free
    w = engine.window
    return dict(
        release=release, tokens=list(h.result()), samples=len(samples),
        context=last["tokens"], global_pages_in_use=last["global_pages"],
        window_pages_in_use=last["window_pages"],
        kv_bytes_in_use=last["bytes"], max_kv_bytes_in_use=max(s["bytes"] for s in samples),
        kv_bytes_per_token=last["bytes"] / last["tokens"], pool_bytes_allocated=pool_bytes,
        global_pool_pages=engine.allocator.num_pages,
        window_pool_pages=None if w is None else w.num_pages,
        window_pages_released=None if w is None else w.num_released,
        window_max_live_pages=None if w is None else w.max_live,
        window_bound_per_slot=None if w is None else w.per_slot,
        predicted_kv_bytes=kv_bytes(cfg, last["tokens"], page_size, release, itemsize),
        sliding_layers=n_window if w is not None else sum(sliding), layers=cfg.num_layers,
        window=cfg.sliding_window, page_size=page_size, dtype=str(kv.k[0].dtype))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--prompt-tokens", type=int, default=1536)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args(argv)

    target = sj.load_model(args.model)
    tok = sj.load_tokenizer(args.model)
    prompt = prompt_tokens(tok, args.prompt_tokens)
    rows = [measure(target, prompt, args.max_new_tokens, r, args.page_size) for r in (True, False)]
    on, off = rows
    identical = on.pop("tokens") == off.pop("tokens")
    for r in rows:
        print(f"release={r['release']!s:5} context {r['context']}: KV in use "
              f"{r['kv_bytes_in_use'] / 2**20:.1f} MiB ({r['kv_bytes_per_token'] / 1024:.1f} KiB/token; "
              f"predicted {r['predicted_kv_bytes'] / 2**20:.1f} MiB), pages in use global "
              f"{r['global_pages_in_use']} window {r['window_pages_in_use']}, pools allocated "
              f"{r['pool_bytes_allocated'] / 2**20:.1f} MiB")
    print(f"release keeps {on['kv_bytes_in_use'] / off['kv_bytes_in_use']:.3f} of the KV; "
          f"outputs identical: {identical}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        result = dict(rows=rows, identical_outputs=identical, prompt_tokens=len(prompt),
                      max_new_tokens=args.max_new_tokens, model=args.model,
                      ratio_in_use=on["kv_bytes_in_use"] / off["kv_bytes_in_use"],
                      ratio_allocated=on["pool_bytes_allocated"] / off["pool_bytes_allocated"])
        with open(args.json, "w") as f:
            json.dump(with_provenance(result, " ".join(["python"] + sys.argv)), f, indent=2,
                      default=str)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
