"""The server in-process (FastAPI TestClient under the official openai client): stop strings are
successes that count only the returned tokens, every request field we do not honour is a 400
naming it, and each response carries its own speculation numbers (``usage.spec_decoding``).

The draft is the whole target (``early_exit_draft`` with every layer): greedy drafts are always
accepted, so the per-request numbers have exact expected values.
"""

import time

import pytest

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")

import specjax as sj  # noqa: E402
from specjax.engine import Engine  # noqa: E402
from specjax.engine.metrics import request_spec_stats  # noqa: E402
from specjax.serve.app import create_app, make_engine_config  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.test_serve import MODEL, write_tokenizer  # noqa: E402

K = 3


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from fastapi.testclient import TestClient  # noqa: PLC0415

    root = tmp_path_factory.mktemp("fields")
    write_tokenizer(str(root / "tok"))
    tok = sj.load_tokenizer(str(root / "tok"))
    target = tiny_model(0, eos=2)
    draft = sj.early_exit_draft(target, target.config.num_layers)  # = the target
    cfg = make_engine_config(method="draft", num_draft_tokens=K, max_slots=2, max_model_len=96,
                             page_size=4, batch_buckets=(2,), token_buckets=(16,))
    engine = Engine(target, draft, cfg)
    engine.warmup()
    app = create_app(engine, tok, model_name=MODEL, max_queue=4)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                               http_client=http)
        yield {"engine": engine, "tok": tok, "client": client, "http": http}


def greedy(engine, ids, n):
    """The engine's own greedy tokens (no stop token: the EOS may or may not appear)."""
    return engine.submit(ids, sj.RequestParams(max_tokens=n, stop_token_ids=())).result(60)


def wait_for(pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------------------ stop strings


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_a_success_counting_only_returned_tokens(served, stream):
    engine, tok, client = served["engine"], served["tok"], served["client"]
    ids = tok.encode("Tell me a story, please")
    want = greedy(engine, ids, 24)
    text = tok.decode(want)
    assert 2 not in want[:12], "pick a prompt whose greedy text has no EOS early"
    stop = text[8:10]
    cut = text.index(stop)
    # tokens up to (and including) the one that completes the stop string
    n = next(j for j in range(1, len(want) + 1) if stop in tok.decode(want[:j]))
    assert n < 24
    before = engine.stats()
    kw = dict(model=MODEL, prompt=ids, max_tokens=24, temperature=0, stop=[stop],
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(**kw, stream=True,
                                                stream_options={"include_usage": True}))
        got = "".join(c.choices[0].text for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        usage = chunks[-1].usage
    else:
        res = client.completions.create(**kw)
        got, reason, usage = res.choices[0].text, res.choices[0].finish_reason, res.usage
    assert got == text[:cut] and reason == "stop"
    assert usage.completion_tokens == n and usage.total_tokens == len(ids) + n

    def settled():  # the engine may finish by length first; the stop string restates it
        s = engine.stats()
        return (s["request_success_total"] == before["request_success_total"] + 1
                and s["request_finished_by_reason"]["stop"]
                == before["request_finished_by_reason"]["stop"] + 1)
    assert wait_for(settled), "a stop-string finish must count as a success"
    after = engine.stats()
    fin_b, fin_a = before["request_finished_by_reason"], after["request_finished_by_reason"]
    assert fin_a["abort"] == fin_b["abort"] and fin_a["stop"] == fin_b["stop"] + 1
    for name in ("e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert after[name]["count"] == before[name]["count"] + 1, name
    assert after["generation_tokens_total"] - before["generation_tokens_total"] == n
    assert engine.occupancy()["kv_pages_in_use"] == 0


def test_disconnect_is_still_an_abort(served):
    """The negative control: a request the server abandons (no stop string) is an abort."""
    engine = served["engine"]
    before = engine.stats()["request_finished_by_reason"]["abort"]
    h = engine.submit([5, 6, 7], sj.RequestParams(max_tokens=60, stop_token_ids=()))
    engine.abort(h.id)
    h.result(60)
    assert h.finish_reason == "abort"
    assert engine.stats()["request_finished_by_reason"]["abort"] == before + 1


# ------------------------------------------------------------------------------ request fields

UNSUPPORTED = [  # (create kwargs, the param the 400 must name); structured outputs:
    # tests/test_serve_structured.py
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"store": True}, "store"),
    ({"metadata": {"a": "b"}}, "metadata"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"n": 2}, "n"),
    ({"extra_body": {"guided_whitespace_pattern": " "}}, "guided_whitespace_pattern"),  # vLLM
    ({"extra_body": {"min_tokens": 3}}, "min_tokens"),
    ({"extra_body": {"repetition_penalty": 1.2}}, "repetition_penalty"),
    ({"messages": [{"role": "user", "content": "hi", "name": "bob"}]}, "messages"),
    ({"stream": True, "stream_options": {"include_usage": True, "bogus": 1}}, "stream_options"),
    ({"max_tokens": None, "max_completion_tokens": 10**9}, "max_completion_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
]


@pytest.mark.parametrize("kw,param", UNSUPPORTED, ids=[p for _, p in UNSUPPORTED])
def test_unsupported_chat_fields_are_400_naming_the_field(served, kw, param):
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        served["client"].chat.completions.create(**kw)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("kw,param", [
    ({"echo": True}, "echo"), ({"suffix": "x"}, "suffix"), ({"best_of": 2}, "best_of"),
    ({"logprobs": 1}, "logprobs"), ({"extra_body": {"response_format": {"type": "regex"}}},
                                    "response_format"),
    ({"extra_body": {"guided_decoding_backend": "outlines"}}, "guided_decoding_backend")])
def test_unsupported_completion_fields_are_400(served, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        served["client"].completions.create(model=MODEL, prompt="hi", max_tokens=4, **kw)
    assert e.value.body["param"] == param, e.value.body


def test_honoured_and_neutral_fields_are_accepted(served):
    """Neutral values of unsupported fields and harmless hints change nothing in the answer."""
    client = served["client"]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6, temperature=0)
    res = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=6, temperature=0, top_p=1.0, seed=3, n=1,
        presence_penalty=0, frequency_penalty=0, logprobs=False, response_format={"type": "text"},
        user="u1", service_tier="auto", store=False, tool_choice="none", stop=None,
        extra_body={"top_k": 0, "ignore_eos": False, "prompt_cache_key": "k"})
    assert res.choices[0].message.content == plain.choices[0].message.content
    # without tools, parallel_tool_calls changes nothing (it used to be a 400 either way)
    for ptc in (False, True):
        res = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=6,
                                             temperature=0, parallel_tool_calls=ptc)
        assert res.choices[0].message.content == plain.choices[0].message.content
    res = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=6,
                                         temperature=0)
    assert res.choices[0].message.content == plain.choices[0].message.content


# ------------------------------------------------------------------------------ per-request spec


def test_response_carries_its_own_spec_numbers(served):
    """Self-draft: every greedy draft is accepted, so each speculative step returns K + 1 tokens
    (the last one possibly cut by max_tokens) and the numbers follow exactly."""
    client = served["client"]
    n = 1 + 3 * (K + 1) + 2  # prefill token, 3 full steps, a step cut to 2 tokens
    res = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=n,
                                    temperature=0, extra_body={"ignore_eos": True})
    sd = res.usage.model_extra["spec_decoding"]
    assert res.usage.completion_tokens == n
    assert sd["num_drafts"] == 4 and sd["num_draft_tokens"] == 4 * K
    assert sd["num_accepted_tokens"] == 3 * K + 2  # the cut step returned 2 accepted drafts
    assert sd["num_accepted_tokens_per_pos"] == [4, 4, 3]
    assert sd["mean_acceptance_length"] == pytest.approx(1 + (3 * K + 2) / 4)  # vLLM's definition
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=n,
                                            temperature=0, stream=True,
                                            extra_body={"ignore_eos": True},
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.model_extra["spec_decoding"] == sd


def test_stop_string_found_after_the_engine_finished_restates_the_count(served):
    """The engine may finish a request by length before the server's detokenizer finds a stop
    string in its text (the race a loaded machine shows): finish_stopped then restates it as a
    "stop" success with only the returned tokens (not an extra success, not a no-op)."""
    engine, tok = served["engine"], served["tok"]
    h = engine.submit(tok.encode("Hello"), sj.RequestParams(max_tokens=8, stop_token_ids=()))
    assert len(h.result(60)) == 8 and h.finish_reason == "length"
    before = engine.stats()
    engine.finish_stopped(h.id, 3)
    assert wait_for(lambda: engine.stats()["request_finished_by_reason"]["stop"]
                    == before["request_finished_by_reason"]["stop"] + 1)
    after = engine.stats()
    assert after["request_finished_by_reason"]["length"] == before["request_finished_by_reason"]["length"] - 1
    assert after["request_success_total"] == before["request_success_total"]
    assert before["generation_tokens_total"] - after["generation_tokens_total"] == 5
    assert len(h.tokens) == 3 and h.finish_reason == "stop"
    engine.finish_stopped(h.id, 2)  # once only: the request left the recent list
    time.sleep(0.3)
    assert engine.stats()["generation_tokens_total"] == after["generation_tokens_total"]


def test_request_spec_stats_counts_only_returned_tokens():
    steps_ = [(1, 3, 3), (5, 1, 3), (7, 0, 0), (8, 2, 3)]  # (start, accepted, drafted)
    full = request_spec_stats(steps_, 11, 3)
    assert full == {"num_drafts": 3, "num_draft_tokens": 9, "num_accepted_tokens": 6,
                    "num_accepted_tokens_per_pos": [3, 2, 1], "mean_acceptance_length": 3.0}
    cut = request_spec_stats(steps_, 6, 3)  # a stop string after the second step's first token
    assert cut["num_drafts"] == 2 and cut["num_accepted_tokens"] == 4
    assert cut["num_accepted_tokens_per_pos"] == [2, 1, 1]
    assert cut["mean_acceptance_length"] == pytest.approx(1 + 4 / 2)
    assert request_spec_stats([], 4, 3)["mean_acceptance_length"] is None
