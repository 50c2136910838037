"""specjax.tokenizer against transformers' tokenizer for the same SmolLM2 GGUF file."""

import os

import pytest

from specjax.tokenizer import Tokenizer, load_tokenizer

transformers = pytest.importorskip("transformers")

# Varied text on which the GGUF "smollm" pre-tokenizer and transformers agree (see
# test_smollm_digit_split_differs_from_transformers for where they do not).
TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "Numbers: 3.14159, 42, 1e-5, 2024-01-31 and 1,000,000.",
    "naïve café – “quotes” — 東京は日本の首都です。 Привет, мир! 🤖🚀 ünïcödé",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "    leading spaces and trailing spaces    ",
    "tabs\t\tand\r\nwindows newlines\n\n\nand   runs   of   spaces",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after eos<repo_name>x<file_sep>",
    "I'm sure they'll say it's fine, won't they? YOU'RE RIGHT.",
    "https://example.com/path?q=a&b=c#frag {\"json\": [1, 2, 3]}",
    "",
    " ",
    "a",
]

CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Germany?"},
]


@pytest.fixture(scope="module")
def gguf_path(smollm2_gguf):
    return smollm2_gguf


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def hf(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path))


def test_special_ids(ours):
    assert ours.eos_token_id == 2
    assert ours.bos_token_id == 1
    assert ours.eos_token == "<|im_end|>"
    assert ours.vocab_size == 49152
    assert ours.chat_template and "<|im_start|>" in ours.chat_template


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours, hf, text):
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)


def test_encode_add_special_tokens_matches(ours, hf):
    # SmolLM2's GGUF says add_bos_token = False: nothing is added either way
    assert ours.encode("hi there", add_special_tokens=True) == hf.encode("hi there")


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(ours, hf, text):
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


def test_special_tokens_are_single_ids(ours):
    assert ours.encode("<|im_start|>") == [1]
    assert ours.encode("<|im_end|>") == [2]
    assert ours.decode([1, 6004, 2]) == "hi"


def test_smollm_digit_split_differs_from_transformers(ours, hf, gguf_path):
    """llama.cpp's "smollm" pre-tokenizer (and SmolLM2's own tokenizer.json) split every digit off
    *before* GPT-2's regex; transformers' GGUF loader does not know "smollm" and uses GPT-2's regex
    alone. The two differ only where whitespace runs meet digits."""
    assert ours.backend.encode("x  12").tokens == ["x", "ĠĠ", "1", "2"]
    assert hf.tokenize("x  12") == ["x", "Ġ", "Ġ", "1", "2"]
    assert ours.backend.encode("a   1").tokens == ["a", "ĠĠĠ", "1"]
    # Overriding the pre-tokenizer reproduces transformers exactly.
    compat = Tokenizer.from_gguf(gguf_path, pre_tokenizer="gpt2")
    for text in TEXTS + ["x  12", "a   1", "in 1990,   2000", "1 2  3   4", "a\n\n\n1"]:
        assert compat.encode(text) == hf.encode(text, add_special_tokens=False), text


def test_chat_template_matches_transformers(ours, hf):
    for conv, gen in ((CHAT, True), (CHAT[:2], False),
                      ([{"role": "system", "content": "Be brief."}] + CHAT[:1], True)):
        want_text = hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
        assert ours.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False) == want_text
        want_ids = hf.apply_chat_template(conv, add_generation_prompt=gen, tokenize=True)
        if isinstance(want_ids, dict) or hasattr(want_ids, "input_ids"):
            want_ids = want_ids["input_ids"]
        assert ours.apply_chat_template(conv, add_generation_prompt=gen) == list(want_ids)


def test_chat_template_raise_exception():
    import jinja2
    import tokenizers
    tok = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()),
                    chat_template="{{ raise_exception('no ' + messages[0]['role']) }}")
    with pytest.raises(jinja2.exceptions.TemplateError, match="no user"):
        tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False)


def test_from_hf_dir(hf, ours, tmp_path):
    hf.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert loaded.eos_token_id == 2
    assert loaded.chat_template == ours.chat_template
    for text in TEXTS:
        assert loaded.encode(text) == hf.encode(text, add_special_tokens=False)
    assert loaded.apply_chat_template(CHAT) == ours.apply_chat_template(CHAT)


def test_load_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m"):
        load_tokenizer("no-such-model")
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_hf_dir(tmp_path)
