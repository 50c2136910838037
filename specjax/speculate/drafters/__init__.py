"""Drafter kinds behind one interface (``base.Drafter``), and ``resolve``: the one place that
maps a SpecConfig method name to a drafter.

| method                               | drafter                          |
|--------------------------------------|----------------------------------|
| "none"                               | NoDrafter                        |
| "draft"                              | DraftLLM (a draft language model)|
| "mtp", "eagle", "eagle3", "eagle-tree" | HeadDrafter (specjax.heads)    |
| "ngram"                              | NgramDrafter                     |
| "dflash"                             | BlockDrafter (specjax.dflash)    |
| "peagle"                             | ParallelHeadDrafter (specjax.peagle) |
| "custom"                             | the Drafter given as draft=Custom(drafter, params) |

``hybrid_min > 0`` wraps a model drafter in ``Hybrid`` (n-gram rows in the same verify).
"""

from __future__ import annotations

from specjax.speculate.drafters.base import Autoregressive, Custom, Drafter, NoDrafter, Span
from specjax.speculate.drafters.block import BlockDrafter
from specjax.speculate.drafters.head import HeadDrafter
from specjax.speculate.drafters.llm import DraftLLM
from specjax.speculate.drafters.ngram import Hybrid, NgramDrafter
from specjax.speculate.drafters.parallel import ParallelHeadDrafter

__all__ = ["Autoregressive", "BlockDrafter", "Custom", "Drafter", "DraftLLM", "HeadDrafter", "Hybrid",
           "NgramDrafter", "NoDrafter", "ParallelHeadDrafter", "Span",
           "resolve"]


def _builders(lc, target_cfg, draft_cfg) -> dict:
    """Method name -> a function building its drafter."""
    head = lambda: HeadDrafter(draft_cfg, target_cfg, lc.attn_impl)  # noqa: E731
    return {"none": NoDrafter, "ngram": lambda: NgramDrafter(lc.ngram_min, lc.ngram_max),
            "draft": lambda: DraftLLM(draft_cfg, lc.attn_impl), "mtp": head, "eagle": head,
            "eagle3": head, "eagle-tree": head,
            "dflash": lambda: BlockDrafter(draft_cfg, target_cfg, lc.attn_impl),
            "peagle": lambda: ParallelHeadDrafter(draft_cfg.head, target_cfg, lc.attn_impl,
                                                  draft_cfg),
            "custom": lambda: draft_cfg}


def resolve(lc, target_cfg, draft_cfg) -> Drafter:
    """The static drafter of a SpecConfig and the draft's static config (a ModelConfig for a
    draft LLM, a HeadConfig for a head, a DFlashConfig for "dflash", a PEagleConfig for
    "peagle", a Drafter for method "custom", None otherwise). The one place that reads
    ``lc.method``."""
    drafter = _builders(lc, target_cfg, draft_cfg)[lc.method]()
    if not isinstance(drafter, Drafter):
        raise TypeError(f'method="{lc.method}" needs draft=specjax.speculate.Custom(drafter, params)')
    if lc.hybrid_min > 0:
        drafter = Hybrid(drafter, lc.ngram_min, lc.ngram_max, lc.hybrid_min)
    drafter.check(lc)
    return drafter
