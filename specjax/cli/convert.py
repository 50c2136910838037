"""``specjax convert``: HF dir / GGUF / name -> specjax checkpoint, or a model / draft -> HF dir."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import specjax as sj
from specjax.cli import _common as C
from specjax.io.checkpoint import save_checkpoint
from specjax.io.heads_io import save_eagle3, save_head
from specjax.io.hf import save_hf_dir


def add_parser(sub) -> None:
    cv = sub.add_parser(
        "convert", help="HF dir / GGUF / name -> specjax checkpoint, or a model/draft -> HF dir",
        description="--to specjax (default): load SRC (a transformers dir, .gguf, or built-in name) "
                    "and save a specjax checkpoint (orbax). --to hf: save SRC as a transformers "
                    "LlamaForCausalLM directory (float32 safetensors + config.json, plus the "
                    "tokenizer when SRC has one); with --target, SRC is a draft LLM checkpoint "
                    "for that target (its shared embedding and lm_head are filled in), so "
                    "transformers can use it as assistant_model=; an EAGLE-3 head (a "
                    "specjax-trained one or a reference directory) with --target is written in "
                    "the reference EAGLE-3 layout (vLLM / SGLang load it), or as a specjax head "
                    "checkpoint with --to specjax.")
    cv.add_argument("src")
    cv.add_argument("out")
    cv.add_argument("--to", choices=["specjax", "hf"], default="specjax")
    cv.add_argument("--target", default=None, help="the target a draft checkpoint belongs to")
    cv.add_argument("--tokenizer", default=None, help="tokenizer to export with --to hf")
    cv.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                    help="parameter dtype of a specjax checkpoint (default: %(default)s)")
    cv.add_argument("--json", default=None, nargs="?", const="-", metavar="PATH")
    cv.add_argument("--no-progress", dest="progress", action="store_false")
    cv.set_defaults(run=run)


def run(args) -> int:
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[args.dtype]
    with C.bar(2, "convert", args.progress) as bar:
        bar.set_postfix_str(f"loading {args.src}")
        if args.target:
            target = sj.load_model(args.target)
            model = sj.load_draft(args.src, target=target)
            if not isinstance(model, sj.Model) and args.to == "hf" and model.config.kind != "eagle3":
                raise ValueError(f"{args.src!r} is a {model.config.kind} head, not a model: heads "
                                 "have no transformers model class (see "
                                 "specjax.io.heads_io.save_mtp_deepseek for DeepSeek MTP names; "
                                 "EAGLE-3 heads convert to their reference layout)")
        else:
            model = sj.load_model(args.src, dtype=dtype)
        bar.update(1)
        bar.set_postfix_str(f"writing {args.out}")
        if not isinstance(model, sj.Model):  # a head: EAGLE-3 reference layout or ours
            if args.to == "hf":
                if args.dtype == "bfloat16":
                    raise ValueError("--dtype: an EAGLE-3 head is written as float32 or float16")
                save_eagle3(model, args.out, dtype=args.dtype)
            else:
                save_head(model, args.out)
        elif args.to == "hf":
            save_hf_dir(model.params, model.config, args.out)
            _save_hf_tokenizer(args.tokenizer or args.target or args.src, args.out)
        else:
            save_checkpoint(args.out, model.params, model.config, kind="model",
                            extra={"converted_from": args.src})
        bar.update(1)
    layers = model.config.num_layers if isinstance(model, sj.Model) else 1
    info = {"src": args.src, "out": args.out, "to": args.to, "layers": layers,
            "params": int(sum(int(np.prod(a.shape)) for a in jax.tree.leaves(model.params)))}
    if args.json:
        C.write_json(info, args.json)
    else:
        kind = "transformers directory" if args.to == "hf" else "specjax checkpoint"
        print(f"wrote {args.out} ({kind}, {info['layers']} layers, "
              f"{info['params'] / 1e6:.1f}M parameters)")
    return 0


def _save_hf_tokenizer(name: str, out: str) -> None:
    """Writes tokenizer.json + tokenizer_config.json next to an exported model, when the source
    has a tokenizer (so transformers' AutoTokenizer loads the directory as well)."""
    try:
        tok = sj.load_tokenizer(name)
    except Exception:  # noqa: BLE001 - a draft checkpoint has no tokenizer of its own
        return
    tok.save(out)
