"""Sharded vs one-device decoding on fake CPU devices (run by tests/test_sharding.py).

Needs its own process: the device count is fixed when jax starts. Run as
``XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/_sharding_check.py CASES OUT``.
CASES: comma-separated ``target:method:tp:dp[:option...]`` (target "kv8" or "kv2", method
"none" | "draft" | "mtp"; or a Gemma 3 target "g2" (GQA) / "g1" (MQA) with sliding windows
shorter than the sequences, method "none" | "ngram" | "draft" (an early-exit draft of its first
layer); options: the placement of a draft LLM "replicated" | "sharded", and
"no-tf" to skip the teacher-forced target logits), or "default" / "full"; an extra ``api`` case
computes one-device ``specjax.generate`` tokens for the multi-process test. Cases of one target
in one process share its one-device references. Writes JSON: one record per case (greedy tokens equal to one device, max
|logit difference| for the target (teacher-forced) and the draft / head (carried logits), the
compiled program's collectives, timings).
"""

import functools
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import specjax as sj  # noqa: E402
from specjax import gemma, kv_cache, registry, sharding, speculate  # noqa: E402
from specjax.config import ModelConfig, SpecConfig  # noqa: E402
from specjax.heads import Head, HeadConfig, init_head  # noqa: E402
from specjax.model import Model, init_params  # noqa: E402

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12], [4] * 17, [9, 9], [3, 1, 4, 1, 5], [2],
           [100, 101]]
MAX_NEW, K, TP_LEN, OUT_LEN, PAGES_PER_SEQ = 20, 3, 32, 32, 6
# Every mesh, every method, KV heads split as they are (8) and repeated to tp (Hkv = 2 < tp) and
# both placements of a draft LLM at least once.
DEFAULT = ["kv2:none:8:1", "kv2:mtp:2:4", "kv8:draft:4:2", "kv8:draft:8:1:sharded:no-tf"]
FULL = [f"{m}:{method}:{tp}:{dp}" for m in ("kv8", "kv2") for method in ("none", "draft", "mtp")
        for tp, dp in ((8, 1), (4, 2), (2, 4))] + ["kv8:draft:4:2:sharded", "kv2:draft:2:4:sharded"]


def tiny(seed, *, kv_heads, layers=2, hidden=64, heads=8, head_dim=16, vocab=128, ffn=192):
    """8 heads and vocab 128 so that tp=8 splits them; no activation a step could all-gather
    has as many elements as a weight (so the weight-gather check cannot be fooled)."""
    cfg = ModelConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                      num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
                      head_dim=head_dim, max_position_embeddings=512)
    return Model(init_params(cfg, jax.random.key(seed), scale=0.3), cfg)


GEMMA_WINDOW = 6  # < the longest prompt (17) and every generated sequence: several windows


def tiny_gemma(seed, *, kv_heads):
    """A tiny Gemma 3 (sizes as ``tiny``, tied embeddings): sliding, sliding, full layers;
    window 6; norms off
    their initial value 1, so that every replicated norm matters."""
    cfg = gemma.Gemma3Config(
        vocab_size=128, hidden_size=64, intermediate_size=192, num_layers=3, num_heads=8,
        num_kv_heads=kv_heads, head_dim=16, query_pre_attn_scalar=24.0,
        sliding_window=GEMMA_WINDOW, layer_types=(gemma.SLIDING, gemma.SLIDING, gemma.FULL),
        rope_theta=1e6, tie_word_embeddings=True, max_position_embeddings=512)
    params = gemma.init_params(cfg, jax.random.key(seed), scale=0.3)
    noise = iter(jax.random.split(jax.random.key(seed + 1), 64))
    params = jax.tree.map(lambda a: a + 0.3 * jax.random.normal(next(noise), a.shape)
                          if a.ndim == 1 else a, params)
    return Model(params, cfg)


def models():
    """name -> (target, {method: draft}): 8 KV heads (pools split over tp) or 2; Gemma 3 with
    2 KV heads or 1 (MQA: repeated to tp)."""
    out = {}
    for name, kv in (("kv8", 8), ("kv2", 2)):
        target = tiny(0, kv_heads=kv)
        hc = HeadConfig.for_target(target.config, "mtp")
        out[name] = (target, {"none": None, "draft": tiny(1, kv_heads=kv, layers=1),
                              "mtp": Head(init_head(hc, jax.random.key(3), scale=0.3), hc)})
    for name, kv in (("g2", 2), ("g1", 1)):
        target = tiny_gemma(0, kv_heads=kv)
        out[name] = (target, {"none": None, "ngram": None,
                              "draft": sj.early_exit_draft(target, 1)})
    return out


def inputs():
    b = len(PROMPTS)
    tokens = np.zeros((b, TP_LEN), np.int32)
    for i, p in enumerate(PROMPTS):
        tokens[i, :len(p)] = p
    rp = speculate.RowParams(
        temperature=jnp.zeros(b), top_k=jnp.zeros(b, jnp.int32), top_p=jnp.ones(b),
        max_new=jnp.full((b,), MAX_NEW, jnp.int32), eos_ids=jnp.full((8,), -1, jnp.int32))
    lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
    return jnp.asarray(tokens), lens, rp, jnp.asarray(0, jnp.int32)


def static(target, draft, method):
    return dict(target_cfg=target.config, draft_cfg=None if draft is None else draft.config,
                lc=SpecConfig(method=method, num_draft_tokens=K),
                num_pages_per_seq=PAGES_PER_SEQ, out_len=OUT_LEN)


@functools.partial(jax.jit, static_argnames=("target_cfg", "draft_cfg", "lc",
                                             "num_pages_per_seq", "out_len"))
def reference(target_params, draft_params, tokens, lens, rp, seed, *, target_cfg, draft_cfg, lc,
              num_pages_per_seq, out_len):
    """The one-device program (plain speculate, no sharding code involved)."""
    state = speculate.prefill(target_params, target_cfg, draft_params, draft_cfg, tokens, lens,
                              rp, seed, lc, num_pages_per_seq, out_len)
    return speculate.decode_loop(target_params, target_cfg, draft_params, draft_cfg, state, rp, lc)


@functools.partial(jax.jit, static_argnames=("cfg",))
def teacher_forced(params, tokens, *, cfg):
    """One-device logits [B, T, V] over full rows (the reference for sharding.logits)."""
    b, t = tokens.shape
    kv, page_table = kv_cache.init_contiguous(cfg, b, t)
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    return registry.forward(params, cfg, tokens, pos, kv, page_table,
                            jnp.zeros((b,), jnp.int32))[0]


def _tp_split_sizes(params, specs):
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    pairs = zip(jax.tree.leaves(params), jax.tree.leaves(specs, is_leaf=is_spec))
    return [int(np.prod(leaf.shape)) for leaf, s in pairs if "tp" in tuple(s)]


def _tokens(state):
    return [np.asarray(state.out_tokens[i, :int(state.num_out[i])]).tolist()
            for i in range(len(PROMPTS))]


def run_case(case, mdls, cache):
    name, method, tp, dp, *options = case.split(":")
    target, drafts = mdls[name]
    draft = drafts[method]
    dparams = None if draft is None else draft.params
    placement = [o for o in options if o in sharding.PLACEMENTS]
    plan = sharding.ShardingPlan(sharding.make_mesh(tp=int(tp), dp=int(dp)), *placement)
    args, st = inputs(), static(target, draft, method)
    c0, t0 = time.process_time(), time.perf_counter()
    if (name, method) not in cache:
        cache[name, method] = reference(target.params, dparams, *args, **st)
    ref = cache[name, method]
    t1 = time.perf_counter()
    placed = sharding.place_inputs(plan, target.params, dparams, *args,
                                   target_cfg=st["target_cfg"], draft_cfg=st["draft_cfg"])
    compiled = sharding.lower_generate(plan, *placed, full_state=True, **st).compile()
    t2 = time.perf_counter()
    got = compiled(*placed)
    t3 = time.perf_counter()
    # Target logits, teacher-forced over prompt + generation, on the mesh vs one device.
    seqs = np.zeros((len(PROMPTS), TP_LEN + MAX_NEW), np.int32)
    for i, (p, g) in enumerate(zip(PROMPTS, _tokens(ref))):
        seqs[i, :len(p) + len(g)] = p + g
    if name not in cache:
        cache[name] = np.asarray(teacher_forced(target.params, jnp.asarray(seqs),
                                                cfg=target.config))
    diffs = {}
    if "no-tf" not in options:
        sharded = sharding.logits(target, seqs, plan)
        diffs["target_logits"] = float(np.max(np.abs(sharded - cache[name])))
    t4 = time.perf_counter()
    if draft is not None:
        diffs["draft_logits"] = float(np.max(np.abs(np.asarray(got.draft_logits)
                                                    - np.asarray(ref.draft_logits))))
    weights = _tp_split_sizes(target.params, sharding.model_specs(target.params, target.config,
                                                                  plan.tp))
    if draft is not None:
        weights += _tp_split_sizes(dparams, sharding.draft_specs(dparams, draft.config, plan))
    return {
        "case": case, "method": method, "tp": int(tp), "dp": int(dp),
        "kv_heads": target.config.num_kv_heads,
        "tokens_equal": _tokens(got) == _tokens(ref),
        "num_generated": sum(len(t) for t in _tokens(got)),
        "accepted_per_pos": np.asarray(got.accepted_per_pos).tolist(),
        "ref_accepted_per_pos": np.asarray(ref.accepted_per_pos).tolist(),
        "max_abs_diff": diffs, "logit_scale": float(np.max(np.abs(cache[name]))),
        "tp_split_weight_elements": weights,
        "pool_elements": min(int(np.prod(x.shape)) for x in
                             jax.tree.leaves((got.target_kv, got.draft_kv))),
        "pool_shape": list(got.target_kv.k[0].shape),
        "pool_shard_shape": list(got.target_kv.k[0].sharding.shard_shape(got.target_kv.k[0].shape)),
        "collectives": [[c.op, c.shape, c.elements, c.in_loop]
                        for c in sharding.collectives(compiled.as_text())],
        "seconds": {"reference": t1 - t0, "compile": t2 - t1, "run": t3 - t2, "logits": t4 - t3,
                    "cpu": time.process_time() - c0},
    }


def api_reference(mdls):
    """One-device specjax.generate tokens for the multi-process worker's setting."""
    target, drafts = mdls["kv8"]
    return {method: sj.generate(target, PROMPTS, max_new_tokens=MAX_NEW, draft=drafts[method],
                                method=method, num_draft_tokens=K, eos_token_id=[]).tokens
            for method in ("draft",)}


def main():
    which, out_path = sys.argv[1], sys.argv[2]
    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, got {jax.device_count()} (set XLA_FLAGS first)")
    cases = {"default": DEFAULT, "full": FULL}.get(which, which.split(","))
    mdls, cache, result = models(), {}, {"cases": []}
    for case in cases:
        if case == "api":
            result["api_reference"] = api_reference(mdls)
            continue
        r = run_case(case, mdls, cache)
        result["cases"].append(r)
        print(r["case"], r["tokens_equal"], r["max_abs_diff"], r["seconds"], flush=True)
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
