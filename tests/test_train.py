"""Training on precomputed hidden states: heads and draft LLMs learn, save, load and draft."""

import dataclasses
import gzip
import json
import os

import jax
import numpy as np
import pytest

import specjax as sj
from specjax.heads import HeadConfig, init_head
from specjax.train import data as data_lib
from specjax.train import distill
from specjax.train import trainer
from tests.conftest import tiny_model


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target and hidden states over its own greedy continuations (self-distillation)."""
    work = tmp_path_factory.mktemp("train")
    target = tiny_model(21, vocab=64, hidden=32, layers=2, scale=0.5)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 64, size=rng.randint(2, 8)).tolist() for _ in range(48)]
    out = sj.generate(target, prompts, max_new_tokens=24, eos_token_id=[])  # greedy: learnable
    cdir = work / "corpus"
    os.makedirs(cdir)
    with open(cdir / "corpus-00000.jsonl", "w") as f:
        for p, o in zip(prompts, out.tokens):
            f.write(json.dumps({"ids": p + o, "prompt_len": len(p)}) + "\n")
    paths = data_lib.collect_hidden(target, str(cdir), str(work / "hidden"), seq_len=32, batch_size=16)
    data = data_lib.load_hidden(paths)
    assert data["hidden"].shape == (48, 32, 32)
    return target, data, work


def _first_last(log_path):
    rows = [json.loads(line) for line in open(log_path)]
    return rows[0], rows[-1]


@pytest.mark.parametrize("kind, norms", [("mtp", True), pytest.param("eagle", False, marks=pytest.mark.slow)])
def test_head_training_learns_and_drafts(setup, kind, norms):
    target, data, work = setup
    hcfg = HeadConfig.for_target(target.config, kind, norms=norms)
    tc = trainer.TrainConfig(steps=60, batch_size=16, seq_len=32, lr=3e-3, warmup=5, log_every=5)

    def loss_fn(p, tp, tokens, lengths, hidden, plens):
        return trainer.head_loss(p, hcfg, tp, target.config, tokens, lengths, hidden, tc, plens)

    params = init_head(hcfg, jax.random.key(0))
    before = trainer.evaluate(loss_fn, params, target.params, data, 16, 32)
    params = trainer.fit(loss_fn, params, target.params, data, tc, str(work / f"run-{kind}"))
    after = trainer.evaluate(loss_fn, params, target.params, data, 16, 32)
    assert after["cls"] < 0.9 * before["cls"]
    assert after["top1"] > before["top1"] + 0.1
    # the trained head drafts losslessly and is accepted more than an untrained one
    from specjax.heads import Head
    from specjax.io.heads_io import save_head
    save_head(Head(params, hcfg), str(work / f"ckpt-{kind}"))
    head = sj.load_draft(str(work / f"ckpt-{kind}"), target=target)
    prompts = [[3, 4, 5], [9]]
    plain = sj.generate(target, prompts, max_new_tokens=20, eos_token_id=[])
    spec = sj.generate(target, prompts, max_new_tokens=20, draft=head, method=kind,
                       num_draft_tokens=3, eos_token_id=[])
    assert spec.tokens == plain.tokens
    untrained = sj.generate(target, prompts, max_new_tokens=20, method=kind, num_draft_tokens=3,
                            draft=Head(init_head(hcfg, jax.random.key(0)), hcfg), eos_token_id=[])
    assert spec.stats["mean_accepted_length"] > untrained.stats["mean_accepted_length"]


def test_resume_continues_from_checkpoint(setup):
    target, data, work = setup
    hcfg = HeadConfig.for_target(target.config, "mtp")
    tc = trainer.TrainConfig(steps=10, batch_size=8, seq_len=32, save_every=3, log_every=1)

    def loss_fn(p, tp, tokens, lengths, hidden, plens):
        return trainer.head_loss(p, hcfg, tp, target.config, tokens, lengths, hidden, tc, plens)

    run = str(work / "run-resume")
    full = trainer.fit(loss_fn, init_head(hcfg, jax.random.key(0)), target.params, data, tc,
                       str(work / "run-full"))
    import dataclasses
    half = dataclasses.replace(tc, steps=5)
    trainer.fit(loss_fn, init_head(hcfg, jax.random.key(0)), target.params, data, half, run)
    resumed = trainer.fit(loss_fn, init_head(hcfg, jax.random.key(1)), target.params, data, tc, run)
    # resuming restores params + optimizer state + data order: same result as one run
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # CheckpointManager steps 3, 5 | 6, 9, 10: the newest two kept
    assert sorted(int(n) for n in os.listdir(os.path.join(run, trainer.STATES))) == [9, 10]


def test_deadline_stops_saves_and_resumes(setup):
    """``fit(deadline=)`` (the GPU call's time budget): no step starts after the deadline, the
    state is saved where it stopped (``last_step``), and a rerun without one goes on from there
    to the same params as an uninterrupted run."""
    import time
    target, data, work = setup
    hcfg = HeadConfig.for_target(target.config, "mtp")
    tc = trainer.TrainConfig(steps=6, batch_size=8, seq_len=32, save_every=4, log_every=1)

    def loss_fn(p, tp, tokens, lengths, hidden, plens):
        return trainer.head_loss(p, hcfg, tp, target.config, tokens, lengths, hidden, tc, plens)

    run = str(work / "run-deadline")
    assert trainer.last_step(run) == 0
    trainer.fit(loss_fn, init_head(hcfg, jax.random.key(0)), target.params, data, tc, run,
                deadline=time.perf_counter())
    assert trainer.last_step(run) == 1
    resumed = trainer.fit(loss_fn, init_head(hcfg, jax.random.key(0)), target.params, data, tc, run)
    assert trainer.last_step(run) == 6
    full = trainer.fit(loss_fn, init_head(hcfg, jax.random.key(0)), target.params, data, tc,
                       str(work / "run-deadline-full"))
    for a, b in zip(jax.tree.leaves(full), jax.tree.leaves(resumed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_legacy_states_resume(tmp_path):
    """Run dirs written before the CheckpointManager (state.npz, then hand-rotated orbax
    ``state-<step>`` dirs) still resume; a manager step wins over both."""
    import orbax.checkpoint as ocp

    tree = {"a": np.arange(3.0), "b": [np.ones((2, 2)), np.zeros(1)]}
    leaves = jax.tree.leaves(tree)
    np.savez(tmp_path / "state.npz", step=7, **{f"l{i}": x for i, x in enumerate(leaves)})
    got, step = trainer._load_state(str(tmp_path), tree)
    assert step == 7
    for a, b in zip(leaves, jax.tree.leaves(got)):
        np.testing.assert_array_equal(a, b)
    with ocp.PyTreeCheckpointer() as ckptr:
        ckptr.save(str(tmp_path / "state-00000009"), {
            "step": np.asarray(9, np.int64),
            "leaves": {f"l{i:04d}": x + 1 for i, x in enumerate(leaves)}})
    got, step = trainer._load_state(str(tmp_path), tree)
    assert step == 9 and np.array_equal(got["a"], tree["a"] + 1)
    trainer._save_state(str(tmp_path), jax.tree.map(lambda x: x + 2, tree), 12)
    got, step = trainer._load_state(str(tmp_path), tree)
    assert step == 12 and np.array_equal(got["a"], tree["a"] + 2)
    os.makedirs(tmp_path / "empty")
    assert trainer._load_state(str(tmp_path / "empty"), tree) is None


def test_draft_llm_distillation(setup):
    target, data, work = setup
    import dataclasses
    tc = trainer.TrainConfig(steps=40, batch_size=16, seq_len=32, lr=3e-3, warmup=5, log_every=5)
    cfg = dataclasses.replace(target.config, num_layers=1)
    trainable = {"layers": [dict(target.params["layers"][0])], "norm": target.params["norm"]}

    def loss_fn(p, tp, tokens, lengths, hidden, plens):
        return trainer.draft_loss(p, tp, target.config, cfg, tokens, lengths, hidden, tc, plens)

    before = trainer.evaluate(loss_fn, trainable, target.params, data, 16, 32)
    trainable = trainer.fit(loss_fn, trainable, target.params, data, tc, str(work / "run-d"))
    after = trainer.evaluate(loss_fn, trainable, target.params, data, 16, 32)
    assert after["kl"] < 0.7 * before["kl"]
    from specjax.io.checkpoint import save_checkpoint
    save_checkpoint(str(work / "draft"), jax.tree.map(lambda a: np.asarray(a, np.float16), trainable),
                    cfg, kind="draft_llm", extra={"shares": ["embed", "lm_head"]})
    draft = sj.load_draft(str(work / "draft"), target=target)
    assert draft.config.num_layers == 1
    plain = sj.generate(target, [[1, 2]], max_new_tokens=16, eos_token_id=[])
    spec = sj.generate(target, [[1, 2]], max_new_tokens=16, draft=draft, method="draft",
                       num_draft_tokens=2, eos_token_id=[])
    assert spec.tokens == plain.tokens


def _fit_head(setup, rollout, steps=60):
    target, data, work = setup
    hcfg = HeadConfig.for_target(target.config, "mtp")
    tc = trainer.TrainConfig(steps=steps, batch_size=16, seq_len=32, lr=3e-3, warmup=5,
                             log_every=5, rollout=rollout)

    def loss_fn(p, tp, tokens, lengths, hidden, plens):
        return trainer.head_loss(p, hcfg, tp, target.config, tokens, lengths, hidden, tc, plens)

    params = trainer.fit(loss_fn, init_head(hcfg, jax.random.key(0)), target.params, data, tc,
                         str(work / f"run-rollout{rollout}-{steps}"))
    return params, hcfg


def _eval_rollout(setup, params, hcfg, rollout):
    target, data, _ = setup
    tc = trainer.TrainConfig(batch_size=16, seq_len=32, rollout=rollout)
    return trainer.evaluate(
        lambda p, tp, tokens, lengths, hidden, plens: trainer.head_loss(
            p, hcfg, tp, target.config, tokens, lengths, hidden, tc, plens),
        params, target.params, data, 16, 32)


def test_rollout_passes_feed_back_the_heads_own_output(setup):
    """rollout=1 is the teacher-forced loss; pass 2 sees the head's own outputs, so a randomly
    initialised head scores differently there, and the loss averages the passes."""
    target, data, _ = setup
    hcfg = HeadConfig.for_target(target.config, "mtp")
    params = init_head(hcfg, jax.random.key(1))
    batch = [jax.numpy.asarray(data["tokens"][:16, :32]), jax.numpy.asarray(data["lengths"][:16]),
             jax.numpy.asarray(data["hidden"][:16, :32])]

    def run(rollout):
        tc = trainer.TrainConfig(rollout=rollout)
        return trainer.head_loss(params, hcfg, target.params, target.config, *batch, tc)

    (l1, one), (l2, two) = run(1), run(2)
    assert "top1_r2" in two and "top1_r2" not in one
    assert float(two["top1"]) == pytest.approx(float(one["top1"]))
    assert float(two["cls"]) == pytest.approx(float(one["cls"]))
    want_l1 = 1.0 * float(one["reg"]) + 0.1 * float(one["cls"])
    assert float(l1) == pytest.approx(want_l1, rel=1e-5)
    assert float(l2) != pytest.approx(float(l1), rel=1e-3)  # pass 2 differs: fed-back features


@pytest.mark.slow
def test_rollout_training_improves_fed_back_drafts(setup):
    """A head trained with rollout=2 predicts better from its own fed-back features than one
    trained teacher-forced only, on the same data and steps."""
    p1, hcfg = _fit_head(setup, 1, steps=120)
    p2, _ = _fit_head(setup, 2, steps=120)
    r1 = _eval_rollout(setup, p1, hcfg, 2)
    r2 = _eval_rollout(setup, p2, hcfg, 2)
    assert r2["top1_r2"] > r1["top1_r2"]


def test_answer_only_mask_scores_answer_tokens():
    """Head position j predicts x_{j+2} from the target's distribution at j+1: it counts iff
    j+1 < length and, answer-only, j+2 >= prompt_len; prompt_len 0 means every position."""
    import jax.numpy as jnp
    tc = trainer.TrainConfig()
    m = trainer._loss_mask(6, 2, jnp.array([5, 7]), jnp.array([3, 0]), tc)
    np.testing.assert_array_equal(np.asarray(m), [[0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    every = trainer._loss_mask(6, 2, jnp.array([5, 7]), jnp.array([3, 0]),
                               trainer.TrainConfig(answer_only=False))
    np.testing.assert_array_equal(np.asarray(every), [[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    # draft LLMs: position t predicts x_{t+1}
    d = trainer._loss_mask(4, 1, jnp.array([4]), jnp.array([2]), tc)
    np.testing.assert_array_equal(np.asarray(d), [[0, 1, 1, 1]])


def test_answer_only_loss_ignores_prompt_positions(setup):
    """prompt_lens = 0 (or none) scores every position; real prompt lengths change the loss; a
    boundary past every sequence leaves nothing to score (metrics 0, no NaN)."""
    target, data, _ = setup
    hcfg = HeadConfig.for_target(target.config, "mtp")
    params = init_head(hcfg, jax.random.key(2))
    jnp = jax.numpy
    tokens, hidden = jnp.asarray(data["tokens"][:16, :32]), jnp.asarray(data["hidden"][:16, :32])
    lengths, plens = jnp.asarray(data["lengths"][:16]), jnp.asarray(data["prompt_lens"][:16])
    tc = trainer.TrainConfig()

    def metrics(pl):
        return trainer.head_loss(params, hcfg, target.params, target.config, tokens, lengths,
                                 hidden, tc, pl)[1]

    none, zero, ans, empty = metrics(None), metrics(jnp.zeros_like(plens)), metrics(plens), metrics(lengths + 2)
    assert float(zero["cls"]) == pytest.approx(float(none["cls"]))
    assert float(ans["cls"]) != pytest.approx(float(none["cls"]), rel=1e-4)
    assert float(empty["cls"]) == 0.0 and float(empty["top1"]) == 0.0


@pytest.mark.slow  # test_eagle3_training_time_test_learns_and_drafts trains over a reduced vocabulary too
def test_head_training_with_reduced_vocab(setup):
    """A head restricted to the 40 most frequent answer tokens trains (loss over the subset),
    its exact top-1 (vs the full-vocabulary teacher) improves, and it drafts losslessly."""
    import jax.numpy as jnp
    from specjax.heads import Head
    target, data, work = setup
    vocab = data_lib.draft_vocab(data, 40, target.config.vocab_size)
    hcfg = HeadConfig.for_target(target.config, "mtp")
    hcfg = HeadConfig(kind="mtp", layer=hcfg.layer, draft_vocab_size=40)
    tc = trainer.TrainConfig(steps=60, batch_size=16, seq_len=32, lr=3e-3, warmup=5, log_every=5)
    vj = jnp.asarray(vocab)

    def loss_fn(p, tp, tokens, lengths, hidden, plens, exact=False):
        return trainer.head_loss(dict(p, draft_vocab=vj), hcfg, tp, target.config, tokens, lengths,
                                 hidden, tc, plens, exact_top1=exact)

    def exact(p, *a):
        return loss_fn(p, *a, exact=True)

    params = init_head(hcfg, jax.random.key(0))
    params.pop("draft_vocab")
    before = trainer.evaluate(exact, params, target.params, data, 16, 32)
    params = trainer.fit(loss_fn, params, target.params, data, tc, str(work / "run-vocab"))
    after = trainer.evaluate(exact, params, target.params, data, 16, 32)
    within = trainer.evaluate(loss_fn, params, target.params, data, 16, 32)
    assert after["cls"] < 0.9 * before["cls"]
    assert after["top1"] > before["top1"] + 0.1
    assert within["top1"] >= after["top1"] - 1e-6  # the subset's argmax is easier to hit
    head = Head(dict(params, draft_vocab=vj), hcfg)
    prompts = [[3, 4, 5], [9]]
    plain = sj.generate(target, prompts, max_new_tokens=20, eos_token_id=[])
    spec = sj.generate(target, prompts, max_new_tokens=20, draft=head, method="mtp",
                       num_draft_tokens=3, eos_token_id=[])
    assert spec.tokens == plain.tokens
    untrained = sj.generate(target, prompts, max_new_tokens=20, method="mtp", num_draft_tokens=3,
                            draft=Head(init_head(hcfg, jax.random.key(0)) | {"draft_vocab": vj}, hcfg),
                            eos_token_id=[])
    assert spec.stats["mean_accepted_length"] > untrained.stats["mean_accepted_length"]


def test_resume_refuses_a_different_run(setup):
    target, data, work = setup
    hcfg = HeadConfig.for_target(target.config, "mtp")
    tc = trainer.TrainConfig(steps=2, batch_size=8, seq_len=32, log_every=1)

    def loss_fn(p, tp, tokens, lengths, hidden, plens):
        return trainer.head_loss(p, hcfg, tp, target.config, tokens, lengths, hidden, tc, plens)

    run = str(work / "run-sig")
    trainer.fit(loss_fn, init_head(hcfg, jax.random.key(0)), target.params, data, tc, run,
                signature={"sequences": 48})
    import dataclasses
    with pytest.raises(ValueError, match="train_config.lr"):
        trainer.fit(loss_fn, init_head(hcfg, jax.random.key(0)), target.params, data,
                    dataclasses.replace(tc, lr=5e-4), run, signature={"sequences": 48})
    with pytest.raises(ValueError, match="signature.sequences"):
        trainer.fit(loss_fn, init_head(hcfg, jax.random.key(0)), target.params, data, tc, run,
                    signature={"sequences": 96})
    # more steps is a resume, not a different run
    trainer.fit(loss_fn, init_head(hcfg, jax.random.key(0)), target.params, data,
                dataclasses.replace(tc, steps=3), run, signature={"sequences": 48})


def test_eagle3_training_time_test_learns_and_drafts(setup, tmp_path):
    """EAGLE-3: fused features from the same forward (hidden_states 0, 1, 2 of the 2-layer
    target), reduced draft vocabulary, 3 rollout passes weighted 0.8**r; the cross-entropy of
    the first and of the last (fed-back) pass falls, and the saved head drafts losslessly."""
    import dataclasses

    import jax.numpy as jnp
    from specjax.heads import Head
    from specjax.io.heads_io import save_head
    from specjax.train.pipeline import init_trainable_head

    target, data, work = setup
    aux = (0, 1, 2)
    paths = data_lib.collect_hidden(target, str(work / "corpus"), str(work / "hidden-aux"),
                                    seq_len=32, batch_size=16, aux_layers=aux)
    data3 = data_lib.load_hidden(paths)
    assert data3["hidden"].shape == (48, 32, 4 * 32)
    np.testing.assert_array_equal(data3["hidden"][..., :32], data["hidden"])
    vocab = jnp.asarray(data_lib.draft_vocab(data, 40, 64))
    hcfg = dataclasses.replace(HeadConfig.for_target(target.config, "eagle3", aux_layers=aux),
                               draft_vocab_size=int(vocab.shape[0]))
    tc = trainer.TrainConfig(steps=60, batch_size=16, seq_len=32, lr=1e-2, warmup=5, log_every=10,
                             rollout=3, rollout_decay=0.8)

    def loss_fn(p, tp, tokens, lengths, hidden, plens):
        return trainer.head_loss(dict(p, draft_vocab=vocab), hcfg, tp, target.config, tokens,
                                 lengths, hidden, tc, plens)

    params = init_trainable_head(target, hcfg, 0, vocab)
    before = trainer.evaluate(loss_fn, params, target.params, data3, 16, 32)
    params = trainer.fit(loss_fn, params, target.params, data3, tc, str(tmp_path / "run"))
    after = trainer.evaluate(loss_fn, params, target.params, data3, 16, 32)
    assert after["cls"] < 0.8 * before["cls"]
    assert after["top1"] > before["top1"] + 0.1 and after["top1_r3"] > before["top1_r3"]
    save_head(Head(dict(params, draft_vocab=vocab), hcfg), str(tmp_path / "e3"))
    head = sj.load_draft(str(tmp_path / "e3"), target=target)
    prompts = [[1, 2], [7, 3, 9]]
    plain = sj.generate(target, prompts, max_new_tokens=16, eos_token_id=[])
    spec = sj.generate(target, prompts, max_new_tokens=16, draft=head, method="eagle3",
                       num_draft_tokens=3, eos_token_id=[])
    assert spec.tokens == plain.tokens and spec.stats["acceptance_rate"] > 0.0


def test_ragged_features_match_padded_and_crop_from_the_front(setup, tmp_path):
    """collect_features (broad-corpus shards, ragged, memory-mapped) stores exactly the hidden
    states collect_hidden pads; RaggedSet.take crops a long row from the front, keeping its
    answer and the features the full-length forward gave those positions; draft_vocab and
    per-domain subsets work on it."""
    target, data, work = setup
    aux = (0, 2)
    rows = [json.loads(line) for line in open(work / "corpus" / "corpus-00000.jsonl")]
    src = tmp_path / "answers-00000.jsonl.gz"  # distill's shard format
    with gzip.open(src, "wt") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps(dict(r, domain="ab"[i % 2], source=str(i),
                                    temperature=0.0)) + "\n")
    assert distill.shard_files(str(tmp_path)) == [str(src)]
    dirs = data_lib.collect_features(target, [str(src)], str(tmp_path / "feat"), aux_layers=aux,
                                     buckets=(16, 32), batch_tokens=96)
    padded = data_lib.load_hidden(data_lib.collect_hidden(
        target, str(work / "corpus"), str(tmp_path / "hid"), seq_len=32, batch_size=16,
        aux_layers=aux))
    ragged = data_lib.RaggedSet(dirs)
    assert len(ragged) == 48 and ragged.feature_size == 3 * 32
    idx = np.arange(48)
    tokens, lengths, hidden, plens = ragged.take(idx, 32)
    np.testing.assert_array_equal(tokens, padded["tokens"])
    np.testing.assert_array_equal(lengths, padded["lengths"])
    np.testing.assert_array_equal(plens, padded["prompt_lens"])
    valid = np.arange(32)[None, :] < lengths[:, None]
    np.testing.assert_allclose(hidden[valid].astype(np.float32),
                               padded["hidden"][valid].astype(np.float32), rtol=2e-3, atol=2e-3)
    t2, l2, h2, p2 = ragged.take(idx, 20)  # rows of 26..31 tokens lose their first tokens
    for i in range(48):
        n, cut = int(lengths[i]), max(0, int(lengths[i]) - 20)
        assert l2[i] == n - cut and p2[i] == max(int(plens[i]) - cut, 0)
        np.testing.assert_array_equal(t2[i, :n - cut], tokens[i, cut:n])
        np.testing.assert_array_equal(h2[i, :n - cut], hidden[i, cut:n])
    np.testing.assert_array_equal(data_lib.draft_vocab(ragged, 40, 64),
                                  data_lib.draft_vocab(padded, 40, 64))
    b = ragged.subset(ragged.domains == "b")
    assert len(b) == 24 and list(b.lengths) == list(lengths[1::2])


def test_distill_pre_encoded_prompts_round_trip_resume_and_budget(setup, tmp_path):
    """Prompts exported as a file answer into the same shards as prompts built in place; a spent
    budget starts no shard; a rerun skips finished shards."""
    target = setup[0]
    rng = np.random.RandomState(3)
    rows = [{"ids": rng.randint(0, 64, size=rng.randint(2, 9)).tolist(), "domain": f"d{i % 3}",
             "source": f"s{i}"} for i in range(10)]
    path = str(tmp_path / "prompts.npz")
    distill.save_prompts(path, rows)
    assert distill.load_prompts(path) == rows

    class Tok:
        eos_token_id = 63

    kw = dict(shard_size=4, batch_size=4, max_new_tokens=6, max_prompt_tokens=7)
    out = str(tmp_path / "corpus")
    assert distill.generate_corpus(target, Tok(), out, prompts=rows, budget_s=0.0, **kw) == []
    paths = distill.generate_corpus(target, Tok(), out, prompts=distill.load_prompts(path), **kw)
    assert [os.path.basename(p) for p in paths] == [f"answers-0000{i}.jsonl.gz" for i in range(3)]
    got = [r for p in paths for r in distill.read_rows(p)]
    kept = [r for r in rows if len(r["ids"]) <= 7]  # longer prompts are skipped
    assert sorted(r["source"] for r in got) == sorted(r["source"] for r in kept)
    for r in got:
        src = next(k for k in kept if k["source"] == r["source"])
        assert r["ids"][:r["prompt_len"]] == src["ids"] and r["domain"] == src["domain"]
        assert 0 < len(r["ids"]) - r["prompt_len"] <= 6
    stamp = os.path.getmtime(paths[0])
    assert distill.generate_corpus(target, Tok(), out, prompts=rows, budget_s=0.0, **kw) == paths
    assert os.path.getmtime(paths[0]) == stamp


def test_eagle3_head_reads_its_layers_from_wider_stored_features(setup, tmp_path):
    """The features ablation: features stored for layers (0, 1, 2) of the 2-layer target serve
    a head fusing any subset of them or the final hidden state (index L = 2 here is both: the
    state entering "layer 2" is the final pre-norm hidden state). The loss over the wide store
    equals the loss over features collected for exactly that head; an unstored layer is a
    ValueError naming it."""
    import dataclasses

    from specjax.train.pipeline import init_trainable_head

    target, data, work = setup
    wide = data_lib.load_hidden(data_lib.collect_hidden(
        target, str(work / "corpus"), str(work / "hidden-w"), seq_len=32, batch_size=16,
        aux_layers=(0, 1)))
    tc = trainer.TrainConfig(steps=1, batch_size=8, seq_len=32, rollout=2)
    b = slice(0, 8)
    for aux in [(2,), (1, 0)]:  # the final state (not in the aux blocks); a reordered subset
        hcfg = HeadConfig.for_target(target.config, "eagle3", aux_layers=aux)
        params = init_trainable_head(target, hcfg, 0)
        narrow = data_lib.load_hidden(data_lib.collect_hidden(
            target, str(work / "corpus"), str(work / f"hidden-{'_'.join(map(str, aux))}"),
            seq_len=32, batch_size=16, aux_layers=aux))
        args = (params, hcfg, target.params, target.config, data["tokens"][b], data["lengths"][b])
        got, _ = trainer.head_loss(*args, wide["hidden"][b], tc, data["prompt_lens"][b],
                                   stored_layers=(0, 1))
        want, _ = trainer.head_loss(*args, narrow["hidden"][b], tc, data["prompt_lens"][b])
        assert float(got) == float(want), aux
    # a head fusing only the final hidden state (aux L) saves in the reference layout (layer id
    # L - 1), loads back with it, and drafts losslessly
    from specjax.heads import Head
    from specjax.io.heads_io import save_eagle3

    hcfg = HeadConfig.for_target(target.config, "eagle3", aux_layers=(2,))
    save_eagle3(Head(init_trainable_head(target, hcfg, 0), hcfg), str(tmp_path / "last"))
    head = sj.load_draft(str(tmp_path / "last"), target=target)
    assert head.config.aux_layers == (2,)
    prompts = [[1, 2], [7, 3, 9]]
    plain = sj.generate(target, prompts, max_new_tokens=8, eos_token_id=[])
    spec = sj.generate(target, prompts, max_new_tokens=8, draft=head, method="eagle3",
                       num_draft_tokens=2, eos_token_id=[])
    assert spec.tokens == plain.tokens
    hcfg = HeadConfig.for_target(target.config, "eagle3", aux_layers=(1,))
    with pytest.raises(ValueError, match=r"need layers \[1\]"):
        trainer.feature_blocks(hcfg, 2, (0,))
    assert trainer.feature_blocks(dataclasses.replace(hcfg, aux_layers=(0, 1)), 2, None) == (1, 2)


def test_train_head_init_from_continues_a_saved_head(tmp_path):
    """``train_head(init_from=...)`` starts from a saved EAGLE-3 head (its params and draft
    vocabulary, in the reference layout it was saved in), not from the target's last layer:
    zero further steps give back the same head, a further run starts at the saved head's loss
    (far below a fresh start's), and a head of another kind, features or vocabulary size is a
    ValueError naming init_from."""
    import types

    from specjax.heads import default_aux_layers
    from specjax.train import pipeline

    target = tiny_model(5, vocab=64, hidden=32, layers=8, scale=0.5)
    rng = np.random.RandomState(1)
    prompts = [rng.randint(0, 64, size=rng.randint(2, 8)).tolist() for _ in range(32)]
    out = sj.generate(target, prompts, max_new_tokens=24, eos_token_id=[])
    os.makedirs(tmp_path / "corpus")
    with open(tmp_path / "corpus" / "corpus-00000.jsonl", "w") as f:
        for p, o in zip(prompts, out.tokens):
            f.write(json.dumps({"ids": p + o, "prompt_len": len(p)}) + "\n")
    work = str(tmp_path)
    data_lib.collect_hidden(target, str(tmp_path / "corpus"),
                            pipeline._hidden_dir(work, "train", default_aux_layers(8)),
                            seq_len=32, batch_size=16, aux_layers=default_aux_layers(8))
    tok = types.SimpleNamespace(eos_token_id=None)
    tc = trainer.TrainConfig(steps=40, batch_size=16, seq_len=32, lr=1e-2, warmup=5, log_every=1,
                             rollout=1)

    def train(out, run, init_from=None, **kw):
        kw = {"draft_vocab": 40, "tc": tc, **kw}
        pipeline.train_head(target, tok, work, str(tmp_path / out), "eagle3", True, kw.pop("tc"),
                            eval_prompts=0, run_name=run, init_from=init_from, **kw)
        return sj.load_draft(str(tmp_path / out), target=target)

    first = train("a", "run-a")
    assert first.config.draft_vocab_size == 40
    same = train("b", "run-b", str(tmp_path / "a"), tc=dataclasses.replace(tc, steps=0))
    for x, y in zip(jax.tree.leaves(first.params), jax.tree.leaves(same.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    train("c", "run-c", str(tmp_path / "a"), draft_vocab=0, tc=dataclasses.replace(tc, steps=3))
    fresh0, fresh_end = _first_last(tmp_path / "run-a" / "log.jsonl")
    cont0, _ = _first_last(tmp_path / "run-c" / "log.jsonl")
    assert fresh_end["cls"] < 0.8 * fresh0["cls"]  # the first run learned ...
    assert cont0["cls"] < 0.5 * (fresh0["cls"] + fresh_end["cls"])  # ... and the second kept it
    with pytest.raises(ValueError, match="init_from .* draft vocabulary of 40 tokens"):
        train("d", "run-d", str(tmp_path / "a"), draft_vocab=20)
    with pytest.raises(ValueError, match=r"init_from .* aux_layers=\(2, 4, 5\)"):
        train("d", "run-d", str(tmp_path / "a"), aux_layers=(8,))
    from specjax.heads import Head
    from specjax.io.heads_io import save_head

    mtp = HeadConfig.for_target(target.config, "mtp")
    save_head(Head(init_head(mtp, jax.random.key(0)), mtp), str(tmp_path / "mtp"))
    with pytest.raises(ValueError, match="init_from .* kind='mtp'; this run trains 'eagle3'"):
        train("d", "run-d", str(tmp_path / "mtp"))
