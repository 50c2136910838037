"""Host overhead of structured outputs in the engine: per-step time with grammar masks vs without.

One engine (speculation on), B concurrent requests, twice: free (no constraint, ``max_tokens``
tokens each) and constrained (a JSON schema). Reported per run: engine steps, wall time per step,
and for the constrained run the host time building the masks and the time blocked reading the
drafts between propose and verify (the extra sync of a split step), both per step, from
``Engine.stats()``. The machine's load average (``os.getloadavg``) is printed beside the numbers.

    python benchmarks/bench_structured.py --model tiny              # random 2-layer target, SmolLM2 tokenizer
    python benchmarks/bench_structured.py --model smollm2-135m --draft-layers 8

Timings on a shared / contended machine are not performance results.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax

import specjax as sj
from specjax.config import ModelConfig, SpecConfig
from specjax.engine import Engine, EngineConfig, RequestParams
from specjax.model import Model, init_params
from specjax.provenance import with_provenance
from specjax.structured import Constraint

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                  "maxItems": 4},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}


def load(name: str):
    tok = sj.load_tokenizer("smollm2-135m")
    if name == "tiny":
        cfg = ModelConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_layers=2,
                          num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=512,
                          eos_token_id=2)
        return Model(init_params(cfg, jax.random.key(0), scale=0.3), cfg), tok
    return sj.load_model(name), tok


def run(engine, tok, batch: int, max_tokens: int, constraint) -> dict:
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe person {i} as "
                                         "JSON with name, age, tags and ok."}])
               for i in range(batch)]
    s0 = engine.stats()
    t0 = time.perf_counter()
    handles = [engine.submit(p, RequestParams(max_tokens=max_tokens, constraint=constraint,
                                              stop_token_ids=None if constraint else ()))
               for p in prompts]
    engine.run()
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    steps = s1["engine_steps"] - s0["engine_steps"]
    ss = s1["structured_steps"] - s0["structured_steps"]
    texts = [tok.decode(h.result()) for h in handles]
    valid = 0
    for t in texts:
        try:
            json.loads(t)
            valid += 1
        except ValueError:
            pass
    return {"mode": "json_schema" if constraint else "free", "steps": steps,
            "tokens": sum(len(h.result()) for h in handles), "wall_s": wall,
            "ms_per_step": 1e3 * wall / max(steps, 1),
            "mask_ms_per_step": 1e3 * (s1["grammar_mask_time_s"] - s0["grammar_mask_time_s"])
            / max(ss, 1),
            "sync_ms_per_step": 1e3 * (s1["grammar_sync_time_s"] - s0["grammar_sync_time_s"])
            / max(ss, 1),
            "valid_json": f"{valid}/{len(texts)}" if constraint else "-",
            "mean_accepted_length": s1.get("spec_accept_length")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--draft-layers", type=int, default=1, help="early-exit draft depth")
    ap.add_argument("-k", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the rows (with provenance) here")
    args = ap.parse_args()
    target, tok = load(args.model)
    draft = sj.early_exit_draft(target, args.draft_layers)
    spec = SpecConfig(method="draft", num_draft_tokens=args.k)
    engine = Engine(target, draft, EngineConfig(spec, max_slots=args.batch,
                                                batch_buckets=(args.batch,), token_buckets=(64,),
                                                max_model_len=256), tokenizer=tok)
    engine.warmup(structured=True)
    c = Constraint.json_schema(SCHEMA)
    run(engine, tok, args.batch, 8, c)  # first compile of the grammar, matchers
    print(f"model {args.model}, method draft (early exit {args.draft_layers}), k {args.k}, "
          f"batch {args.batch}, max_tokens {args.max_tokens}, device {jax.devices()[0].platform}")
    rows = []
    for _ in range(args.repeats):
        for constraint in (None, c):
            r = run(engine, tok, args.batch, args.max_tokens, constraint)
            rows.append({**r, "loadavg": [round(x, 2) for x in os.getloadavg()]})
            print(json.dumps(rows[-1]))
    if args.json:
        result = {"model": args.model, "draft_layers": args.draft_layers, "k": args.k,
                  "batch": args.batch, "max_tokens": args.max_tokens, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(with_provenance(result), f, indent=2)


if __name__ == "__main__":
    main()
