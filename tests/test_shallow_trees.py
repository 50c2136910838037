"""Depth-1 and depth-2 dynamic trees (the shipped default is depth 1: 1/3/3), on every surface:
the fused loop (greedy == plain, stats against the tokens returned, the exact sampled
distribution with the bonus after a full-depth path reached), the engine (greedy == plain under a
mix of requests) and the server (openai client, greedy == plain, per-request numbers counting
every verified node).

A depth-1 tree is its own edge case: every node is a child of the root, so a step accepts 0 or 1
draft and the bonus follows a full-depth path at every accepted step; the dynamic-tree builder
(tree.py) selects all of its nodes from one expansion."""

import numpy as np
import pytest

import specjax as sj
from specjax.config import SpecConfig
from specjax.engine import Engine, EngineConfig, RequestParams
from specjax.tree import TreeConfig
from tests.conftest import accept_length_counts, mimic_head, predictable_target
from tests.test_speculative import (ALPHA, N_ROWS, PROMPTS, _chi2_pvalue, _exact_joint, cells_of,
                                    check_stats_agree)

SHALLOW = {"depth1": TreeConfig(depth=1, top_k=3, num_nodes=3),  # the shipped default's shape
           "depth2": TreeConfig(depth=2, top_k=2, num_nodes=4)}


@pytest.fixture(scope="module")
def predictable():
    return predictable_target(0, context=0.05)


@pytest.fixture(scope="module")
def plain(predictable):
    return sj.generate(predictable, PROMPTS, max_new_tokens=30, eos_token_id=[]).tokens


@pytest.mark.parametrize("kind", ["mtp", "eagle"])
@pytest.mark.parametrize("name", list(SHALLOW))
def test_greedy_lossless_and_counted(predictable, plain, kind, name):
    tc = SHALLOW[name]
    out = sj.generate(predictable, PROMPTS, max_new_tokens=30, draft=mimic_head(predictable, kind),
                      method="eagle-tree", tree=tc, eos_token_id=[])
    assert out.tokens == plain
    counts = accept_length_counts(out.stats)
    assert len(counts) == tc.max_depth + 1 and all(c > 0 for c in counts), counts  # 0..D reached
    check_stats_agree(out, len(PROMPTS))
    s = out.stats
    # every verified node counts as a drafted token: num_nodes per speculative row-step
    assert s["drafted_tokens"] == tc.num_nodes * s["speculative_steps"]
    assert s["acceptance_rate"] == pytest.approx(s["accepted_tokens"] / s["drafted_tokens"])
    assert s["mean_accepted_length"] == pytest.approx(1 + s["accepted_tokens"] / s["speculative_steps"])


V4 = 4
PROMPT4 = [3, 1, 2]


@pytest.fixture(scope="module")
def dist_target():
    return predictable_target(13, vocab=V4, context=0.2, hidden=16, layers=2, heads=2, kv_heads=1,
                              scale=1.0)


@pytest.mark.parametrize("name", list(SHALLOW))
def test_sampled_distribution_is_the_targets(dist_target, name):
    """depth + 2 tokens per row at temperature 0.8 / top-p 0.95 through the fused tree loop: the
    joint law is the target's own sampler's (chi-square at ALPHA), the bonus after full-depth
    paths included (at depth 1: every accepted step)."""
    tc = SHALLOW[name]
    n = tc.max_depth + 2
    out = sj.generate(dist_target, [PROMPT4] * N_ROWS, max_new_tokens=n,
                      draft=mimic_head(dist_target, "mtp", gain=1.0), method="eagle-tree", tree=tc,
                      temperature=0.8, top_p=0.95, eos_token_id=[])
    s = out.stats
    assert 0.05 < s["acceptance_rate"] < 0.95
    assert s["per_position_acceptance"][-1] > 0.05  # full-depth paths, then the bonus
    expected = _exact_joint(dist_target, 0.8, 0, 0.95, n=n, prompt=PROMPT4)
    assert _chi2_pvalue(cells_of(out.tokens, V4), expected) > ALPHA


def test_sampled_distribution_negative_control(dist_target):
    """The same test fails on a wrong sampler at the same size: the target's law at another
    temperature (1.2 instead of 0.8; no top-p, so both have full support) is rejected, so the
    test above has the power to see a mis-tempered bonus or residual."""
    tc = SHALLOW["depth1"]
    out = sj.generate(dist_target, [PROMPT4] * N_ROWS, max_new_tokens=3,
                      draft=mimic_head(dist_target, "mtp", gain=1.0), method="eagle-tree", tree=tc,
                      temperature=1.2, eos_token_id=[])
    expected = _exact_joint(dist_target, 0.8, 0, 1.0, n=3, prompt=PROMPT4)
    assert _chi2_pvalue(cells_of(out.tokens, V4), expected) < ALPHA


@pytest.mark.parametrize("name", list(SHALLOW))
def test_engine_greedy_equals_plain(predictable, name):
    """Requests of mixed lengths through the continuous-batching engine with a shallow tree: each
    output equals the prompt run alone with plain decoding; every page comes back."""
    engine = Engine(predictable, mimic_head(predictable, "eagle"), EngineConfig(
        SpecConfig(method="eagle-tree", tree=SHALLOW[name], page_size=4), max_slots=4,
        batch_buckets=(4,), token_buckets=(8,), max_model_len=64))
    start = engine.allocator.snapshot()
    rng = np.random.default_rng(4)
    reqs = [(rng.integers(0, 64, int(rng.integers(1, 9))).tolist(), int(rng.integers(1, 20)))
            for _ in range(10)]
    handles = [engine.submit(p, RequestParams(max_tokens=m, stop_token_ids=())) for p, m in reqs]
    engine.run()
    for (p, m), h in zip(reqs, handles):
        assert h.result() == sj.generate(predictable, [p], max_new_tokens=m,
                                         eos_token_id=[]).tokens[0]
    assert engine.allocator.snapshot() == start
    s = engine.stats()
    assert s["spec_decode_num_draft_tokens"] == SHALLOW[name].num_nodes * s["spec_decode_num_drafts"]
    assert s["spec_decode_num_accepted_tokens"] > 0


def test_server_with_the_default_tree_shape(predictable, tmp_path):
    """The server in-process with a depth-1 tree (1/3/3): a greedy chat answer through the
    official openai client equals plain decoding, and its usage counts 3 verified drafts per
    speculative step."""
    pytest.importorskip("fastapi")
    openai = pytest.importorskip("openai")
    from fastapi.testclient import TestClient  # noqa: PLC0415

    from specjax.serve.app import create_app, make_engine_config  # noqa: PLC0415
    from tests.test_serve import MODEL, write_tokenizer  # noqa: PLC0415

    write_tokenizer(str(tmp_path / "tok"))
    tok = sj.load_tokenizer(str(tmp_path / "tok"))
    cfg = make_engine_config(method="eagle-tree", tree_depth=1, tree_top_k=3, tree_nodes=3,
                             max_slots=2, max_model_len=96, page_size=4, batch_buckets=(2,),
                             token_buckets=(16,))
    engine = Engine(predictable, mimic_head(predictable, "eagle"), cfg)
    app = create_app(engine, tok, model_name=MODEL, max_queue=4)
    ids = tok.encode("Once upon a time")
    want = sj.generate(predictable, [ids], max_new_tokens=12, eos_token_id=[]).tokens[0]
    with TestClient(app) as http:
        client = openai.OpenAI(base_url="http://testserver/v1", api_key="none", max_retries=0,
                               http_client=http)
        res = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert res.choices[0].text == tok.decode(want)
    sd = res.usage.model_extra["spec_decoding"]
    assert sd["num_drafts"] > 0 and sd["num_draft_tokens"] == 3 * sd["num_drafts"]
    assert sd["mean_acceptance_length"] == pytest.approx(1 + sd["num_accepted_tokens"] / sd["num_drafts"])
