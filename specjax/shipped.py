"""Shipped draft checkpoints: where they are, which one is best per kind, loading it.

The repository's ``checkpoints/`` folder (present in a source checkout, see checkpoints/README.md)
holds drafts trained for SmolLM2-135M-Instruct. ``SHIPPED`` lists them best first; every caller
that wants "the shipped draft" (the CLI, ``specjax.bench``, benchmarks/bench_engine.py,
benchmarks/gpu_check.py) asks this module instead of naming a folder.
"""

from __future__ import annotations

import os

SHIPPED_FOR = "smollm2-135m"  # the target (``Model.source``) the shipped drafts were trained for
KINDS = ("mtp", "eagle", "eagle3", "draft")
# (folder name, draft kind), best first: within a kind the first present one is used. The
# default draft (no method asked for) is the first present one overall: smollm2-mtp-v8k is the
# one measured fastest on the CPU (benchmarks/RESULTS.md); smollm2-eagle3-broad accepts more on
# held-out broad prompts but its wall-clock speed has not been measured side by side yet.
SHIPPED = (("smollm2-mtp-v8k", "mtp"), ("smollm2-eagle3-broad", "eagle3"), ("smollm2-mtp", "mtp"),
           ("smollm2-eagle", "eagle"), ("smollm2-draft", "draft"))


def checkpoints_dir() -> str:
    """The repository's checkpoints/ folder (it may be absent in an installed package)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")


def path(name: str) -> str:
    """Path of shipped checkpoint ``name`` (which may not exist)."""
    return os.path.join(checkpoints_dir(), name)


def available(kind: str | None = None) -> list[tuple[str, str]]:
    """(name, kind) of the shipped checkpoints present here, best first; only ``kind`` if given."""
    from specjax.io.checkpoint import is_checkpoint  # noqa: PLC0415 - orbax only when asked
    from specjax.io.heads_io import is_eagle3_dir  # noqa: PLC0415

    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    return [(n, k) for n, k in SHIPPED if kind in (None, k)
            and (is_eagle3_dir(path(n)) if k == "eagle3" else is_checkpoint(path(n)))]


def best(kind: str) -> str | None:
    """Name of the best shipped checkpoint of ``kind`` present here, or None."""
    found = available(kind)
    return found[0][0] if found else None


def applies_to(target) -> bool:
    """Whether the shipped drafts were trained for ``target`` (a ``specjax.Model``)."""
    return getattr(target, "source", None) == SHIPPED_FOR


def load_best(target, kind: str):
    """(draft, "checkpoints/<name>") of the best shipped ``kind`` for ``target``, or None when the
    drafts do not apply to this target or none of that kind is present."""
    import specjax as sj  # noqa: PLC0415

    name = best(kind) if applies_to(target) else None
    if name is None:
        return None
    return sj.load_draft(path(name), target=target), f"checkpoints/{name}"


def default_draft(target, method: str | None = None, layers: int = 8):
    """The best shipped draft for ``target`` (MTP head, EAGLE head, distilled draft LLM, in that
    order; restricted to ``method`` if given; any head drafts trees for "eagle-tree"), else an
    untrained early-exit draft of the target's first ``layers`` layers.

    Returns (draft, description, method).
    Raises:
      ValueError: ``method`` needs a trained draft and none is shipped for this target.
    """
    import specjax as sj  # noqa: PLC0415

    if applies_to(target):
        for name, kind in available():
            tree_ok = method == "eagle-tree" and kind in ("mtp", "eagle", "eagle3")
            if method in (None, kind) or tree_ok:
                return (sj.load_draft(path(name), target=target), f"checkpoints/{name}",
                        method if tree_ok else kind)
    if method in (None, "draft"):
        return (sj.early_exit_draft(target, layers),
                f"early-exit draft (first {layers} layers)", "draft")
    raise ValueError(f"no shipped {method!r} draft for {getattr(target, 'source', None)!r}: "
                     "pass --draft PATH")
