"""Training MTP/EAGLE heads and small draft LLMs on precomputed target hidden states (optax).

Heads: head position j gets (x_{j+1}, f_j) and is trained so that its output h'_j matches the
target's next hidden state h_{j+1} (SmoothL1, in the space the head feeds back on: RMS-normalised
for MTP heads, post-norm features for EAGLE-1) and its logits (through the shared, frozen lm_head)
match the target's next-token distribution softmax(lm_head(h_{j+1})) (soft cross-entropy).
EAGLE-3 heads drop the feature regression (their fused features live in no target space) and
learn from the soft cross-entropy alone, through EAGLE-3's training-time test: ``rollout`` passes
fed the head's own outputs, pass r weighted ``rollout_decay ** r``.
Draft LLMs: KL to the target's next-token distribution at every position, with the target's
embedding, final norm and lm_head shared and frozen.

Runs are resumable: an orbax ``CheckpointManager`` under ``run_dir/states`` saves params +
optimizer state every ``save_every`` steps and at the end (the newest two are kept; older runs'
``state-<step>`` / ``state.npz`` still resume); ``run_dir/log.jsonl`` has one line per logged
step and a tqdm bar shows progress on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from specjax import heads, kv_cache
from specjax.model import forward, lm_head, rms_norm
from specjax.train import data as data_lib

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 400
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup: int = 20
    weight_decay: float = 0.0
    reg_weight: float = 1.0  # SmoothL1 on hidden states (heads only)
    cls_weight: float = 0.1  # soft CE on next-token distribution (heads)
    grad_clip: float = 0.5
    rollout: int = 1  # heads: passes fed their own previous output (1 = teacher-forced only)
    rollout_decay: float = 1.0  # loss weight of rollout pass r is rollout_decay ** r (EAGLE-3: 0.8)
    answer_only: bool = True  # loss/metrics only where the predicted token is past the prompt
    seed: int = 0
    save_every: int = 50
    log_every: int = 10


def _paged(b, t, cfg):
    return (*kv_cache.init_contiguous(cfg, b, t),
            jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)))


def _smooth_l1(x, y):
    d = jnp.abs(x - y)
    return jnp.mean(jnp.where(d < 1.0, 0.5 * d * d, d - 0.5), axis=-1)


def _loss_mask(t, offset, lengths, prompt_lens, tc: TrainConfig):
    """[B, t] float mask of the positions j that predict token index j + offset from a teacher
    (the target's distribution at index j + offset - 1) inside the sequence, and, with
    ``tc.answer_only`` and prompt_lens given, whose predicted token is part of the answer
    (index >= prompt_len): the chat template and system prompt repeat across samples and would
    inflate top-1 while teaching the draft nothing it meets when drafting answers."""
    idx = jnp.arange(t)[None, :] + offset
    mask = idx - 1 < lengths[:, None]
    if tc.answer_only and prompt_lens is not None:
        mask &= idx >= prompt_lens[:, None]
    return mask.astype(jnp.float32)


def feature_blocks(head_cfg: heads.HeadConfig, num_layers: int,
                   stored_layers: tuple | None) -> tuple[int, ...]:
    """Which E-wide blocks of stored features an EAGLE-3 head reads, in its ``aux_layers`` order.

    Stored features are [final hidden, states entering ``stored_layers``...] (block 0 = the
    final pre-norm hidden state = the state "entering" layer ``num_layers``); ``stored_layers``
    None means they are exactly ``head_cfg.aux_layers``. ValueError when a layer is not stored."""
    stored = head_cfg.aux_layers if stored_layers is None else tuple(stored_layers)
    where = {num_layers: 0, **{int(i): 1 + j for j, i in enumerate(stored)}}
    missing = [i for i in head_cfg.aux_layers if i not in where]
    if missing:
        raise ValueError(f"head aux_layers {head_cfg.aux_layers} need layers {missing}, not in the "
                         f"stored features (final = {num_layers}, stored {stored})")
    return tuple(where[i] for i in head_cfg.aux_layers)


def head_loss(head_params, head_cfg: heads.HeadConfig, tp, tcfg, tokens, lengths, hidden,
              tc: TrainConfig, prompt_lens=None, *, exact_top1: bool = False,
              stored_layers: tuple | None = None):
    """Head loss on one batch. tp/tcfg: the target's params and config; tokens [B, T],
    lengths [B], hidden [B, T, E] (EAGLE-3: [B, T, E + S*E], the final hidden states followed by
    the states entering ``stored_layers`` (default: exactly ``head_cfg.aux_layers``), see
    data.collect_hidden; the head reads the blocks of its own ``aux_layers``, ``feature_blocks``),
    prompt_lens [B] (optional; see ``_loss_mask``).

    Pass 1 is teacher-forced: head position j sees (x_{j+1}, f_j). With ``tc.rollout`` = R > 1,
    pass r feeds position j the head's own pass-(r-1) output at j-1 in place of f_j, the input it
    gets when drafting its r-th token (the feature it was trained to predict); gradients flow
    through the fed-back features. The loss is the passes' mean weighted ``tc.rollout_decay ** r``; metrics report pass 1 (and
    ``top1_r{R}`` for the last pass). Unlike inference, the earlier positions of pass r also use
    fed-back features (their cached K/V would come from the target's features).

    With a reduced draft vocabulary (``head_params["draft_vocab"]``, [Vd]) the soft CE runs over
    the Vd tokens against the target's distribution renormalised to them (the head cannot propose
    anything else), at Vd/V of the output projection's cost; ``top1`` then is agreement within
    the subset unless ``exact_top1`` (the full-vocabulary teacher's argmax: what greedy
    acceptance sees; one more V-wide projection, for evaluation).
    """
    b, t = tokens.shape
    hidden = hidden.astype(jnp.float32)
    eagle3 = head_cfg.kind == "eagle3"
    e = tcfg.hidden_size
    aux = (jnp.concatenate([hidden[:, :-1, i * e:(i + 1) * e] for i in
                            feature_blocks(head_cfg, tcfg.num_layers, stored_layers)], axis=-1)
           if eagle3 else None)
    hidden = hidden[..., :tcfg.hidden_size]
    feats = heads.head_features(head_params, head_cfg, tp, tcfg, hidden[:, :-1], aux)  # f_j
    h_next = hidden[:, 1:]  # h_{j+1}
    vocab = head_params.get("draft_vocab")
    if vocab is None:
        teacher = jax.lax.stop_gradient(lm_head(tp, tcfg, h_next))  # predicts x_{j+2}
        want = jnp.argmax(teacher, -1)
    else:
        # [B, T-1, Vd]: the target's logits on the subset
        teacher = jax.lax.stop_gradient(heads.target_logits(tp, tcfg, h_next, vocab))
        want = (jnp.argmax(lm_head(tp, tcfg, h_next), -1) if exact_top1
                else jnp.take(vocab, jnp.argmax(teacher, -1)))
    teacher_p = jax.nn.softmax(teacher, -1)  # soft cross-entropy targets
    kv, pt, pos = _paged(b, t - 1, head_cfg.layer)
    mask = _loss_mask(t - 1, 2, lengths, prompt_lens, tc)  # head position j predicts x_{j+2}
    denom = jnp.maximum(mask.sum(), 1.0)
    if head_cfg.norms:
        reg_target = rms_norm(h_next, jnp.ones(h_next.shape[-1]), 1e-6)
    else:
        reg_target = heads.head_features(head_params, head_cfg, tp, tcfg, h_next)
    total, metrics = 0.0, {}
    weights = [tc.rollout_decay ** r for r in range(max(tc.rollout, 1))]
    for r, weight in enumerate(weights):
        hh, _ = heads.head_forward(head_params, head_cfg, tp, tokens[:, 1:], feats, pos, kv,
                                   pt, jnp.zeros((b,), jnp.int32), jnp.maximum(lengths - 1, 1))
        logits = heads.head_logits(head_params, head_cfg, tp, tcfg, hh, compact=True)
        got = jnp.argmax(logits, -1) if vocab is None else jnp.take(vocab, jnp.argmax(logits, -1))
        out = rms_norm(hh, jnp.ones(hh.shape[-1]), 1e-6) if head_cfg.norms else hh
        reg = 0.0 if eagle3 else (_smooth_l1(out, reg_target) * mask).sum() / denom
        cls = (optax.softmax_cross_entropy(logits, teacher_p) * mask).sum() / denom
        top1 = ((got == want) * mask).sum() / denom
        # EAGLE-3: the cross-entropy is the whole objective (cls_weight scales only a mix)
        total = total + weight * (cls if eagle3 else tc.reg_weight * reg + tc.cls_weight * cls)
        if r == 0:
            metrics = {"reg": reg, "cls": cls, "top1": top1}
        elif r == tc.rollout - 1:
            metrics[f"top1_r{r + 1}"] = top1
        # next pass: position j is fed the head's output at j - 1 (position 0 keeps f_0)
        feats = jnp.concatenate([feats[:, :1], hh[:, :-1].astype(feats.dtype)], axis=1)
    return total / sum(weights), metrics


def draft_loss(trainable, tp, tcfg, cfg, tokens, lengths, hidden, tc: TrainConfig,
               prompt_lens=None):
    """KL(target || draft) of next-token distributions at every valid position (answer positions
    only with ``tc.answer_only``). The draft uses the target's embedding and lm_head (from tp)
    with its own layers and final norm."""
    params = dict({k: v for k, v in tp.items() if k not in ("layers", "norm")}, **trainable)
    b, t = tokens.shape
    kv, pt, pos = _paged(b, t, cfg)
    logits, _, _ = forward(params, cfg, tokens, pos, kv, pt, jnp.zeros((b,), jnp.int32), lengths)
    teacher = jax.lax.stop_gradient(lm_head(tp, tcfg, hidden.astype(jnp.float32)))
    kl = optax.losses.kl_divergence_with_log_targets(jax.nn.log_softmax(logits, -1),
                                                     jax.nn.log_softmax(teacher, -1))
    mask = _loss_mask(t, 1, lengths, prompt_lens, tc)  # position t predicts x_{t+1}
    denom = jnp.maximum(mask.sum(), 1.0)
    kl = (kl * mask).sum() / denom
    top1 = ((jnp.argmax(logits, -1) == jnp.argmax(teacher, -1)) * mask).sum() / denom
    return kl, {"kl": kl, "top1": top1}


def _optimizer(tc: TrainConfig):
    sched = optax.warmup_cosine_decay_schedule(0.0, tc.lr, tc.warmup, max(tc.steps, tc.warmup + 1),
                                               tc.lr * 0.05)
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip),
                       optax.adamw(sched, weight_decay=tc.weight_decay))


STATES = "states"  # run_dir/states/<step>: orbax CheckpointManager steps
_KEEP = 2  # newest checkpoints kept
_LEGACY_STATE = re.compile(r"^state-(\d{8})$")  # hand-rotated orbax states of older runs


def _manager(run_dir: str, create: bool = True):
    """The run's orbax ``CheckpointManager`` (synchronous saves, newest ``_KEEP`` kept; orbax
    finalises a step by renaming its temporary directory, so an interrupted save leaves the
    previous one intact)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 - orbax (~1 s) only when saving or loading

    opts = ocp.CheckpointManagerOptions(max_to_keep=_KEEP, create=create,
                                        enable_async_checkpointing=False)
    return ocp.CheckpointManager(os.path.abspath(os.path.join(run_dir, STATES)), options=opts)


def _leaves(tree) -> dict:
    return {f"l{i:04d}": np.asarray(x) for i, x in enumerate(jax.tree.leaves(tree))}


def _save_state(run_dir: str, tree, step: int) -> None:
    """Writes params + optimizer state as step ``step`` of the run's CheckpointManager."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 - orbax (~1 s) only when saving or loading

    with _manager(run_dir) as mngr:
        mngr.save(step, args=ocp.args.StandardSave({"leaves": _leaves(tree)}), force=True)


def _has_state(run_dir: str) -> bool:
    return (os.path.isdir(os.path.join(run_dir, STATES))
            or any(_LEGACY_STATE.match(n) for n in os.listdir(run_dir))
            or os.path.exists(os.path.join(run_dir, "state.npz")))


def _load_legacy(run_dir: str, n: int):
    """(leaves, step) of the newest state a run from before the CheckpointManager wrote: an
    orbax ``state-<step>`` directory or a ``state.npz``; None if there is neither."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 - orbax (~1 s) only when saving or loading

    names = sorted(name for name in os.listdir(run_dir) if _LEGACY_STATE.match(name))
    if names:
        with ocp.PyTreeCheckpointer() as ckptr:
            z = ckptr.restore(os.path.abspath(os.path.join(run_dir, names[-1])))
        return [z["leaves"][f"l{i:04d}"] for i in range(n)], int(z["step"])
    if os.path.exists(os.path.join(run_dir, "state.npz")):
        z = np.load(os.path.join(run_dir, "state.npz"))
        return [z[f"l{i}"] for i in range(n)], int(z["step"])
    return None


def _load_state(run_dir: str, template):
    """(tree shaped like ``template``, step) from the newest state in run_dir, or None (also
    reads the states of runs written before the CheckpointManager)."""
    import orbax.checkpoint as ocp  # noqa: PLC0415 - orbax (~1 s) only when saving or loading

    n = len(jax.tree.leaves(template))
    found = None
    if os.path.isdir(os.path.join(run_dir, STATES)):
        with _manager(run_dir, create=False) as mngr:
            step = mngr.latest_step()
            if step is not None:
                z = mngr.restore(step, args=ocp.args.StandardRestore({"leaves": _leaves(template)}))
                found = [z["leaves"][f"l{i:04d}"] for i in range(n)], int(step)
    if found is None and os.path.isdir(run_dir):
        found = _load_legacy(run_dir, n)
    if found is None:
        return None
    leaves, step = found
    return jax.tree.unflatten(jax.tree.structure(template), [jnp.asarray(x) for x in leaves]), step


def _batches(data, tc: TrainConfig, start_step: int):
    n = len(data) if isinstance(data, data_lib.RaggedSet) else len(data["tokens"])
    rng = np.random.RandomState(tc.seed)
    order = np.concatenate([rng.permutation(n) for _ in range(tc.steps * tc.batch_size // n + 2)])
    for step in range(start_step, tc.steps):
        idx = order[step * tc.batch_size:(step + 1) * tc.batch_size]
        yield step, data_lib.take(data, idx, tc.seq_len)


_RESUME_FREE = ("steps", "save_every", "log_every")  # may change between a run and its resume


def _check_resume(run_dir: str, tc: TrainConfig, signature: dict | None):
    """Writes run_dir/run.json on a fresh run; on resume, ValueError if the training config or
    ``signature`` (what is trained, on how much data) differs from the run being resumed."""
    meta = {"train_config": {k: v for k, v in dataclasses.asdict(tc).items() if k not in _RESUME_FREE},
            "signature": signature or {}}
    meta = json.loads(json.dumps(meta))  # tuples -> lists, as read back
    path = os.path.join(run_dir, "run.json")
    if not os.path.exists(path):
        if not _has_state(run_dir):
            with open(path, "w") as f:
                json.dump(meta, f, indent=2)
        return  # (a run from before run.json existed resumes unchecked)
    with open(path) as f:
        old = json.load(f)
    diff = [f"{group}.{k}" for group in meta for k in set(meta[group]) | set(old.get(group, {}))
            if meta[group].get(k) != old.get(group, {}).get(k)]
    if diff:
        raise ValueError(f"{run_dir} holds a run with different {', '.join(sorted(diff))}: "
                         "pick another run directory (--run-name) or delete it to start over")


def fit(loss_fn, trainable, frozen, data, tc: TrainConfig, run_dir: str, describe: str = "",
        signature: dict | None = None, progress: bool = True, deadline: float | None = None):
    """Generic resumable optax loop.

    loss_fn(trainable, frozen, tokens, lengths, hidden, prompt_lens) -> (loss, metrics). ``frozen``
    (the target's params) is a jit argument, never a closure constant (XLA would fold 100+ MB of
    it). Resuming checks that ``tc`` (all but steps / save_every / log_every) and ``signature``
    match the run in ``run_dir``. ``progress``: a tqdm bar (rate, ETA, latest metrics) on stderr.
    ``deadline`` (a ``time.perf_counter()`` value): no step starts after it; the state is saved
    where the run stopped (rerun to go on; the schedule is still the one of ``tc.steps``).
    """
    os.makedirs(run_dir, exist_ok=True)
    _check_resume(run_dir, tc, signature)
    opt = _optimizer(tc)
    opt_state = opt.init(trainable)
    start = 0
    loaded = _load_state(run_dir, (trainable, opt_state))
    if loaded is not None:
        (trainable, opt_state), start = loaded
        logger.info("resuming %s at step %d", run_dir, start)

    @jax.jit
    def update(trainable, opt_state, frozen, tokens, lengths, hidden, prompt_lens):
        (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, frozen, tokens, lengths, hidden, prompt_lens)
        updates, opt_state = opt.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates), opt_state, dict(metrics, loss=loss)

    t0 = time.perf_counter()
    log = open(os.path.join(run_dir, "log.jsonl"), "a")
    bar = tqdm(total=tc.steps, initial=start, desc=describe or "train", unit="step",
               file=sys.stderr, disable=not progress)
    step = start
    for step, (tokens, lengths, hidden, plens) in _batches(data, tc, start):
        trainable, opt_state, m = update(trainable, opt_state, frozen, jnp.asarray(tokens),
                                         jnp.asarray(lengths), jnp.asarray(hidden), jnp.asarray(plens))
        bar.update(1)
        if (step + 1) % tc.log_every == 0 or step == start:
            m = {k: float(v) for k, v in m.items()}
            bar.set_postfix({k: f"{v:.4f}" for k, v in m.items()}, refresh=False)
            log.write(json.dumps(dict(step=step + 1, time=time.perf_counter() - t0, **m)) + "\n")
            log.flush()
        if (step + 1) % tc.save_every == 0:
            _save_state(run_dir, (trainable, opt_state), step + 1)
        if deadline is not None and time.perf_counter() >= deadline and step + 1 < tc.steps:
            logger.info("%s: deadline reached after step %d of %d", run_dir, step + 1, tc.steps)
            if (step + 1) % tc.save_every:
                _save_state(run_dir, (trainable, opt_state), step + 1)
            break
    else:
        if tc.steps > start and tc.steps % tc.save_every:  # the last steps since a periodic save
            _save_state(run_dir, (trainable, opt_state), tc.steps)
    bar.close()
    log.close()
    return trainable


def held_out_report(loss_fn, trainable, frozen, held, tc: TrainConfig, run_dir: str,
                    max_batches: int) -> dict:
    """``evaluate`` on the held-out set plus ``steps`` (the newest saved state's), logged and
    written to ``run_dir/held_out.json``; returns it."""
    m = evaluate(loss_fn, trainable, frozen, held, batch_size=tc.batch_size, seq_len=tc.seq_len,
                 max_batches=max_batches)
    m = {"steps": last_step(run_dir), **m}
    logger.info("held-out (teacher-forced, %d batches): %s", max_batches,
                {k: round(v, 4) for k, v in m.items()})
    with open(os.path.join(run_dir, "held_out.json"), "w") as f:
        json.dump(m, f, indent=2)
    return m


def last_step(run_dir: str) -> int:
    """The step of the newest saved state in ``run_dir`` (0 when none)."""
    if not os.path.isdir(os.path.join(run_dir, STATES)):
        return 0
    with _manager(run_dir, create=False) as mngr:
        step = mngr.latest_step()
    return 0 if step is None else int(step)


def evaluate(loss_fn, trainable, frozen, data, batch_size=8, seq_len=256, max_batches=None):
    """Mean metrics over a held-out hidden-state set (teacher-forced, inference forward)."""
    fn = jax.jit(loss_fn)
    n = len(data) if isinstance(data, data_lib.RaggedSet) else len(data["tokens"])
    sums, count = {}, 0
    for i, b0 in enumerate(range(0, n - batch_size + 1, batch_size)):
        if max_batches is not None and i >= max_batches:
            break
        batch = data_lib.take(data, np.arange(b0, b0 + batch_size), seq_len)
        _, m = fn(trainable, frozen, *map(jnp.asarray, batch))
        for k, v in m.items():
            sums[k] = sums.get(k, 0.0) + float(v)
        count += 1
    return {k: v / max(count, 1) for k, v in sums.items()}
