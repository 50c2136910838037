"""The attention core of a sharded program: per dp shard with shard-local page ids.

KV pages are split over ``dp``: each dp group holds only its rows' pages. ``ShardedAttention``
is an attention implementation for ``model.forward(..., attn_impl=...)`` (a frozen, hashable
value, so it is part of the jit cache key; nothing is read from a global while tracing): it runs
the K/V write + paged attention (``model.attention_core``) per dp shard in a ``shard_map`` over
``dp`` (``tp`` left to the SPMD partitioner) with shard-local page ids, so reading the cache needs
no communication, and pins each pool's layout. Contract: a row in dp group i only uses pages
``[i*P/dp, (i+1)*P/dp)`` (the contiguous page table that ``speculate.prefill`` builds satisfies
it; an allocator must keep one free list per dp group).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from specjax.sharding.specs import ShardingPlan, draft_kv_spec, is_head, kv_spec


def _per_dp_shard(core, mesh, q, k, v, k_pages, v_pages, page_table, cache_start, valid,
                  new_mask, *extra):
    """Runs the attention core on each dp shard's rows and pages, with shard-local page ids
    (``extra``: more [B, ...] row arrays for the core, e.g. Gemma 3's query positions)."""
    rows, pool = P("dp"), P(None, "dp")
    masks = () if new_mask is None else (new_mask,)

    def local(q, k, v, kp, vp, pt, cs, valid, *rest):
        first = lax.axis_index("dp") * kp.shape[1]  # this shard's first global page id
        pt = jnp.where(pt >= 0, pt - first, pt)  # -1 (unallocated) stays -1
        mask = rest[0] if masks else None
        return core(q, k, v, kp, vp, pt, cs, valid, mask, *rest[len(masks):])

    in_specs = (rows,) * 3 + (pool, pool) + (rows,) * (3 + len(masks) + len(extra))
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=(rows, pool, pool),
                         axis_names={"dp"}, check_vma=False)(
        q, k, v, k_pages, v_pages, page_table, cache_start, valid, *masks, *extra)


def pool_specs(plan: ShardingPlan, target_cfg, draft_cfg) -> tuple:
    """((layer config, pool spec), ...); a config used by two differently laid out models maps
    to None (its pools are then left to the partitioner between the pinned loop carries)."""
    specs = {target_cfg: kv_spec(target_cfg.num_kv_heads, plan.tp)}
    if draft_cfg is not None:
        dcfg = draft_cfg.layer if is_head(draft_cfg) else draft_cfg
        dspec = draft_kv_spec(draft_cfg, plan)
        specs[dcfg] = dspec if specs.get(dcfg, dspec) == dspec else None
    return tuple(specs.items())


@dataclasses.dataclass(frozen=True)
class ShardedAttention:
    """``attn_impl`` of a sharded program: ``impl`` ("reference" | "pallas") per dp shard.

    ``model.decoder_layer`` calls ``wrap(core, cfg)`` on its attention core (the protocol of a
    non-string attn_impl: ``.impl`` names the kernel, ``.wrap`` returns the core to run).
    """

    plan: ShardingPlan
    pool_specs: tuple = ()  # ((layer config, PartitionSpec | None), ...) from ``pool_specs``
    impl: str = "reference"

    @classmethod
    def for_models(cls, plan: ShardingPlan, target_cfg, draft_cfg=None, impl: str = "reference"):
        return cls(plan, pool_specs(plan, target_cfg, draft_cfg), impl)

    def wrap(self, core, cfg):
        """core(q, k, v, k_pages, v_pages, page_table, cache_start, valid, new_mask, *rows) run
        per dp shard, its pools pinned to the layer config's spec (``rows``: any further [B, ...]
        arguments of the family's core, split over dp with the batch)."""
        plan, spec = self.plan, dict(self.pool_specs).get(cfg)

        def run(q, k, v, k_pages, v_pages, page_table, cache_start, valid, new_mask, *rows):
            if plan.dp > 1:
                o, k_pages, v_pages = _per_dp_shard(core, plan.mesh, q, k, v, k_pages, v_pages,
                                                    page_table, cache_start, valid, new_mask,
                                                    *rows)
            else:
                o, k_pages, v_pages = core(q, k, v, k_pages, v_pages, page_table, cache_start,
                                           valid, new_mask, *rows)
            if spec is not None:
                k_pages = lax.with_sharding_constraint(k_pages, plan.sharding(spec))
                v_pages = lax.with_sharding_constraint(v_pages, plan.sharding(spec))
            return o, k_pages, v_pages
        return run
