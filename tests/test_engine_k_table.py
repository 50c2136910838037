"""Draft length by batch size (EngineConfig.num_speculative_tokens_per_batch_size, vLLM's table):
parsing, validation, and an engine that drafts k(batch) tokens per step with exact outputs."""

import pytest

from specjax.engine import Engine, EngineConfig, RequestParams
from specjax.engine.engine import check_spec_table, parse_spec_tokens_per_batch_size
from tests.test_engine import BASE, alone, drafts, spec, target  # noqa: F401 (fixtures)

TABLE = ((1, 2, 3), (3, 4, 1), (5, 8, 0))


def test_parse_and_check_the_table():
    assert parse_spec_tokens_per_batch_size("[[1, 8, 3], [9, 16, 1], [17, 64, 0]]") == (
        (1, 8, 3), (9, 16, 1), (17, 64, 0))
    for bad in ("[[1, 8]]", "[[1, 8, 2.5]]", "{}", "[[1, 8, 3]", "[[1, 8, true]]"):
        with pytest.raises(ValueError):
            parse_spec_tokens_per_batch_size(bad)
    assert check_spec_table(TABLE, 8, 3) == TABLE
    assert check_spec_table([[1, 64, 2]], 8, 3) == ((1, 64, 2),)
    for bad, match in (([[2, 8, 3]], "start at 1"), ([[1, 4, 3], [6, 8, 1]], "gaps"),
                       ([[1, 4, 3], [4, 8, 1]], "overlaps"), ([[1, 4, 3]], "max_slots"),
                       ([[1, 8, 4]], "outside"), ([[1, 8, -1]], "outside"), ([], "non-empty")):
        with pytest.raises(ValueError, match=match):
            check_spec_table(bad, 8, 3)


def test_tree_and_adaptive_refuse_the_table(target, drafts):  # noqa: F811
    with pytest.raises(ValueError, match="chain method"):
        Engine(target, drafts["eagle-tree"], EngineConfig(
            spec("eagle-tree"), **BASE, num_speculative_tokens_per_batch_size=TABLE))


def test_engine_drafts_k_by_decode_batch_size(target, drafts):  # noqa: F811
    engine = Engine(target, drafts["draft"], EngineConfig(
        spec("draft"), **BASE, num_speculative_tokens_per_batch_size=TABLE))
    assert [v for v in engine.variants() if v[0] != "extend"] == [("spec", 8, 3), ("spec", 8, 1)]
    prompt = [5, 9, 13, 2, 40]
    h = engine.submit(prompt, RequestParams(max_tokens=12, stop_token_ids=()))
    engine.run()
    assert h.result() == alone(target, prompt, 12)
    s1 = h.spec_stats()
    assert s1["num_drafts"] > 0 and s1["num_draft_tokens"] == 3 * s1["num_drafts"]  # alone: k=3
    prompts = [[i + 1, 7, 3 * i] for i in range(4)]
    hs = [engine.submit(p, RequestParams(max_tokens=12, stop_token_ids=())) for p in prompts]
    engine.run()
    for h, p in zip(hs, prompts):
        assert h.result() == alone(target, p, 12)
    ks = {h.spec_stats()["num_draft_tokens"] / max(h.spec_stats()["num_drafts"], 1) for h in hs}
    assert 1 in ks  # four rows: k = 1 (the last ones alone again draft 3)
    before = engine.stats()["steps"]["decode"]
    prompts = [[i + 2, 11, i] for i in range(6)]
    hs = [engine.submit(p, RequestParams(max_tokens=6, stop_token_ids=())) for p in prompts]
    engine.run()
    for h, p in zip(hs, prompts):
        assert h.result() == alone(target, p, 6)
    assert engine.stats()["steps"]["decode"] > before  # six rows: plain steps (k = 0)
