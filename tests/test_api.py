"""The public surface: clear errors for bad input, EOS handling, per-row streams, and one device
program per generation (no host callbacks in its HLO)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import speculate
from specjax.tree import TreeConfig
from tests.conftest import mimic_head, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model(7)


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts=[[]]), "prompts\\[0\\] is empty"),
    (dict(prompts=[[1, 2], []]), "prompts\\[1\\] is empty"),
    (dict(prompts=[]), "non-empty list"),
    (dict(prompts=[[1, 64]]), "outside the vocabulary \\[0, 64\\)"),
    (dict(prompts=[[-1]]), "outside the vocabulary"),
    (dict(prompts=[[1] * 500], max_new_tokens=20), "max length 512"),
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=-3), "max_new_tokens"),
    (dict(max_new_tokens=2.5), "max_new_tokens"),
    (dict(temperature=-0.1), "temperature must be"),
    (dict(temperature=float("nan")), "temperature must be"),
    (dict(temperature=[0.5, -1.0]), "temperature must be"),
    (dict(temperature=[0.5]), "temperature has 1 entries for 2 prompts"),
    (dict(top_p=0.0), "top_p must be in \\(0, 1\\]"),
    (dict(top_p=1.5), "top_p must be in"),
    (dict(top_k=-1), "top_k must be an int >= 0"),
    (dict(top_k=1.5), "top_k must be an int"),
    (dict(method="magic"), "method must be one of"),
    (dict(method="draft"), "needs a draft"),
    (dict(method="draft", draft="x"), "draft must be a specjax Model"),
    (dict(num_draft_tokens=0, method="draft"), "num_draft_tokens must be an int in \\[1, 64\\]"),
    (dict(page_size=0), "page_size"),
    (dict(draft="x"), "draft was given with method=\"none\""),
    (dict(seed=2**31), "seed must be an int"),
    (dict(seed=1.5), "seed must be an int"),
    (dict(seed=None), "seed must be an int"),
    (dict(eos_token_id=64), "eos_token_id 64 is outside the vocabulary"),
    (dict(eos_token_id="55"), "eos_token_id must be an int"),
    (dict(eos_token_id=[1.5]), "eos_token_id must contain ints"),
    (dict(eos_token_id=1.5), "eos_token_id must be an int"),
    (dict(prompts=[[1.7, 2.2]]), "integer token ids"),
    (dict(prompts=[[True]]), "integer token ids"),
])
def test_bad_input_is_a_clear_error(model, kwargs, match):
    args = dict(prompts=[[1, 2, 3], [4]], max_new_tokens=4)
    args.update(kwargs)
    with pytest.raises((ValueError, TypeError), match=match):
        sj.generate(model, **args)


def test_early_exit_draft_and_tokenizer_arguments_are_checked(model):
    """A non-Model target and a tokenizer without encode() used to be AttributeErrors from
    inside; a numpy int layer count is an int."""
    for bad in (None, "smollm2-135m", model.params):
        with pytest.raises(TypeError, match="early_exit_draft: target must be a specjax Model"):
            sj.early_exit_draft(bad, 1)
    for n in (0, 3, 1.0, True, None):
        with pytest.raises(ValueError, match="num_layers must be an int in \\[1, 2\\]"):
            sj.early_exit_draft(model, n)
    assert sj.early_exit_draft(model, np.int64(1)).config.num_layers == 1
    with pytest.raises(TypeError, match="tokenizer must have an encode"):
        sj.generate(model, ["hi"], tokenizer=5)


def test_draft_vocab_mismatch(model):
    other = tiny_model(8, vocab=65)
    with pytest.raises(ValueError, match="vocab_size 65 != target vocab_size 64"):
        sj.generate(model, [[1]], draft=other, method="draft")


def test_string_prompt_needs_tokenizer(model):
    with pytest.raises(ValueError, match="tokenizer"):
        sj.generate(model, ["hello"])


def test_logits_errors(model):
    with pytest.raises(ValueError, match="empty"):
        sj.logits(model, [])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        sj.logits(model, [3, 99])
    with pytest.raises(TypeError, match="token_ids"):
        sj.logits(model, "abc")


def test_stops_at_eos_inclusive_and_max_new(model):
    free = sj.generate(model, [[1, 2, 3]], max_new_tokens=30, eos_token_id=[]).tokens[0]
    eos = free[5]
    stop = free.index(eos)
    out = sj.generate(model, [[1, 2, 3]], max_new_tokens=30, eos_token_id=eos).tokens[0]
    assert out == free[: stop + 1]
    assert sj.generate(model, [[1, 2, 3]], max_new_tokens=7, eos_token_id=[]).tokens[0] == free[:7]
    multi = sj.generate(model, [[1, 2, 3]], max_new_tokens=30, eos_token_id=[free[9], eos]).tokens[0]
    assert multi == free[: min(stop, free.index(free[9])) + 1]


def test_sampled_rows_independent_and_seeded(model):
    outs = sj.generate(model, [[1, 2, 3]] * 16, max_new_tokens=8, temperature=1.0, seed=3,
                       eos_token_id=[]).tokens
    assert len({tuple(o) for o in outs}) > 8
    again = sj.generate(model, [[1, 2, 3]] * 16, max_new_tokens=8, temperature=1.0, seed=3,
                        eos_token_id=[]).tokens
    assert outs == again
    other = sj.generate(model, [[1, 2, 3]] * 16, max_new_tokens=8, temperature=1.0, seed=4,
                        eos_token_id=[]).tokens
    assert other != outs
    # row i's stream depends on (seed, i) only, not on the rest of the batch
    alone = sj.generate(model, [[1, 2, 3]], max_new_tokens=8, temperature=1.0, seed=3,
                        eos_token_id=[]).tokens
    assert alone[0] == outs[0]


def test_top_k_one_is_greedy(model):
    greedy = sj.generate(model, [[5, 6]] * 4, max_new_tokens=10, eos_token_id=[]).tokens
    topk1 = sj.generate(model, [[5, 6]] * 4, max_new_tokens=10, temperature=1.3, top_k=1,
                        eos_token_id=[]).tokens
    assert topk1 == greedy


def test_batch_sizes_share_compilations(model):
    from tests.test_engine import COMPILES  # XLA's compile events (jax.monitoring)
    sj.generate(model, [[1, 2]] * 3, max_new_tokens=5, eos_token_id=[])
    before = COMPILES.count
    a = sj.generate(model, [[1, 2], [3], [4, 5], [6]], max_new_tokens=5, eos_token_id=[4])
    b = sj.generate(model, [[1, 2], [3], [4, 5]], max_new_tokens=7, eos_token_id=[4, 5],
                    num_draft_tokens=2)  # ignored by method="none"
    c = sj.generate(model, [[1, 2], [3], [4, 5]], max_new_tokens=5, eos_token_id=[4])
    d = sj.generate(model, [[1, 2], [3], [4, 5]], max_new_tokens=5, eos_token_id=[4],
                    spec=sj.SpecConfig(num_draft_tokens=9, page_size=16))  # the same config
    assert COMPILES.count == before  # batch 3/4, eos 0-2 ids, k: one compile
    assert a.tokens[:3] == c.tokens == d.tokens  # padding rows change nothing
    assert len(b.tokens) == 3


def test_multiple_eos_from_hf_config(model):
    import dataclasses
    free = sj.generate(model, [[1, 2, 3]], max_new_tokens=20, eos_token_id=[]).tokens[0]
    multi = dataclasses.replace(model, config=dataclasses.replace(
        model.config, eos_token_id=(free[6], free[3])))
    assert sj.generate(multi, [[1, 2, 3]], max_new_tokens=20).tokens[0] == free[:4]
    from specjax.config import ModelConfig
    cfg = ModelConfig.from_hf_config(dict(vocab_size=8, hidden_size=4, intermediate_size=8,
                                          num_hidden_layers=1, num_attention_heads=2,
                                          eos_token_id=[3, 5]))
    assert cfg.eos_token_ids == (3, 5)


def test_numpy_scalars_accepted(model):
    out = sj.generate(model, [np.array([1, 2, 3])], max_new_tokens=np.int64(3),
                      temperature=np.float32(0.5), top_k=np.int64(5), eos_token_id=[])
    assert len(out.tokens[0]) == 3


# Host round trips a compiled program can hold: Python callbacks (jax.debug.print, pure_callback,
# io_callback lower to custom calls named *callback*), outfeed / infeed, send / recv.
_HOST_OPS = re.compile(r"callback|outfeed|infeed|stablehlo\.send|stablehlo\.recv")


class _Captured(Exception):
    pass


def _lowered_generate(monkeypatch, model, **kw) -> str:
    """The StableHLO text of the one program sj.generate runs (lowered, not compiled or run)."""
    seen = {}

    def capture(*args, **kwargs):
        seen.update(args=args, kwargs=kwargs)
        raise _Captured

    monkeypatch.setattr(speculate, "generate_device", capture)
    with pytest.raises(_Captured):
        sj.generate(model, [[1, 2, 3], [4]], max_new_tokens=4, eos_token_id=[], **kw)
    monkeypatch.undo()
    return speculate.generate_device.lower(*seen["args"], **seen["kwargs"]).as_text()


@pytest.mark.parametrize("method", ["none", "draft", "mtp", "eagle-tree"])
def test_generation_is_one_program_without_host_callbacks(model, monkeypatch, method):
    """Prefill and the whole while_loop are one program with no host round trip inside, so the
    only device->host transfer of a generation is the final read (stats no longer report a
    'host_syncs' figure that was 1 by construction)."""
    draft = {"none": None, "draft": model, "mtp": mimic_head(model, "mtp"),
             "eagle-tree": mimic_head(model, "eagle")}[method]
    tree = TreeConfig(depth=2, top_k=2, num_nodes=3) if method == "eagle-tree" else None
    text = _lowered_generate(monkeypatch, model, draft=draft, method=method, tree=tree)
    assert "stablehlo.while" in text
    assert not _HOST_OPS.findall(text)


def test_host_callback_detector_has_power():
    """The same pattern finds the callback a stray jax.debug.print leaves in a program."""
    text = jax.jit(lambda x: (jax.debug.print("x {}", x), x + 1)[1]).lower(jnp.ones(2)).as_text()
    assert _HOST_OPS.findall(text)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(method="medusa"), ValueError, "SpecConfig.method must be one of 'none', 'draft'"),
    (dict(method="draft", num_draft_tokens=0), ValueError,
     "SpecConfig.num_draft_tokens must be an int in \\[1, 64\\]"),
    (dict(method="draft", num_draft_tokens=True), ValueError, "num_draft_tokens"),
    (dict(method="draft", draft_sampling=1), TypeError, "SpecConfig.draft_sampling must be a bool"),
    (dict(method="draft", tree=sj.SpecConfig(method="eagle-tree").tree), ValueError,
     'tree is only used with method="eagle-tree"'),
    (dict(method="eagle-tree", tree=(0, 0, 1)), TypeError, "TreeConfig"),
    (dict(method="eagle-tree", draft_sampling=True), ValueError, "draft_sampling"),
    (dict(attn_impl="cuda"), ValueError, "SpecConfig.attn_impl must be one of"),
    (dict(page_size=0), ValueError, "SpecConfig.page_size must be an int >= 1"),
    (dict(method="ngram", ngram_min=0), ValueError, "ngram_min must be an int in \\[1, 64\\]"),
    (dict(method="ngram", ngram_min=4, ngram_max=3), ValueError, "ngram_min \\(4\\) must be <="),
    (dict(method="ngram", hybrid_min=-1), ValueError, "hybrid_min must be an int >= 0"),
    (dict(adaptive=True), ValueError, 'adaptive=True needs a speculative method'),
])
def test_spec_config_is_validated(kwargs, error, match):
    with pytest.raises(error, match=match):
        sj.SpecConfig(**kwargs)


def test_spec_config_normalises_and_is_static():
    assert sj.SpecConfig(num_draft_tokens=7, draft_sampling=True) == sj.SpecConfig()  # "none"
    tree = sj.SpecConfig(method="eagle-tree")
    assert tree.tree is not None and tree.k_eff == tree.tree.max_depth and tree.uses_head
    chain = sj.SpecConfig(method="mtp", num_draft_tokens=3, adaptive=True)
    assert (chain.k, chain.k_eff, chain.extra_slots) == (3, 3, 4) and hash(chain)


def test_spec_argument_conflicts_and_unavailable_methods(model, monkeypatch):
    from specjax import speculate
    with pytest.raises(ValueError, match="pass either spec=... or method, not both"):
        sj.generate(model, [[1]], method="draft", spec=sj.SpecConfig())
    with pytest.raises(TypeError, match="spec must be a specjax.SpecConfig"):
        sj.generate(model, [[1]], spec="draft")
    monkeypatch.setattr(speculate, "METHODS", ("none",))  # a method the config knows, not the loop
    with pytest.raises(ValueError, match='method="draft" is not available'):
        sj.generate(model, [[1]], draft=model, method="draft")


def test_merge_outputs_equals_one_batched_call(model):
    """Per-prompt calls merged report what one batched greedy call over the same rows reports
    (the accepted drafts of a row do not depend on its batch-mates), with partial acceptance."""
    from specjax.api import merge_outputs

    draft = sj.early_exit_draft(model, 1)
    prompts = [[1, 2, 3], [5, 9, 11, 4, 4], [7]]
    kw = dict(max_new_tokens=12, draft=draft, method="draft", num_draft_tokens=3, eos_token_id=[])
    batched = sj.generate(model, prompts, **kw)
    merged = merge_outputs([sj.generate(model, [p], **kw) for p in prompts])
    assert merged.tokens == batched.tokens
    for key in ("accepted_tokens", "row_steps", "generated_tokens"):
        assert merged.stats[key] == batched.stats[key], key
    for key in ("mean_accepted_length", "acceptance_rate"):
        assert merged.stats[key] == pytest.approx(batched.stats[key]), key
    assert merged.stats["per_position_acceptance"] == pytest.approx(
        batched.stats["per_position_acceptance"])
    assert 0 < merged.stats["acceptance_rate"] < 1  # drafts accepted in part: the sums matter
    with pytest.raises(ValueError, match="at least one"):
        merge_outputs([])
