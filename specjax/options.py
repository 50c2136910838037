"""One translation from loose speculation options (command-line flags, a server's settings, a
``checkpoints/fastest.json`` entry) to a validated ``SpecConfig``.

Every default is stated once, in ``SpecConfig`` / ``TreeConfig`` (and
``config.default_num_draft_tokens`` for the draft length when it is unset); this module only
fills the options left unset (``None``) from the measured-fastest entry when one applies, else
from those defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from specjax.config import SpecConfig, default_num_draft_tokens
from specjax.tree import TreeConfig

# SpecConfig's fields set directly by an option of the same name ("tree" is built from TREE_KEYS).
SPEC_KEYS = tuple(f.name for f in dataclasses.fields(SpecConfig) if f.name != "tree")
# option name -> TreeConfig field, in the order of a fastest.json entry's "tree" list.
TREE_KEYS = {"tree_depth": "depth", "tree_top_k": "top_k", "tree_nodes": "num_nodes"}
KEYS = SPEC_KEYS + tuple(TREE_KEYS) + ("tree",)


def spec_from_options(options: Mapping[str, Any],
                      recommended: Mapping | None = None) -> SpecConfig:
    """The SpecConfig of ``options``.

    Args:
      options: SpecConfig field names (method, num_draft_tokens, draft_sampling, attn_impl,
        page_size, ngram_min, ngram_max, hybrid_min, adaptive, adaptive_by) plus tree_depth /
        tree_top_k / tree_nodes (method "eagle-tree"), or ``tree`` (a ready TreeConfig, instead
        of tree_*). A value of None means unset.
      recommended: a ``checkpoints/fastest.json`` entry (``specjax.shipped.recommended``): its
        method, num_draft_tokens, tree, hybrid_min, adaptive and adaptive_by fill the options
        left unset, when its method is the method in use (the options' method, or unset).

    Unset options with no recommended value take SpecConfig's / TreeConfig's defaults, except
    the draft length: ``config.default_num_draft_tokens(method, adaptive)``.

    Raises:
      ValueError: an unknown option (named), tree options without method "eagle-tree", or an
        invalid value (from SpecConfig / TreeConfig, naming the field).
    """
    if not isinstance(options, Mapping):
        raise TypeError(f"options must be a mapping, got {type(options).__name__}")
    unknown = sorted(set(options) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown speculation option(s) {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(KEYS)}")
    given = {k: v for k, v in options.items() if v is not None}
    rec = dict(recommended or {})
    method = given.get("method", rec.get("method") or "none")
    if rec and rec.get("method") != method:
        rec = {}  # measured for another method: it says nothing about this one
    fields = {k: given[k] for k in SPEC_KEYS if k in given}
    fields["method"] = method
    if rec:
        if "adaptive" not in fields and rec.get("adaptive"):
            fields["adaptive"] = True
            if "adaptive_by" not in fields and rec.get("adaptive_by"):
                fields["adaptive_by"] = rec["adaptive_by"]
        if "hybrid_min" not in fields and rec.get("hybrid_min"):
            fields["hybrid_min"] = int(rec["hybrid_min"])
        if "num_draft_tokens" not in fields and rec.get("num_draft_tokens"):
            fields["num_draft_tokens"] = int(rec["num_draft_tokens"])
    if "num_draft_tokens" not in fields:
        fields["num_draft_tokens"] = default_num_draft_tokens(method,
                                                              bool(fields.get("adaptive")))
    fields["tree"] = _tree(method, given, rec)
    return SpecConfig(**fields)


def _tree(method: str, given: dict, rec: dict) -> TreeConfig | None:
    named = [k for k in TREE_KEYS if k in given]
    if "tree" in given and named:
        raise ValueError(f"pass either tree or {', '.join(named)}, not both")
    if method != "eagle-tree":
        if named or "tree" in given:
            raise ValueError(f"{(named or ['tree'])[0]} is only used with method 'eagle-tree', "
                             f"got method {method!r}")
        return None
    if "tree" in given:
        return given["tree"]  # SpecConfig checks its type
    shape = dict(zip(TREE_KEYS.values(), rec.get("tree") or ()))
    shape.update({TREE_KEYS[k]: given[k] for k in named})
    return TreeConfig(**{k: int(v) for k, v in shape.items()})
