"""Shipped draft checkpoints: where they are, which one is best per kind, loading it.

The repository's ``checkpoints/`` folder (present in a source checkout, see checkpoints/README.md)
holds drafts trained for SmolLM2-135M-Instruct. ``SHIPPED`` lists them best first; every caller
that wants "the shipped draft" (the CLI, ``specjax bench``, benchmarks/bench_engine.py,
benchmarks/gpu_check.py) asks this module instead of naming a folder.

``checkpoints/fastest.json`` holds, per JAX backend ("cpu", "gpu", ...), the speculative
configuration measured fastest at batch 1 (draft, method, k or tree, hybrid n-gram minimum) with
its speedup, the command and the machine: written by ``benchmarks/bench_drafts.py
--write-fastest``, read by ``fastest`` / ``recommended`` (the CLI's and demo's defaults).
"""

from __future__ import annotations

import json
import os

import jax

import specjax as sj
from specjax.io.checkpoint import is_checkpoint
from specjax.io.heads_io import is_eagle3_dir

SHIPPED_FOR = "smollm2-135m"  # the target (``Model.source``) the shipped drafts were trained for
KINDS = ("mtp", "eagle", "eagle3", "draft")
# (folder name, draft kind), best first: within a kind the first present one is used. Without a
# fastest.json entry the default draft is the first present one overall: smollm2-mtp-v8k is the
# fastest on the wiki chat prompts at k=2; smollm2-eagle3-broad74-gpu (broad47-r1 fine-tuned on an
# H200 on all 74 broad shards, 2.25M answer tokens) drafts the best first token and accepts the
# most at k=1, k=3 and in trees on held-out broad prompts (benchmarks/RESULTS.md, "The EAGLE-3
# head on the full corpus, trained on the GPU"); smollm2-eagle3-broad47-r1 (broad16-r1 fine-tuned
# on broad shards 17-46 on the CPU) is its starting point. Timed side by side on a quiet machine
# broad74-gpu has the best worst case over chat + demo prompts, so fastest.json names it on CPU
# (since 2026-12-05 as a depth-1 tree of its top 3 first tokens, RESULTS.md "Depth-1 trees");
# smollm2-eagle3-broad16-r1 (16 broad shards, teacher-forced, 1,800 steps) was before it
# (RESULTS.md, "Training compute of the EAGLE-3 head"); smollm2-eagle3-broad (rollout 3) accepts
# more at k>=3 than broad16-r1.
SHIPPED = (("smollm2-mtp-v8k", "mtp"), ("smollm2-eagle3-broad74-gpu", "eagle3"),
           ("smollm2-eagle3-broad47-r1", "eagle3"),
           ("smollm2-eagle3-broad16-r1", "eagle3"),
           ("smollm2-eagle3-broad", "eagle3"), ("smollm2-mtp", "mtp"),
           ("smollm2-eagle", "eagle"), ("smollm2-draft", "draft"))


def checkpoints_dir() -> str:
    """The repository's checkpoints/ folder (it may be absent in an installed package)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "checkpoints")


def path(name: str) -> str:
    """Path of shipped checkpoint ``name`` (which may not exist)."""
    return os.path.join(checkpoints_dir(), name)


def available(kind: str | None = None) -> list[tuple[str, str]]:
    """(name, kind) of the shipped checkpoints present here, best first; only ``kind`` if given."""
    if kind is not None and kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS} or None, got {kind!r}")
    return [(n, k) for n, k in SHIPPED if kind in (None, k)
            and (is_eagle3_dir(path(n)) if k == "eagle3" else is_checkpoint(path(n)))]


def best(kind: str) -> str | None:
    """Name of the best shipped checkpoint of ``kind`` present here, or None."""
    found = available(kind)
    return found[0][0] if found else None


FASTEST_FILE = "fastest.json"


def fastest_path() -> str:
    return os.path.join(checkpoints_dir(), FASTEST_FILE)


def fastest(backend: str | None = None) -> dict | None:
    """The configuration measured fastest on ``backend`` (default: JAX's default backend), as
    written by ``bench_drafts.py --write-fastest``: {"draft" (a SHIPPED name), "method",
    "num_draft_tokens", "tree" ([depth, top_k, nodes] or None), "hybrid_min", "speedup",
    "mean_accepted_length", "command", "date", "machine", ...}; None when nothing was measured
    there, the file is unreadable, or its draft is not present here."""
    if backend is None:
        backend = jax.default_backend()
    try:
        with open(fastest_path()) as f:
            entry = json.load(f).get(backend)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(entry, dict) or entry.get("draft") not in dict(available()):
        return None
    return entry


def recommended(target, method: str | None = None) -> dict | None:
    """``fastest()`` when it applies: the shipped drafts fit ``target`` and ``method`` is None or
    the measured one ("eagle-tree" also matches a tree entry). None otherwise."""
    entry = fastest() if applies_to(target) else None
    if entry is None or method not in (None, entry.get("method")):
        return None
    return entry


def write_fastest(entry: dict, backend: str, dest: str | None = None) -> str:
    """Stores ``entry`` (see ``fastest``) for ``backend`` in checkpoints/fastest.json (or
    ``dest``), keeping the other backends' entries. Returns the path."""
    if entry.get("draft") not in dict(SHIPPED):
        raise ValueError(f"entry['draft'] must be one of the shipped drafts "
                         f"{[n for n, _ in SHIPPED]}, got {entry.get('draft')!r}")
    dest = dest or fastest_path()
    try:
        with open(dest) as f:
            data = json.load(f)
    except (OSError, ValueError):
        data = {}
    data[backend] = entry
    with open(dest, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
    return dest


def applies_to(target) -> bool:
    """Whether the shipped drafts were trained for ``target`` (a ``specjax.Model``)."""
    return getattr(target, "source", None) == SHIPPED_FOR


def load_best(target, kind: str):
    """(draft, "checkpoints/<name>") of the best shipped ``kind`` for ``target``, or None when the
    drafts do not apply to this target or none of that kind is present."""
    name = best(kind) if applies_to(target) else None
    if name is None:
        return None
    return sj.load_draft(path(name), target=target), f"checkpoints/{name}"


def default_draft(target, method: str | None = None, layers: int = 8):
    """The best shipped draft for ``target`` (MTP head, EAGLE head, distilled draft LLM, in that
    order; restricted to ``method`` if given; any head drafts trees for "eagle-tree"). For a
    target no shipped draft applies to: n-gram prompt lookup when no method is named (no draft
    model; an untrained early-exit draft of a few layers accepts almost nothing: 0 of 60 drafts
    of Gemma 3 270M's first 8 layers), an early-exit draft of the first ``layers`` layers for
    method "draft".

    Returns (draft or None, description, method).
    Raises:
      ValueError: ``method`` needs a trained draft and none is shipped for this target.
    """
    if applies_to(target):
        for name, kind in available():
            tree_ok = method == "eagle-tree" and kind in ("mtp", "eagle", "eagle3")
            if method in (None, kind) or tree_ok:
                return (sj.load_draft(path(name), target=target), f"checkpoints/{name}",
                        method if tree_ok else kind)
    if method is None:
        return None, "n-gram lookup (no draft model: none is shipped for this target)", "ngram"
    if method == "draft":
        layers = min(layers, target.config.num_layers)
        return (sj.early_exit_draft(target, layers),
                f"early-exit draft (first {layers} layers)", "draft")
    raise ValueError(f"no shipped {method!r} draft for {getattr(target, 'source', None)!r}: "
                     "pass --draft PATH")
