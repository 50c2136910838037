"""Frozen, hashable model, sampling and speculation configs (static jit arguments where they
reach jitted code). Configs of one module live next to it (heads.HeadConfig, tree.TreeConfig,
deepseek.DeepseekConfig, the engine's StepConfig)."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Mapping

from specjax.tree import TreeConfig  # tree.py imports no specjax config: no cycle


def parse_eos(value) -> int | tuple[int, ...] | None:
    """An HF / JSON ``eos_token_id`` (None, an int, or a list of ints) as a config field value:
    None, an int, or a non-empty tuple of ints (hashable)."""
    if isinstance(value, (list, tuple)):
        return tuple(int(e) for e in value) or None
    return None if value is None else int(value)


def eos_ids(value) -> tuple[int, ...]:
    """A config's ``eos_token_id`` field as a tuple of stop ids (empty when there is none)."""
    value = parse_eos(value)
    if value is None:
        return ()
    return value if isinstance(value, tuple) else (value,)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (``rope_scaling={"rope_type": "llama3", ...}``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


def _max_len(d: dict) -> int:
    """max_position_embeddings, capped at a sliding attention window when one applies (Mistral's
    ``sliding_window``; Qwen2/3 with ``use_sliding_window``): we attend over the full prefix, which
    equals windowed attention exactly up to the window's length."""
    n = int(d.get("max_position_embeddings", 2048))
    window = d.get("sliding_window")
    uses = d.get("use_sliding_window", d.get("model_type") == "mistral")
    return min(n, int(window)) if window and uses else n


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
    qk_norm: bool = False  # Qwen3: RMSNorm over D on each query / key head before RoPE

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

    def is_moe_layer(self, i: int) -> bool:
        """Whether layer i is a sparse MoE layer (never, for a dense Llama-family model)."""
        return False

    def with_layers(self, layers) -> "ModelConfig":
        """The config of a model made of this one's layers ``layers`` (indices, in order): an
        early-exit draft, a student's picks, a head's one block. Families with per-layer fields
        (Gemma 3's layer_types) keep those of the picked layers."""
        return dataclasses.replace(self, num_layers=len(layers))

    @property
    def group_size(self) -> int:
        """Query heads per KV head (1 = MHA, H = MQA)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any] | Any) -> "ModelConfig":
        """Builds a config from a transformers Llama-family config (object or config.json dict):
        llama, mistral, qwen2, qwen3 (per-head q/k RMSNorm), smollm3."""
        d = dict(hf) if isinstance(hf, Mapping) else hf.to_dict()
        return cls(**cls._hf_kwargs(d))

    @staticmethod
    def _hf_kwargs(d: dict) -> dict:
        """The ModelConfig fields read from a config.json dict (subclasses add theirs)."""
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
        eos = parse_eos(d.get("eos_token_id"))
        return dict(
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
            max_position_embeddings=_max_len(d),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            qk_norm=d.get("model_type") in ("qwen3", "qwen3_moe"),
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """All stop ids as a tuple (empty when the model has none)."""
        return eos_ids(self.eos_token_id)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["eos_token_id"] = parse_eos(d.get("eos_token_id"))
        if d.get("rope_scaling") is not None:
            d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        if isinstance(d.get("mlp_only_layers"), list):
            d["mlp_only_layers"] = tuple(d["mlp_only_layers"])
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(ModelConfig):
    """A Qwen3-MoE decoder: Llama-family attention (with q/k norms) and sparse MoE MLPs.

    Layer i is MoE when i is not in ``mlp_only_layers`` and (i + 1) % decoder_sparse_step == 0
    (transformers' rule); other layers keep the dense MLP of width F. Letters: X experts,
    Fm each expert's hidden width.
    """

    num_experts: int = 8  # X
    num_experts_per_tok: int = 2  # top-k
    moe_intermediate_size: int = 64  # Fm
    norm_topk_prob: bool = False  # renormalise the top-k softmax weights to sum to 1
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        for name in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                     "decoder_sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Qwen3MoeConfig.{name} must be a positive int, got {value!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"Qwen3MoeConfig.num_experts_per_tok ({self.num_experts_per_tok}) "
                             f"must be <= num_experts ({self.num_experts})")
        if not isinstance(self.mlp_only_layers, tuple):
            raise ValueError("Qwen3MoeConfig.mlp_only_layers must be a tuple of layer indices")

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @staticmethod
    def _hf_kwargs(d: dict) -> dict:
        kw = ModelConfig._hf_kwargs(d)
        kw.update(num_experts=int(d.get("num_experts") or d["num_local_experts"]),
                  num_experts_per_tok=int(d["num_experts_per_tok"]),
                  moe_intermediate_size=int(d["moe_intermediate_size"]),
                  norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                  decoder_sparse_step=int(d.get("decoder_sparse_step") or 1),
                  mlp_only_layers=tuple(int(i) for i in d.get("mlp_only_layers") or ()))
        return kw


METHODS = ("none", "draft", "mtp", "eagle", "eagle3", "eagle-tree", "ngram", "dflash", "peagle",
           "custom")
MODEL_DRAFTERS = ("draft", "mtp", "eagle", "eagle3", "dflash", "custom")  # methods that can hybrid / adapt by confidence
ATTN_IMPLS = ("reference", "pallas")
ADAPTIVE_SIGNALS = ("history", "confidence")  # SpecConfig.adaptive_by


def _check_int(name: str, value, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or value < lo or (hi is not None and value > hi):
        allowed = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValueError(f"SpecConfig.{name} must be an int {'in ' if hi is not None else ''}"
                         f"{allowed}, got {value!r}")


DEFAULT_NUM_DRAFT_TOKENS = 4  # SpecConfig.num_draft_tokens's default
# The k taken when k is unset, per method where it differs from DEFAULT_NUM_DRAFT_TOKENS (fixed k
# only: adaptive k searches 0..k, so it keeps the default): an MTP head's second draft is rarely
# accepted, and n-gram matches are at most ngram_max (3) tokens long.
METHOD_NUM_DRAFT_TOKENS = {"mtp": 1, "ngram": 3}


def default_num_draft_tokens(method: str, adaptive: bool = False) -> int:
    """The draft length k for ``method`` when none is given (``METHOD_NUM_DRAFT_TOKENS``)."""
    if adaptive:
        return DEFAULT_NUM_DRAFT_TOKENS
    return METHOD_NUM_DRAFT_TOKENS.get(method, DEFAULT_NUM_DRAFT_TOKENS)


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    """How decoding speculates: the one static (jit) description shared by ``sj.generate``, the
    decode loop (``specjax.speculate``) and the serving engine (``EngineConfig.spec``).

    Frozen and hashable; every field is validated here (ValueError / TypeError naming the field
    and its allowed range). Changing any field recompiles.

    Attributes:
      method: "none" (plain decoding), "draft" (a draft LLM), "mtp" / "eagle" (a head fed the
        target's features, drafting a chain), "eagle3" (EAGLE-3 head on fused multi-layer
        features), "eagle-tree" (a head drafting a tree, see ``tree``), "ngram" (drafts copied
        from the context, no draft model), "dflash" (a DFlash block drafter: k <= B-1 drafts
        in one pass, specjax.dflash), "peagle" (a P-EAGLE head: k <= K drafts in one causal pass,
        specjax.peagle), "custom" (the ``specjax.speculate.Drafter`` passed as
        ``draft=specjax.speculate.Custom(drafter, params)``).
      num_draft_tokens: k, the chain draft length, in [1, 64] (``k``). Ignored by "eagle-tree"
        (the tree's depth bounds a step) and stored as 1 for "none". Default 4
        (``DEFAULT_NUM_DRAFT_TOKENS``); where k is left unset (``specjax.options.spec_from_options``:
        the CLI, the server) it is ``default_num_draft_tokens(method, adaptive)`` instead.
      draft_sampling: sample drafts from the draft distribution q (True) or take its argmax
        (False, point-mass drafts). Not with "eagle-tree"; stored as False for "none".
      tree: a ``specjax.tree.TreeConfig``, present exactly when method == "eagle-tree" (default
        there: the EAGLE-2 dynamic tree ``TreeConfig()``).
      attn_impl: attention implementation, "reference" (jnp) or "pallas" (kernels); inside a
        sharded program, a ``specjax.sharding.ShardedAttention`` wrapping one of them.
      page_size: KV-cache page size in tokens, >= 1.
      ngram_min, ngram_max: n-gram drafting: shortest / longest context suffix matched, with
        1 <= ngram_min <= ngram_max <= 64.
      hybrid_min: n-gram hybrid drafting: an n-gram match of at least this many tokens is
        preferred over the model draft (0 = no hybrid); >= 0.
      adaptive: adapt the draft length per step (not with "none"; specjax.adaptive).
      adaptive_by: what adaptive k follows: "history" (the acceptance observed over recent
        steps, one estimate per draft position) or "confidence" (each step's own drafts: the
        drafter's probability of them, calibrated online against observed acceptance; drafting
        stops early when more drafts cannot pay). Anything but "history" needs ``adaptive``;
        "confidence" needs a model drafter ("draft", "mtp", "eagle", "eagle3").

    Method "none" stores ``num_draft_tokens=1`` and ``draft_sampling=False`` whatever is passed,
    so every plain-decoding config is equal and the baseline compiles once.
    """

    method: str = "none"
    num_draft_tokens: int = DEFAULT_NUM_DRAFT_TOKENS  # k
    draft_sampling: bool = False
    tree: TreeConfig | None = None
    attn_impl: str = "reference"
    page_size: int = 16
    ngram_min: int = 1
    ngram_max: int = 3
    hybrid_min: int = 0  # 0 = no hybrid
    adaptive: bool = False
    adaptive_by: str = "history"

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"SpecConfig.method must be one of {', '.join(map(repr, METHODS))}; "
                             f"got {self.method!r}")
        _check_int("num_draft_tokens", self.num_draft_tokens, 1, 64)
        for name in ("draft_sampling", "adaptive"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"SpecConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if self.method == "eagle-tree":
            if self.tree is None:
                object.__setattr__(self, "tree", TreeConfig())
            if not isinstance(self.tree, TreeConfig):
                raise TypeError(f"SpecConfig.tree must be a specjax.tree.TreeConfig, got "
                                f"{type(self.tree).__name__}")
            if self.draft_sampling:
                raise ValueError('SpecConfig.draft_sampling=True is not supported with method='
                                 '"eagle-tree": tree nodes are the head\'s top-k tokens (acceptance '
                                 'stays lossless)')
        elif self.tree is not None:
            raise ValueError(f'SpecConfig.tree is only used with method="eagle-tree", got '
                             f"method={self.method!r}")
        # A name, or an implementation object naming one (``.impl``) and wrapping the attention
        # core (``.wrap``): specjax.sharding.ShardedAttention, which the sharded program sets.
        named = isinstance(self.attn_impl, str)
        impl = self.attn_impl if named else getattr(self.attn_impl, "impl", None)
        if impl not in ATTN_IMPLS or not (named or callable(getattr(self.attn_impl, "wrap", None))):
            raise ValueError(f"SpecConfig.attn_impl must be one of {ATTN_IMPLS}, got "
                             f"{self.attn_impl!r}")
        _check_int("page_size", self.page_size, 1)
        _check_int("ngram_min", self.ngram_min, 1, 64)
        _check_int("ngram_max", self.ngram_max, 1, 64)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"SpecConfig.ngram_min ({self.ngram_min}) must be <= ngram_max "
                             f"({self.ngram_max})")
        _check_int("hybrid_min", self.hybrid_min, 0)
        if self.hybrid_min > self.ngram_max:
            raise ValueError(f"SpecConfig.hybrid_min ({self.hybrid_min}) must be <= ngram_max "
                             f"({self.ngram_max}): longer matches are never searched")
        if self.hybrid_min and self.method not in MODEL_DRAFTERS:
            raise ValueError(f'SpecConfig.hybrid_min > 0 needs method "draft", "mtp", "eagle" or '
                             f'"eagle3" (a model drafts the rows without an n-gram match), got '
                             f"method={self.method!r}")
        if self.adaptive and self.method == "eagle-tree":
            raise ValueError('SpecConfig.adaptive=True picks a chain length per step: not with '
                             'method="eagle-tree"')
        if self.adaptive_by not in ADAPTIVE_SIGNALS:
            raise ValueError(f"SpecConfig.adaptive_by must be one of {ADAPTIVE_SIGNALS}, got "
                             f"{self.adaptive_by!r}")
        if self.adaptive_by != "history" and not self.adaptive:
            raise ValueError(f"SpecConfig.adaptive_by={self.adaptive_by!r} needs adaptive=True")
        if self.adaptive_by == "confidence" and self.method not in MODEL_DRAFTERS:
            raise ValueError('SpecConfig.adaptive_by="confidence" needs a model drafter (method '
                             f'"draft", "mtp", "eagle" or "eagle3"), got method={self.method!r}')
        if self.method == "none":
            if self.adaptive:
                raise ValueError('SpecConfig.adaptive=True needs a speculative method, got '
                                 'method="none"')
            object.__setattr__(self, "num_draft_tokens", 1)
            object.__setattr__(self, "draft_sampling", False)

    @property
    def k(self) -> int:
        """The chain draft length (``num_draft_tokens``)."""
        return self.num_draft_tokens

    @property
    def k_eff(self) -> int:
        """Most drafts one step can accept (0 for plain decoding; the tree's depth for trees)."""
        if self.method == "none":
            return 0
        return self.tree.max_depth if self.tree is not None else self.k

    @property
    def uses_head(self) -> bool:
        """Whether the draft is a head fed by the target's features (MTP / EAGLE)."""
        return self.method in ("mtp", "eagle", "eagle3", "eagle-tree")

    @property
    def uses_history(self) -> bool:
        """Whether decoding keeps each row's token history on device (n-gram drafting)."""
        return self.method == "ngram" or self.hybrid_min > 0

    @property
    def extra_slots(self) -> int:
        """Cache slots one step may write beyond the committed length (page allocation)."""
        if self.tree is not None:
            return max(self.tree.n + 1, self.tree.draft_slots, self.k_eff + 1)
        return self.k_eff + 1
