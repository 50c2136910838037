"""The Drafter interface is real: a drafter defined here, in the test file, plugs into
``sj.generate`` and the engine without editing specjax/speculate/, and stays lossless.
Also: the speculative core looks at the method name in at most four places."""

import ast
import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax as sj
from specjax import speculate
from specjax.config import SpecConfig
from specjax.engine import Engine, EngineConfig, RequestParams
from tests.conftest import accept_length_counts, tiny_model

PROMPTS = [[1, 2, 3], [5], [7, 8, 9, 10, 11, 12]]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class BigramDrafter(speculate.Drafter):
    """Drafts by a bigram table: d_1 = table[x_{n-1}], d_{i+1} = table[d_i]. No cache, no carry."""

    def propose(self, models, state, rp, k, keys, sampled):
        table = models.draft["table"]  # [V] int32

        def body(prev, _):
            nxt = table[prev]
            return nxt, nxt

        _, ds = jax.lax.scan(body, state.last_token, None, length=k)  # [K, B]
        b = state.lengths.shape[0]
        return speculate.Drafts(tokens=ds.T.astype(jnp.int32), probs=None,
                                draft_kv=state.draft_kv, carry=state.carry,
                                proposing=jnp.ones((b,), bool))

    def extend(self, models, kv, span):
        return kv, {}

    def absorb(self, models, state, drafts, verified):
        return drafts.draft_kv, drafts.carry


@pytest.fixture(scope="module")
def target():
    return tiny_model(0)


@pytest.fixture(scope="module")
def plain(target):
    return sj.generate(target, PROMPTS, max_new_tokens=24, eos_token_id=[]).tokens


@pytest.fixture(scope="module")
def bigram(target, plain):
    """A table that knows most of the plain continuations' bigrams: drafts accept partially."""
    rng = np.random.default_rng(0)
    table = rng.integers(0, target.config.vocab_size, target.config.vocab_size)
    for row in plain[::2]:  # half the rows: the others' bigrams are partly wrong
        for a, b in zip(row, row[1:]):
            table[a] = b
    return speculate.Custom(BigramDrafter(), {"table": jnp.asarray(table, jnp.int32)})


@pytest.mark.parametrize("k", [1, 3])
def test_custom_drafter_in_generate_is_lossless(target, plain, bigram, k):
    out = sj.generate(target, PROMPTS, max_new_tokens=24, draft=bigram, eos_token_id=[],
                      spec=SpecConfig(method="custom", num_draft_tokens=k))
    assert out.tokens == plain
    counts = accept_length_counts(out.stats)
    assert counts[0] > 0 and counts[-1] > 0, counts  # rejections and full acceptances


def test_custom_drafter_in_the_engine_is_lossless(target, plain, bigram):
    engine = Engine(target, bigram, EngineConfig(SpecConfig(method="custom", num_draft_tokens=3,
                                                            page_size=4),
                                                 max_slots=4, batch_buckets=(4,),
                                                 token_buckets=(8,), max_model_len=40))
    got = engine.generate(PROMPTS, RequestParams(max_tokens=24, stop_token_ids=()))
    assert got == plain


def test_custom_drafter_needs_method_custom(target, bigram):
    with pytest.raises(TypeError, match="custom"):
        sj.generate(target, PROMPTS, draft=3, spec=SpecConfig(method="custom"))
    with pytest.raises(ValueError, match="custom"):
        sj.generate(target, PROMPTS, draft=bigram, spec=SpecConfig(method="draft"))


# ---------------------------------------------------------------- the core asks no method names

CORE = [os.path.join(REPO, "specjax", "engine", "steps.py")] + [
    os.path.join(root, f) for root, _, files in os.walk(os.path.join(REPO, "specjax", "speculate"))
    for f in files if f.endswith(".py")]


def _method_tests(src: str) -> list[int]:
    """Lines comparing a method name (``x.method == "..."``, ``method in (...)``, ``uses_head``)."""
    hits = []
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.Compare):
            sides = [node.left] + list(node.comparators)
            named = any((isinstance(s, ast.Attribute) and s.attr == "method")
                        or (isinstance(s, ast.Name) and s.id == "method") for s in sides)
            if named:
                hits.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in ("uses_head", "HEAD_METHODS"):
            hits.append(node.lineno)
    return hits


def test_the_core_looks_at_the_method_name_in_at_most_four_places():
    hits = {os.path.relpath(p, REPO): _method_tests(open(p).read()) for p in CORE}
    total = sum(len(v) for v in hits.values())
    assert total <= 4, {k: v for k, v in hits.items() if v}


def test_method_name_counter_sees_a_branch():
    """Negative control: the counter finds the kinds of branches the core used to have."""
    src = 'if lc.method == "draft":\n    pass\nif lc.uses_head:\n    pass\nx = method in ("a",)\n'
    assert _method_tests(src) == [1, 3, 5]
