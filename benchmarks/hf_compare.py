"""Side-by-side benchmark: specjax vs HF transformers on the same weights, in the same run.

Cases (greedy, EOS off, every row generates exactly ``max_new_tokens``):

  HF transformers   plain ``generate``; assisted generation (``assistant_model=`` the same draft
                    LLM converted to an HF directory, a constant ``k`` and no confidence cut-off,
                    plus HF's default adaptive schedule); prompt lookup (``prompt_lookup_num_tokens``).
                    HF runs assisted generation and prompt lookup at batch 1 only.
  specjax           plain (``method="none"``); the draft LLM (``method="draft"``); the MTP and
                    EAGLE heads (``method="mtp"`` / ``"eagle"``) when given; n-gram prompt lookup
                    (``method="ngram"``, beside HF's prompt lookup at the same k); optionally each
                    method with ``adaptive=True`` (k chosen on device per step).

Targets: SmolLM2-135M-Instruct (the default; held-out chat prompts through its chat template; HF
reads the exact float32 weights specjax dequantized, written as a transformers directory) or a
base model, ``--model gemma3-270m`` (Gemma 3 270M, Gemma Terms of Use: continuation prompts of
``--prompt-tokens`` tokens from held-out Wikipedia intros with BOS; HF reads the same GGUF itself,
``from_pretrained(dir, gguf_file=...)``, and dequantizes it to float32; no draft LLM, since HF
assisted generation would need it as a transformers directory: plain and prompt lookup / n-gram
only). ``--weights`` picks specjax's weights: "quantized" (the GGUF blocks through the native
kernel), "float32" (HF's math) or "both" (a second specjax plain row on the other one).

Batch 1 runs the prompts one after another; the batched run puts ``batch`` prompts in one call
(HF: left padding + attention mask; specjax: ragged prompts). Timing: one warm-up per case
(compilation excluded), then ``repeats`` timed rounds with the cases in alternating order;
tokens/s = all new tokens / wall time of the generate calls (prefill included), median over
rounds. During every timed run the CPU share used by *other* processes is recorded ("foreign
CPU"); ``wait_idle`` waits for a quiet machine first. Greedy outputs are compared row by row with
HF plain batch 1 (the reference) and with specjax plain batch 1.

``specjax bench`` runs it with small defaults (from a source checkout: it loads this file by
path); ``benchmarks/bench_compare.py`` with the defaults used for benchmarks/RESULTS.md. Torch is
needed only for the HF cases (skipped with ``hf=False`` / ``--no-hf``). The library never imports
this module (it lives in benchmarks/, beside the scripts that use it).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import sys
import tempfile
from typing import Callable

import jax
import jaxlib
import numpy as np
from tqdm.auto import tqdm

import specjax as sj
from specjax import shipped
from specjax.cost_model import cost_ratios
from specjax.io.gemma_io import GEMMA_LICENSE
from specjax.io.gguf import builtin_gguf_path
from specjax.io.hf import save_hf_dir
from specjax.options import spec_from_options
from specjax.provenance import with_provenance
from specjax.timing import Timer, machine_info, usable_cpus, wait_idle
from specjax.train.corpora import chat_prompts, wiki_entries

# Base models: continuation prompts from held-out Wikipedia, HF reads the GGUF itself.
BASE_MODELS = {"gemma3-270m": GEMMA_LICENSE}


# ------------------------------------------------------------------------------ the machine


def versions(hf: bool) -> dict:
    out = {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
           "numpy": np.__version__, "jax_backend": jax.default_backend(),
           "jax_device": str(jax.devices()[0].device_kind)}
    if hf:
        import torch  # noqa: PLC0415 - torch: only for the HF cases
        import transformers  # noqa: PLC0415
        out.update(torch=torch.__version__, transformers=transformers.__version__,
                   torch_threads=torch.get_num_threads())
    return out


# ------------------------------------------------------------------------------------ cases


@dataclasses.dataclass
class Case:
    """One row of the comparison. ``run(prompts)`` generates for a batch and returns
    (tokens per row, extra stats dict)."""

    name: str
    engine: str  # "specjax" | "hf"
    method: str  # "plain" | "assisted" | "assisted (HF schedule)" | "prompt lookup" | "draft" | ...
    draft: str  # what proposes ("-" for plain)
    k: int  # draft length (0 = plain)
    run: Callable
    batched: bool = True  # can run a batch > 1


def specjax_cases(target, n_new: int, drafts: dict, ks: dict, adaptive: bool = False,
                  plain_variants: dict | None = None) -> list[Case]:
    """specjax plain + one case per draft (+ its adaptive twin). drafts: {method: (draft,
    description)}; method "ngram" takes draft None. plain_variants: {label: Model}, one more
    plain case each ("specjax plain (label)": the same target with other weights)."""

    def runner(method, draft, k, adapt=False, model=target):
        # the one translation the CLI, the server and sj.generate use (specjax/options.py)
        spec = spec_from_options({"method": method, "num_draft_tokens": k, "adaptive": adapt})

        def run(prompts):
            out = sj.generate(model, prompts, max_new_tokens=n_new, draft=draft, spec=spec,
                              temperature=0.0, eos_token_id=[])
            s = out.stats
            extra = {"row_steps": s["row_steps"],  # tokens after each row's first
                     "step_tokens": s["generated_tokens"] - len(prompts)}
            if "k_histogram" in s:
                extra["k_histogram"] = s["k_histogram"]
            return out.tokens, extra
        return run

    cases = [Case("specjax plain", "specjax", "plain", "-", 0, runner("none", None, 1))]
    for label, model in (plain_variants or {}).items():
        cases.append(Case(f"specjax plain ({label})", "specjax", f"plain ({label})", "-", 0,
                          runner("none", None, 1, model=model)))
    for method, (draft, desc) in drafts.items():
        cases.append(Case(f"specjax {method}", "specjax", method, desc, ks[method],
                          runner(method, draft, ks[method])))
        if adaptive:
            cases.append(Case(f"specjax {method} adaptive", "specjax", f"{method} adaptive", desc,
                              ks[method], runner(method, draft, ks[method], True)))
    return cases


def _hf_model(path: str, device: str = "cpu", gguf_file: str | None = None):
    """An HF model from a transformers directory, or from ``path/gguf_file`` (a GGUF, which
    transformers dequantizes to float32)."""
    import torch  # noqa: PLC0415 - torch: only for the HF cases
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    kw = {} if gguf_file is None else {"gguf_file": gguf_file}
    m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw).to(device).eval()
    m.generation_config.eos_token_id = None  # never stop early (EOS off on both sides)
    return m


def hf_generate(hf, prompts: list, n_new: int, pad: int = 0, **kw) -> list[list[int]]:
    """Greedy HF ``generate`` of exactly ``n_new`` tokens per prompt (EOS off), the prompts
    left-padded with ``pad`` under an attention mask, on the model's device; ``kw`` go to
    ``generate`` (assistant_model, prompt_lookup_num_tokens, ...). Returns the new tokens."""
    import torch  # noqa: PLC0415 - torch: only for the HF cases

    dev = next(hf.parameters()).device
    lmax = max(len(p) for p in prompts)
    ids = np.full((len(prompts), lmax), pad, np.int64)
    mask = np.zeros((len(prompts), lmax), np.int64)
    for i, p in enumerate(prompts):  # left padding
        ids[i, lmax - len(p):] = p
        mask[i, lmax - len(p):] = 1
    with torch.inference_mode():
        out = hf.generate(torch.from_numpy(ids).to(dev), attention_mask=torch.from_numpy(mask).to(dev),
                          max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                          eos_token_id=None, pad_token_id=pad, **kw)
    return out[:, lmax:].tolist()


def hf_cases(target, n_new: int, draft=None, draft_desc: str = "-", k: int = 2,
             prompt_lookup_k: int = 0, work: str | None = None, device: str = "cpu",
             gguf: str | None = None) -> list[Case]:
    """HF plain (+ assisted with ``draft`` converted to HF, + prompt lookup) on ``target``'s
    exact weights: both are written as HF directories (float32 safetensors) under ``work``;
    with ``gguf`` (the target's GGUF file) HF loads and dequantizes that file instead."""

    if gguf is not None:
        hf = _hf_model(os.path.dirname(os.path.abspath(gguf)), device, os.path.basename(gguf))
    else:
        work = work or tempfile.mkdtemp(prefix="specjax-bench-")
        tdir = os.path.join(work, "hf-target")
        save_hf_dir(target.params, target.config, tdir)
        hf = _hf_model(tdir, device)
    pad = target.config.eos_token_id if isinstance(target.config.eos_token_id, int) else 0

    def gen(prompts, **kw):
        return hf_generate(hf, prompts, n_new, pad=pad, **kw), {}

    cases = [Case("HF plain", "hf", "plain", "-", 0, gen)]
    if draft is not None:
        work = work or tempfile.mkdtemp(prefix="specjax-bench-")
        ddir = os.path.join(work, "hf-draft")
        save_hf_dir(draft.params, draft.config, ddir)
        hd = _hf_model(ddir, device)
        hd_default = _hf_model(ddir, device)  # HF's own defaults: adaptive k, confidence cut-off
        hd.generation_config.num_assistant_tokens = k
        hd.generation_config.num_assistant_tokens_schedule = "constant"
        hd.generation_config.assistant_confidence_threshold = 0.0
        cases.append(Case("HF assisted", "hf", "assisted", draft_desc, k,
                          lambda p: gen(p, assistant_model=hd), batched=False))
        cases.append(Case("HF assisted (HF defaults)", "hf",
                          "assisted (HF defaults: k<=20, confidence cut-off 0.4)", draft_desc,
                          int(hd_default.generation_config.num_assistant_tokens or 20),
                          lambda p: gen(p, assistant_model=hd_default), batched=False))
    if prompt_lookup_k:
        cases.append(Case("HF prompt lookup", "hf", "prompt lookup", "prompt n-grams",
                          prompt_lookup_k, lambda p: gen(p, prompt_lookup_num_tokens=prompt_lookup_k),
                          batched=False))
    return cases


# ------------------------------------------------------------------------------- measuring


def _first_divergence(a, b):
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure(cases: list[Case], prompts: list, batch: int, repeats: int = 3, wait_idle_s: float = 0.0,
            progress: bool = True, batch_prompts: list | None = None) -> dict:
    """Times every case at batch 1 (prompts one by one) and at ``batch`` (the first ``batch``
    prompts in one call). Returns {"batch1": {name: result}, "batchB": {...}}."""

    n_rounds = repeats + 1
    settings = [("batch1", 1, [[p] for p in prompts])]
    if batch > 1:
        settings.append(("batchB", batch, [(batch_prompts or prompts)[:batch]]))
    total = sum(n_rounds * len(calls) * sum(1 for c in cases if b == 1 or c.batched)
                for _, b, calls in settings)
    bar = tqdm(total=total, desc="bench", unit="call", disable=not progress, file=sys.stderr)
    out = {}
    for label, b, calls in settings:
        todo = [c for c in cases if b == 1 or c.batched]
        res = {c.name: {"wall_s": [], "foreign_cpu": [], "tokens": None, "extra": []} for c in todo}
        for r in range(n_rounds):  # round 0 = warm-up (compilation), then timed, order alternating
            for c in (todo if r % 2 == 0 else todo[::-1]):
                bar.set_postfix_str(f"{label} {c.name}{' (warm-up)' if r == 0 else ''}")
                wall, foreign, toks, extra = 0.0, [], [], []
                for call in calls:
                    if r:
                        wait_idle(wait_idle_s)
                    with Timer() as t:
                        tk, ex = c.run(call)
                    wall += t.wall
                    foreign.append((t.foreign, t.wall))
                    toks += tk
                    extra.append(ex)
                    bar.update(1)
                if r == 0:
                    res[c.name]["warmup_s"] = wall
                    continue
                res[c.name]["wall_s"].append(wall)
                # The round's foreign share, wall-weighted over its calls (a single short call's
                # share is dominated by the 10 ms granularity of /proc/stat).
                fc = [(f, w) for f, w in foreign if f is not None]
                res[c.name]["foreign_cpu"].append(
                    sum(f * w for f, w in fc) / max(sum(w for _, w in fc), 1e-9) if fc else None)
                res[c.name]["tokens"] = toks
                res[c.name]["extra"] = extra
        for c in todo:
            d = res[c.name]
            n_tok = sum(len(t) for t in d["tokens"])
            d.update(engine=c.engine, method=c.method, draft=c.draft, k=c.k, batch=b,
                     new_tokens=n_tok, tokens_per_second=[n_tok / w for w in d["wall_s"]])
            d["median_tokens_per_second"] = float(statistics.median(d["tokens_per_second"]))
            steps = sum(e.get("row_steps", 0) for e in d["extra"])
            if steps and c.k:
                d["mean_accepted_length"] = sum(e["step_tokens"] for e in d["extra"]) / steps
            hists = [e["k_histogram"] for e in d["extra"] if "k_histogram" in e]
            if hists:  # adaptive: steps per chosen k, summed over the last round's calls
                d["k_histogram"] = [int(sum(col)) for col in zip(*hists)]
            fc = [f for f in d["foreign_cpu"] if f is not None]
            d["max_foreign_cpu"] = max(fc) if fc else None
            del d["extra"]
        out[label] = res
    bar.close()
    return out


def compare_outputs(results: dict) -> None:
    """Adds per-row greedy agreement with HF plain ("vs_hf") and specjax plain
    ("vs_specjax_plain") batch-1 tokens to every result (when those cases ran)."""
    for res in results.values():
        for d in res.values():
            for ref_name, key in (("HF plain", "vs_hf"), ("specjax plain", "vs_specjax_plain")):
                ref = results["batch1"].get(ref_name)
                if ref is None:
                    continue
                divs = [_first_divergence(a, b) for a, b in zip(d["tokens"], ref["tokens"])]
                d[key] = {"identical_rows": sum(x is None for x in divs), "rows": len(divs),
                          "first_divergence": divs}


def _fmt_match(m) -> str:
    if m is None:
        return "-"
    s = f"{m['identical_rows']}/{m['rows']}"
    firsts = [x for x in m["first_divergence"] if x is not None]
    return s + (f" (first diff at token {min(firsts)})" if firsts else "")


def table(results: dict, batch: int) -> str:
    """Markdown table: one row per (batch, case), ratios against HF at the same batch."""
    rows = ["| batch | engine | method | draft | k | tok/s | vs HF plain | vs HF assisted | "
            "mean acc. len | greedy = HF plain (rows) | = specjax plain | max foreign CPU |",
            "|---:|---|---|---|---:|---:|---:|---:|---:|---|---|---:|"]
    for label, res in results.items():
        b = 1 if label == "batch1" else batch
        hf_plain = res.get("HF plain", {}).get("median_tokens_per_second")
        assisted = results["batch1"].get("HF assisted", {})
        hf_assist = assisted.get("median_tokens_per_second")
        for name, d in res.items():
            tps = d["median_tokens_per_second"]
            vs_plain = f"{tps / hf_plain:.2f}x" if hf_plain else "-"
            # only against HF assisted with the *same* draft (a different draft is no comparison)
            same_draft = d["k"] and d["draft"] == assisted.get("draft")
            vs_assist = f"{tps / hf_assist:.2f}x" if hf_assist and same_draft and b == 1 else "-"
            mal = f"{d['mean_accepted_length']:.2f}" if "mean_accepted_length" in d else "-"
            fc = d.get("max_foreign_cpu")
            rows.append(f"| {b} | {d['engine']} | {d['method']} | {d['draft']} | {d['k'] or '-'} | "
                        f"{tps:.1f} | {vs_plain} | {vs_assist} | {mal} | {_fmt_match(d.get('vs_hf'))} | "
                        f"{_fmt_match(d.get('vs_specjax_plain'))} | "
                        f"{'?' if fc is None else f'{100 * fc:.0f}%'} |")
    return "\n".join(rows)


# --------------------------------------------------------------------------------- the run


def run(target, prompts: list, *, num_prompts: int | None = None, max_new_tokens: int = 32,
        batch: int = 4, repeats: int = 2,
        drafts: dict | None = None, ks: dict | None = None, hf: bool = True,
        hf_draft_method: str = "draft", prompt_lookup_k: int = 0, wait_idle_s: float = 0.0,
        work: str | None = None, progress: bool = True, cost_model: bool = True,
        hf_device: str = "cpu", adaptive: bool = False, hf_gguf: str | None = None,
        plain_variants: dict | None = None) -> dict:
    """Runs the comparison and returns a JSON-able report (with ``table_md``).

    Args:
      target: a specjax Model (float32 for the HF comparison).
      prompts: token-id lists: batch 1 runs the first ``num_prompts`` (default: all) one at a
        time, the batched run the first ``batch`` in one call.
      drafts: {method: (draft, description)} for methods "draft", "mtp", "eagle" and "ngram"
        (draft None); the "draft" entry (a draft LLM) is also HF's assistant model.
      adaptive: also run every specjax method with ``adaptive=True``.
      ks: draft length per method.
      hf: include the HF transformers cases (needs torch).
      hf_gguf: HF loads this GGUF (the target's own file) instead of the target's weights.
      plain_variants: {label: Model}: more specjax plain cases (the target with other weights).
    """
    drafts, ks = drafts or {}, ks or {}
    info = {"machine": machine_info(), "versions": versions(hf), "command": " ".join(sys.argv),
            "max_new_tokens": max_new_tokens, "batch": batch, "repeats": repeats,
            "num_prompts": num_prompts or len(prompts), "prompt_lengths": [len(p) for p in prompts],
            "wait_idle_s": wait_idle_s, "ks": ks,
            "drafts": {m: d for m, (_, d) in drafts.items()}}
    cases = []
    if hf:
        dr = drafts.get(hf_draft_method)
        cases += hf_cases(target, max_new_tokens, draft=None if dr is None else dr[0],
                          draft_desc="-" if dr is None else dr[1], k=ks.get(hf_draft_method, 2),
                          prompt_lookup_k=prompt_lookup_k, work=work, device=hf_device,
                          gguf=hf_gguf)
    cases += specjax_cases(target, max_new_tokens, drafts, ks, adaptive, plain_variants)
    results = measure(cases, prompts[:num_prompts or len(prompts)], batch, repeats, wait_idle_s,
                      progress, batch_prompts=prompts[:batch])
    compare_outputs(results)
    report = {**info, "results": results, "table_md": table(results, batch)}
    if cost_model:
        ctx = int(np.mean([len(p) for p in prompts])) + max_new_tokens // 2
        report["costs"] = cost_ratios(target, [1] + [k for k in ks.values()], ctx, drafts)
    fcs = [d.get("max_foreign_cpu") for r in results.values() for d in r.values()]
    fcs = [f for f in fcs if f is not None]
    report["max_foreign_cpu"] = max(fcs) if fcs else None
    report["loadavg_at_end"] = machine_info()["loadavg"]
    return report


def summary(report: dict) -> str:
    """A few lines under the table: costs and contention."""
    lines = []
    c = report.get("costs")
    if c:
        vd = ", ".join(f"k={k}: {v:.2f}" for k, v in c["verify_over_decode"].items())
        lines.append(f"target decode step {c['target_decode_ms']:.1f} ms at context {c['context']}; "
                     f"verify(k+1)/decode(1): {vd}"
                     + "".join(f"; draft/target step ({m[2:]}) {v:.2f}" for m, v in c.items()
                               if m.startswith("c_")))
    fc = report.get("max_foreign_cpu")
    if fc is not None:
        lines.append(f"max foreign CPU during timed runs: {100 * fc:.0f}%"
                     + (" -- contended: treat the numbers with care" if fc > 0.1 else ""))
    return "\n".join(lines)


def dump(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(with_provenance(report), f, indent=2, default=float)


# ------------------------------------------------------------------- command-line plumbing


def add_arguments(p, *, max_new_tokens=32, num_prompts=4, batch=4, repeats=2, out=None) -> None:
    """The options shared by ``specjax bench`` and benchmarks/bench_compare.py."""
    p.add_argument("--model", default="smollm2-135m",
                   help="target: name, HF dir, .gguf, checkpoint; a base model "
                        f"({', '.join(BASE_MODELS)}) gets held-out Wikipedia continuations and "
                        "HF reads its GGUF")
    p.add_argument("--weights", choices=("quantized", "float32", "both"), default="quantized",
                   help="specjax's weights for a GGUF target: its quantized blocks (native kernel), "
                        "float32 (dequantized: HF's math), or both (float32 is 'specjax plain', "
                        "the quantized run one more plain row)")
    p.add_argument("--prompt-tokens", type=int, default=64,
                   help="a base model's prompt length (BOS + held-out Wikipedia text; shorter "
                        "intros continue with the next ones, so prompts may exceed a window)")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: same as --model)")
    p.add_argument("--draft", default=None,
                   help="draft LLM for specjax 'draft' and HF assisted generation (default: "
                        "checkpoints/smollm2-draft if present, else an early-exit draft)")
    p.add_argument("--early-exit-layers", type=int, default=2,
                   help="layers of the early-exit fallback draft (the target's first n layers)")
    p.add_argument("--mtp", default="auto", help="MTP head path, 'auto' (the best shipped MTP head, "
                                                  "see specjax.shipped) or 'none'")
    p.add_argument("--eagle", default="auto", help="EAGLE head path, 'auto' (the shipped "
                                                    "EAGLE head) or 'none'")
    p.add_argument("--k-draft", type=int, default=None,
                   help="draft length for the draft LLM, same for HF assisted (default: 1 for the "
                        "untrained early-exit draft, 3 for a trained one)")
    p.add_argument("--k-mtp", type=int, default=1, help="draft length for the MTP head")
    p.add_argument("--k-eagle", type=int, default=1, help="draft length for the EAGLE head")
    p.add_argument("--prompt-lookup", type=int, default=3,
                   help="k of HF prompt lookup (prompt_lookup_num_tokens) and of specjax's n-gram "
                        "drafting (method ngram) beside it; 0 = skip both")
    p.add_argument("--adaptive", action="store_true",
                   help="also run each specjax method with adaptive k (chosen on device per step)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--num-prompts", type=int, default=num_prompts,
                   help="held-out prompts (chat, or a base model's Wikipedia continuations), "
                        "run one at a time for batch 1")
    p.add_argument("--batch", type=int, default=batch, help="the batched run's size (1 = skip)")
    p.add_argument("--repeats", type=int, default=repeats, help="timed rounds after a warm-up")
    p.add_argument("--no-hf", dest="hf", action="store_false",
                   help="skip the HF transformers peer (no torch needed)")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="torch.set_num_threads (default: the CPUs this process may use)")
    p.add_argument("--wait-idle", type=float, default=0.0,
                   help="wait up to this many seconds for a quiet machine before each timed run")
    p.add_argument("--no-cost-model", dest="cost_model", action="store_false",
                   help="skip timing verify(k+1)/decode(1) forwards")
    p.add_argument("--work", default=None, help="where the HF copies of the weights go "
                                                 "(default: a temporary directory)")
    p.add_argument("--out", default=out, help="write the JSON report here (and the table to .md)")
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="print the JSON report on stdout (or write it to PATH)")
    p.add_argument("--no-progress", dest="progress", action="store_false")


def _resolve_head(target, arg: str, kind: str):
    """--mtp / --eagle: "none", "auto" (the best shipped head of ``kind``, if any) or a path."""

    if arg == "none":
        return None
    if arg == "auto":
        return shipped.load_best(target, kind)
    return sj.load_draft(arg, target=target), arg


def wiki_prompts(tok, n: int, prompt_tokens: int) -> list[list[int]]:
    """``n`` continuation prompts for a base model, ``prompt_tokens`` ids each: BOS + a held-out
    Wikipedia intro (as benchmarks/bench_quant.py's prompts), continued by the next intros
    (blank-line separated) while shorter, so that a prompt can span a sliding window."""
    if prompt_tokens < 2:
        raise ValueError(f"prompt_tokens must be >= 2, got {prompt_tokens}")
    entries = iter(wiki_entries("held_out"))
    out = []
    for _ in range(n):
        ids = list(tok.encode(next(entries)["extract"], add_special_tokens=True))
        while len(ids) < prompt_tokens:
            ids += tok.encode("\n\n" + next(entries)["extract"], add_special_tokens=False)
        out.append(ids[:prompt_tokens])
    return out


def run_from_args(args) -> dict:
    """Loads the target, drafts and prompts named by ``args`` and runs the comparison."""

    if args.hf:
        import torch  # noqa: PLC0415 - torch: only for the HF cases
        torch.set_num_threads(args.torch_threads or len(usable_cpus()))
    weights = getattr(args, "weights", "quantized")
    target = sj.load_model(args.model, weights="quantized" if weights == "quantized" else "float32")
    variants = ({"quantized weights": sj.load_model(args.model, weights="quantized")}
                if weights == "both" else None)
    tok = sj.load_tokenizer(args.tokenizer or args.model)
    base = args.model in BASE_MODELS
    drafts, ks = {}, {}
    best_draft = None if args.draft or base else shipped.load_best(target, "draft")
    if args.draft:
        drafts["draft"] = (sj.load_draft(args.draft, target=target), args.draft)
    elif best_draft is not None:
        drafts["draft"] = best_draft
    elif not base:  # a base model: plain (and n-gram) only, see the module docstring
        n = args.early_exit_layers
        drafts["draft"] = (sj.early_exit_draft(target, n), f"early-exit {n} layers")
    trained = bool(args.draft) or best_draft is not None
    if "draft" in drafts:
        ks["draft"] = args.k_draft or (3 if trained else 1)
    for method, arg, k in (("mtp", args.mtp, args.k_mtp), ("eagle", args.eagle, args.k_eagle)):
        head = _resolve_head(target, arg, method)
        if head is not None:
            drafts[method], ks[method] = head, k
    if args.prompt_lookup:
        drafts["ngram"], ks["ngram"] = (None, "prompt n-grams"), args.prompt_lookup
    n = max(args.num_prompts, args.batch)
    if base:
        prompts = wiki_prompts(tok, n, args.prompt_tokens)
    else:
        prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=n)]
    report = run(target, prompts, num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                 batch=args.batch, repeats=args.repeats, drafts=drafts, ks=ks, hf=args.hf,
                 prompt_lookup_k=args.prompt_lookup, wait_idle_s=args.wait_idle, work=args.work,
                 progress=args.progress, cost_model=args.cost_model,
                 adaptive=getattr(args, "adaptive", False),
                 hf_gguf=builtin_gguf_path(args.model) if base else None,
                 plain_variants=variants)
    report.update(model=args.model, weights=weights,
                  prompts=(f"held-out Wikipedia intros, BOS + {args.prompt_tokens} tokens"
                           if base else "held-out chat prompts (chat template)"))
    if base:
        report["license"] = BASE_MODELS[args.model]
    report["sample_output"] = tok.decode(report["results"]["batch1"]["specjax plain"]["tokens"][0])
    if args.out:
        dump(report, args.out)
        with open(os.path.splitext(args.out)[0] + ".md", "w") as f:
            f.write(report["table_md"] + "\n\n" + summary(report) + "\n")
    return report
