"""Structured outputs with speculation: grammar masks keep decoding lossless w.r.t. the
*constrained* target distribution, for every drafter kind, in the engine and the server.

Tiny random targets with character-level HF tokenizers built here (each character one token,
so the grammars' token languages are small and random drafts are valid often enough for
acceptances to happen): a JSON alphabet for schemas, and "abc" for the distribution test, where
the constrained distribution is enumerable exactly.
"""

import itertools
import json
import os

import jax
import numpy as np
import pytest

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

import specjax as sj  # noqa: E402
from specjax import dflash, peagle  # noqa: E402
from specjax.config import SpecConfig  # noqa: E402
from specjax.engine import Engine, EngineConfig, RequestParams  # noqa: E402
from specjax.heads import Head, HeadConfig, init_head  # noqa: E402
from specjax.structured import Constraint, GrammarCompiler, allowed  # noqa: E402
from specjax.tree import TreeConfig  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # <|im_end|> = id 2 = EOS
JSON_CHARS = list('abcdefghijklmnopqrstuvwxyz0123456789 {}[]":,.-_\n')
K = 3
ENGINE = dict(max_slots=4, batch_buckets=(4,), token_buckets=(16,), max_model_len=96)
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["ok", "color", "n"], "additionalProperties": False}
CONSTRAINTS = [Constraint.json_schema(SCHEMA), Constraint.regex(r"[a-f]{2,6}(-[0-9]{1,3})?"),
               Constraint.choice(["alpha", "beta", "gamma delta"])]


def write_tokenizer(path, chars, chat_template=None):
    """A character-level tokenizer: 3 special tokens then one token per character."""
    import tokenizers  # noqa: PLC0415

    vocab = {t: i for i, t in enumerate(SPECIAL + chars)}
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab, [], unk_token=None))
    tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in SPECIAL])
    tok.decoder = tokenizers.decoders.Fuse()
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    config = {"eos_token": "<|im_end|>"}
    if chat_template:
        config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return sj.load_tokenizer(path)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = write_tokenizer(str(tmp_path_factory.mktemp("tok")), JSON_CHARS)
    target = tiny_model(0, vocab=64, eos=2)

    def head(kind):
        aux = (0, 1, 1) if kind == "eagle3" else None  # the 2-layer target's features
        cfg = HeadConfig.for_target(target.config, kind, aux_layers=aux)
        return Head(init_head(cfg, jax.random.key(3), scale=1.0), cfg)

    tc = target.config
    block = dflash.DFlashConfig(num_layers=1, hidden_size=tc.hidden_size, num_heads=4,
                                num_kv_heads=2, head_dim=8, intermediate_size=40, block_size=K + 1,
                                mask_token_id=5, target_layer_ids=(0,),
                                target_hidden_size=tc.hidden_size, vocab_size=tc.vocab_size,
                                rope_theta=10000.0)
    parallel = peagle.PEagleConfig(HeadConfig.for_target(tc, "eagle3", aux_layers=(0, 1, 1)),
                                   mask_token_id=5,
                                   num_depths=K)
    # the whole target as its draft: its greedy drafts are accepted wherever they are valid
    whole = sj.early_exit_draft(target, target.config.num_layers)
    drafts = {"none": None, "draft": whole, "mtp": head("mtp"), "eagle-tree": head("eagle"),
              "ngram": None, "eagle3": head("eagle3"),
              "dflash": dflash.DFlashHead(dflash.init_params(block, jax.random.key(4), scale=0.5),
                                          block),
              "peagle": peagle.PEagleHead(peagle.init_params(parallel, jax.random.key(5),
                                                             scale=0.5), parallel),
              "hybrid": whole, "adaptive": whole}
    return {"tok": tok, "target": target, "drafts": drafts, "engines": {}}


def engine_for(setup, method):
    if method not in setup["engines"]:
        kw = {"tree": TreeConfig(depth=3, top_k=2, num_nodes=6)} if method == "eagle-tree" else {}
        if method == "ngram":
            kw = dict(ngram_min=1, ngram_max=2)
        if method == "hybrid":  # n-gram matches of >= 1 token preferred over the draft's
            kw = dict(ngram_min=1, ngram_max=2, hybrid_min=1)
        if method == "adaptive":
            kw = dict(adaptive=True)
        spec = SpecConfig(method={"hybrid": "draft", "adaptive": "draft"}.get(method, method),
                          num_draft_tokens=K, page_size=4, **kw)
        setup["engines"][method] = Engine(setup["target"], setup["drafts"][method],
                                          EngineConfig(spec, **ENGINE), tokenizer=setup["tok"])
    return setup["engines"][method]


PROMPTS = ["answer in json", "pick one:", "x"]


def run_batch(engine, tok, free_alongside=True):
    """Every (prompt, constraint) pair plus unconstrained requests, all in one engine run."""
    handles = []
    for p in PROMPTS:
        ids = tok.encode(p)
        for c in CONSTRAINTS:
            handles.append(engine.submit(ids, RequestParams(max_tokens=48, constraint=c)))
        if free_alongside:
            handles.append(engine.submit(ids, RequestParams(max_tokens=12, stop_token_ids=())))
    engine.run()
    return [(h.result(), h.finish_reason) for h in handles]


def check_valid(tok, constraint, tokens, reason):
    assert reason == "stop" and tokens[-1] == 2, (reason, tokens)
    text = tok.decode(tokens[:-1])
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif constraint.kind == "regex":
        import re  # noqa: PLC0415

        assert re.fullmatch(constraint.value, text), text
    else:
        assert text in constraint.value, text


@pytest.fixture(scope="module")
def reference(setup):
    """Plain decoding's outputs: constrained requests together, each free request alone."""
    eng, tok = engine_for(setup, "none"), setup["tok"]
    together = run_batch(eng, tok, free_alongside=False)
    alone = [eng.submit(tok.encode(p), RequestParams(max_tokens=12, stop_token_ids=())).result()
             for p in PROMPTS]
    return together, alone


@pytest.mark.parametrize("method", ["draft", "mtp", "ngram", "eagle-tree", "eagle3", "dflash",
                                    "peagle", "hybrid", "adaptive"])
def test_greedy_constrained_output_is_identical_with_speculation(setup, reference, method):
    tok = setup["tok"]
    eng = engine_for(setup, method)
    out = run_batch(eng, tok)
    together, alone = reference
    per = len(CONSTRAINTS) + 1
    for i, p in enumerate(PROMPTS):
        rows = out[i * per:(i + 1) * per]
        for j, c in enumerate(CONSTRAINTS):
            tokens, reason = rows[j]
            assert tokens == together[i * len(CONSTRAINTS) + j][0], (method, p, c.kind)
            check_valid(tok, c, tokens, reason)
        assert rows[-1][0] == alone[i], "a free row beside constrained ones changed"  # (d)
    s = eng.stats()
    assert s["structured_steps"] > 0 and s["spec_decode_num_drafts"] > 0
    if method in ("draft", "hybrid"):  # the target drafting for itself: valid drafts accepted
        assert s["spec_decode_num_accepted_tokens"] > 0


def test_matcher_chain_and_tree_masks(setup):
    tok = setup["tok"]
    comp = GrammarCompiler(tok, 64, [2])
    m = comp.matcher(Constraint.choice(["ab", "ac"]))
    a, b, c, z = (tok.token_to_id(x) for x in "abcz")
    out = np.zeros((4, comp.words), np.int32)
    assert m.chain_masks([a, b, z], out) == 2  # "ab" valid, then only EOS
    assert allowed(out[0], a) and not allowed(out[0], b)
    assert allowed(out[1], b) and allowed(out[1], c) and not allowed(out[1], 2)
    assert allowed(out[2], 2) and not allowed(out[2], z)
    assert (out[3] == out[2]).all()  # past the cut: never reached
    assert m.chain_masks([z, a], out) == 0 and m.accept([a]) == 1  # state was unchanged
    # a tree: root -> a -> {b, z}; root -> z -> c
    m = comp.matcher(Constraint.choice(["ab", "ac"]))
    tree_out = np.zeros((6, comp.words), np.int32)
    m.tree_masks([a, b, z, z, c], [-1, 0, 1, 1, 0, 4], tree_out)
    assert allowed(tree_out[1], c) and allowed(tree_out[2], 2) and not allowed(tree_out[2], a)
    assert (tree_out[3] == tree_out[1]).all() and (tree_out[5] == tree_out[4]).all()
    with pytest.raises(ValueError, match="invalid json_schema"):
        comp.compile(Constraint.json_schema({"type": "nonsense"}))
    with pytest.raises(ValueError, match="invalid regex"):
        comp.compile(Constraint.regex("[a"))


# ------------------------------------------------------------------------------ distribution

ABC_CHARS = list("abc")
REGEX = "[ab]{3}"  # eight strings, then the stop token
N_SAMPLES = 800


def exact_distributions(target, prompt, ids, length=3):
    """Over the strings of ``ids`` of ``length``: (the constrained law P'(s) = prod_j
    softmax(logits_j restricted to the mask at j), the wrong 'sample unconstrained, keep the
    valid strings' law P(s) ∝ prod_j p(s_j | s_<j) * p(EOS | s))."""
    want, wrong = {}, {}
    for s in itertools.product(ids, repeat=length):
        logits = np.asarray(sj.logits(target, prompt + list(s)), np.float64)[-length - 1:]
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)  # [length + 1, V] p at the positions of s, then EOS
        want[s] = np.prod([p[j, s[j]] / p[j, list(ids)].sum() for j in range(length)])
        wrong[s] = np.prod([p[j, s[j]] for j in range(length)]) * p[length, 2]
    z = sum(wrong.values())
    return want, {s: v / z for s, v in wrong.items()}


@pytest.mark.parametrize("draft_layers", [2, 1])  # q = p (valid drafts always accepted), q != p
def test_sampled_constrained_decoding_matches_the_constrained_distribution(tmp_path, draft_layers):
    from scipy import stats  # noqa: PLC0415

    tok = write_tokenizer(str(tmp_path / "tok"), ABC_CHARS)
    target = tiny_model(2, vocab=8, eos=2)
    draft = sj.early_exit_draft(target, draft_layers)
    spec = SpecConfig(method="draft", num_draft_tokens=2, page_size=4, draft_sampling=True)
    eng = Engine(target, draft, EngineConfig(spec, max_slots=8, batch_buckets=(8,),
                                             token_buckets=(8,), max_model_len=32),
                 tokenizer=tok)
    prompt = tok.encode("c")
    ids = (tok.token_to_id("a"), tok.token_to_id("b"))
    handles = []
    for wave in range(0, N_SAMPLES, 8):  # waves of max_slots: decode steps speculate
        handles += [eng.submit(prompt, RequestParams(max_tokens=8, temperature=1.0, seed=i,
                                                     constraint=Constraint.regex(REGEX)))
                    for i in range(wave, wave + 8)]
        eng.run()
    counts, bonus = {}, 0
    for h in handles:
        out = h.result()
        assert len(out) == 4 and out[3] == 2 and h.finish_reason == "stop", out
        counts[tuple(out[:3])] = counts.get(tuple(out[:3]), 0) + 1
        # a step from output index 1 that accepted both drafts: its bonus token (the EOS at
        # index 3) was sampled under the bonus position's mask (only EOS allowed there)
        bonus += any(start == 1 and a == 2 for start, a, _ in h._req.spec_steps)
    assert bonus > 0 and eng.stats()["spec_decode_num_accepted_tokens_per_pos"][1] > 0
    want, wrong = exact_distributions(target, prompt, ids)
    keys = sorted(want)
    obs = np.array([counts.get(k, 0) for k in keys])
    assert sum(abs(want[k] - wrong[k]) for k in keys) > 0.2  # the control is a different law
    # significance 1e-3 each (seeded: the test is deterministic)
    p_ok = stats.chisquare(obs, N_SAMPLES * np.array([want[k] for k in keys])).pvalue
    p_wrong = stats.chisquare(obs, N_SAMPLES * np.array([wrong[k] for k in keys])).pvalue
    assert p_ok > 1e-3, (p_ok, obs, want)
    assert p_wrong < 1e-3, (p_wrong, obs, wrong)  # negative control: must be rejected


def test_smollm2_tokenizer_json_schema_with_speculation(smollm2_gguf):
    """SmolLM2's byte-level BPE tokenizer (multi-character tokens that straddle JSON syntax)
    with a tiny random target of its vocabulary: greedy output identical with and without a
    draft, and valid."""
    tok = sj.load_tokenizer(smollm2_gguf)
    target = tiny_model(0, vocab=49152, eos=2)
    ids = tok.encode("Give me the item as JSON:")
    outs = []
    for draft in (None, sj.early_exit_draft(target, target.config.num_layers)):
        spec = SpecConfig(method="none" if draft is None else "draft", num_draft_tokens=K,
                          page_size=4)
        eng = Engine(target, draft, EngineConfig(spec, **ENGINE), tokenizer=tok)
        h = eng.submit(ids, RequestParams(max_tokens=48, constraint=CONSTRAINTS[0]))
        outs.append(h.result())
        check_valid(tok, CONSTRAINTS[0], outs[-1], h.finish_reason)
    assert outs[0] == outs[1]
    # drafts were verified (a random model's unmasked argmax over 49152 tokens is seldom valid:
    # acceptances are exercised with the small vocabularies above)
    assert eng.stats()["spec_decode_num_drafts"] > 0
