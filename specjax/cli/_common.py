"""Flag helpers shared by the ``specjax`` commands: the speculation flags (one table, translated
by ``specjax.options.spec_from_options``), model loading with the recommended draft, progress
bars and JSON output."""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import time

from tqdm.auto import tqdm

import specjax as sj
from specjax import shipped
from specjax.config import ADAPTIVE_SIGNALS, ATTN_IMPLS, METHODS, SpecConfig
from specjax.heads import default_aux_layers
from specjax.options import spec_from_options
from specjax.train import pipeline, trainer
from specjax.tree import TreeConfig

_SPEC = SpecConfig()
_TREE = TreeConfig()

# The speculation flags: (flag names, option of spec_from_options, argparse settings). Every
# default is None (unset): spec_from_options fills it from checkpoints/fastest.json when the
# recommended draft is used, else from SpecConfig / TreeConfig (whose values the help quotes).
SPEC_FLAGS = (
    (("-k", "--num-draft-tokens"), "num_draft_tokens",
     dict(type=int, help="draft length k (default: the measured-fastest k of checkpoints/"
                         "fastest.json with the shipped draft, else "
                         "specjax.config.default_num_draft_tokens: 1 for mtp, 3 for ngram, "
                         f"{_SPEC.num_draft_tokens} otherwise)")),
    (("--draft-sampling",), "draft_sampling",
     dict(action="store_const", const=True,
          help="sample drafts from the draft distribution (default: argmax drafts)")),
    (("--adaptive",), "adaptive",
     dict(nargs="?", const="history", choices=ADAPTIVE_SIGNALS,
          help="pick k in 0..k on device every step (k = 0: a plain step) from the recent "
               "acceptance ('history', the default) or from each step's drafts ('confidence': "
               "the drafter's calibrated confidence, model drafters only), with a cost model "
               "measured at warm-up")),
    (("--ngram-min",), "ngram_min",
     dict(type=int, help=f"n-gram lookup: shortest suffix match (default {_SPEC.ngram_min})")),
    (("--ngram-max",), "ngram_max",
     dict(type=int, help=f"n-gram lookup: longest suffix match (default {_SPEC.ngram_max})")),
    (("--hybrid-min",), "hybrid_min",
     dict(type=int, help="with a draft/head: rows with an n-gram match this long draft by lookup "
                         f"(0 = off; default: the measured-fastest setting, else "
                         f"{_SPEC.hybrid_min})")),
    (("--tree-depth",), "tree_depth",
     dict(type=int, help=f"eagle-tree: draft levels (default: the measured-fastest tree, else "
                         f"{_TREE.depth})")),
    (("--tree-top-k",), "tree_top_k",
     dict(type=int, help="eagle-tree: children per expanded node and nodes expanded per level "
                         f"(default: the measured-fastest tree, else {_TREE.top_k})")),
    (("--tree-nodes",), "tree_nodes",
     dict(type=int, help="eagle-tree: nodes kept, the target verifies nodes + 1 tokens (default: "
                         f"the measured-fastest tree, else {_TREE.num_nodes})")),
    (("--attn-impl",), "attn_impl",
     dict(choices=ATTN_IMPLS, help=f"attention implementation (default {_SPEC.attn_impl})")),
    (("--page-size",), "page_size",
     dict(type=int, help=f"KV-cache page size in tokens (default {_SPEC.page_size})")),
)


CLI_METHODS = tuple(m for m in METHODS if m != "custom")  # "custom" takes a Python Drafter


def add_spec_flags(p, methods=CLI_METHODS) -> None:
    """--method, --draft and the SPEC_FLAGS table (all unset by default)."""
    p.add_argument("--draft", default=None,
                   help="draft path: a draft LLM or MTP/EAGLE head checkpoint, or any model path "
                        "(default: the measured-fastest shipped draft of checkpoints/fastest.json, "
                        "else the best shipped draft in checkpoints/: MTP, EAGLE, draft LLM; else "
                        "n-gram lookup (--method draft: an untrained early-exit draft)")
    p.add_argument("--method", choices=methods, default=None,
                   help="none = plain decoding; eagle-tree = a head drafting an EAGLE-2 dynamic "
                        "tree (--tree-*); ngram = prompt lookup (no draft model, --ngram-*); "
                        "default: the measured-fastest configuration (checkpoints/fastest.json), "
                        "else the best shipped draft's method")
    for names, dest, kw in SPEC_FLAGS:
        p.add_argument(*names, dest=dest, default=None, **kw)


def spec_options(args, method=None) -> dict:
    """The spec_from_options options of the parsed flags (method: ``args.method`` unless given)."""
    opts = {dest: getattr(args, dest) for _, dest, _ in SPEC_FLAGS}
    signal = opts.pop("adaptive")
    opts.update(adaptive=None if signal is None else True, adaptive_by=signal,
                method=method or args.method)
    return opts


def add_model_flags(p) -> None:
    p.add_argument("--model", default="smollm2-135m",
                   help="target: 'smollm2-135m' (built in), a transformers dir, a .gguf or a "
                        "specjax checkpoint (default: %(default)s)")
    p.add_argument("--tokenizer", default=None, help="tokenizer (default: same as --model)")
    p.add_argument("--activations", default="float32", choices=("float32", "int8"),
                   help="GGUF targets on CPU: 'int8' multiplies the file's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q6_K blocks "
                        "with 8-bit inputs and integer dots (llama.cpp's arithmetic: faster, "
                        "logits within ~1e-3, text may differ from the exact 'float32' path; "
                        "default: %(default)s)")


def add_sampling_flags(p) -> None:
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, nargs="?", const="-", metavar="PATH",
                   help="JSON output on stdout (or to PATH) instead of text")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bars on stderr")


@dataclasses.dataclass
class Loaded:
    """A command's models and speculation: ``spec`` is ``spec_from_options(options, rec)``,
    ``rec`` the fastest.json entry used (or None)."""

    target: sj.Model
    tok: object
    draft: object
    spec: SpecConfig
    draft_name: str | None
    options: dict
    rec: dict | None


def check_spec_flags(args) -> None:
    """Fails on contradictory speculation flags before anything is loaded (when --method is
    given: without it the method comes with the draft)."""
    if args.method is not None:
        spec_from_options(spec_options(args))


def load(args) -> Loaded:
    """Loads --model / --tokenizer and the draft, and builds the SpecConfig of the flags.

    With no --draft (and --method not "none" / "ngram"): the measured-fastest configuration of
    checkpoints/fastest.json when it applies to the target and --method, else the best shipped
    draft (``shipped.default_draft``)."""
    check_spec_flags(args)
    t0 = time.perf_counter()
    target = sj.load_model(args.model, activations=args.activations)
    tok = sj.load_tokenizer(args.tokenizer or args.model)
    method, draft, draft_name, rec = args.method, None, None, None
    if method == "ngram" and not args.draft:
        draft_name = "n-gram lookup (no draft model)"
    elif method != "none":
        if args.draft:
            draft, draft_name = sj.load_draft(args.draft, target=target), args.draft
            method = method or ("draft" if isinstance(draft, sj.Model)
                                else getattr(draft.config, "kind", "dflash"))
        elif (rec := shipped.recommended(target, method)) is not None:
            draft = sj.load_draft(shipped.path(rec["draft"]), target=target)
            draft_name, method = f"checkpoints/{rec['draft']}", rec["method"]
        else:
            draft, draft_name, method = shipped.default_draft(target, method)
    options = spec_options(args, method)
    spec = spec_from_options(options, rec)
    log(f"loaded {args.model} ({target.config.num_layers} layers) in "
        f"{time.perf_counter() - t0:.1f}s" + (f"; draft: {draft_name}" if draft_name else ""))
    return Loaded(target, tok, draft, spec, draft_name, options, rec)


def encode_prompts(tok, chat_texts, raw_texts, chat: bool = True) -> tuple[list, list]:
    """(texts, token ids) of the prompts a command runs: ``chat_texts`` as user turns through the
    tokenizer's chat template, or, when ``chat`` is off or the tokenizer has none (a base model
    such as gemma3-270m), ``raw_texts`` as plain text with the tokenizer's special tokens
    (Gemma's BOS)."""
    if chat and tok.chat_template is None:
        log("the tokenizer has no chat template (a base model): prompts run as raw text to "
            "continue")
        chat = False
    if chat:
        return list(chat_texts), [tok.apply_chat_template([{"role": "user", "content": t}])
                                  for t in chat_texts]
    return list(raw_texts), [tok.encode(t, add_special_tokens=True) for t in raw_texts]


def describe(spec: SpecConfig) -> str:
    """k=4, or the tree's shape."""
    tc = spec.tree
    if tc is not None:
        return f"tree depth {tc.depth}, top-k {tc.top_k}, {tc.num_nodes} nodes"
    return f"k={spec.k}"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def bar(total: int, desc: str, enabled: bool = True):
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled,
                bar_format="{desc}: {n}/{total} [{elapsed}] {postfix}")


def write_json(obj, dest: str | None) -> None:
    """dest "-" = stdout, else a file path."""
    text = json.dumps(obj, indent=2, default=float)
    if dest in (None, "-"):
        print(text)
    else:
        with open(dest, "w") as f:
            f.write(text + "\n")
        log(f"wrote {dest}")


def add_train_flags(p) -> None:
    """The flags train-head and train-draft share."""
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--work", default="data/smollm2", help="corpus, hidden states and run state")
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument("--num-prompts", type=int, default=768, help="self-distilled train answers")
    p.add_argument("--num-wiki", type=int, default=2048, help="wiki extracts framed as answers")
    p.add_argument("--held-out-prompts", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=128)
    # None: the recipe of the kind trained (TRAIN_DEFAULTS); block drafters train longer sequences
    # in smaller batches at a lower rate than the MTP / EAGLE heads
    p.add_argument("--seq-len", type=int, default=None, help="default 256 (320 for dflash/peagle)")
    p.add_argument("--steps", type=int, default=None, help="default 400 (1500 for dflash/peagle)")
    p.add_argument("--batch-size", type=int, default=None, help="default 8 (4 for dflash/peagle)")
    p.add_argument("--lr", type=float, default=None,
                   help="default 1e-3 (6e-4 for dflash, 3e-4 for peagle)")
    p.add_argument("--rollout", type=int, default=None,
                   help="heads: training passes fed the head's own previous output (EAGLE-3-style "
                        "training-time test; 1 = teacher-forced only; default 3 for eagle3, else 1)")
    p.add_argument("--loss-on", choices=("answer", "all"), default="answer",
                   help="positions trained and scored: answer tokens only (default) or every "
                        "position including the chat template / system prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-prompts", type=int, default=8)
    p.add_argument("--run-name", default=None,
                   help="run directory under --work (resumed when it exists; default from the kind)")


# the recipe defaults of the shared training flags, per kind (the block drafters' are their
# trainers' own: specjax.train.dflash_train / peagle_train)
TRAIN_DEFAULTS = {"seq_len": 256, "steps": 400, "batch_size": 8, "lr": 1e-3}
BLOCK_TRAIN_DEFAULTS = {"dflash": {"seq_len": 320, "steps": 1500, "batch_size": 4, "lr": 6e-4},
                        "peagle": {"seq_len": 320, "steps": 1500, "batch_size": 4, "lr": 3e-4}}


def resolve_train_defaults(args) -> None:
    """Fills the shared training flags left unset with the recipe of ``args.kind``."""
    defaults = BLOCK_TRAIN_DEFAULTS.get(getattr(args, "kind", None), TRAIN_DEFAULTS)
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def prepare_training(args):
    """Builds (or resumes) the training data of train-head / train-draft: (target, tok,
    TrainConfig, the pipeline module)."""
    # Stage and resume messages of the training pipeline go to stderr, timestamped.
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s",
                        datefmt="%H:%M:%S", stream=sys.stderr)
    resolve_train_defaults(args)
    target = sj.load_model(args.model)
    tok = sj.load_tokenizer(args.model)
    eagle3 = getattr(args, "kind", None) == "eagle3"
    aux = default_aux_layers(target.config.num_layers) if eagle3 else ()
    args.data = None
    if getattr(args, "corpus", None):
        if not args.held_out_corpus:
            raise ValueError("--corpus needs --held-out-corpus (distill --split held_out)")
        # the three EAGLE-3 layers are stored for every head kind (others read the final
        # hidden states, the first E features), so one feature collection serves all kinds
        args.data = pipeline.prepare_broad(target, args.corpus, args.held_out_corpus, args.work,
                                           aux_layers=default_aux_layers(target.config.num_layers),
                                           shards=args.shards)
    else:
        pipeline.prepare(target, tok, args.work, args.num_prompts, args.num_wiki,
                         args.held_out_prompts, args.answer_tokens, args.seq_len, aux_layers=aux)
    rollout = args.rollout if args.rollout is not None else (3 if eagle3 else 1)
    decay = getattr(args, "rollout_decay", None)
    tc = trainer.TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len,
                             lr=args.lr, seed=args.seed, rollout=rollout,
                             rollout_decay=decay if decay is not None else (0.8 if eagle3 else 1.0),
                             answer_only=args.loss_on == "answer")
    return target, tok, tc, pipeline
