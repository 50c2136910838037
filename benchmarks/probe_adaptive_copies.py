"""Counts whole-KV-pool copies per decoding step in the compiled fused loop, fixed k vs adaptive.

XLA (CPU, jax 0.10) copies buffers that flow through a ``lax.switch``/``lax.cond`` inside a
``while_loop`` body: an adaptive loop whose switch over k-variants took the KV pools as operands
copied every layer's K and V pool on every step (6 copies for this model), which a fixed-k loop
updates in place; specjax.control's loop-based branches now keep them in place (0). This
script compiles both loops for a tiny random model (XLA's HLO dump, after optimisations), finds
the decode ``while`` body and prints how many copies of a pool-shaped buffer each step makes:

    python benchmarks/probe_adaptive_copies.py

The count does not depend on model size; the bytes copied per step do (layers x 2 x pool size).
"""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import tempfile

CHILD = r"""
import jax, specjax as sj, sys
from specjax.config import ModelConfig
from specjax.model import init_params
cfg = ModelConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=16, tie_word_embeddings=True, max_position_embeddings=512)
t = sj.Model(init_params(cfg, jax.random.key(0)), cfg)
sj.generate(t, [[1, 2, 3, 4, 5]], max_new_tokens=32, draft=sj.early_exit_draft(t, 1), method="draft",
            num_draft_tokens=3, adaptive=sys.argv[1] == "1", eos_token_id=[])
"""


def _computations(text: str) -> dict:
    comps, name = {}, None
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?(%[\w.\-]+) ", line)
        if m and line.rstrip().endswith("{"):
            name = m.group(1)
            comps[name] = []
        elif name is not None:
            comps[name].append(line)
    return comps


def _entry_names(text: str) -> set:
    return set(re.findall(r"^ENTRY (%[\w.\-]+) ", text, flags=re.M))


def pool_copies_per_step(adaptive: bool) -> tuple[int, int]:
    """(copies of pool-shaped buffers in the decode while body and the computations it calls,
    copies in the body itself)."""
    with tempfile.TemporaryDirectory() as d:
        env = dict(os.environ, XLA_FLAGS=f"--xla_dump_to={d} --xla_dump_hlo_as_text "
                                         "--xla_dump_hlo_pass_re=NONE", JAX_PLATFORMS="cpu")
        subprocess.run([sys.executable, "-c", CHILD, "1" if adaptive else "0"], env=env, check=True,
                       capture_output=True)
        (path,) = glob.glob(os.path.join(d, "*jit__generate_device*after_optimizations.txt"))
        text = open(path).read()
    comps = _computations(text)
    pool = "f32[2,4,16,16]"  # [Hkv, pages, page_size, head_dim] of the tiny model
    # The decode loop: the while in the ENTRY computation whose body is largest (nested whiles,
    # e.g. specjax.control's branches, are followed from it below).
    entry = next(v for k, v in comps.items() if k in _entry_names(text))
    bodies = re.findall(r"while\([^)]*\), condition=(%[\w.\-]+), body=(%[\w.\-]+)",
                        "\n".join(entry))
    body = max((b for _, b in bodies), key=lambda b: len(comps.get(b, [])))

    def called(name, seen):
        if name in seen or name not in comps:
            return
        seen.add(name)
        for line in comps[name]:
            for callee in re.findall(r"(?:calls=|body=|to_apply=)(%[\w.\-]+)", line):
                called(callee, seen)
            m = re.search(r"branch_computations=\{([^}]*)\}", line)
            if m:
                for callee in m.group(1).split(","):
                    called(callee.strip(), seen)
    seen = set()
    called(body, seen)

    def n(name):
        return sum(1 for line in comps[name] if " copy(" in line and pool in line)
    return sum(n(c) for c in seen), n(body)


def main() -> None:
    for adaptive in (False, True):
        total, in_body = pool_copies_per_step(adaptive)
        print(f"{'adaptive' if adaptive else 'fixed k '}: pool copies in the decode loop body {in_body}, "
              f"including every branch it calls {total} (each branch runs only when taken)")


if __name__ == "__main__":
    main()
