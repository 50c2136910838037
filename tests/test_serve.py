"""``specjax serve``: the OpenAI-compatible server, driven by the official ``openai`` client.

One server subprocess (a tiny random target, its one-layer early-exit draft with method "draft",
k = 3, and a 64-token character tokenizer with a ChatML template, all written to a temp dir)
serves every test in this module on a free loopback port. Greedy outputs are compared with
``sj.generate`` on the same model in this process. The engine is configured with one batch and
one token bucket, so warm-up compiles two step variants and nothing compiles afterwards.
"""

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import specjax as sj  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "tiny"
MAX_LEN = 512  # room for long requests that the client abandons mid-stream
M = 24  # max_tokens of every compared greedy request
# Compared prompts are 17..32 tokens (completion text of 17..30 characters, chat content of at most
# 12): one sj.generate prompt bucket, so the references compile once.
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ .,!?\n:'-")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(path):
    """A 64-token character-level tokenizer (3 special tokens, <|im_end|> = EOS, ChatML)."""
    import tokenizers  # noqa: PLC0415

    vocab = {t: i for i, t in enumerate(SPECIAL + CHARS)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token=None))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIAL])
    tok.decoder = tokenizers.decoders.Fuse()
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "chat_template": CHATML}, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from specjax.io.checkpoint import save_checkpoint  # noqa: PLC0415

    root = tmp_path_factory.mktemp("serve")
    target = tiny_model(0, eos=2)
    draft = sj.early_exit_draft(target, 1)
    save_checkpoint(str(root / "target"), target.params, target.config)
    save_checkpoint(str(root / "draft"), draft.params, draft.config)
    write_tokenizer(str(root / "tok"))
    return {"root": root, "target": target, "tok": sj.load_tokenizer(str(root / "tok"))}


def stop_server(proc, timeout_s: float) -> None:
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()


def start_server(files, *extra, port=None):
    port = port or free_port()
    root = files["root"]
    log = open(root / f"server-{port}.log", "w")
    cmd = [sys.executable, "-m", "specjax.cli", "serve", "--model", str(root / "target"),
           "--tokenizer", str(root / "tok"), "--served-model-name", MODEL, "--port", str(port),
           "--max-slots", "8", "--batch-buckets", "8", "--token-buckets", "16", "--page-size", "4",
           "--max-model-len", str(MAX_LEN), "--log-level", "warning", *extra]
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 600
    while time.time() < deadline:
        if proc.poll() is not None:
            break
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not start:\n{(root / f'server-{port}.log').read_text()[-4000:]}")


@pytest.fixture(scope="module")
def server(files):
    proc, url = start_server(files, "--draft", str(files["root"] / "draft"), "--method", "draft",
                             "-k", "3")
    yield url
    stop_server(proc, 30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=120)


_REFS = {}


def reference(files, ids, max_tokens=M):
    """Greedy tokens of ``ids`` run alone with sj.generate (plain decoding, the model's EOS)."""
    key = (tuple(ids), max_tokens)
    assert 17 <= len(ids) <= 32, len(ids)  # one prompt bucket: one compile
    if key not in _REFS:
        _REFS[key] = sj.generate(files["target"], [list(ids)], max_new_tokens=max_tokens).tokens[0]
    return _REFS[key]


def chat_ids(files, text):
    return files["tok"].apply_chat_template([{"role": "user", "content": text}])


def stats(url):
    return httpx.get(url + "/stats", timeout=30).json()


def health(url):
    return httpx.get(url + "/health", timeout=30).json()


# ------------------------------------------------------------------------------ correctness


def test_completions_and_chat_equal_generate(files, server, client):
    """Completion and chat, streamed and not: greedy text = sj.generate's; usage counts right;
    the generated-token counter grows by exactly the completion tokens reported."""
    tok = files["tok"]
    before = stats(server)["generation_tokens_total"]
    reported = 0
    for text, short in (("Hello there, how are", "Hi there"),
                        ("What colour is the sky?", "Sky colour?")):
        ids = tok.encode(text)
        want = reference(files, ids)
        res = client.completions.create(model=MODEL, prompt=text, max_tokens=M, temperature=0)
        assert res.choices[0].text == tok.decode(want)
        assert res.choices[0].finish_reason == ("stop" if want[-1] == 2 else "length")
        assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(ids), len(want))
        reported += res.usage.completion_tokens
        chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=M,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True}))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == tok.decode(want)
        assert chunks[-1].usage.completion_tokens == len(want)
        assert len([c for c in chunks if c.choices]) <= len(want)  # one chunk per token batch
        reported += len(want)

        cids = chat_ids(files, short)
        want = reference(files, cids)
        msgs = [{"role": "user", "content": short}]
        res = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=M, temperature=0)
        assert res.choices[0].message.content == tok.decode(want)
        assert res.choices[0].message.role == "assistant"
        assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (len(cids), len(want))
        reported += len(want)
        stream = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=M,
                                                temperature=0, stream=True)
        got = "".join(c.choices[0].delta.content or "" for c in stream)
        assert got == tok.decode(want)
        reported += len(want)
    assert stats(server)["generation_tokens_total"] - before == reported


def test_stop_strings_and_stop_token_ids(files, server, client):
    tok = files["tok"]
    ids = tok.encode("Tell me a story, please")
    want = reference(files, ids)
    text = tok.decode(want)
    # a stop string from the middle of the expected text: the text is cut before it
    stop = text[len(text) // 2:len(text) // 2 + 2]
    for stream in (False, True):
        if stream:
            chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=M,
                                                    temperature=0, stop=[stop], stream=True))
            got = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            res = client.completions.create(model=MODEL, prompt=ids, max_tokens=M, temperature=0,
                                            stop=stop)
            got, reason = res.choices[0].text, res.choices[0].finish_reason
        assert got == text[:text.index(stop)] and reason == "stop"
    # a stop token id (vLLM's stop_token_ids; also accepted as ints in "stop")
    j = len(want) // 2
    res = client.completions.create(model=MODEL, prompt=ids, max_tokens=M, temperature=0,
                                    extra_body={"stop_token_ids": [want[j]]})
    first = want.index(want[j])
    assert res.choices[0].text == tok.decode(want[:first]) and res.choices[0].finish_reason == "stop"
    assert res.usage.completion_tokens == first + 1
    # ignore_eos: generation runs to max_tokens whatever the model emits
    res = client.completions.create(model=MODEL, prompt=ids, max_tokens=M, temperature=0.9, seed=3,
                                    extra_body={"ignore_eos": True, "top_k": 5})
    assert res.usage.completion_tokens == M and res.choices[0].finish_reason == "length"


BAD = [  # (json body or raw bytes, path, expected param)
    ({"model": "gpt-4", "prompt": "hi"}, "completions", "model"),
    ({"model": MODEL, "prompt": ""}, "completions", "prompt"),
    ({"model": MODEL, "prompt": []}, "completions", "prompt"),
    ({"model": MODEL, "prompt": "a" * MAX_LEN}, "completions", "prompt"),
    ({"model": MODEL, "prompt": "abc", "max_tokens": MAX_LEN}, "completions", "max_tokens"),
    ({"model": MODEL, "prompt": "abc", "max_tokens": 0}, "completions", "max_tokens"),
    ({"model": MODEL, "prompt": "abc", "max_tokens": "ten"}, "completions", "max_tokens"),
    ({"model": MODEL, "prompt": "abc", "temperature": -0.5}, "completions", "temperature"),
    ({"model": MODEL, "prompt": "abc", "top_p": 0}, "completions", "top_p"),
    ({"model": MODEL, "prompt": "abc", "top_p": 1.5}, "completions", "top_p"),
    ({"model": MODEL, "prompt": "abc", "n": 2}, "completions", "n"),
    ({"model": MODEL, "prompt": "abc", "stream": "yes"}, "completions", "stream"),
    ({"model": MODEL, "prompt": 5}, "completions", "prompt"),
    ({"model": MODEL, "prompt": [1, 99]}, "completions", "prompt"),
    ({"model": MODEL, "prompt": "abc", "stop_token_ids": [64]}, "completions", "stop_token_ids"),
    ({"model": MODEL, "prompt": "abc", "logprobs": 2}, "completions", "logprobs"),
    ({"prompt": "abc"}, "completions", "model"),
    (b'{"model": "tiny", "prompt": ', "completions", None),
    ({"model": MODEL, "messages": []}, "chat/completions", "messages"),
    ({"model": MODEL, "messages": [{"role": "user"}], "max_tokens": -1}, "chat/completions",
     "max_tokens"),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, "chat/completions",
     "messages"),
    ({"model": MODEL, "messages": "hello"}, "chat/completions", "messages"),
]


def post_bad(url, body, path):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}/v1/{path}", content=data, timeout=60,
                      headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("body,path,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_get_400_naming_the_field(server, body, path, param):
    r = post_bad(server, body, path)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]


def test_models_health_metrics(files, server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    client.completions.create(model=MODEL, prompt="abc", max_tokens=M, temperature=0,
                              extra_body={"ignore_eos": True})  # speculative steps happened
    h = health(server)
    assert h["status"] == "ok" and h["kv_pages_in_use"] == 0 and h["kv_pages_total"] > 0
    text = httpx.get(server + "/metrics", timeout=30).text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    s = stats(server)

    def value(name, **labels):
        return [x.value for x in fams[name].samples
                if x.name.endswith("_total") and all(x.labels.get(k) == v for k, v in labels.items())]

    assert value("vllm:spec_decode_num_drafts") == [s["spec_decode_num_drafts"]] != [0]
    assert value("vllm:spec_decode_num_draft_tokens") == [s["spec_decode_num_draft_tokens"]]
    assert value("vllm:spec_decode_num_accepted_tokens") == [s["spec_decode_num_accepted_tokens"]]
    per_pos = [value("vllm:spec_decode_num_accepted_tokens_per_pos", position=str(i))[0]
               for i in range(3)]
    assert per_pos == s["spec_decode_num_accepted_tokens_per_pos"]
    assert value("vllm:generation_tokens") == [s["generation_tokens_total"]]
    assert value("vllm:request_success", finished_reason="stop")[0] \
        + value("vllm:request_success", finished_reason="length")[0] == s["request_success_total"]
    ttft = {x.name: x for x in fams["vllm:time_to_first_token_seconds"].samples}
    assert ttft["vllm:time_to_first_token_seconds_count"].value \
        == s["time_to_first_token_seconds"]["count"] > 0
    gauges = {f: fams[f].samples[0].value for f in ("vllm:num_requests_running",
                                                     "specjax:kv_pages_in_use")}
    assert gauges == {"vllm:num_requests_running": 0, "specjax:kv_pages_in_use": 0}


def test_warmup_structured_leaves_nothing_to_compile(files):
    """``serve --warmup-structured`` compiles the masked step variants too: a constrained request
    (vLLM's guided_choice, here over the tiny tokenizer's characters) compiles nothing more."""
    proc, url = start_server(files, "--draft", str(files["root"] / "draft"), "--method", "draft",
                             "-k", "3", "--warmup-structured")
    try:
        before = health(url)
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        for prompt in ("pick one", "again, pick"):
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=M,
                temperature=0, extra_body={"guided_choice": ["abc", "ba", "cab cab"]})
            assert r.choices[0].message.content in ("abc", "ba", "cab cab")
        after = health(url)
        assert before["compiles"] > 0 and after["compiles"] == before["compiles"]
    finally:
        stop_server(proc, 30)


# ----------------------------------------------------------------------------------- load


def hang_up(url, chat, text, kw, after=2):
    """Streams a long request with the (sync) openai client and closes the connection after
    ``after`` chunks; returns the chunks read."""
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    if chat:
        stream = client.chat.completions.create(messages=[{"role": "user", "content": text}], **kw)
    else:
        stream = client.completions.create(prompt=text, **kw)
    n = 0
    for c in stream:
        n += bool(c.choices)
        if n >= after:
            break
    stream.close()
    client.close()
    return n


async def _load(files, url, n, n_disconnect, n_bad, seed):
    """n concurrent streaming requests: greedy / sampled / disconnecting / malformed; /health
    polled throughout. Returns a report dict."""
    rng = np.random.default_rng(seed)
    tok = files["tok"]
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
    http = httpx.AsyncClient(timeout=60)
    kinds = ["disconnect"] * n_disconnect + ["bad"] * n_bad
    kinds += ["greedy" if i % 2 == 0 else "sampled" for i in range(n - len(kinds))]
    rng.shuffle(kinds)
    report = {"greedy": [], "sampled": [], "bad": [], "disconnect": [], "health": []}
    done = asyncio.Event()

    async def poll():
        while not done.is_set():
            t = time.perf_counter()
            r = await http.get(url + "/health")
            report["health"].append((r.status_code, time.perf_counter() - t))
            await asyncio.sleep(0.2)

    async def one(i, kind):
        await asyncio.sleep(float(rng.uniform(0, 1.0)))
        chat = i % 3 == 0
        n_chars = int(rng.integers(3, 13) if chat else rng.integers(17, 31))
        text = "".join(rng.choice(CHARS[:52], n_chars))
        if kind == "bad":
            body = [{"model": MODEL, "prompt": text, "top_p": 2.0},
                    {"model": MODEL, "prompt": text, "max_tokens": "x"},
                    {"model": MODEL, "prompt": ""}][int(rng.integers(0, 3))]
            r = await http.post(url + "/v1/completions", content=json.dumps(body))
            report["bad"].append(r.status_code)
            return
        kw = dict(model=MODEL, max_tokens=M, stream=True, temperature=0)
        if kind == "sampled":
            kw.update(temperature=float(rng.uniform(0.3, 1.5)), top_p=float(rng.uniform(0.5, 1)),
                      seed=int(rng.integers(0, 1000)),
                      extra_body={"top_k": int(rng.integers(0, 20))})
        if kind == "disconnect":  # in a thread, so a busy event loop cannot delay the hang-up
            kw.update(max_tokens=400, extra_body={"ignore_eos": True})
            got = await asyncio.to_thread(hang_up, url, chat, text, kw)
            report["disconnect"].append(got)
            return
        if chat:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": text}], **kw)
            ids = chat_ids(files, text)
        else:
            stream = await client.completions.create(prompt=text, **kw)
            ids = tok.encode(text)
        parts, reason = [], None
        async for c in stream:
            if not c.choices:
                continue
            parts.append((c.choices[0].delta.content or "") if chat else c.choices[0].text)
            reason = c.choices[0].finish_reason or reason
        report[kind].append((ids, "".join(parts), reason))

    poller = asyncio.create_task(poll())
    await asyncio.gather(*(one(i, k) for i, k in enumerate(kinds)))
    done.set()
    await poller
    await http.aclose()
    await client.close()
    return report


def _check_load(files, url, n, n_disconnect, n_bad):
    tok = files["tok"]
    before = health(url)
    aborted0 = stats(url)["request_finished_by_reason"]["abort"]
    t0 = time.perf_counter()
    report = asyncio.run(_load(files, url, n, n_disconnect, n_bad, seed=n))
    wall = time.perf_counter() - t0
    assert wall < 600
    assert report["bad"] == [400] * n_bad
    assert report["disconnect"] == [2] * n_disconnect
    for ids, text, reason in report["greedy"]:
        want = reference(files, ids)
        assert text == tok.decode(want) and reason == ("stop" if want[-1] == 2 else "length")
    assert all(reason in ("stop", "length") for _, _, reason in report["sampled"])
    assert len(report["greedy"]) + len(report["sampled"]) == n - n_disconnect - n_bad
    assert report["health"] and all(code == 200 for code, _ in report["health"])
    assert max(t for _, t in report["health"]) < 10  # answered while the engine was busy
    deadline = time.time() + 30
    while time.time() < deadline:  # aborts are applied at the engine's next step
        after = health(url)
        if not (after["requests_in_server"] or after["num_requests_running"]
                or after["num_requests_waiting"]):
            break
        time.sleep(0.2)
    assert after["kv_pages_in_use"] == 0 and after["requests_in_server"] == 0
    assert after["num_requests_running"] == after["num_requests_waiting"] == 0
    assert before["compiles"] > 0 and after["compiles"] == before["compiles"]  # none after warm-up
    assert stats(url)["request_finished_by_reason"]["abort"] - aborted0 == n_disconnect


def test_load_64_streams(files, server):
    """64 concurrent streams with mixed sampling settings, 8 disconnecting mid-stream, 8
    malformed: greedy ones exact, malformed ones 400, abandoned ones aborted with their pages
    freed, /health answered throughout, nothing recompiled (~3 s on the tiny model)."""
    _check_load(files, server, 64, 8, 8)


# ------------------------------------------------------------------------ in-process pieces


def test_capacity_gives_503_and_cancel_frees_the_slot(files):
    """max_slots 1 + max_queue 0: while one request is in the server the next gets 503; the
    cancelled request's slot comes back. (Engine not started: nothing compiles.)"""
    from specjax.engine import Engine  # noqa: PLC0415
    from specjax.serve.app import create_app, make_engine_config  # noqa: PLC0415

    engine = Engine(files["target"], None, make_engine_config(
        method="none", num_draft_tokens=1, max_slots=1, max_model_len=32, page_size=4))
    app = create_app(engine, files["tok"], model_name=MODEL, max_queue=0, start_engine=False)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 4}

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            first = asyncio.create_task(c.post("/v1/completions", json=body))
            while app.state.server.active == 0:
                await asyncio.sleep(0.01)
            r = await c.post("/v1/completions", json=body)
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded"
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            assert app.state.server.active == 0
            r = await c.post("/v1/completions", json={**body, "top_p": 7})
            assert r.status_code == 400

    asyncio.run(main())
    engine.step()  # applies the abort queued when the first request was cancelled
    assert engine.stats()["request_finished_by_reason"]["abort"] == 1
    assert engine.occupancy()["kv_pages_in_use"] == 0


def test_detokenizer_holds_back_stop_prefixes(files):
    from specjax.serve.app import Detokenizer  # noqa: PLC0415

    tok = files["tok"]
    ids = tok.encode("hello world, bye")
    d = Detokenizer(tok, ["wor", "xyz"])
    out = []
    for t in ids:
        delta, reason = d.add([t], None)
        out.append(delta)
        if reason:
            break
    assert "".join(out) == "hello " and reason == "stop"
    d = Detokenizer(tok)
    assert d.add(ids[:5], None) == ("hello", None)
    assert d.add(ids[5:] + [2], "stop") == (" world, bye", "stop")  # EOS text dropped


def test_adaptive_flag_reaches_the_spec_config():
    from specjax import cli  # noqa: PLC0415
    from specjax.serve.app import make_engine_config  # noqa: PLC0415

    assert make_engine_config(method="draft", num_draft_tokens=2, adaptive=True).spec.adaptive
    assert not make_engine_config(method="draft", num_draft_tokens=2).spec.adaptive
    with pytest.raises(ValueError, match="adaptive"):
        make_engine_config(method="none", num_draft_tokens=1, adaptive=True)
    assert cli.main(["serve", "--adaptive", "--method", "none"]) == 2  # before loading anything


# ------------------------------------------------------------------------------ real model


def test_serve_flags_reach_the_engine_config():
    """--enable-prefix-caching and --num-speculative-tokens-per-batch-size (vLLM's table) reach
    EngineConfig; a malformed table is a usage error (exit 2) before anything loads."""
    from specjax.cli import build_parser, main  # noqa: PLC0415
    from specjax.serve.app import make_engine_config  # noqa: PLC0415

    args = build_parser().parse_args(["serve", "--enable-prefix-caching",
                                      "--num-speculative-tokens-per-batch-size",
                                      "[[1, 4, 2], [5, 8, 0]]"])
    assert args.enable_prefix_caching
    assert args.num_speculative_tokens_per_batch_size == ((1, 4, 2), (5, 8, 0))
    cfg = make_engine_config(method="draft", num_draft_tokens=2, enable_prefix_caching=True,
                             num_speculative_tokens_per_batch_size=((1, 4, 2), (5, 8, 0)))
    assert cfg.enable_prefix_caching and cfg.num_speculative_tokens_per_batch_size == ((1, 4, 2), (5, 8, 0))
    assert not build_parser().parse_args(["serve"]).enable_prefix_caching
    for bad in ("[[1, 4]]", "not json", "[[1, 4, 2.5]]"):
        with pytest.raises(SystemExit) as e:
            main(["serve", "--num-speculative-tokens-per-batch-size", bad])
        assert e.value.code == 2


@pytest.mark.parametrize("flag, value", [
    ("--port", "70000"), ("--port", "-1"), ("--max-queue", "-1"), ("--max-slots", "0"),
    ("--max-model-len", "1"), ("--num-pages", "0"), ("--batch-buckets", "a,2"),
    ("--batch-buckets", "0,2"), ("--token-buckets", ""), ("--token-buckets", "16,x")])
def test_bad_serve_flags_are_usage_errors_before_loading(flag, value, capsys):
    """Each is exit 2 naming the flag at parse time (a bad --port / --max-queue used to fail
    only after the model loaded and warmed up; --batch-buckets a,2 said only 'invalid literal')."""
    from specjax.cli import build_parser, main  # noqa: PLC0415

    with pytest.raises(SystemExit) as e:
        main(["serve", "--model", "no/such/model", flag, value])
    assert e.value.code == 2 and flag in capsys.readouterr().err
    args = build_parser().parse_args(["serve", "--batch-buckets", "1,4", "--port", "0"])
    assert args.batch_buckets == (1, 4) and args.token_buckets == (16, 64) and args.port == 0


@pytest.mark.slow
def test_smollm2_with_shipped_head(tmp_path):
    """SmolLM2-135M + the shipped MTP head: chat, streamed and not, equals sj.generate greedy."""
    from specjax import shipped  # noqa: PLC0415

    if shipped.best("mtp") is None:
        pytest.skip("no shipped MTP head")
    try:
        target = sj.load_model("smollm2-135m")
        tok = sj.load_tokenizer("smollm2-135m")
    except Exception as e:  # noqa: BLE001 - the GGUF comes with the optional 'models' extra
        pytest.skip(f"SmolLM2 not available: {e}")
    files = {"root": tmp_path}
    port = free_port()
    log = open(tmp_path / "server.log", "w")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "specjax.cli", "serve", "--port", str(port),
                             "--served-model-name", MODEL, "--max-slots", "4",
                             "--batch-buckets", "4", "--max-model-len", "512",
                             "--log-level", "warning"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        for _ in range(1200):
            if proc.poll() is not None:
                raise RuntimeError((tmp_path / "server.log").read_text()[-4000:])
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        want = sj.generate(target, [tok.apply_chat_template(msgs)], max_new_tokens=48).tokens[0]
        res = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48, temperature=0)
        assert res.choices[0].message.content == tok.decode(want)
        stream = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=48,
                                           temperature=0, stream=True)
        assert "".join(x.choices[0].delta.content or "" for x in stream) == tok.decode(want)
        assert stats(url)["spec_decode_num_drafts"] > 0
    finally:
        del files
        proc.terminate()
        proc.wait(60)


def test_serve_accepts_every_method_and_option():
    """`specjax serve --method` takes every method sj.generate does, and make_engine_config
    translates every speculation option the way spec_from_options does (lossless)."""
    from specjax.cli import build_parser  # noqa: PLC0415
    from specjax.config import METHODS  # noqa: PLC0415
    from specjax.options import spec_from_options  # noqa: PLC0415
    from specjax.serve.app import make_engine_config  # noqa: PLC0415

    for method in METHODS:
        if method == "custom":  # a Python Drafter object: sj.generate / sj.Engine only
            with pytest.raises(SystemExit):
                build_parser().parse_args(["serve", "--method", method])
            continue
        assert build_parser().parse_args(["serve", "--method", method]).method == method
    args = build_parser().parse_args(
        ["serve", "--method", "eagle3", "-k", "3", "--ngram-min", "2", "--ngram-max", "4",
         "--hybrid-min", "2", "--draft-sampling", "--adaptive", "confidence"])
    opts = dict(method="eagle3", num_draft_tokens=3, ngram_min=2, ngram_max=4, hybrid_min=2,
                draft_sampling=True, adaptive=True, adaptive_by="confidence")
    from specjax.cli._common import spec_options  # noqa: PLC0415
    assert {k: v for k, v in spec_options(args).items() if v is not None} == opts
    assert make_engine_config(**opts).spec == spec_from_options(opts)
    tree = make_engine_config(method="eagle-tree", tree_depth=2, tree_top_k=2, tree_nodes=3).spec
    assert (tree.tree.depth, tree.tree.top_k, tree.tree.num_nodes) == (2, 2, 3)
    with pytest.raises(ValueError, match="'bogus'"):
        make_engine_config(method="draft", bogus=1)


# default run: every command works with its defaults (README's claim; ~1-2 min each)
def test_serve_with_defaults_answers_the_openai_client(tmp_path):
    """`specjax serve --model smollm2-135m` (only a port added): no draft named, so the
    recommended draft of checkpoints/fastest.json; one chat request through the openai client
    equals greedy sj.generate with the same SpecConfig's target (lossless)."""
    try:
        target = sj.load_model("smollm2-135m")
        tok = sj.load_tokenizer("smollm2-135m")
    except Exception as e:  # noqa: BLE001 - the GGUF comes with the optional 'models' extra
        pytest.skip(f"SmolLM2 not available: {e}")
    port = free_port()
    log_path = tmp_path / "server.log"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "specjax.cli", "serve", "--model",
                                 "smollm2-135m", "--port", str(port)],
                                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 1500
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(log_path.read_text()[-4000:])
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(1.0)
        else:
            raise RuntimeError("server did not start: " + log_path.read_text()[-4000:])
        c = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300)
        msgs = [{"role": "user", "content": "What is the capital of France?"}]
        want = sj.generate(target, [tok.apply_chat_template(msgs)], max_new_tokens=16).tokens[0]
        res = c.chat.completions.create(model="smollm2-135m", messages=msgs, max_tokens=16,
                                        temperature=0)
        assert res.choices[0].message.content == tok.decode(want)
        assert "draft checkpoints/" in log_path.read_text()  # the recommended draft was loaded
    finally:
        stop_server(proc, 60)
