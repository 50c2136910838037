"""OpenAI API request / response shapes (the subset specjax serves) and its error format.

Requests are validated by pydantic in strict mode for types (a string where an int belongs is an
error, an int where a float belongs is fine) and by field constraints for ranges; any violation
becomes HTTP 400 with OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``
(``param`` names the offending field). Fields OpenAI defines that specjax does not implement
(``logprobs``, ``echo``, ``n`` > 1, penalties, ...) are accepted at their neutral value and
rejected otherwise, so a client never silently gets something other than it asked for.

Extensions (as in vLLM): ``top_k`` (0 or -1 = off), ``stop_token_ids``, ``ignore_eos``; ``stop``
may also hold token ids (ints) besides strings.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

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
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="ignore")

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
    # OpenAI fields accepted only at their neutral value (see check_unsupported)
    logprobs: Any = None
    presence_penalty: Optional[Number] = 0
    frequency_penalty: Optional[Number] = 0
    logit_bias: Optional[dict] = None
    best_of: Optional[StrictInt] = None
    user: Optional[StrictStr] = None

    def check_unsupported(self) -> None:
        if self.logprobs not in (None, False, 0):
            raise APIError("logprobs are not supported", param="logprobs")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0):
                raise APIError(f"{name} is not supported (must be 0)", param=name)
        if self.logit_bias:
            raise APIError("logit_bias is not supported", param="logit_bias")
        if self.best_of not in (None, 1):
            raise APIError("best_of must be 1", param="best_of")

    def stop_lists(self) -> tuple[list[str], list[int]]:
        """(stop strings, stop token ids) from ``stop`` and ``stop_token_ids``."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        strings = [s for s in stop if isinstance(s, str)]
        if any(s == "" for s in strings):
            raise APIError("stop strings must not be empty", param="stop")
        ids = [s for s in stop if isinstance(s, int)] + list(self.stop_token_ids or [])
        return strings, ids


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, a list of token ids, or a list of one string."""

    prompt: Union[StrictStr, list[StrictInt], list[StrictStr], list[list[StrictInt]]]
    max_tokens: Optional[StrictInt] = Field(16, ge=1)
    echo: StrictBool = False
    suffix: Optional[StrictStr] = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
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


# ---------------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
