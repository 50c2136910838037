"""Tensor- and data-parallel sharding of the fused speculative loop (JAX SPMD, one program).

A ``Mesh`` has two axes: ``dp`` splits the batch (independent sequences, each dp group an
independent replica of the decode loop) and ``tp`` splits each model's tensors (Megatron style).
``generate_device`` runs ``speculate.prefill`` + ``speculate.decode_loop`` under ``jax.jit`` with
one layout for weights, caches and batch state for the whole ``lax.while_loop``, so the loop
never reshards. The package, one concept per module (imports run top to bottom only)::

    specs          mesh, ShardingPlan, partition specs (the layout table), placement
    dp_attention   ShardedAttention: the attn_impl of a sharded program (attention per dp
                   shard with shard-local page ids, pools pinned); explicit, no global
    distributed    multi-process setup (public jax.distributed) and a cross-process barrier
    hlo            collectives of a compiled program, in-loop or not
    programs       generate_device / lower_generate / place_inputs, teacher-forced logits
    families       each model family's placement rules (``families.shard``: load_model(mesh=))

Collectives per fused step (read from the compiled HLO; the table in docs/sharding.md):
per target layer two all-reduces of [B/dp, T, E] (after wo and w_down) plus one for the
vocab-parallel embedding lookup; argmax over the vocab-split logits all-gathers one (value,
index) pair per tp shard; the loop condition and the all-greedy test reduce a few [B/dp]
vectors / scalars over dp. None moves a weight or a page pool.

Draft on the leader rank: SPEC's draft-target schedule runs the draft only on one device of the
TP group. Inside one SPMD program every device runs the same program over the same buffers, so
"one device only" cannot live in the fused loop; the replicated draft gives the same latency
there (the other devices would otherwise wait for the draft tokens) at the cost of its weights
and cache on each device. ``draft_placement="leader"`` places the draft on ``leader_device`` for
host-driven steps; ``generate_device`` rejects it with that explanation.

Expert parallelism for MoE families (an ``ep`` axis, all-to-all dispatch) lives with the MoE
dispatch in ``specjax.moe``.
"""

from specjax.sharding.distributed import barrier, initialize_distributed
from specjax.sharding.dp_attention import ShardedAttention, pool_specs
from specjax.sharding.hlo import Collective, collectives
from specjax.sharding.programs import generate_device, logits, lower_generate, place_inputs
from specjax.sharding.specs import (AXES, PLACEMENTS, ShardingPlan, as_plan, check_family,
                                    check_tp,
                                    constrain_state, draft_kv_spec, draft_specs, head_specs,
                                    is_head, kv_heads_for, kv_spec, layer_specs, make_mesh,
                                    model_specs, place, prepare, put, repeat_kv_heads,
                                    replicated_specs, shard_draft, shard_model, sharded_configs,
                                    state_specs)

__all__ = [
    "AXES", "PLACEMENTS", "Collective", "ShardedAttention", "ShardingPlan", "as_plan", "barrier",
    "check_family", "check_tp", "collectives", "constrain_state", "draft_kv_spec", "draft_specs",
    "generate_device", "head_specs", "initialize_distributed", "is_head", "kv_heads_for",
    "kv_spec", "layer_specs", "logits", "lower_generate", "make_mesh", "model_specs", "place",
    "place_inputs", "pool_specs", "prepare", "put", "repeat_kv_heads", "replicated_specs",
    "shard_draft", "shard_model", "sharded_configs", "state_specs",
]
