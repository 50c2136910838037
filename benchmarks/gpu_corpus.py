"""One prepared GPU call: the broad corpus at scale, its features and an EAGLE-3 head, as files.

On the 2-core CPU the self-distilled corpus grows at ~73 answer tokens/s (checkpoints/README.md),
so issue 21's >= 2M answer tokens is ~8 CPU-hours before any training. On the H200 the same
pipeline (``specjax.train.distill`` -> ``pipeline.prepare_broad`` -> ``pipeline.train_head``) runs
in minutes: on 2026-12-04 ~9,100 answer tokens/s at batch 256 after a 72 s first shard, features of
74 shards (3.8M tokens) in 181 s, 1,000 head steps x 64 in 58 s (benchmarks/RESULTS.md).
Sections, each against the time budget (``benchmarks.gpu_check.Report``: a section that does not
fit is skipped, a failure is recorded with its traceback, the report is rewritten after every
section):

1. env       versions, device.
2. held_out  the held-out shards (``--held-out-shards``, the prompts of ``.gpucorpus/held_out.npz``).
3. corpus    train shards from ``--first-shard`` on (the committed CPU shards come before it),
             at batch ``--batch-size``, until ``--gen-budget-s``; ``corpus_new.tar`` under $OUT
             is written when the section ends (a later section's failure still brings them back).
4. features  target features of every shard (committed + new), the three EAGLE-3 layers.
5. train     an EAGLE-3 head (by default an 8,192-token draft vocabulary and the training-time
             test: 3 fed-back passes, decay 0.8; ``--rollout``, ``--lr``, ``--draft-vocab``) for
             ``--steps`` at ``--train-batch``, from scratch or ``--init-from`` a head checkpoint
             on the machine (fine-tune; its vocabulary kept); written in the reference layout and
             returned as ``head.tar.partN`` files of <= 15 MiB.
6. dflash    a DFlash block drafter (``specjax.train.dflash_train.train_drafter``: ``--dflash-layers``
             layers, block ``--dflash-block``, target layers 1/14/26) on the same features for
             ``--block-steps`` at ``--block-batch``, stopping at ``--block-budget-s`` (its state
             saved; the held-out metrics say how many steps ran); ``dflash.tar.partN``.
7. peagle    a P-EAGLE head (``specjax.train.peagle_train.train_head``, K = ``--peagle-depths``)
             started from the EAGLE-3 head of section 5 (or ``--init-from``), same budget rule;
             ``peagle.tar.partN``. ``--sections`` picks the sections to run, e.g.
             ``--sections features,dflash,peagle --gen-budget-s 0`` on the committed corpus.
8. arms      the ablation (``--arms``): shorter runs that each change one thing of the main
             recipe, e.g. ``--arms "mtp:kind=mtp;r1:rollout=1;data1x:shards=8;v32k:vocab=32768"``
             (keys: kind eagle3|mtp, rollout, shards = the first N train shards, vocab, steps;
             ``--arm-steps`` by default), each with its held-out top-1 per domain (teacher-forced)
             and, with ``--arm-accept-prompts`` N > 0, mean accepted length per domain at k=3
             from decoding N held-out prompts per domain (benchmarks/eval_domains.py). The main
             recipe at ``--arm-steps``, from scratch (no ``--init-from``), is the arms' baseline
             ("base").

Generation and features run with float32 matmuls at "highest" precision (no TF32), so answers
and features are those of the CPU inference path up to summation order; training uses the
default precision. Acceptance is then measured on the CPU (``benchmarks/eval_domains.py``;
acceptance counts do not depend on the machine's speed).

Why the prompts travel: the code prompts come from the running CPython's standard library, and
the GPU machine runs Python 3.12 (here 3.11), so built there the shards would hold other prompts.
``--prepare`` writes the train and held-out prompts pre-encoded (``distill.save_prompts``).

Here, before the calls (CPU)::

    python benchmarks/gpu_corpus.py --prepare     # .gpucorpus/ (git-ignored) + GGUF parts in .smol/
    # the tracked tree travels too and must leave room: --prepare says what to move aside

Then the calls it prints (the first stages GGUF parts, the last runs this script, ~9 minutes).
Back here::

    python benchmarks/gpu_corpus.py --unpack /work/.device/<files_at>   # shards + head + report

The CPU smoke test (tests/test_benchmarks.py) runs every section on a tiny random model.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import io
import json
import os
import shutil
import sys
import tarfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks import weights_transport  # noqa: E402
from benchmarks.gpu_check import Report, Skip, _tiny_model, sec_env  # noqa: E402

PREP_DIR = os.path.join(REPO, ".gpucorpus")
CORPUS = os.path.join(REPO, "checkpoints", "corpus", "broad")
HELD_OUT = os.path.join(REPO, "checkpoints", "corpus", "broad-held-out")
HEAD_OUT = os.path.join(REPO, "checkpoints", "smollm2-eagle3")
BLOCK_OUT = {"dflash": os.path.join(REPO, "checkpoints", "smollm2-dflash-gpu"),
             "peagle": os.path.join(REPO, "checkpoints", "smollm2-peagle-gpu")}
SECTIONS = ("held_out", "corpus", "features", "train", "dflash", "peagle", "arms")
PART_BYTES = 15 << 20
TREE_LIMIT_MIB = 64.0


def _tar(paths: list[str], dst: str) -> None:
    with tarfile.open(dst + ".tmp", "w") as t:
        for p in paths:
            t.add(p, arcname=os.path.basename(p))
    os.replace(dst + ".tmp", dst)


def prepare() -> None:
    """Writes .gpucorpus/{train,held_out}.npz (encoded prompts) and the GGUF parts, then prints
    the device calls."""
    from specjax.tokenizer import load_tokenizer  # noqa: PLC0415
    from specjax.train import distill  # noqa: PLC0415

    os.makedirs(PREP_DIR, exist_ok=True)
    tok = load_tokenizer("smollm2-135m")
    for split in ("train", "held_out"):
        path = os.path.join(PREP_DIR, f"{split}.npz")
        if not os.path.exists(path):
            distill.save_prompts(path, distill.encode_prompts(tok, split))
    prep_mib = sum(os.path.getsize(p) for p in glob.glob(os.path.join(PREP_DIR, "*"))) / 2**20
    tree_mib = weights_transport.tracked_bytes() / 2**20
    exclude = os.path.join(REPO, ".git", "info", "exclude")
    have = open(exclude).read() if os.path.exists(exclude) else ""
    if "/.gpucorpus/" not in have:
        with open(exclude, "a") as f:
            f.write("/.gpucorpus/\n")
    room = TREE_LIMIT_MIB - 4 - prep_mib - tree_mib
    print(f"tracked tree present: {tree_mib:.1f} MiB; prompts {prep_mib:.1f} MiB; room for GGUF "
          f"parts: {room:.1f} MiB per call")
    if room < 16:
        big = sorted(glob.glob(os.path.join(REPO, "checkpoints", "smollm2-*")))
        raise SystemExit("too little room in a device call: move shipped checkpoints aside for the "
                         "calls (they are not needed there) and rerun --prepare, e.g.\n  mkdir -p "
                         "/tmp/park && mv " + " ".join(os.path.relpath(b, REPO) for b in big)
                         + " /tmp/park/\n(and move them back afterwards: git status shows them deleted)")
    weights_transport.make_parts(max_tree_mib=TREE_LIMIT_MIB - 4 - prep_mib)
    print("For the last call add '.gpucorpus' to carry and run instead:\n  <install as above>"
          "PYTHONUNBUFFERED=1 python3 benchmarks/gpu_corpus.py --out $OUT")


def unpack(files_at: str) -> None:
    """Puts what a GPU run returned into the repository: new shards into checkpoints/corpus/,
    the head into checkpoints/smollm2-eagle3/ (with the run's report)."""
    for name, dst in (("held_out_new.tar", HELD_OUT), ("corpus_new.tar", CORPUS)):
        src = os.path.join(files_at, name)
        if os.path.exists(src):
            with tarfile.open(src) as t:
                names = [m for m in t.getnames() if not os.path.exists(os.path.join(dst, m))]
                t.extractall(dst, members=[t.getmember(m) for m in names])
            print(f"{dst}: {len(names)} new shards")
    for stem, dst in (("head", HEAD_OUT), *BLOCK_OUT.items()):
        parts = sorted(glob.glob(os.path.join(files_at, f"{stem}.tar.part*")),
                       key=lambda p: int(p.rsplit("part", 1)[1]))
        if parts:
            buf = io.BytesIO(b"".join(open(p, "rb").read() for p in parts))
            with tarfile.open(fileobj=buf) as t:
                t.extractall(dst)
            shutil.copy(os.path.join(files_at, "gpu_corpus.json"), os.path.join(dst, "gpu_run.json"))
            print(f"{dst}: {stem} from {len(parts)} parts")


ARM_KEYS = {"kind": str, "rollout": int, "shards": int, "vocab": int, "steps": int}


def parse_arms(spec: str) -> dict:
    """``"name:key=value,key=value;name2:..."`` -> {name: {key: value}} (see ARM_KEYS)."""
    arms = {}
    for part in filter(None, (x.strip() for x in spec.split(";"))):
        name, _, body = part.partition(":")
        if not name or name in arms:
            raise ValueError(f"--arms: every arm needs a new name before ':', got {part!r}")
        kw = {}
        for item in filter(None, body.split(",")):
            key, _, value = item.partition("=")
            if key not in ARM_KEYS:
                raise ValueError(f"--arms: unknown key {key!r} in arm {name!r} (keys: {sorted(ARM_KEYS)})")
            kw[key] = ARM_KEYS[key](value)
        if kw.get("kind", "eagle3") not in ("eagle3", "mtp"):
            raise ValueError(f"--arms: kind must be eagle3 or mtp, got {kw['kind']!r}")
        arms[name] = kw
    return arms


@dataclasses.dataclass(frozen=True)
class Plan:
    out: str
    first_shard: int
    held_out_shards: int
    batch_size: int
    gen_budget_s: float
    steps: int
    train_batch: int
    seq_len: int
    draft_vocab: int
    work: str
    arms: str = ""
    arm_steps: int = 500
    arm_accept_prompts: int = 4
    tiny: bool = False  # CPU smoke: a tiny random target, tiny prompt sets
    rollout: int = 3  # the main head's fed-back passes (training-time test); 1 = teacher-forced
    lr: float = 1e-3
    init_from: str | None = None  # the main head starts from this head checkpoint (fine-tune)
    sections: tuple[str, ...] = SECTIONS
    block_steps: int = 4000  # DFlash / P-EAGLE steps (each stops at block_budget_s)
    block_batch: int = 32
    block_budget_s: float = 150.0
    dflash_layers: int = 1
    dflash_block: int = 8
    peagle_depths: int = 4


def _target(plan: Plan, explicit: str | None):
    import jax.numpy as jnp  # noqa: PLC0415

    import specjax as sj  # noqa: PLC0415

    if plan.tiny:
        class Tok:
            eos_token_id = 63
        return _tiny_model(21, jnp.float32, vocab_size=64, num_layers=8), Tok(), "tiny random model"
    path, where = weights_transport.find_smollm2(explicit)
    if path is None:
        raise Skip(where)
    target = sj.load_model(path, dtype=jnp.float32)
    return dataclasses.replace(target, source="smollm2-135m"), sj.load_tokenizer(path), where


def _prompts(split: str, plan: Plan):
    from specjax.train import distill  # noqa: PLC0415

    if plan.tiny:
        import numpy as np  # noqa: PLC0415

        from specjax.train.prompts import DOMAINS  # noqa: PLC0415
        rng = np.random.RandomState(0 if split == "train" else 1)
        return [{"ids": rng.randint(0, 63, size=rng.randint(3, 9)).tolist(),
                 "domain": DOMAINS[i % 3], "source": f"{split}{i}"} for i in range(24)]
    path = os.path.join(PREP_DIR, f"{split}.npz")
    if not os.path.exists(path):
        raise Skip(f"{path} missing: run --prepare here and carry .gpucorpus")
    return distill.load_prompts(path)


def run(plan: Plan, budget_s: float, explicit_gguf: str | None) -> dict:
    import jax  # noqa: PLC0415

    from specjax.train import data as data_lib  # noqa: PLC0415
    from specjax.train import distill, pipeline, trainer  # noqa: PLC0415

    report = Report(plan.out, budget_s, name="gpu_corpus")
    report.data["plan"] = dataclasses.asdict(plan)
    report.section("env", sec_env, 0)
    state = {}
    corpus_dir = os.path.join(plan.work, "corpus")
    held_dir = os.path.join(plan.work, "held_out")
    gen = dict(batch_size=plan.batch_size, shard_size=8 if plan.tiny else 256,
               max_new_tokens=8 if plan.tiny else 192)

    def load():
        state["target"], state["tok"], where = _target(plan, explicit_gguf)
        return {"weights": where}

    def shards(split, src, dst, n, first, budget, tar_name):
        os.makedirs(dst, exist_ok=True)
        for p in distill.shard_files(src) if os.path.isdir(src) else []:
            if not os.path.exists(os.path.join(dst, os.path.basename(p))):
                shutil.copy(p, dst)
        have = set(os.listdir(dst))
        t0 = time.perf_counter()
        with jax.default_matmul_precision("highest"):
            paths = distill.generate_corpus(state["target"], state["tok"], dst, prompts=_prompts(split, plan),
                                            first_shard=first, num_shards=n, budget_s=budget, **gen)
        new = [p for p in paths if os.path.basename(p) not in have]
        dt = time.perf_counter() - t0
        rows = [r for p in new for r in distill.read_rows(p)]
        tokens = sum(len(r["ids"]) - r["prompt_len"] for r in rows)
        _tar(new, os.path.join(plan.out, tar_name))
        return {"new_shards": [os.path.basename(p) for p in new], "answers": len(rows),
                "answer_tokens": tokens, "seconds": dt, "answer_tokens_per_s": tokens / max(dt, 1e-9),
                "total_shards": len(distill.shard_files(dst))}

    def features():
        with jax.default_matmul_precision("highest"):
            train, held = pipeline.prepare_broad(state["target"], corpus_dir, held_dir, plan.work,
                                                 aux_layers=_aux(state["target"]))
        state["data"] = (train, held)
        return {"train_rows": len(train), "train_answer_tokens": int((train.lengths - train.prompt_lens).sum()),
                "held_out_rows": len(held)}

    def fit(name, kind="eagle3", rollout=None, shards=None, vocab=None, steps=None, init_from=None):
        steps = steps or plan.steps
        rollout = plan.rollout if rollout is None else rollout
        tc = trainer.TrainConfig(steps=steps, batch_size=plan.train_batch, seq_len=plan.seq_len,
                                 rollout=rollout, lr=plan.lr, rollout_decay=0.8 if kind == "eagle3" else 1.0,
                                 save_every=max(steps // 4, 1), log_every=max(steps // 50, 1))
        train, held = state["data"]
        if shards is not None:
            if not 1 <= shards <= len(train.dirs):
                raise ValueError(f"arm {name}: shards must be in [1, {len(train.dirs)}], got {shards}")
            train = data_lib.RaggedSet(train.dirs[:shards])
        head_dir = os.path.join(plan.work, name)
        rep = pipeline.train_head(state["target"], state["tok"], plan.work, head_dir, kind, True, tc,
                                  eval_prompts=0, draft_vocab=plan.draft_vocab if vocab is None else vocab,
                                  run_name=f"run-{name}", data=(train, held), init_from=init_from)
        return head_dir, rep

    def parts(src_dir, stem):
        """src_dir's files as OUT/<stem>.tar.partN of <= PART_BYTES; returns the bytes."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as t:
            for name in sorted(os.listdir(src_dir)):
                t.add(os.path.join(src_dir, name), arcname=name)
        blob = buf.getvalue()
        for i in range(0, len(blob), PART_BYTES):
            with open(os.path.join(plan.out, f"{stem}.tar.part{i // PART_BYTES}"), "wb") as f:
                f.write(blob[i:i + PART_BYTES])
        return len(blob)

    def train():
        head_dir, rep = fit("head", init_from=plan.init_from)
        state["head_dir"] = head_dir
        return {"report": rep, "head_bytes": parts(head_dir, "head")}

    def block_tc(lr):
        steps = 3 if plan.tiny else plan.block_steps
        return trainer.TrainConfig(steps=steps, batch_size=plan.train_batch if plan.tiny else plan.block_batch,
                                   seq_len=plan.seq_len, lr=lr, warmup=min(50, steps // 10),
                                   save_every=max(steps // 4, 1), log_every=max(steps // 50, 1))

    def deadline():  # leaves a minute of the budget for the held-out pass, export and parts
        return time.perf_counter() + max(5.0, min(plan.block_budget_s, report.left() - 60.0))

    def dflash_section():
        from specjax.train import dflash_train  # noqa: PLC0415
        target = state["target"]
        train, held = state["data"]
        cfg = dflash_train.drafter_config(target.config, layers=plan.dflash_layers,
                                          block_size=plan.dflash_block,
                                          mask_token_id=3 if plan.tiny else 16)
        tc, t0 = block_tc(6e-4), time.perf_counter()
        out = os.path.join(plan.work, "dflash")
        m = dflash_train.train_drafter(target, cfg, train, held, tc, os.path.join(plan.work, "run-dflash"),
                                       eval_batches=2 if plan.tiny else 16, export=out,
                                       deadline=deadline())
        return {"held_out": m, "seconds": time.perf_counter() - t0, "batch": tc.batch_size,
                "bytes": parts(out, "dflash")}

    def peagle_section():
        from specjax.train import peagle_train  # noqa: PLC0415
        target = state["target"]
        train, held = state["data"]
        start = plan.init_from or state.get("head_dir")
        head = peagle_train.start_head(target, start, 3 if plan.tiny else 16, plan.peagle_depths)
        tc, t0 = block_tc(3e-4), time.perf_counter()
        out = os.path.join(plan.work, "peagle")
        m = peagle_train.train_head(target, head, train, held, tc, os.path.join(plan.work, "run-peagle"),
                                    eval_batches=2 if plan.tiny else 16, export=out, deadline=deadline())
        return {"held_out": m, "init_from": start, "seconds": time.perf_counter() - t0,
                "batch": tc.batch_size, "bytes": parts(out, "peagle")}

    def arms():
        import specjax as sj  # noqa: PLC0415
        from benchmarks import eval_domains  # noqa: PLC0415

        results = {}
        held = _prompts("held_out", plan)
        for name, kw in {"base": {}, **parse_arms(plan.arms)}.items():
            if report.left() < (0 if plan.tiny else 45):
                results[name] = {"status": "skipped", "reason": f"{report.left():.0f}s left"}
                continue
            t0 = time.perf_counter()
            head_dir, rep = fit(f"arm-{name}", **{"steps": plan.arm_steps, **kw})
            res = {"config": kw, "held_out": rep["held_out"], "train_answer_tokens": rep["train_answer_tokens"]}
            if plan.arm_accept_prompts:
                head = sj.load_draft(head_dir, target=state["target"])
                with jax.default_matmul_precision("highest"):
                    acc = eval_domains.evaluate(state["target"], state["tok"], head,
                                                [("k=3", dict(method=head.config.kind, num_draft_tokens=3))],
                                                plan.arm_accept_prompts, 8 if plan.tiny else 64,
                                                encoded=held)["k=3"]
                res["accepted_length_k3"] = {d: v["mean_accepted_length"] for d, v in acc.items()}
                res["identical_to_plain"] = acc["all"]["identical_to_plain"]
            res["seconds"] = time.perf_counter() - t0
            results[name] = res
        return {"arms": results}

    gen_left = lambda: max(0.0, plan.gen_budget_s - (time.perf_counter() - report.t0))  # noqa: E731
    for name, fn, need in (
            ("load", load, 5),
            ("held_out", lambda: shards("held_out", HELD_OUT if not plan.tiny else "", held_dir,
                                        plan.held_out_shards, 0, None, "held_out_new.tar"), 20),
            ("corpus", lambda: shards("train", CORPUS if not plan.tiny else "", corpus_dir, None,
                                      plan.first_shard, gen_left(), "corpus_new.tar"), 30),
            ("features", features, 20),
            ("train", train, 30),
            ("dflash", dflash_section, 60),
            ("peagle", peagle_section, 60),
            ("arms", arms, 60)):
        if name != "load" and name not in plan.sections:
            continue
        res = report.section(name, fn, 0 if plan.tiny else need)
        if res["status"] != "ok":
            break
    report.write()
    return report.data


def _aux(target):
    from specjax.heads import default_aux_layers  # noqa: PLC0415
    return default_aux_layers(target.config.num_layers)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT", "runs/gpu_corpus"))
    ap.add_argument("--prepare", action="store_true", help="here: encoded prompts + GGUF parts")
    ap.add_argument("--unpack", default=None, metavar="FILES_AT", help="here: take a run's files in")
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny random model, every section, CPU")
    ap.add_argument("--work", default="/tmp/specjax-gpu-corpus")
    ap.add_argument("--first-shard", type=int, default=None,
                    help="first train shard to generate (default: after the committed ones)")
    ap.add_argument("--held-out-shards", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--gen-budget-s", type=float, default=300.0,
                    help="no corpus shard starts after this many seconds of the run")
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--train-batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--draft-vocab", type=int, default=8192,
                    help="the main head's draft vocabulary (0: the full vocabulary)")
    ap.add_argument("--rollout", type=int, default=3,
                    help="the main head's fed-back passes (1: teacher-forced only)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--init-from", default=None,
                    help="start the main head from this head checkpoint (its vocabulary too)")
    ap.add_argument("--arms", default="", help='ablation arms, e.g. "mtp:kind=mtp;r1:rollout=1" (see 6.)')
    ap.add_argument("--arm-steps", type=int, default=500)
    ap.add_argument("--arm-accept-prompts", type=int, default=4,
                    help="held-out prompts per domain decoded per arm (0: teacher-forced metrics only)")
    ap.add_argument("--sections", default=",".join(SECTIONS),
                    help="the sections to run, comma-separated (env and load always run)")
    ap.add_argument("--block-steps", type=int, default=4000, help="DFlash / P-EAGLE steps")
    ap.add_argument("--block-batch", type=int, default=32)
    ap.add_argument("--block-budget-s", type=float, default=150.0,
                    help="each block drafter stops after this many seconds (state saved)")
    ap.add_argument("--dflash-layers", type=int, default=1)
    ap.add_argument("--dflash-block", type=int, default=8)
    ap.add_argument("--peagle-depths", type=int, default=4)
    ap.add_argument("--budget-s", type=float, default=540.0)
    ap.add_argument("--smollm2-gguf", default=None)
    args = ap.parse_args(argv)
    try:
        parse_arms(args.arms)
    except ValueError as e:
        ap.error(str(e))
    sections = tuple(x.strip() for x in args.sections.split(",") if x.strip())
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        ap.error(f"--sections: unknown {unknown} (choose from {', '.join(SECTIONS)})")
    block = dict(sections=sections, dflash_layers=args.dflash_layers,
                 dflash_block=args.dflash_block, peagle_depths=args.peagle_depths)
    if args.prepare:
        prepare()
        return {}
    if args.unpack:
        unpack(args.unpack)
        return {}
    from specjax.train import distill  # noqa: PLC0415

    first = args.first_shard if args.first_shard is not None else len(distill.shard_files(CORPUS))
    if args.cpu_smoke:
        plan = Plan(out=args.out, first_shard=0, held_out_shards=1, batch_size=8, gen_budget_s=1e9,
                    steps=4, train_batch=4, seq_len=32, draft_vocab=32, work=args.work,
                    arms=args.arms or "mtp:kind=mtp,rollout=1;data1:shards=1", arm_steps=2,
                    arm_accept_prompts=1, tiny=True, **block)
    else:
        plan = Plan(out=args.out, first_shard=first, held_out_shards=args.held_out_shards,
                    batch_size=args.batch_size, gen_budget_s=args.gen_budget_s, steps=args.steps,
                    train_batch=args.train_batch, seq_len=args.seq_len, draft_vocab=args.draft_vocab,
                    work=args.work, arms=args.arms, arm_steps=args.arm_steps,
                    arm_accept_prompts=args.arm_accept_prompts, rollout=args.rollout, lr=args.lr,
                    init_from=args.init_from, block_steps=args.block_steps,
                    block_batch=args.block_batch, block_budget_s=args.block_budget_s, **block)
    data = run(plan, args.budget_s, args.smollm2_gguf)
    print(open(os.path.join(args.out, "gpu_corpus.md")).read())
    return data


if __name__ == "__main__":
    main()
