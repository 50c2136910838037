"""Structured outputs through the server (in-process, official openai client): OpenAI's
``response_format`` (json_schema strict, json_object) and vLLM's ``structured_outputs`` /
``guided_*`` answers match their constraint with speculation on; a schema, regex or grammar the
grammar engine rejects is a 400 naming the field, and the server keeps serving."""

import json
import re

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

import specjax as sj  # noqa: E402
from specjax.engine import Engine  # noqa: E402
from specjax.serve.app import create_app, make_engine_config  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.test_serve import CHATML  # noqa: E402
from tests.test_structured import JSON_CHARS, SCHEMA, write_tokenizer  # noqa: E402

MODEL = "tiny"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from fastapi.testclient import TestClient  # noqa: PLC0415

    tok = write_tokenizer(str(tmp_path_factory.mktemp("tok")), JSON_CHARS, CHATML)
    target = tiny_model(0, vocab=64, eos=2)
    draft = sj.early_exit_draft(target, target.config.num_layers)
    cfg = make_engine_config(method="draft", num_draft_tokens=3, max_slots=2, max_model_len=256,
                             page_size=4, batch_buckets=(2,), token_buckets=(16,))
    engine = Engine(target, draft, cfg)
    engine.warmup(structured=True)
    app = create_app(engine, tok, model_name=MODEL, max_queue=4)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                               http_client=http)
        yield {"engine": engine, "tok": tok, "client": client}


def chat(client, max_tokens=100, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "describe the item as json"}],
        max_tokens=max_tokens, temperature=0, **kw)


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_strict_answer_validates(served, stream):
    rf = {"type": "json_schema", "json_schema": {"name": "item", "schema": SCHEMA, "strict": True}}
    r = chat(served["client"], response_format=rf, stream=stream)
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        text, reason = r.choices[0].message.content, r.choices[0].finish_reason
    assert reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert served["engine"].stats()["structured_steps"] > 0


def test_json_object_and_vllm_fields(served):
    client = served["client"]
    r = chat(client, response_format={"type": "json_object"}, max_tokens=140)
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    kw = dict(model=MODEL, prompt="the code is", max_tokens=20, temperature=0)
    r = client.completions.create(**kw, extra_body={"structured_outputs": {"regex": "[a-c]{3}-[0-9]{2}"}})
    assert re.fullmatch("[a-c]{3}-[0-9]{2}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(**kw, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].text in ("yes", "no")
    r = client.completions.create(**kw, extra_body={"guided_choice": ["up", "down"]})
    assert r.choices[0].text in ("up", "down")
    r = client.completions.create(**kw, extra_body={"guided_grammar": 'root ::= "x" [0-9] "y"'})
    assert re.fullmatch("x[0-9]y", r.choices[0].text), r.choices[0].text
    r = client.completions.create(model=MODEL, prompt="{", max_tokens=100, temperature=0.7,
                                  seed=3, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)


@pytest.mark.parametrize("extra, param", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
     "response_format"),
    ({"structured_outputs": {"regex": "[a"}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_json": {"type": "object", "properties": {"a": {"type": "wat"}}}}, "guided_json"),
    ({"guided_choice": ["a"], "guided_regex": "b"}, "guided_choice"),  # the second one given
    ({"structured_outputs": {"json_object": "yes"}}, "structured_outputs"),  # not a bool
    ({"structured_outputs": {"json_object": 1}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "(?=a)b"}}, "structured_outputs"),  # xgrammar: no lookahead
    # no token can start it (not in the character vocabulary): was a 200 "abort" with no text
    ({"guided_regex": "€+"}, "guided_regex"),
    ({"guided_choice": ["€", "Q"]}, "guided_choice"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": False}}},
     "response_format"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {}, "strict": "yes"}}},
     "response_format"),
])
def test_rejected_constraint_is_a_400_naming_the_field(served, extra, param):
    client = served["client"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body=extra)
    err = e.value.response.json()["error"]
    assert err["param"] == param
    assert not re.search(r"\[[0-9:]+\] \S+\.cc:\d+", err["message"]), err  # no C++ log prefix
    # the server goes on serving
    r = client.completions.create(model=MODEL, prompt="x", max_tokens=4,
                                  extra_body={"guided_choice": ["ok"]})
    assert r.choices[0].text == "ok"
