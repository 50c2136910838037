"""Training a P-EAGLE head on the frozen EAGLE-3 features (``specjax.peagle``).

Per batch, depth 0 is the EAGLE-3 objective at every head position j (fed (x_{j+1}, f_j),
predicting x_{j+2}); per sequence, ``anchors`` random head positions a among the answer carry
K-1 placeholder slots (``peagle.train_logits``: slot d sees head positions <= a and slots < d of
its own block) predicting x_{a+d+2}. Loss: cross-entropy on the corpus tokens (the target's own
regenerated answers), depth 0 averaged over the answer positions plus the slots' CE weighted
exp(-(d-1)/gamma), normalised by the weights present (the DFlash trainer's weighting,
``specjax.train.dflash_train``). With a reduced draft vocabulary the CE runs over it; target
tokens outside it are left out. Speculators trains with KL to the verifier's logits and COD
down-sampling of deep anchors; we do neither (see the module docstring of specjax.peagle).

Data and features: exactly the EAGLE-3 heads' (``pipeline.prepare_broad`` with the default aux
layers, shared through ``--features``); training is ``trainer.fit`` (orbax states, resumable:
rerun the same command). ``--init-from`` an EAGLE-3 head directory starts fc / midlayer / norms /
lm_head / draft vocabulary from it (mask_hidden starts at N(0, 1)).

    nice -n 19 python -m specjax.train.peagle_train --out /work/peagle_run --shards 4 \\
        --init-from checkpoints/smollm2-eagle3-broad74-gpu --depths 4 --steps 1500 \\
        [--export checkpoints/smollm2-peagle-k4]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

import jax
import jax.numpy as jnp

import specjax as sj
from specjax import heads, peagle
from specjax.heads import default_aux_layers
from specjax.train import pipeline, trainer
from specjax.train.dflash_train import sample_anchors

logger = logging.getLogger(__name__)


def _draft_index(vocab, v: int, tgt):
    """Target ids -> draft-vocabulary indices (-1 outside it); identity without a vocabulary."""
    if vocab is None:
        return tgt
    inv = jnp.full((v,), -1, jnp.int32).at[vocab].set(jnp.arange(vocab.shape[0], dtype=jnp.int32))
    return inv[tgt]


def _ce(logits, tgt):
    """CE and top-1 hit of logits [..., Vd] against indices tgt [...] (-1: absent -> 0)."""
    lp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(lp, jnp.maximum(tgt, 0)[..., None], axis=-1)[..., 0]
    return ce, jnp.argmax(logits, axis=-1) == tgt


def peagle_loss(params, frozen, tokens, lengths, hidden, prompt_lens, *, cfg, target_cfg,
                anchors: int, gamma: float, seed: int, stored_layers: tuple | None = None):
    """(loss, metrics) of one batch (``trainer.fit``'s contract). hidden: [N, T, E + S*E] (final
    hidden states, then the states entering ``stored_layers``, default cfg's aux layers).
    Metrics: loss, acc0 (depth-0 top-1 on answer positions), acc_d{d} per slot depth, tau (the
    teacher-forced accepted length of one pass: 1 + sum_k prod_{j<=k} correct_j over depth 0 at
    the anchor and its slots, blocks fully inside the sequence)."""
    n, t = tokens.shape
    e = target_cfg.hidden_size
    blocks = trainer.feature_blocks(cfg.head, target_cfg.num_layers, stored_layers)
    hidden = hidden.astype(jnp.float32)
    aux = jnp.concatenate([hidden[..., i * e:(i + 1) * e] for i in blocks], axis=-1)
    mix = jnp.sum(tokens.astype(jnp.uint32) * (jnp.arange(t, dtype=jnp.uint32) + 1)[None])
    key = jax.random.fold_in(jax.random.key(seed), mix)
    a1, ok = sample_anchors(key, lengths, prompt_lens, t, anchors)  # a1 in [plen, len-2]
    anc = jnp.maximum(a1 - 1, 0)  # head position a: depth 0 predicts x_{a+2} = x_{a1+1}
    ctx, blk = peagle.train_logits(params, cfg, frozen, target_cfg, tokens, aux, anc,
                                   compact=True)
    vocab = params.get("draft_vocab")
    v = target_cfg.vocab_size
    # depth 0 at every head position j: predicts tokens[j + 2]
    j = jnp.arange(t - 1)
    tgt0 = jnp.concatenate([tokens[:, 2:], jnp.zeros((n, 1), jnp.int32)], axis=1)
    idx0 = _draft_index(vocab, v, tgt0)
    pres0 = ((j[None] + 2 < lengths[:, None]) & (j[None] + 2 >= prompt_lens[:, None])
             & (idx0 >= 0))
    ce0, hit0 = _ce(ctx, idx0)
    # slots d = 1..K-1 of block a: predict tokens[a + d + 2]
    kd = blk.shape[2]
    d = jnp.arange(1, kd + 1, dtype=jnp.int32)
    tpos = anc[:, :, None] + d + 2  # [N, M, K-1]
    tgt = jnp.take_along_axis(tokens, jnp.clip(tpos, 0, t - 1).reshape(n, -1), axis=1)
    idx = _draft_index(vocab, v, tgt.reshape(tpos.shape))
    pres = ok[:, :, None] & (tpos < lengths[:, None, None]) & (idx >= 0)
    ce, hit = _ce(blk, idx)
    w = jnp.exp(-(d - 1).astype(jnp.float32) / gamma) * pres
    n0 = jnp.maximum(jnp.sum(pres0), 1)
    loss = jnp.sum(ce0 * pres0) / n0 + jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1.0)
    # tau over one pass: depth 0 at the anchor, then its slots
    first = jnp.take_along_axis(hit0 & pres0, anc, axis=1)  # [N, M]
    chain = jnp.concatenate([first[..., None], hit & pres], axis=-1)
    full = ok & pres[:, :, -1] & jnp.take_along_axis(pres0, anc, axis=1)
    tau = 1.0 + jnp.sum(jnp.cumprod(chain, axis=-1), axis=-1)
    metrics = {"loss": loss, "acc0": jnp.sum(hit0 & pres0) / n0,
               "tau": jnp.sum(tau * full) / jnp.maximum(jnp.sum(full), 1)}
    for i in range(kd):
        metrics[f"acc_d{i + 1}"] = (jnp.sum(hit[..., i] & pres[..., i])
                                    / jnp.maximum(jnp.sum(pres[..., i]), 1))
    return loss, metrics


def start_head(target, init_from: str | None, mask_token_id: int, depths: int, seed: int = 0):
    """The head a run starts from: ``init_from`` (an EAGLE-3 head directory / checkpoint, or a
    P-EAGLE head) or, without it, the target's last layer (``pipeline.init_trainable_head``)."""
    key = jax.random.key(seed)
    if init_from is None:
        hcfg = heads.HeadConfig.for_target(target.config, "eagle3")
        start = heads.Head(pipeline.init_trainable_head(target, hcfg, seed), hcfg)
    else:
        start = sj.load_draft(init_from, target=target)
        if isinstance(start, peagle.PEagleHead):
            return start
        if not isinstance(start, heads.Head) or start.config.kind != "eagle3":
            raise ValueError(f"init_from {init_from!r} is not an EAGLE-3 or P-EAGLE head")
    return peagle.from_eagle3(start, mask_token_id, depths, jax.random.fold_in(key, 7))


def train_head(target, head: peagle.PEagleHead, train, held, tc: trainer.TrainConfig,
               run_dir: str, *, anchors: int = 16, gamma: float = 4.0, eval_batches: int = 16,
               export: str | None = None, signature: dict | None = None,
               deadline: float | None = None) -> dict:
    """Trains (or resumes) the P-EAGLE ``head`` (its starting point: ``start_head``) on the
    EAGLE-3 feature sets ``train`` / ``held`` (default aux layers) in ``run_dir``; writes
    ``held_out.json`` there and, with ``export``, the head in speculators' layout.
    ``deadline``: ``trainer.fit``'s. Returns the held-out metrics with ``steps`` (those run)."""
    cfg = head.config
    stored = default_aux_layers(target.config.num_layers)
    trainer.feature_blocks(cfg.head, target.config.num_layers, stored)  # ValueError early
    vocab = head.params.get("draft_vocab")
    params = {k: v for k, v in head.params.items() if k != "draft_vocab"}

    def loss(p, *a):
        p = p if vocab is None else dict(p, draft_vocab=vocab)
        return peagle_loss(p, *a, cfg=cfg, target_cfg=target.config, anchors=anchors,
                           gamma=gamma, seed=tc.seed, stored_layers=stored)

    sig = {"kind": "peagle", "head": cfg.head.to_dict(), "mask_token_id": cfg.mask_token_id,
           "depths": cfg.num_depths, "anchors": anchors, "gamma": gamma, **(signature or {})}
    params = trainer.fit(loss, params, target.params, train, tc, run_dir,
                         describe=f"peagle K={cfg.num_depths}", signature=sig, deadline=deadline)
    m = trainer.held_out_report(loss, params, target.params, held, tc, run_dir, eval_batches)
    if export:
        from specjax.io import peagle_io
        trained = peagle.PEagleHead(params if vocab is None else dict(params, draft_vocab=vocab),
                                    cfg)
        peagle_io.save_peagle(trained, export, dtype="float16")
        logger.info("exported the head to %s", export)
    return m


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="run directory (features, states, log)")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--corpus", default="checkpoints/corpus/broad")
    p.add_argument("--held-out-corpus", default="checkpoints/corpus/broad-held-out")
    p.add_argument("--features", default=None,
                   help="feature directory (default OUT/work); shared with EAGLE-3 runs")
    p.add_argument("--shards", type=int, default=4, help="train shards used (data scale)")
    p.add_argument("--init-from", default=None, help="an EAGLE-3 (or P-EAGLE) head to start from")
    p.add_argument("--mask-token-id", type=int, default=16)
    p.add_argument("--depths", type=int, default=4, help="K: drafts per pass")
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
    p.add_argument("--gamma", type=float, default=4.0)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=320)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--export", default=None,
                   help="write the trained head here (speculators layout)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)

    target = sj.load_model(args.model)
    head = start_head(target, args.init_from, args.mask_token_id, args.depths, args.seed)
    cfg = head.config
    stored = default_aux_layers(target.config.num_layers)
    trainer.feature_blocks(cfg.head, target.config.num_layers, stored)  # ValueError early
    work = args.features or os.path.join(args.out, "work")
    logger.info("features (%d train shards + held-out) under %s", args.shards, work)
    train, held = pipeline.prepare_broad(target, args.corpus, args.held_out_corpus, work,
                                         aux_layers=stored, shards=args.shards)
    logger.info("%d train rows, %d held-out rows", len(train), len(held))
    tc = trainer.TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                             lr=args.lr, warmup=min(50, args.steps // 10), seed=args.seed,
                             save_every=args.save_every, log_every=10)
    train_head(target, head, train, held, tc, args.out, anchors=args.anchors, gamma=args.gamma,
               eval_batches=args.eval_batches, export=args.export,
               signature={"shards": args.shards, "model": args.model, "init_from": None
                          if args.init_from is None else os.path.abspath(args.init_from)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
