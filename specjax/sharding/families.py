"""Each model family's rules for placing a loaded Model on a mesh, by family name.

The family records (``specjax.registry``) sit below this package and do not import it; the
rules live here, in one ``{family name: function}`` table checked against the registry when this
module is imported (``registry.check_table``: every family has an entry unless its record says
"sharding" is not supported yet)::

    family     SHARD                                           mesh
    llama      specs.shard_model (Megatron tp, KV heads lcm)   sharding.make_mesh (dp, tp)
    gemma3     specs.shard_model (the same; its extra norms     sharding.make_mesh (dp, tp)
               and per-head q/k norms replicated)
    deepseek   deepseek.param_specs + deepseek.shard            deepseek.make_mesh (tp, ep)
    qwen3_moe  -  (registry: no expert-parallel rules yet)

``shard`` is what ``sj.load_model(mesh=...)`` calls.
"""

from __future__ import annotations

import dataclasses

from specjax import deepseek, registry
from specjax.model import Model
from specjax.sharding.specs import shard_model


def _shard_deepseek(m: Model, mesh) -> Model:
    """On a ``deepseek.make_mesh`` (tp, ep) mesh: heads / MLP hidden over tp, experts over ep."""
    return dataclasses.replace(m, params=deepseek.shard(
        m.params, deepseek.param_specs(m.params, m.config, mesh), mesh))


# (Model, mesh) -> the Model placed on the mesh
SHARD = registry.check_table({"llama": shard_model, "gemma3": shard_model,
                              "deepseek": _shard_deepseek}, "sharding")


def shard(m: Model, mesh) -> Model:
    """A Model placed on ``mesh`` by its family's sharding rules.

    Raises:
      ValueError: the family has no sharding rules yet (the message names it and says why).
    """
    fam = registry.require(m.config, "sharding")
    return SHARD[fam.name](m, mesh)
