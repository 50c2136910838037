"""The specjax command on tiny models (real tokenizer, tiny random weights)."""

import json

import jax
import pytest

from specjax import cli
from specjax.config import ModelConfig
from specjax.io.hf import save_hf_dir
from specjax.model import init_params


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    out = []
    for seed, layers in ((0, 2), (1, 1)):
        cfg = ModelConfig(vocab_size=49152, hidden_size=16, intermediate_size=32, num_layers=layers,
                          num_heads=2, num_kv_heads=1, head_dim=8, tie_word_embeddings=True,
                          max_position_embeddings=256, eos_token_id=2)
        d = tmp_path_factory.mktemp(f"m{seed}")
        save_hf_dir(init_params(cfg, jax.random.key(seed), scale=0.5), cfg, str(d))
        out.append(str(d))
    return out


def test_generate_plain_and_draft_json(tiny_dirs, capsys):
    target, draft = tiny_dirs
    base = ["generate", "--model", target, "--tokenizer", "smollm2-135m", "--prompt", "Hello there",
            "--max-new-tokens", "6", "--json"]
    assert cli.main(base + ["--method", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main(base + ["--method", "draft", "--draft", draft, "-k", "3"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert spec["tokens"] == plain["tokens"] and len(plain["tokens"][0]) <= 6
    assert spec["stats"]["method"] == "draft" and spec["stats"]["num_draft_tokens"] == 3
    assert cli.main(base + ["--method", "ngram", "-k", "2", "--ngram-max", "2"]) == 0
    ngram = json.loads(capsys.readouterr().out)
    assert ngram["tokens"] == plain["tokens"] and ngram["stats"]["method"] == "ngram"
    assert cli.main(base + ["--method", "ngram", "--ngram-min", "3", "--ngram-max", "2"]) == 2
    assert "ngram_min (3) must be <= ngram_max" in capsys.readouterr().err


def test_bad_arguments_exit_2(tiny_dirs, capsys):
    target, _ = tiny_dirs
    rc = cli.main(["generate", "--model", target, "--tokenizer", "smollm2-135m", "--prompt", "x",
                   "--method", "none", "--temperature", "-1"])
    assert rc == 2
    assert "temperature must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--method", "magic"])
    # train-head --aux-layers is checked before any model or data is loaded
    for bad, msg in [(["--aux-layers", "2,x"], "comma-separated"), (["--aux-layers", "3,3"], "distinct"),
                     (["--aux-layers", "-1"], "distinct"), (["--kind", "mtp", "--aux-layers", "2"],
                                                             "for --kind eagle3"),
                     (["--init-from", "no/such/head"], "--init-from 'no/such/head': no such")]:
        argv = ["train-head", "--model", target, "--out", "unused", "--kind", "eagle3", *bad]
        assert cli.main(argv) == 2
        assert msg in capsys.readouterr().err


def test_activations_flag(tiny_dirs, capsys):
    """--activations is on every model-loading command, float32 by default; int8 on a
    transformers dir is a clear error (exit 2), not a crash."""
    target, _ = tiny_dirs
    parser = cli.build_parser()
    for cmd in ("generate", "demo", "serve"):
        assert parser.parse_args([cmd]).activations == "float32"
        assert parser.parse_args([cmd, "--activations", "int8"]).activations == "int8"
    rc = cli.main(["generate", "--model", target, "--tokenizer", "smollm2-135m", "--prompt", "x",
                   "--method", "none", "--activations", "int8"])
    assert rc == 2
    assert "needs a GGUF target" in capsys.readouterr().err


def test_help_for_every_command(capsys):
    for cmd in ([], ["demo"], ["generate"], ["serve"], ["bench"], ["convert"], ["train-head"],
                ["train-draft"]):
        with pytest.raises(SystemExit) as e:
            cli.main(cmd + ["--help"])
        assert e.value.code == 0
    out = capsys.readouterr().out
    assert "--stream" in out and "one prefill per prompt" in out  # streaming is explained
    assert "assistant_model" in out  # convert says what --to hf is for


@pytest.mark.slow
def test_generate_stream_matches_one_run(tiny_dirs, capsys):
    """--stream goes through the engine: the same greedy tokens as one batched run, each prompt
    prefilled once (one ordinary step per prompt, the rest speculative), text printed per prompt."""
    target, draft = tiny_dirs
    base = ["generate", "--model", target, "--tokenizer", "smollm2-135m", "--prompt", "Hello there",
            "--prompt", "The sea", "--max-new-tokens", "10", "--no-chat", "--method", "draft",
            "--draft", draft, "-k", "2", "--no-progress"]
    assert cli.main(base + ["--json"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert cli.main(base + ["--stream", "--json"]) == 0
    streamed = json.loads(capsys.readouterr().out)
    assert streamed["tokens"] == whole["tokens"]
    steps = streamed["stats"]["steps"]
    assert steps["extend"] == 1 and steps["spec"] >= 1  # both prompts prefilled in one step
    assert streamed["stats"]["generation_tokens_total"] == sum(map(len, whole["tokens"]))
    assert cli.main(base + ["--stream"]) == 0
    out = capsys.readouterr().out
    first, second = out.split("### The sea")
    assert "### Hello there" in first and whole["texts"][0].strip() in first
    assert whole["texts"][1].strip() in second


def test_convert_round_trips(tiny_dirs, tmp_path, capsys):
    import numpy as np

    import specjax as sj
    from specjax.io.checkpoint import save_checkpoint
    from specjax.io.hf import load_hf_dir

    target, _ = tiny_dirs
    ck, back = str(tmp_path / "ck"), str(tmp_path / "hf")
    assert cli.main(["convert", target, ck, "--no-progress", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layers"] == 2
    assert cli.main(["convert", ck, back, "--to", "hf", "--no-progress"]) == 0
    ids = [5, 9, 300, 4000, 7]
    ref = sj.logits(sj.load_model(target), ids)
    np.testing.assert_allclose(sj.logits(sj.load_model(ck), ids), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(sj.logits(sj.load_model(back), ids), ref, rtol=1e-6, atol=1e-6)
    # a draft LLM checkpoint (layers only; shares the target's embedding) -> a complete HF dir
    tm = sj.load_model(target)
    dck, dhf = str(tmp_path / "draft"), str(tmp_path / "draft-hf")
    cfg = tm.config.__class__.from_dict({**tm.config.to_dict(), "num_layers": 1})
    save_checkpoint(dck, {"layers": tm.params["layers"][:1], "norm": tm.params["norm"]}, cfg,
                    kind="draft_llm", extra={"shares": ["embed"]})
    assert cli.main(["convert", dck, dhf, "--to", "hf", "--target", target, "--no-progress"]) == 0
    dcfg, dparams = load_hf_dir(dhf)
    assert dcfg.num_layers == 1
    np.testing.assert_array_equal(dparams["embed"], np.asarray(tm.params["embed"]))
    assert cli.main(["convert", "/nonexistent", str(tmp_path / "x"), "--no-progress"]) == 2


@pytest.mark.slow
def test_bench_specjax_only_json(tiny_dirs, capsys):
    target, draft = tiny_dirs
    rc = cli.main(["bench", "--model", target, "--tokenizer", "smollm2-135m", "--draft", draft,
                   "--no-hf", "--mtp", "none", "--eagle", "none", "--num-prompts", "1", "--batch", "1",
                   "--max-new-tokens", "4", "--repeats", "1", "--no-cost-model", "--no-progress",
                   "--json"])
    assert rc == 0
    rep = json.loads(capsys.readouterr().out)
    rows = rep["results"]["batch1"]
    assert set(rows) == {"specjax plain", "specjax draft", "specjax ngram"}  # ngram: --prompt-lookup
    assert rows["specjax draft"]["vs_specjax_plain"]["identical_rows"] == 1
    assert rows["specjax ngram"]["vs_specjax_plain"]["identical_rows"] == 1
    assert "| 1 | specjax | draft |" in rep["table_md"]


def test_generate_eagle_tree_with_a_head_checkpoint(tiny_dirs, tmp_path, capsys):
    """--method eagle-tree drafts a tree with a head checkpoint; greedy output equals plain."""
    import specjax as sj
    from specjax.heads import Head, HeadConfig, init_head
    from specjax.io.heads_io import save_head

    target, _ = tiny_dirs
    tcfg = sj.load_model(target).config
    hcfg = HeadConfig.for_target(tcfg, "mtp")
    save_head(Head(init_head(hcfg, jax.random.key(0), scale=0.5), hcfg), str(tmp_path / "head"))
    base = ["generate", "--model", target, "--tokenizer", "smollm2-135m", "--prompt", "Hello there",
            "--max-new-tokens", "6", "--json"]
    assert cli.main(base + ["--method", "none"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli.main(base + ["--method", "eagle-tree", "--draft", str(tmp_path / "head"),
                            "--tree-depth", "3", "--tree-top-k", "2", "--tree-nodes", "5"]) == 0
    tree = json.loads(capsys.readouterr().out)
    assert tree["tokens"] == plain["tokens"]
    assert tree["stats"]["method"] == "eagle-tree" and tree["stats"]["num_draft_tokens"] == 3
    # the demo with a tree (as checkpoints/fastest.json may choose): its adaptive run is the head's
    # own chain (adaptive k is a chain length), and the text report names both
    assert cli.main(["demo", "--model", target, "--tokenizer", "smollm2-135m", "--method",
                     "eagle-tree", "--draft", str(tmp_path / "head"), "--tree-depth", "1",
                     "--tree-top-k", "3", "--tree-nodes", "3", "--max-new-tokens", "4",
                     "--rounds", "1", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "tree depth 1, top-k 3, 3 nodes" in text
    assert "adaptive speculation (method mtp, k chosen" in text and "steps per chosen k" in text
    assert text.count("outputs identical to plain decoding: True") == 2


def test_demo_times_interleaved_rounds(tiny_dirs, capsys):
    """The demo's speedups come from interleaved rounds (median, min, max, foreign CPU), and its
    speculative and adaptive answers equal plain decoding."""
    target, draft = tiny_dirs
    rc = cli.main(["demo", "--model", target, "--tokenizer", "smollm2-135m", "--draft", draft,
                   "--method", "draft", "-k", "2", "--max-new-tokens", "6", "--rounds", "3",
                   "--json", "-", "--no-progress"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["identical"] and out["adaptive_identical"]
    timing = out["timing"]
    assert timing["rounds"] == 3
    for name in ("speculative", "adaptive"):
        sp = timing["speedup"][name]
        assert sp["rounds"] == 3 and 0 < sp["min"] <= sp["median"] <= sp["max"]
    assert out["speedup"] == timing["speedup"]["speculative"]["median"]
    assert set(timing["tokens_per_second"]) == {"plain", "speculative", "adaptive"}
    with pytest.raises(SystemExit):
        cli.main(["demo", "--model", target, "--tokenizer", "smollm2-135m", "--rounds", "0"])


def test_measured_fastest_config_sets_the_defaults(tiny_dirs, tmp_path, monkeypatch, capsys):
    """checkpoints/fastest.json (written by bench_drafts.py from its measured rows) picks the
    draft and k the CLI uses when none is given; rows with changed output, high foreign CPU or a
    draft that is not shipped never win; explicit flags still override; an entry whose draft is
    absent is ignored."""
    import importlib.util
    import os
    import sys

    import specjax as sj
    from specjax import shipped
    from specjax.io.checkpoint import save_checkpoint

    target, draft_dir = tiny_dirs
    ckpts = tmp_path / "checkpoints"
    d = sj.load_model(draft_dir)
    save_checkpoint(str(ckpts / "smollm2-draft"), d.params, d.config)
    monkeypatch.setattr(shipped, "checkpoints_dir", lambda: str(ckpts))
    monkeypatch.setattr(shipped, "SHIPPED_FOR", sj.load_model(target).source)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("_bench_drafts_t", os.path.join(
        root, "benchmarks", "bench_drafts.py"))
    bd = importlib.util.module_from_spec(spec)
    sys.modules["_bench_drafts_t"] = bd
    spec.loader.exec_module(bd)

    def row(draft, k, med, same=True, foreign=0.01):
        return dict(draft=draft, method="draft", k=k, mean_accepted_length=1.5, identical_to_plain=same,
                    max_foreign_cpu=foreign, speedup=dict(median=med, min=med, max=med, rounds=3))
    result = dict(prompt_set="chat", prompts=4, max_new_tokens=8, date="today", machine={},
                  rows=[row("checkpoints/smollm2-draft", "3", 1.2),
                        row("checkpoints/smollm2-draft", "2", 1.1),
                        row("checkpoints/smollm2-draft", "4", 1.9, same=False),
                        row("checkpoints/smollm2-draft", "1 hybrid 2", 1.8, foreign=0.5),
                        row("/elsewhere/my-draft", "1", 2.5)])
    timed = []

    def confirm(key, row_, results, med=1.15, same=True, foreign=0.01):
        """A stand-in for bench_drafts.confirm_run (timed on SmolLM2 elsewhere): a second run
        that measures the chosen configuration a little lower than its selection run."""
        timed.append(key)
        sets = [r.get("prompt_set", "chat") for r in results]
        return dict(speedup=dict(median=med, min=med - 0.1, max=med + 0.1, rounds=5),
                    speedup_by_prompt_set={s: med for s in sets}, prompt_set=sets[0], prompts=4,
                    max_new_tokens=8, max_foreign_cpu=foreign, identical_to_plain=same,
                    mean_accepted_length=1.5, date="later", machine={}, command="confirm")
    entry = bd.write_fastest(result, "cmd", confirm, backend=jax.default_backend())
    assert (entry["draft"], entry["num_draft_tokens"], entry["hybrid_min"]) == ("smollm2-draft", 3, 0)
    assert timed == [("smollm2-draft", "draft", "3")]  # only the chosen one is timed again
    # the figure stored is the confirmation run's, the selection run's is kept apart
    assert shipped.fastest()["speedup"]["median"] == 1.15 and entry["beats_plain"]
    assert entry["confirmed"]["median"] == 1.15 and entry["confirmed"]["rounds"] == 5
    assert entry["selection"]["speedup_by_prompt_set"] == {"chat": 1.2}
    assert entry["selection"]["candidates"] == 2 and "commit" in entry
    # a confirmation run that changed the output or ran on a loaded machine writes nothing
    assert bd.write_fastest(result, "cmd", lambda *a: confirm(*a, same=False)) is None
    assert bd.write_fastest(result, "cmd", lambda *a: confirm(*a, foreign=0.5)) is None
    with pytest.raises(ValueError, match="rounds"):
        bd.confirm_run(rounds=3)
    assert bd._spec_of_label("tree 4/2/8") == dict(num_draft_tokens=4, tree=[4, 2, 8], hybrid_min=0)
    # several prompt sets: the best worst case wins (k=2: 1.1 / 1.05 beats k=3: 1.2 / 0.9), and a
    # configuration missing from one set (k=5) does not count
    demo = dict(result, prompt_set="demo", rows=[row("checkpoints/smollm2-draft", "3", 0.9),
                                                 row("checkpoints/smollm2-draft", "2", 1.05),
                                                 row("checkpoints/smollm2-draft", "5", 3.0)])
    both = bd.write_fastest([result, demo], "cmd", confirm, backend=jax.default_backend())
    assert both["num_draft_tokens"] == 2
    assert both["selection"]["speedup_by_prompt_set"] == {"chat": 1.1, "demo": 1.05}
    assert set(both["speedup_by_prompt_set"]) == {"chat", "demo"}  # confirmed on both sets
    assert bd.write_fastest([result, dict(demo, rows=[])], "cmd", confirm) is None
    entry = bd.write_fastest(result, "cmd", confirm, backend=jax.default_backend())  # chat only
    # the real confirmation run: plain vs the chosen row again, interleaved, >= 5 rounds
    real = bd.confirm_run(5, target=sj.load_model(target), tok=sj.load_tokenizer("smollm2-135m"))(
        ("smollm2-draft", "draft", "2"), result["rows"][1],
        [dict(result, prompt_set="chat", prompts_arg=1, max_new_tokens=4)])
    assert real["identical_to_plain"] and real["speedup"]["rounds"] == 5
    assert real["prompt_set"] == "chat" and real["prompts"] == 1 and real["speedup"]["min"] <= real["speedup"]["median"]
    capsys.readouterr()

    base = ["generate", "--model", target, "--tokenizer", "smollm2-135m", "--prompt", "Hello",
            "--max-new-tokens", "6", "--json"]
    assert cli.main(base) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["method"] == "draft" and stats["num_draft_tokens"] == 3
    assert cli.main(base + ["-k", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["num_draft_tokens"] == 2
    assert cli.main(base + ["--method", "ngram"]) == 0  # another method: the entry does not apply
    assert json.loads(capsys.readouterr().out)["stats"]["method"] == "ngram"
    with pytest.raises(ValueError, match="shipped drafts"):
        shipped.write_fastest(dict(draft="nope"), "cpu")
    (ckpts / "smollm2-draft" / "specjax_config.json").unlink()  # the measured draft is gone
    assert shipped.fastest() is None


def test_script_entry_point_resolves():
    """pyproject's `specjax = "specjax.cli:main"` names the package's main."""
    import importlib
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    entry = tomllib.loads((root / "pyproject.toml").read_text())["project"]["scripts"]["specjax"]
    module, name = entry.split(":")
    assert getattr(importlib.import_module(module), name) is cli.main


def _run_cli(*argv, timeout=1800):
    """`python -m specjax.cli ARGV` in a subprocess from the repository root."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "specjax.cli", *argv], capture_output=True,
                          text=True, env=env, cwd=root, timeout=timeout)


def _smollm2_or_skip():
    import specjax as sj
    try:
        sj.load_model("smollm2-135m")
    except Exception as e:  # noqa: BLE001 - the GGUF comes with the optional 'models' extra
        pytest.skip(f"SmolLM2 not available: {e}")


# default run: every command works with its defaults (README's claim; ~1-2 min each)
def test_generate_with_its_defaults():
    """`specjax generate --prompt ...` with every default (shorter output only): SmolLM2, the
    recommended draft, and the same tokens as plain decoding (greedy is lossless)."""
    _smollm2_or_skip()
    prompt = "Why is the sky blue?"
    spec = _run_cli("generate", "--prompt", prompt, "--max-new-tokens", "8", "--json")
    assert spec.returncode == 0, spec.stderr[-3000:]
    out = json.loads(spec.stdout)
    assert out["stats"]["method"] != "none" and "draft: checkpoints/" in spec.stderr
    plain = _run_cli("generate", "--prompt", prompt, "--max-new-tokens", "8", "--json",
                     "--method", "none")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert out["tokens"] == json.loads(plain.stdout)["tokens"] and len(out["tokens"][0]) == 8


# default run: every command works with its defaults (README's claim; ~1-2 min each)
def test_demo_with_its_defaults():
    """`specjax demo` with every default but one round and short answers: the report names the
    recommended draft and finds both speculative answers identical to plain decoding."""
    _smollm2_or_skip()
    res = _run_cli("demo", "--max-new-tokens", "8", "--rounds", "1", "--no-progress")
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.count("outputs identical to plain decoding: True") == 2
    assert "draft checkpoints/" in res.stdout and "speedup" in res.stdout


def test_base_model_without_chat_template_runs_raw_prompts(tiny_dirs, tmp_path, capsys):
    """generate and demo with a tokenizer that has no chat template (a base model, as
    gemma3-270m's) run their prompts as raw text to continue instead of failing."""
    import copy

    import specjax as sj

    hf = copy.deepcopy(sj.load_tokenizer("smollm2-135m").hf)
    hf.chat_template = None
    hf.save_pretrained(str(tmp_path / "tok"))
    tok = sj.load_tokenizer(str(tmp_path / "tok"))
    assert tok.chat_template is None
    target, _ = tiny_dirs
    assert cli.main(["generate", "--model", target, "--tokenizer", str(tmp_path / "tok"),
                     "--prompt", "Hello there", "--max-new-tokens", "4", "--json"]) == 0
    captured = capsys.readouterr()
    assert "no chat template" in captured.err
    assert len(json.loads(captured.out)["tokens"][0]) <= 4
    assert cli.main(["demo", "--model", target, "--tokenizer", str(tmp_path / "tok"),
                     "--max-new-tokens", "4", "--rounds", "1", "--json", "-", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["prompts"][0] == "The capital of France is" and out["identical"]
