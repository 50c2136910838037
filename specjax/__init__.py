"""specjax: speculative decoding for LLMs in JAX/XLA."""

from specjax.api import (GenerateOutput, early_exit_draft, generate, load_draft, load_model,
                         load_tokenizer, logits)
from specjax.config import ModelConfig, RopeScaling, SpecConfig
from specjax.model import Model
from specjax.engine import Engine, EngineConfig, RequestParams  # noqa: F401 - serving engine

__all__ = ["GenerateOutput", "Model", "ModelConfig", "RopeScaling", "SpecConfig",
           "early_exit_draft", "generate", "load_draft", "load_model", "load_tokenizer", "logits"]
__version__ = "0.1.0"
