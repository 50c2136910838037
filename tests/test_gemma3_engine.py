"""Gemma 3 through the continuous-batching engine and the server: a tiny transformers Gemma 3
(sliding window 7, a full-attention layer, GQA) whose sequences span several windows, served
with page size 4 and 8-token prefill chunks, so pages, chunks and draft blocks cross the window
edge. Greedy outputs equal plain decoding (itself equal to HF, tests/test_gemma3.py) for every
drafter kind that needs no trained weights: none, n-gram, an early-exit draft of the model's
first layers (a sliding and a full layer: their types are kept) and the hybrid of the two."""

import os

import numpy as np
import pytest
import torch
import transformers

import specjax as sj
from specjax.config import SpecConfig
from specjax.engine import Engine, EngineConfig, RequestParams
from tests.test_gemma3 import WINDOW, _hf_config

V = 64  # the character tokenizer of tests/test_serve.py


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("gemma3_engine"))
    hc = _hf_config(2, vocab_size=V, layer_types=["sliding_attention", "full_attention",
                                                   "sliding_attention", "sliding_attention"])
    hc._attn_implementation = "eager"
    torch.manual_seed(3)
    m = transformers.Gemma3ForCausalLM(hc).eval()
    m.save_pretrained(path)
    return m, sj.load_model(path)


PROMPTS = [[int(t) for t in np.random.RandomState(i).randint(3, V, n)] for i, n in
           enumerate([5, 9, 17, 30])]


def plain(model, prompt, n):
    return list(sj.generate(model, [prompt], max_new_tokens=n, method="none",
                            eos_token_id=[]).tokens[0])


@pytest.mark.parametrize("method", ["none", "ngram", "draft", "draft-hybrid"])
def test_engine_greedy_equals_plain_across_windows(gemma, method):
    hf, model = gemma
    draft = sj.early_exit_draft(model, 2) if method.startswith("draft") else None
    assert draft is None or draft.config.layer_types == model.config.layer_types[:2]
    spec = SpecConfig(method="draft" if draft is not None else method, num_draft_tokens=3,
                      page_size=4, hybrid_min=2 if method == "draft-hybrid" else 0)
    engine = Engine(model, draft, EngineConfig(spec, max_slots=4, batch_buckets=(4,),
                                               token_buckets=(8,), max_model_len=64))
    got = engine.generate(PROMPTS, RequestParams(max_tokens=20, stop_token_ids=()))
    for p, g in zip(PROMPTS, got):
        assert list(g) == plain(model, p, 20), f"{method}: prompt of {len(p)} tokens"
    assert len(PROMPTS[-1]) + 20 > 4 * WINDOW  # the longest spans several windows
    if method == "none":  # and HF itself, once
        with torch.no_grad():
            ref = hf.generate(torch.tensor([PROMPTS[-1]]), max_new_tokens=20, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(PROMPTS[-1]):].tolist()
        assert list(got[-1]) == ref
    else:
        s = engine.stats()
        assert s["spec_decode_num_drafts"] > 0
    assert engine.allocator.num_used == 0  # every page back in the pool


def write_bos_tokenizer(path):
    """tests/test_serve.py's character tokenizer, with a post-processor that prepends
    <|endoftext|> as Gemma's tokenizer prepends <bos> (add_special_tokens)."""
    import tokenizers  # noqa: PLC0415

    from tests.test_serve import write_tokenizer  # noqa: PLC0415

    write_tokenizer(path)
    f = os.path.join(path, "tokenizer.json")
    tok = tokenizers.Tokenizer.from_file(f)
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    tok.save(f)


def test_server_answers_the_openai_client(gemma, tmp_path):
    """The server in-process over the Gemma engine (n-gram speculation): a greedy completion
    through the official openai client equals plain decoding, and a text prompt is encoded with
    the tokenizer's special tokens (its BOS) unless the request says add_special_tokens=false."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient  # noqa: PLC0415

    from specjax.serve.app import create_app, make_engine_config  # noqa: PLC0415
    from tests.test_serve import MODEL  # noqa: PLC0415

    _, model = gemma
    write_bos_tokenizer(str(tmp_path / "tok"))
    tok = sj.load_tokenizer(str(tmp_path / "tok"))
    cfg = make_engine_config(method="ngram", num_draft_tokens=3, max_slots=2, max_model_len=64,
                             page_size=4, batch_buckets=(2,), token_buckets=(8,))
    app = create_app(Engine(model, None, cfg), tok, model_name=MODEL, max_queue=4)
    ids, text = PROMPTS[2], "the cat sat on the mat"
    bos_ids = tok.encode(text, add_special_tokens=True)
    assert bos_ids == [0] + tok.encode(text)
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                               http_client=http)
        res = client.completions.create(model=MODEL, prompt=ids, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
        by_text = client.completions.create(model=MODEL, prompt=text, max_tokens=8,
                                            temperature=0, extra_body={"ignore_eos": True})
        raw = client.completions.create(model=MODEL, prompt=text, max_tokens=8, temperature=0,
                                        extra_body={"ignore_eos": True,
                                                    "add_special_tokens": False})
    assert res.choices[0].text == tok.decode(plain(model, ids, 16))
    assert res.usage.completion_tokens == 16
    assert by_text.usage.prompt_tokens == len(bos_ids)
    assert by_text.choices[0].text == tok.decode(plain(model, bos_ids, 8))
    assert raw.usage.prompt_tokens == len(bos_ids) - 1
