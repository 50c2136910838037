"""specjax.options.spec_from_options: the one translation of loose options to a SpecConfig."""

import pytest

from specjax.config import SpecConfig
from specjax.options import KEYS, spec_from_options
from specjax.tree import TreeConfig

REC = {"draft": "some-head", "method": "eagle-tree", "num_draft_tokens": 1, "tree": [1, 3, 3],
       "hybrid_min": 0, "speedup": {"median": 1.3}}


def test_unset_options_take_the_config_defaults():
    assert spec_from_options({}) == SpecConfig()
    everything_unset = {k: None for k in KEYS}
    assert spec_from_options(everything_unset) == SpecConfig()
    # the tree default is TreeConfig's, the one stated in tree.py
    assert spec_from_options({"method": "eagle-tree"}).tree == TreeConfig()
    assert spec_from_options({"method": "draft"}) == SpecConfig(method="draft")


def test_default_k_per_method():
    assert spec_from_options({"method": "mtp"}).num_draft_tokens == 1
    assert spec_from_options({"method": "ngram"}).num_draft_tokens == 3
    assert spec_from_options({"method": "eagle"}).num_draft_tokens == 4
    # adaptive k searches 0..k: it keeps the general default
    assert spec_from_options({"method": "mtp", "adaptive": True}).num_draft_tokens == 4
    assert spec_from_options({"method": "mtp", "num_draft_tokens": 3}).num_draft_tokens == 3


def test_every_option_reaches_the_config():
    spec = spec_from_options(dict(method="eagle3", num_draft_tokens=5, draft_sampling=True,
                                  attn_impl="pallas", page_size=8, ngram_min=2, ngram_max=4,
                                  hybrid_min=3, adaptive=True, adaptive_by="confidence"))
    assert spec == SpecConfig(method="eagle3", num_draft_tokens=5, draft_sampling=True,
                              attn_impl="pallas", page_size=8, ngram_min=2, ngram_max=4,
                              hybrid_min=3, adaptive=True, adaptive_by="confidence")
    tree = spec_from_options({"method": "eagle-tree", "tree_depth": 3, "tree_nodes": 6}).tree
    assert (tree.depth, tree.top_k, tree.num_nodes) == (3, TreeConfig().top_k, 6)
    given = TreeConfig(depth=2, top_k=2, num_nodes=4)
    assert spec_from_options({"method": "eagle-tree", "tree": given}).tree is given


def test_recommended_fills_only_the_unset_options():
    spec = spec_from_options({}, REC)
    assert spec.method == "eagle-tree" and spec.tree == TreeConfig(depth=1, top_k=3, num_nodes=3)
    spec = spec_from_options({"tree_depth": 2}, REC)
    assert spec.tree == TreeConfig(depth=2, top_k=3, num_nodes=3)
    chain = {"method": "mtp", "num_draft_tokens": 2, "hybrid_min": 2, "adaptive": True,
             "adaptive_by": "confidence"}
    spec = spec_from_options({}, chain)
    assert (spec.method, spec.k, spec.hybrid_min, spec.adaptive, spec.adaptive_by) == \
        ("mtp", 2, 2, True, "confidence")
    spec = spec_from_options({"num_draft_tokens": 5, "adaptive": False}, chain)
    assert (spec.k, spec.adaptive, spec.adaptive_by, spec.hybrid_min) == (5, False, "history", 2)
    # an entry measured for another method says nothing about this one
    assert spec_from_options({"method": "draft"}, REC) == SpecConfig(method="draft")


def test_bad_options_raise_naming_them():
    with pytest.raises(ValueError, match="'num_draft'"):
        spec_from_options({"num_draft": 3})
    with pytest.raises(ValueError, match="tree_depth is only used with method 'eagle-tree'"):
        spec_from_options({"method": "mtp", "tree_depth": 3})
    with pytest.raises(ValueError, match="either tree or tree_nodes"):
        spec_from_options({"method": "eagle-tree", "tree": TreeConfig(), "tree_nodes": 3})
    with pytest.raises(ValueError, match="ngram_min"):
        spec_from_options({"method": "ngram", "ngram_min": 4, "ngram_max": 2})
    with pytest.raises(TypeError, match="options must be a mapping"):
        spec_from_options([("method", "draft")])


def test_default_draft_of_a_target_without_shipped_drafts_is_ngram():
    """A target the shipped drafts do not apply to gets n-gram lookup by default (an untrained
    early-exit draft of a few layers accepts almost nothing); --method draft still gets one."""
    from specjax import shipped  # noqa: PLC0415
    from tests.conftest import tiny_model  # noqa: PLC0415

    target = tiny_model(3, layers=4)
    assert not shipped.applies_to(target)
    draft, name, method = shipped.default_draft(target)
    assert (draft, method) == (None, "ngram") and "n-gram" in name
    draft, name, method = shipped.default_draft(target, "draft")
    assert method == "draft" and draft.config.num_layers == 4  # min(8, the target's layers)
