"""Model and draft file readers and writers: GGUF (re-exported here), transformers directories
(``hf``), DeepSeek state dicts (``deepseek_hf``), draft heads (``heads_io``) and specjax
checkpoints (``checkpoint``)."""

from specjax.io.gguf import (
    SMOLLM2_GGUF_NAME,
    config_from_metadata,
    gguf_metadata,
    load_gguf,
    open_gguf,
    permute_rope_rows,
    smollm2_gguf_path,
    unpermute_rope_rows,
)

__all__ = [
    "SMOLLM2_GGUF_NAME",
    "config_from_metadata",
    "gguf_metadata",
    "load_gguf",
    "open_gguf",
    "permute_rope_rows",
    "smollm2_gguf_path",
    "unpermute_rope_rows",
]
