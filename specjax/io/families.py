"""Each model family's transformers-directory reader and MTP-layer reader, by family name.

The family records (``specjax.registry``) sit below this package and do not import it; the
readers live here, one ``{family name: function}`` table each, checked against the registry when
this module is imported (``registry.check_table``)::

    family     LOAD_HF                                    READ_MTP
    llama      io.hf.load_hf_dir (ModelConfig)            -
    qwen3_moe  io.hf.load_hf_dir (Qwen3MoeConfig)         -
    deepseek   io.deepseek_hf.load_hf_dir                 io.deepseek_hf.load_mtp_dir
    gemma3     io.gemma_io.load_hf_dir                    -

``load_hf_dir`` (``sj.load_model``) picks the reader by the directory's ``model_type``;
``read_mtp`` (``sj.load_draft``) reads the MTP head a target's own directory holds.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from specjax import registry
from specjax.config import ModelConfig, Qwen3MoeConfig
from specjax.io import deepseek_hf, gemma_io, hf


def _llama_reader(config_class):
    return lambda path, dtype: hf.load_hf_dir(path, np.dtype(dtype), config_class)


# (dir, dtype) -> (config, host or device params) for a transformers directory of the family
LOAD_HF = registry.check_table({
    "llama": _llama_reader(ModelConfig),
    "qwen3_moe": _llama_reader(Qwen3MoeConfig),
    "deepseek": deepseek_hf.load_hf_dir,
    "gemma3": gemma_io.load_hf_dir,
}, "load_hf")
# (dir, target Model) -> Head from the directory's own MTP layer; families without MTP layers
# have no entry
READ_MTP = registry.check_table({"deepseek": deepseek_hf.load_mtp_dir}, "read_mtp",
                                every_family=False)


def load_hf_dir(path: str, dtype=jnp.float32):
    """(config, params) from a transformers directory, through its model_type's family.

    Raises:
      ValueError: an unsupported ``model_type`` (the message names the supported ones).
    """
    hf_cfg = hf.read_config(path)
    fam = registry.family_for_model_type(hf_cfg.get("model_type"), hf_cfg.get("architectures"))
    return LOAD_HF[fam.name](path, dtype)


def read_mtp(path: str, target):
    """The MTP head stored in the target's own HF directory (DeepSeek-V3), or None when the
    target's family has no MTP layers or the directory holds none."""
    fam = registry.family_of(target.config)
    reader = READ_MTP.get(fam.name)
    if reader is None:
        return None
    hf_cfg = hf.read_config(path)
    if not (hf_cfg.get("num_nextn_predict_layers") or 0) \
            or hf_cfg.get("model_type") not in fam.model_types:
        return None
    return reader(path, target)
