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


def test_bad_arguments_exit_2(tiny_dirs, capsys):
    target, _ = tiny_dirs
    rc = cli.main(["generate", "--model", target, "--tokenizer", "smollm2-135m", "--prompt", "x",
                   "--method", "none", "--temperature", "-1"])
    assert rc == 2
    assert "temperature must be" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["generate", "--method", "magic"])
