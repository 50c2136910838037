"""Serving benchmark for ``specjax serve`` (after vLLM's ``benchmark_serving``): speculation on vs off.

For each mode ("off" = method none, "on" = the given speculative method) a server is started in
a subprocess (or ``--base-url`` points at a running one), warmed up, and driven by an async
client: requests from a fixed prompt set arrive as a Poisson process at each ``--rates`` value
(requests/s; ``inf`` = all at once), each a streamed completion of exactly ``--max-tokens``
tokens (greedy, ``ignore_eos``). Per request the client measures TTFT (first text chunk), the
gaps between chunks (inter-token latency, ITL: a speculative step delivers several tokens in one
chunk, as in vLLM), TPOT = (e2e - TTFT) / (tokens - 1) and e2e latency. Reported per mode and
rate: request and output-token throughput, mean / p50 / p90 / p99 of TTFT, ITL, TPOT and e2e,
and the server's mean accepted length (``/stats``).

Workloads and modes (vLLM users' daily ones): ``--workload shared-prefix`` puts one long system
prompt (~1,500 characters) before every request, so ``--prefix-cache on`` (the server's
``--enable-prefix-caching``) can reuse its pages (the server's prefix-cache hit rate is reported);
``--structured-frac F`` gives that fraction of requests ``response_format: json_object`` (mixed
with free ones; each structured answer must parse as JSON); ``--disconnect-frac F`` makes that
fraction of clients drop their stream after 1-5 chunks. After each run the client waits for the
server to go idle and checks that every request that did not disconnect completed ("lost" counts
those that did not) and that no KV page stays in use ("pages in use after").

    python benchmarks/bench_serve.py --tiny --rates 4,inf --num-prompts 16      # seconds, CPU
    python benchmarks/bench_serve.py --tiny --workload shared-prefix --prefix-cache off,on \
        --structured-frac 0.25 --disconnect-frac 0.2 --rates inf --num-prompts 64 --max-slots 8
    python benchmarks/bench_serve.py --draft checkpoints/smollm2-mtp-v8k --method mtp -k 1 \\
        --rates 1,4,16,inf --num-prompts 64 --json benchmarks/results/serve.json

Timings on a shared / contended machine are not performance results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np

from specjax.timing import Timer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = os.path.join(ROOT, "benchmarks", "data", "smollm2_prompts.json")


def write_tiny(path: str) -> dict:
    """A tiny random target, its 1-layer early-exit draft and a character tokenizer (ChatML)."""
    sys.path.insert(0, ROOT)
    import jax  # noqa: PLC0415
    import tokenizers  # noqa: PLC0415

    import specjax as sj  # noqa: PLC0415
    from specjax.io.checkpoint import save_checkpoint  # noqa: PLC0415
    from specjax.model import Model, init_params  # noqa: PLC0415

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?\n:'-")
    vocab = {t: i for i, t in enumerate(special + chars)}
    cfg = sj.ModelConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=2048,
                         eos_token_id=2)
    target = Model(init_params(cfg, jax.random.key(0), scale=0.3), cfg)
    draft = sj.early_exit_draft(target, 1)
    save_checkpoint(os.path.join(path, "target"), target.params, target.config)
    save_checkpoint(os.path.join(path, "draft"), draft.params, draft.config)
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token=None))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in special])
    tok.decoder = tokenizers.decoders.Fuse()
    os.makedirs(os.path.join(path, "tok"), exist_ok=True)
    tok.save(os.path.join(path, "tok", "tokenizer.json"))
    with open(os.path.join(path, "tok", "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "chat_template":
                   "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                   "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                   "{% endif %}"}, f)
    return {"model": os.path.join(path, "target"), "tokenizer": os.path.join(path, "tok"),
            "draft": os.path.join(path, "draft"), "method": "draft", "k": 3}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SYSTEM = ("You are a careful assistant for a public library. Answer in plain English, in short "
          "paragraphs, without lists unless the user asks for one. When a question is about a "
          "book, name its author and the year it was first published if you know them; when you "
          "do not know, say so instead of guessing. Keep a friendly tone, avoid jargon, and "
          "explain any technical word you must use. If a question is ambiguous, answer the most "
          "likely reading and mention the other briefly. Never invent quotations, page numbers "
          "or catalogue identifiers. For questions about opening hours, borrowing rules or fees, "
          "tell the user to check the front desk, because these change during the year. For "
          "homework questions, explain the idea and give a small example rather than the final "
          "answer. Stay polite when the user is rude, and keep answers under two hundred words "
          "unless the user asks for more detail. Remember that many readers are children, so "
          "avoid frightening details, and suggest a related book when it fits the conversation.")


def start_server(args, spec: bool, log_path: str, cache: bool = False):
    import httpx  # noqa: PLC0415

    port = free_port()
    cmd = [sys.executable, "-m", "specjax.cli", "serve", "--model", args.model, "--port", str(port),
           "--served-model-name", "bench", "--max-slots", str(args.max_slots),
           "--max-model-len", str(args.max_model_len), "--max-queue", str(args.num_prompts),
           "--log-level", "warning"]
    if args.tokenizer:
        cmd += ["--tokenizer", args.tokenizer]
    if args.batch_buckets:
        cmd += ["--batch-buckets", args.batch_buckets]
    if cache:
        cmd += ["--enable-prefix-caching"]
    if spec:
        cmd += ["--method", args.method, "-k", str(args.k)] + (["--draft", args.draft] if args.draft else [])
    else:
        cmd += ["--method", "none"]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + args.start_timeout
    while time.time() < deadline and proc.poll() is None:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    with open(log_path) as f:
        raise RuntimeError(f"server did not start: {' '.join(cmd)}\n{f.read()[-3000:]}")


async def one_request(client, url: str, prompt: str, max_tokens: int, chat: bool,
                      system: str | None = None, structured: bool = False,
                      drop_after: int | None = None) -> dict:
    """One streamed request; ``drop_after``: close the stream after that many text chunks."""
    body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": not structured, "stream": True, "stream_options": {"include_usage": True}}
    if structured:
        body["response_format"] = {"type": "json_object"}
    if chat:
        body["messages"] = ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": prompt}]
    else:
        body["prompt"] = (system + "\n\n" if system else "") + prompt
    path = "/v1/chat/completions" if chat else "/v1/completions"
    t0 = time.perf_counter()
    ttft, last, itl, tokens, ok, chunks, text_all = None, None, [], 0, False, 0, []
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "dropped": False}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                ok = True
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if not chunk["choices"]:
                continue
            c = chunk["choices"][0]
            text = c["delta"].get("content") if chat else c["text"]
            if not text:
                continue
            now = time.perf_counter()
            if ttft is None:
                ttft = now - t0
            else:
                itl.append(now - last)
            last = now
            chunks += 1
            text_all.append(text)
            if drop_after is not None and chunks >= drop_after:
                return {"ok": False, "dropped": True}  # leaving the block closes the stream
    e2e = time.perf_counter() - t0
    out = {"ok": ok, "dropped": False, "ttft": ttft, "itl": itl, "e2e": e2e, "tokens": tokens,
           "tpot": (e2e - ttft) / (tokens - 1) if ttft is not None and tokens > 1 else None}
    if structured:
        try:
            json.loads("".join(text_all))
            out["valid_json"] = True
        except ValueError:
            out["valid_json"] = False
    return out


async def run_rate(url: str, prompts: list, rate: float, args) -> dict:
    import httpx  # noqa: PLC0415

    rng = np.random.default_rng(args.seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        tasks = []
        t0 = time.perf_counter()
        system = SYSTEM if args.workload == "shared-prefix" else None
        for i in range(args.num_prompts):
            structured = bool(rng.random() < args.structured_frac)
            drop = int(rng.integers(1, 6)) if rng.random() < args.disconnect_frac else None
            tasks.append(asyncio.create_task(one_request(
                client, url, prompts[i % len(prompts)], args.max_tokens, args.chat, system,
                structured, drop)))
            if np.isfinite(rate):
                await asyncio.sleep(float(rng.exponential(1.0 / rate)))
        results = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    done = [r for r in results if r["ok"]]
    dropped = sum(r["dropped"] for r in results)
    structured = [r for r in done if "valid_json" in r]

    def pct(values):
        a = np.asarray([v for v in values if v is not None], np.float64) * 1000
        if not a.size:
            return None
        return {"mean": float(a.mean()), "p50": float(np.percentile(a, 50)),
                "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}

    out_tokens = sum(r["tokens"] for r in done)
    return {"rate": rate, "completed": len(done), "dropped": dropped,
            "lost": len(results) - len(done) - dropped,
            "structured": len(structured),
            "structured_valid_json": sum(r["valid_json"] for r in structured),
            "wall_s": wall, "request_throughput": len(done) / wall,
            "output_tokens_per_s": out_tokens / wall, "ttft_ms": pct(r["ttft"] for r in done),
            "itl_ms": pct(x for r in done for x in r["itl"]), "tpot_ms": pct(r["tpot"] for r in done),
            "e2e_ms": pct(r["e2e"] for r in done)}


def _idle_stats(url: str, timeout: float = 120.0) -> dict:
    """/stats once the server runs no request (aborted ones are released at the next step)."""
    import httpx  # noqa: PLC0415

    deadline = time.time() + timeout
    while True:
        st = httpx.get(url + "/stats", timeout=30).json()
        if (st["num_requests_running"] == 0 and st["num_requests_waiting"] == 0) \
                or time.time() > deadline:
            return st
        time.sleep(0.2)


def bench_mode(args, spec: bool, prompts: list, workdir: str, cache: bool = False) -> dict:
    import httpx  # noqa: PLC0415

    proc = None
    if args.base_url:
        url = args.base_url.rstrip("/")
    else:
        proc, url = start_server(args, spec, os.path.join(workdir, f"server-{int(spec)}{int(cache)}.log"),
                                 cache)
    try:
        asyncio.run(run_rate(url, prompts[:2], float("inf"),
                             argparse.Namespace(**{**vars(args), "num_prompts": 2})))  # warm path
        rows = []
        for rate in args.rates:
            before = httpx.get(url + "/stats", timeout=30).json()
            with Timer(own_pids=() if proc is None else (proc.pid,)) as timer:
                row = asyncio.run(run_rate(url, prompts, rate, args))
            row["foreign_cpu"] = timer.foreign  # CPU share used by processes other than ours
            after = _idle_stats(url)
            row["pages_in_use_after"] = after.get("kv_cache_usage_perc")
            q = after.get("prefix_cache_queries", 0) - before.get("prefix_cache_queries", 0)
            h = after.get("prefix_cache_hits", 0) - before.get("prefix_cache_hits", 0)
            row["prefix_cache_hit_rate"] = h / q if q else None
            d = after["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
            a = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
            row["mean_accepted_length"] = 1 + a / d if d else None
            rows.append(row)
            print(f"[{'spec' if spec else 'plain'}] rate {rate}: "
                  f"{row['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                  f"{(row['ttft_ms'] or {}).get('p50', float('nan')):.1f} ms, ITL p50 "
                  f"{(row['itl_ms'] or {}).get('p50', float('nan')):.1f} ms, "
                  f"accepted length {row['mean_accepted_length']}, prefix hits "
                  f"{row['prefix_cache_hit_rate']}, lost {row['lost']}, pages in use after "
                  f"{row['pages_in_use_after']}, foreign CPU {row['foreign_cpu']}",
                  file=sys.stderr, flush=True)
        return {"spec": spec, "cache": cache, "method": args.method if spec else "none",
                "rows": rows}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)


def table(results: list) -> str:
    lines = ["| mode | prefix cache (hit rate) | rate (req/s) | done / dropped / lost | "
             "JSON valid | req/s | out tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 ms | "
             "accepted len | pages in use after | foreign CPU |", "|" + "---|" * 13]
    for res in results:
        for r in res["rows"]:
            def p(key, q):
                return f"{r[key][q]:.1f}" if r[key] else "-"
            acc = f"{r['mean_accepted_length']:.2f}" if r["mean_accepted_length"] else "-"
            fc = "-" if r.get("foreign_cpu") is None else f"{100 * r['foreign_cpu']:.0f}%"
            hit = r.get("prefix_cache_hit_rate")
            cache = ("on" if res.get("cache") else "off") + ("" if hit is None else f" ({hit:.2f})")
            js = f"{r['structured_valid_json']}/{r['structured']}" if r["structured"] else "-"
            lines.append(f"| {res['method']} | {cache} | {r['rate']} | "
                         f"{r['completed']} / {r['dropped']} / {r['lost']} | {js} | "
                         f"{r['request_throughput']:.2f} | {r['output_tokens_per_s']:.1f} | "
                         f"{p('ttft_ms', 'p50')} / {p('ttft_ms', 'p99')} | "
                         f"{p('itl_ms', 'p50')} / {p('itl_ms', 'p99')} | {p('tpot_ms', 'p50')} | {acc} | "
                         f"{r.get('pages_in_use_after')} | {fc} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--draft", default=None, help="default: the best shipped draft")
    ap.add_argument("--method", default="mtp")
    ap.add_argument("-k", type=int, default=1)
    ap.add_argument("--tiny", action="store_true", help="a tiny random model (CPU smoke run)")
    ap.add_argument("--base-url", default=None, help="benchmark a running server (one mode)")
    ap.add_argument("--modes", default="off,on", help="off (plain), on (speculative)")
    ap.add_argument("--prefix-cache", default="off", help="off, on or off,on (the server's "
                    "--enable-prefix-caching); each combination with --modes is one server")
    ap.add_argument("--workload", choices=("chat", "shared-prefix"), default="chat",
                    help="shared-prefix: one long system prompt before every request")
    ap.add_argument("--structured-frac", type=float, default=0.0,
                    help="fraction of requests with response_format json_object")
    ap.add_argument("--disconnect-frac", type=float, default=0.0,
                    help="fraction of clients that drop their stream after 1-5 chunks")
    ap.add_argument("--rates", default="1,4,inf",
                    type=lambda s: [float(x) for x in s.split(",")])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--max-slots", type=int, default=8)
    ap.add_argument("--batch-buckets", default=None)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--start-timeout", type=float, default=1200)
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args(argv)
    with open(PROMPTS) as f:
        prompts = json.load(f)["prompts"]
    with tempfile.TemporaryDirectory() as workdir:
        if args.tiny:
            tiny = write_tiny(workdir)
            for key in ("model", "tokenizer", "draft", "method", "k"):
                setattr(args, key, tiny[key])
        modes = [m.strip() for m in args.modes.split(",")]
        caches = [c.strip() == "on" for c in args.prefix_cache.split(",")]
        results = [bench_mode(args, m == "on", prompts, workdir, c) for c in caches for m in modes]
    report = {"args": {k: v for k, v in vars(args).items()}, "results": results,
              "table_md": table(results)}
    print(report["table_md"])
    if args.json:
        from specjax.provenance import with_provenance  # noqa: PLC0415
        with open(args.json, "w") as f:
            json.dump(with_provenance(report), f, indent=2, default=str)
    return report


if __name__ == "__main__":
    main()
