"""Frozen, hashable configs: the static arguments of every jitted function in specjax."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_scaling={"rope_type": "llama3", ...}``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A Llama-family decoder.

    Sizes use the project's letters: V vocab, E model dim, F MLP hidden, H query heads,
    Hkv key/value heads, D head dim, L layers.
    """

    vocab_size: int  # V
    hidden_size: int  # E
    intermediate_size: int  # F
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # Hkv
    head_dim: int  # D (need not equal E // H)
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None  # one id or several (Llama-3 style)

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelConfig.num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = MHA, H = MQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any] | Any) -> "ModelConfig":
        """Builds a config from a transformers Llama-family config (object or config.json dict)."""
        d = dict(hf) if isinstance(hf, Mapping) else hf.to_dict()
        num_heads = d["num_attention_heads"]
        head_dim = d.get("head_dim") or d["hidden_size"] // num_heads
        rope = d.get("rope_scaling") or None
        # transformers >= 5 folds rope_theta into rope_parameters.
        params = d.get("rope_parameters") or {}
        if rope is None and params.get("rope_type", "default") not in (None, "default"):
            rope = params
        theta = d.get("rope_theta") or params.get("rope_theta") or 10000.0
        scaling = None
        if rope is not None:
            kind = rope.get("rope_type", rope.get("type"))
            if kind == "llama3":
                scaling = RopeScaling(
                    factor=float(rope["factor"]),
                    low_freq_factor=float(rope["low_freq_factor"]),
                    high_freq_factor=float(rope["high_freq_factor"]),
                    original_max_position_embeddings=int(rope["original_max_position_embeddings"]))
            elif kind not in (None, "default"):
                raise ValueError(f"rope_scaling type {kind!r} is not supported (llama3 or none)")
        eos = d.get("eos_token_id")
        if isinstance(eos, (list, tuple)):
            eos = tuple(int(e) for e in eos) or None
        return cls(
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rope_theta=float(theta),
            rope_scaling=scaling,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All stop ids as a tuple (empty when the model has none)."""
        if self.eos_token_id is None:
            return ()
        return tuple(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else (self.eos_token_id,)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        if isinstance(d.get("eos_token_id"), list):
            d["eos_token_id"] = tuple(d["eos_token_id"])
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-call sampling settings. temperature 0 means greedy (argmax)."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self):
        validate_sampling(self.temperature, self.top_k, self.top_p)


def validate_sampling(temperature, top_k, top_p) -> None:
    """Raises ValueError naming the argument for an invalid sampling setting."""
    import numbers  # noqa: PLC0415

    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not temperature >= 0.0 or temperature == float("inf"):
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {top_k!r}")
    if isinstance(top_p, bool) or not isinstance(top_p, numbers.Real) or not (0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """How a speculative step drafts. Static: changing it recompiles."""

    method: str = "none"  # "none" | "draft" | "mtp" | "eagle" | "eagle3" | "eagle-tree"
    num_draft_tokens: int = 4  # k
    draft_sampling: bool = False  # False: point-mass (argmax) drafts; True: sample from q

    def __post_init__(self):
        methods = ("none", "draft", "mtp", "eagle", "eagle3", "eagle-tree")
        if self.method not in methods:
            raise ValueError(f"method must be one of {methods}; got {self.method!r}")
        if isinstance(self.num_draft_tokens, bool) or not isinstance(self.num_draft_tokens, int) \
                or not 1 <= self.num_draft_tokens <= 64:
            raise ValueError(f"num_draft_tokens must be an int in [1, 64], got {self.num_draft_tokens!r}")
