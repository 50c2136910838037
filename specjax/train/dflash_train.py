"""Training a DFlash block drafter on frozen target features (SpecForge's recipe).

Per sequence, ``anchors`` random positions a among the answer tokens (a >= prompt length, a + 1
< length); each block ``[tok[a], mask x (B-1)]`` at positions a..a+B-1 sees the context strictly
before a and its own block only (``dflash.train_logits``); cross-entropy on tok[a+k] for rows
k >= 1 (a + k < length), weighted exp(-(k-1)/gamma), normalised by the weights present.

Data: the broad distilled corpus (``specjax.train.distill`` shards under checkpoints/corpus)
through ``pipeline.prepare_broad``'s resumable feature collection; the features it stores (final
hidden states, then the states *entering* the aux layers) serve the drafter when its
``target_layer_ids`` are those aux layers minus one (the default, (1, 14, 26) on SmolLM2's 30
layers, is the EAGLE-3 heads' collection: one feature set for both). Training is
``trainer.fit`` (optax, orbax states every ``--save-every`` steps, tqdm on stderr): rerun the same
command to resume. ``--export DIR`` writes the newest state in the published layout.

    nice -n 15 python -m specjax.train.dflash_train --out /work/dflash_run --shards 4 \\
        --layers 1 --block-size 8 --steps 1500 [--export checkpoints/smollm2-dflash-b8-l1]
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

import jax
import jax.numpy as jnp

import specjax as sj
from specjax import dflash
from specjax.heads import default_aux_layers, llama_block_config
from specjax.io import dflash_io
from specjax.train import pipeline, trainer

logger = logging.getLogger(__name__)


def drafter_config(target_cfg, *, layers: int = 1, block_size: int = 8, mask_token_id: int = 16,
                   target_layer_ids: tuple | None = None) -> dflash.DFlashConfig:
    """A drafter with the target's widths (hidden, heads, head dim, MLP) and ``layers`` layers;
    ``target_layer_ids`` default: outputs of layers 1, L//2 - 1, L - 4 (the EAGLE-3 collection's
    states entering 2, L//2, L-3)."""
    if target_layer_ids is None:
        target_layer_ids = tuple(i - 1 for i in default_aux_layers(target_cfg.num_layers))
    tc = llama_block_config(target_cfg)  # a DeepSeek target has no Llama head_dim: E // H
    return dflash.DFlashConfig(
        num_layers=layers, hidden_size=tc.hidden_size, num_heads=tc.num_heads,
        num_kv_heads=tc.num_kv_heads, head_dim=tc.head_dim, intermediate_size=tc.intermediate_size,
        block_size=block_size, mask_token_id=mask_token_id,
        target_layer_ids=tuple(target_layer_ids), target_hidden_size=tc.hidden_size,
        vocab_size=tc.vocab_size, rms_norm_eps=tc.rms_norm_eps, rope_theta=tc.rope_theta,
        max_position_embeddings=tc.max_position_embeddings)


def sample_anchors(key, lengths, prompt_lens, seq_len: int, num: int):
    """``num`` distinct anchor positions per row among a in [prompt_len, length - 2] (Gumbel
    top-k). lengths, prompt_lens: [N] -> (anchors [N, num] int32, ok [N, num] bool: False where
    a row has fewer valid positions)."""
    pos = jnp.arange(seq_len)[None, :]
    valid = (pos >= prompt_lens[:, None]) & (pos + 1 < lengths[:, None])
    g = jax.random.gumbel(key, valid.shape)
    score = jnp.where(valid, g, -jnp.inf)
    top, idx = jax.lax.top_k(score, num)
    return idx.astype(jnp.int32), jnp.isfinite(top)


def dflash_loss(params, frozen, tokens, lengths, hidden, prompt_lens, *, cfg, target_cfg,
                anchors: int, gamma: float, seed: int):
    """(loss, metrics) of one batch (``trainer.fit``'s contract). hidden: [N, T, E + A*E]
    (final hidden states first, as ``collect_features`` stores them). Anchors are drawn from a
    key folded from the batch's tokens (deterministic per batch, different across batches).
    Metrics: loss, acc1 (first draft top-1), acc (all rows), tau (teacher-forced accepted length of a
    greedy chain over the block: 1 + sum_k prod_{j<=k} correct_j)."""
    n, t = tokens.shape
    bs = cfg.block_size
    feats = hidden[..., target_cfg.hidden_size:].astype(jnp.float32)
    mix = jnp.sum(tokens.astype(jnp.uint32) * (jnp.arange(t, dtype=jnp.uint32) + 1)[None])
    key = jax.random.fold_in(jax.random.key(seed), mix)
    anc, ok = sample_anchors(key, lengths, prompt_lens, t, anchors)
    logits = dflash.train_logits(params, cfg, frozen, target_cfg, tokens, feats, anc)
    k = jnp.arange(1, bs, dtype=jnp.int32)  # [B-1]
    tpos = anc[:, :, None] + k  # [N, M, B-1]
    tgt = jnp.take_along_axis(tokens, jnp.clip(tpos, 0, t - 1).reshape(n, -1), axis=1)
    tgt = tgt.reshape(tpos.shape)
    present = ok[:, :, None] & (tpos < lengths[:, None, None])
    lp = jax.nn.log_softmax(logits, axis=-1)
    ce = -jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0]
    w = jnp.exp(-(k - 1).astype(jnp.float32) / gamma) * present
    loss = jnp.sum(w * ce) / jnp.maximum(jnp.sum(w), 1.0)
    correct = (jnp.argmax(logits, axis=-1) == tgt) & present
    full = ok & present[:, :, -1]  # blocks with every row inside the sequence
    tau = 1.0 + jnp.sum(jnp.cumprod(correct, axis=-1), axis=-1)
    metrics = {"acc1": jnp.sum(correct[..., 0]) / jnp.maximum(jnp.sum(present[..., 0]), 1),
               "acc": jnp.sum(correct) / jnp.maximum(jnp.sum(present), 1),
               "tau": jnp.sum(tau * full) / jnp.maximum(jnp.sum(full), 1), "loss": loss}
    return loss, metrics


def export_head(params, cfg, target_cfg, out: str, dtype: str = "float16") -> None:
    """Writes the drafter in the published layout (``dflash_io.save_dflash``)."""
    dflash_io.save_dflash(dflash.DFlashHead(params=params, config=cfg), out,
                          num_target_layers=target_cfg.num_layers, dtype=dtype)


def train_drafter(target, cfg: dflash.DFlashConfig, train, held, tc: trainer.TrainConfig,
                  run_dir: str, *, anchors: int = 16, gamma: float | None = None,
                  eval_batches: int = 16, export: str | None = None, signature: dict | None = None,
                  deadline: float | None = None) -> dict:
    """Trains (or resumes) a DFlash drafter ``cfg`` on feature sets ``train`` / ``held``
    (``pipeline.prepare_broad``'s, holding ``cfg.aux_layers``) in ``run_dir``; writes
    ``held_out.json`` there and, with ``export``, the drafter in the published layout. gamma
    default: 7 for B >= 16, else 4. ``deadline``: ``trainer.fit``'s. Returns the held-out
    metrics (teacher-forced) with ``steps`` (those run)."""
    gamma = gamma if gamma is not None else (7.0 if cfg.block_size >= 16 else 4.0)
    loss = lambda *a: dflash_loss(*a, cfg=cfg, target_cfg=target.config,  # noqa: E731
                                  anchors=anchors, gamma=gamma, seed=tc.seed)
    params = dflash.init_params(cfg, jax.random.key(tc.seed))
    sig = {"kind": "dflash", "config": dataclasses.asdict(cfg), "anchors": anchors,
           "gamma": gamma, **(signature or {})}
    params = trainer.fit(loss, params, target.params, train, tc, run_dir,
                         describe=f"dflash B={cfg.block_size} L={cfg.num_layers}", signature=sig,
                         deadline=deadline)
    m = trainer.held_out_report(loss, params, target.params, held, tc, run_dir, eval_batches)
    if export:
        export_head(params, cfg, target.config, export)
        logger.info("exported the drafter to %s", export)
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
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--mask-token-id", type=int, default=16)
    p.add_argument("--target-layer-ids", default=None, help="e.g. 1,14,26 (layer outputs)")
    p.add_argument("--anchors", type=int, default=16, help="blocks per sequence")
    p.add_argument("--gamma", type=float, default=None, help="default 7 for B=16, 4 for B=8")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=320)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batches", type=int, default=16)
    p.add_argument("--export", default=None, help="write the trained drafter here (published layout)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S",
                        stream=sys.stderr)

    target = sj.load_model(args.model)
    ids = None if args.target_layer_ids is None else tuple(
        int(x) for x in args.target_layer_ids.split(","))
    cfg = drafter_config(target.config, layers=args.layers, block_size=args.block_size,
                         mask_token_id=args.mask_token_id, target_layer_ids=ids)
    cfg.check_target(target.config)
    work = args.features or os.path.join(args.out, "work")
    logger.info("features (%d train shards + held-out) under %s", args.shards, work)
    train, held = pipeline.prepare_broad(target, args.corpus, args.held_out_corpus, work,
                                         aux_layers=cfg.aux_layers, shards=args.shards)
    logger.info("%d train rows, %d held-out rows", len(train), len(held))
    tc = trainer.TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                             lr=args.lr, warmup=min(50, args.steps // 10), seed=args.seed,
                             save_every=args.save_every, log_every=10)
    train_drafter(target, cfg, train, held, tc, args.out, anchors=args.anchors, gamma=args.gamma,
                  eval_batches=args.eval_batches, export=args.export,
                  signature={"shards": args.shards, "model": args.model})
    return 0


if __name__ == "__main__":
    sys.exit(main())
