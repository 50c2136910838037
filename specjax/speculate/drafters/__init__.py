"""Drafter kinds behind one interface (``base.Drafter``), and ``resolve``: the one place that
maps a SpecConfig method name to a drafter.

| method                               | drafter                          |
|--------------------------------------|----------------------------------|
| "none"                               | NoDrafter                        |
| "draft"                              | DraftLLM (a draft language model)|
| "mtp", "eagle", "eagle3", "eagle-tree" | HeadDrafter (specjax.heads)    |
| "ngram"                              | NgramDrafter                     |
| "custom"                             | the Drafter given as draft=Custom(drafter, params) |

``hybrid_min > 0`` wraps a model drafter in ``Hybrid`` (n-gram rows in the same verify).
"""

from __future__ import annotations

from specjax.speculate.drafters.base import Autoregressive, Custom, Drafter, NoDrafter, Span
from specjax.speculate.drafters.head import HeadDrafter
from specjax.speculate.drafters.llm import DraftLLM
from specjax.speculate.drafters.ngram import Hybrid, NgramDrafter

__all__ = ["Autoregressive", "Custom", "Drafter", "DraftLLM", "HeadDrafter", "Hybrid",
           "NgramDrafter", "NoDrafter", "Span", "resolve"]


def resolve(lc, target_cfg, draft_cfg) -> Drafter:
    """The static drafter of a SpecConfig and the draft's static config (a ModelConfig for a
    draft LLM, a HeadConfig for a head, a Drafter for method "custom", None otherwise)."""
    method = lc.method
    if method == "none":
        return NoDrafter()
    if method == "ngram":
        return NgramDrafter(lc.ngram_min, lc.ngram_max)
    if method == "custom":
        if not isinstance(draft_cfg, Drafter):
            raise TypeError('method="custom" needs draft=specjax.speculate.Custom(drafter, params)')
        drafter = draft_cfg
    elif method == "draft":
        drafter = DraftLLM(draft_cfg, lc.attn_impl)
    else:
        drafter = HeadDrafter(draft_cfg, target_cfg, lc.attn_impl)
    if lc.hybrid_min > 0:
        drafter = Hybrid(drafter, lc.ngram_min, lc.ngram_max, lc.hybrid_min)
    drafter.check(lc)
    return drafter
