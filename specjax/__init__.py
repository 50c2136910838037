"""specjax: speculative decoding for LLMs in JAX/XLA."""

from specjax.api import (GenerateOutput, draft_logits, draft_method, early_exit_draft, generate, load_draft,
                         load_model, load_tokenizer, logits)
from specjax.config import ModelConfig, RopeScaling, SpecConfig
from specjax.model import Model
from specjax.speculate import Custom, Drafter  # the drafter interface (specjax.speculate.drafters)
from specjax.engine import Engine, EngineConfig, RequestParams  # noqa: F401 - serving engine

__all__ = ["Custom", "Drafter", "GenerateOutput", "Model", "ModelConfig", "RopeScaling", "SpecConfig",
           "draft_logits", "draft_method", "early_exit_draft", "generate", "load_draft", "load_model", "load_tokenizer", "logits"]
__version__ = "0.1.0"
