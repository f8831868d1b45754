"""OpenAI-compatible request bodies (pydantic), and the one error type of the HTTP layer.

Every failure leaves the server as `APIError` → `{"error": {...}}` with its status;
`api_error()` is the one place where the engine's typed errors get their status.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from app.engine.errors import (
    EngineDead,
    InvalidParameter,
    QueueFull,
    RequestFailed,
    RequestShed,
)
from app.engine.sampling_params import INT64_MAX, INT64_MIN, SamplingParams


class APIError(Exception):
    """An error the HTTP layer turns into `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type_, code, headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_union_tag(part: str) -> bool:
    """pydantic names the member of a union it tried (`str`, `list[str]`, `ContentPart`)
    in an error's location; the client's field path has none of those."""
    return part in _TYPE_TAGS or "[" in part or "-" in part or part[:1].isupper()


def from_validation_error(e: ValidationError, prefix: str | None = None) -> APIError:
    err = e.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"] if not _is_union_tag(str(p))]
    param = ".".join(([prefix] if prefix else []) + loc) or None
    value = repr(err.get("input"))
    if len(value) > 80:
        value = value[:80] + "..."
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":  # OpenAI's words; param is the field's container
        container = ".".join(([prefix] if prefix else []) + loc[:-1]) or None
        return APIError(400, f"Unrecognized request argument supplied: {param}", container)
    return APIError(400, f"invalid value for '{param}': {value}: {msg}", param)


def api_error(e: Exception, retry_after_seconds: int = 1) -> APIError | None:
    """The HTTP form of an engine error; None for an error that is a bug (→ 500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidParameter):
        return APIError(400, str(e), e.param)
    if isinstance(e, QueueFull | RequestShed):
        wait = e.retry_after if e.retry_after is not None else retry_after_seconds
        code = e.reason if isinstance(e, QueueFull) else "shed"
        return APIError(503, f"server is overloaded: {e}", None, "service_unavailable", code,
                        {"Retry-After": str(max(1, math.ceil(wait)))})
    if isinstance(e, EngineDead):
        return APIError(503, str(e), None, "service_unavailable")
    if isinstance(e, RequestFailed):
        return APIError(500, str(e), None, "server_error")
    return None


def parse(model_cls: type[BaseModel], body: Any) -> Any:
    """Validate a JSON body into a pydantic model, as a 400 APIError on failure."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None)
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        raise from_validation_error(e) from e


def parse_params(build: Callable[[], SamplingParams], prefix: str | None = None) -> SamplingParams:
    """SamplingParams from a validated body; a range error names the field under `prefix`."""
    try:
        return build()
    except InvalidParameter as e:
        raise APIError(400, str(e), f"{prefix}.{e.param}" if prefix else e.param) from e


Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
MAX_PROMPTS = 256  # prompts in one /v1/completions body (each is a request)


class Body(BaseModel):
    """Every request body: strict types (`"no"` is not a boolean, 2.5 is not an integer),
    as the OpenAI API itself checks them."""

    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(Body):
    include_usage: bool = False


class _SamplingFields(Body):
    """Sampling fields shared by both OpenAI endpoints, plus vLLM's extensions."""

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM / SGLang extensions
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    request_id: str | None = Field(None, max_length=256)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           "stream_options")
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else (self.stop or []),
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logprobs=logprobs,
            n=self.n,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False

    @field_validator("prompt")
    @classmethod
    def _bounded(cls, prompt):
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        return prompt


class ContentPart(Body):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class ChatMessage(Body):
    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: str | list[ContentPart] | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content part {j} has type {part.type!r}: only text "
                                     f"parts ({{'type': 'text', 'text': ...}}) are supported")
        return content

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it: text parts joined by newlines,
        as vLLM joins them for text-only models."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(part.text for part in self.content)
        return out


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True


class GenerateSamplingParams(Body):
    """SGLang's `sampling_params`, typed as strictly as the OpenAI bodies."""

    model_config = ConfigDict(extra="forbid", strict=True)
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1

    def to_params(self) -> SamplingParams:
        fields = self.model_dump(exclude={"max_new_tokens", "min_new_tokens", "stop",
                                          "stop_token_ids"})
        return SamplingParams(max_tokens=self.max_new_tokens, min_tokens=self.min_new_tokens,
                              stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
                              stop_token_ids=self.stop_token_ids or [], **fields)


class GenerateRequest(Body):
    """SGLang's native /generate body."""

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = Field(None, max_length=256)


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


class AbortRequest(Body):
    rid: str


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

