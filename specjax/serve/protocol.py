"""OpenAI API request / response shapes (the subset specjax serves) and its error format.

Requests are validated by pydantic in strict mode for types (a string where an int belongs is an
error, an int where a float belongs is fine) and by field constraints for ranges; any violation
becomes HTTP 400 with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``
(``param`` names the offending field). Fields OpenAI defines that specjax does not implement
(``logprobs``, ``echo``, ``n`` > 1, penalties, tools, ...) are accepted at
their neutral value and rejected otherwise, and a field nobody defined is rejected too, so a
client never silently gets something other than it asked for.

Response extension: ``usage.spec_decoding`` (non-streamed responses, and the final usage chunk of
a stream with ``stream_options.include_usage``) holds the request's own speculation numbers,
counted from the tokens it returned (``specjax.engine.metrics.request_spec_stats``):
``num_drafts`` (speculative steps that proposed drafts), ``num_draft_tokens``,
``num_accepted_tokens``, ``num_accepted_tokens_per_pos`` [K] and ``mean_acceptance_length``
(tokens returned by those steps / num_drafts; null without drafts).

Extensions (as in vLLM): ``top_k`` (0 or -1 = off), ``stop_token_ids``, ``ignore_eos``; ``stop``
may also hold token ids (ints) besides strings; completions' ``add_special_tokens`` (default
true: a text prompt is encoded with the tokenizer's special tokens, Gemma's BOS; token-id
prompts are used as given).

Structured outputs (``_SamplingFields.constraint``, specjax.structured): OpenAI's
``response_format`` ``{"type": "json_schema", "json_schema": {"name", "schema", "strict",
"description"}}`` and ``{"type": "json_object"}``; vLLM's ``structured_outputs`` with exactly one
of ``json`` (a schema), ``regex``, ``choice``, ``grammar`` (EBNF), ``json_object`` (and
``disable_any_whitespace``); vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` /
``guided_grammar``. At most one of these per request. JSON is generated compact unless
``disable_any_whitespace`` is false.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from specjax.structured import Constraint

Number = Union[StrictInt, StrictFloat]


class APIError(Exception):
    """An error the server answers with OpenAI's JSON error body."""

    def __init__(self, message: str, *, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | int | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type
        self.code = code if code is not None else status

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` honoured; ``include_obfuscation`` (OpenAI's random
    padding field on stream events) accepted and ignored: no padding is sent. Others: 400."""

    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False
    include_obfuscation: StrictBool = False


def _neutral(value, neutral) -> bool:
    return value is None or value in neutral


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions.

    Unknown fields are rejected (``extra="forbid"``: HTTP 400 naming the field); OpenAI fields
    that specjax does not implement are declared here and accepted only at their neutral value
    (``check_unsupported``); ``user`` / ``safety_identifier`` (end-user ids) and
    ``prompt_cache_key`` (a cache-routing hint; prefix caching needs none) do not change the
    answer and are accepted.
    """

    model_config = ConfigDict(extra="forbid")

    model: StrictStr
    temperature: Optional[Number] = Field(1.0, ge=0, le=100)
    top_p: Optional[Number] = Field(1.0, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(0, ge=-1)
    seed: Optional[StrictInt] = Field(None, ge=-2**31, lt=2**31)
    stop: Union[StrictStr, list[Union[StrictStr, StrictInt]], None] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    n: Optional[StrictInt] = Field(1, ge=1, le=1)
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None
    safety_identifier: Optional[StrictStr] = None
    prompt_cache_key: Optional[StrictStr] = None
    # OpenAI fields accepted only at their neutral value (see check_unsupported)
    logprobs: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    logit_bias: Any = None
    service_tier: Any = None
    # structured outputs (see ``constraint``)
    response_format: Optional[dict] = None
    structured_outputs: Optional[dict] = None
    guided_json: Union[dict, StrictStr, None] = None
    guided_regex: Optional[StrictStr] = None
    guided_choice: Optional[list[StrictStr]] = None
    guided_grammar: Optional[StrictStr] = None

    # field -> neutral values (None is always neutral) and why a non-neutral one is refused
    UNSUPPORTED: ClassVar[dict] = {
        "logprobs": ((False, 0), "logprobs are not supported"),
        "presence_penalty": ((0,), "presence_penalty is not supported (must be 0)"),
        "frequency_penalty": ((0,), "frequency_penalty is not supported (must be 0)"),
        "logit_bias": (({},), "logit_bias is not supported"),
        "service_tier": (("auto", "default"), "service_tier must be 'auto' or 'default'"),
    }

    def check_unsupported(self) -> None:
        """Raises APIError naming the first field set to a value specjax does not honour."""
        for name, (neutral, why) in {**self.UNSUPPORTED, **self.EXTRA_UNSUPPORTED}.items():
            value = getattr(self, name)
            if isinstance(value, bool) and False not in neutral:
                raise APIError(why, param=name)
            if not _neutral(value, neutral):
                raise APIError(why, param=name)

    EXTRA_UNSUPPORTED: ClassVar[dict] = {}  # per endpoint

    def constraint(self) -> tuple:
        """(Constraint or None, the field it came from). Raises APIError naming the field for
        a malformed one or for more than one; whether the grammar compiles is checked later."""
        given = [n for n in ("response_format", "structured_outputs", "guided_json",
                             "guided_regex", "guided_choice", "guided_grammar")
                 if getattr(self, n) is not None
                 and not (n == "response_format" and self.response_format == {"type": "text"})]
        if len(given) > 1:
            raise APIError(f"give at most one structured-output field, got {', '.join(given)}",
                           param=given[1])
        if not given:
            return None, None
        name = given[0]
        value = getattr(self, name)
        try:
            if name == "response_format":
                return _response_format(value), name
            if name == "structured_outputs":
                return _structured_outputs(value), name
            if name == "guided_json":
                return Constraint.json_schema(value), name
            if name == "guided_regex":
                return Constraint.regex(value), name
            if name == "guided_choice":
                return Constraint.choice(value), name
            return Constraint.grammar(value), name
        except (ValueError, TypeError) as e:
            raise APIError(f"{name}: {e}", param=name) from None

    def stop_lists(self) -> tuple[list[str], list[int]]:
        """(stop strings, stop token ids) from ``stop`` and ``stop_token_ids``."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        strings = [s for s in stop if isinstance(s, str)]
        if any(s == "" for s in strings):
            raise APIError("stop strings must not be empty", param="stop")
        ids = [s for s in stop if isinstance(s, int)] + list(self.stop_token_ids or [])
        return strings, ids


def _response_format(rf: dict) -> Constraint | None:
    kind = rf.get("type")
    if kind == "json_object" and set(rf) == {"type"}:
        return Constraint.json_object()
    if kind == "json_schema" and set(rf) == {"type", "json_schema"}:
        js = rf["json_schema"]
        if not isinstance(js, dict) or not isinstance(js.get("name"), str):
            raise ValueError("json_schema must be an object with a string 'name'")
        extra = set(js) - {"name", "schema", "strict", "description"}
        if extra:
            raise ValueError(f"json_schema has unknown fields {sorted(extra)}")
        if "schema" not in js:
            raise ValueError("json_schema.schema is required")
        if not isinstance(js.get("strict", False), (bool, type(None))) \
                or not isinstance(js.get("description", ""), (str, type(None))):
            raise ValueError("json_schema.strict must be a bool and json_schema.description a "
                             "string")
        return Constraint.json_schema(js["schema"])
    raise ValueError('must be {"type": "text"}, {"type": "json_object"} or {"type": '
                     '"json_schema", "json_schema": {"name", "schema", "strict"}}')


_SO_KINDS = {"json": Constraint.json_schema, "regex": Constraint.regex,
             "choice": Constraint.choice, "grammar": Constraint.grammar}


def _structured_outputs(so: dict) -> Constraint:
    extra = set(so) - set(_SO_KINDS) - {"json_object", "disable_any_whitespace"}
    if extra:
        raise ValueError(f"unsupported fields {sorted(extra)}")
    kinds = [k for k in (*_SO_KINDS, "json_object") if so.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise ValueError(f"give exactly one of json, regex, choice, grammar, json_object; got "
                         f"{kinds or 'none'}")
    if not isinstance(so.get("json_object", False), bool):
        raise ValueError("json_object must be a bool")
    ws = so.get("disable_any_whitespace", True)
    if not isinstance(ws, bool):
        raise ValueError("disable_any_whitespace must be a bool")
    k = kinds[0]
    if k == "json_object":
        return Constraint.json_object(any_whitespace=not ws)
    if k == "json":
        return Constraint.json_schema(so[k], any_whitespace=not ws)
    if k == "choice" and not isinstance(so[k], list):
        raise ValueError("choice must be a list of strings")
    return _SO_KINDS[k](so[k])


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, a list of token ids, or a list of one string."""

    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=1)
    echo: StrictBool = False
    suffix: Optional[StrictStr] = None
    best_of: Any = None
    add_special_tokens: StrictBool = True  # vLLM: a text prompt gets the tokenizer's BOS etc.

    EXTRA_UNSUPPORTED: ClassVar[dict] = {
        "best_of": ((1,), "best_of must be 1"),
        "echo": ((False,), "echo is not supported"),
        "suffix": (("",), "suffix is not supported"),
    }


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One message; fields the template cannot render (``name``, ``tool_calls``, ...) are a 400."""

    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[StrictStr, list[TextPart], None] = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions (rendered with the tokenizer's chat template)."""

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: Optional[StrictInt] = Field(None, ge=1)
    max_completion_tokens: Optional[StrictInt] = Field(None, ge=1)
    top_logprobs: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    store: Any = None
    metadata: Any = None

    EXTRA_UNSUPPORTED: ClassVar[dict] = {
        "top_logprobs": ((0,), "top_logprobs are not supported"),
        "tools": (([],), "tools (function calling) are not supported"),
        "tool_choice": (("none",), "tool_choice is not supported (only 'none')"),
        # without tools (refused above unless empty) either value changes nothing
        "parallel_tool_calls": ((False, True), "parallel_tool_calls is not supported (no tools)"),
        "functions": (([],), "functions (function calling) are not supported"),
        "function_call": (("none",), "function_call is not supported (only 'none')"),
        "audio": ((), "audio output is not supported"),
        "modalities": ((["text"],), "only the 'text' modality is supported"),
        "prediction": ((), "predicted outputs are not supported"),
        "reasoning_effort": ((), "reasoning_effort is not supported"),
        "verbosity": ((), "verbosity is not supported"),
        "web_search_options": ((), "web search is not supported"),
        "store": ((False,), "store (stored completions) is not supported"),
        "metadata": (({},), "metadata is only used with store, which is not supported"),
    }


# ---------------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    spec_decoding: Optional[dict] = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: Optional[str] = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class ChatChoiceMessage(BaseModel):
    role: str = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatChoiceMessage
    finish_reason: Optional[str] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: ChatDelta
    finish_reason: Optional[str] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
