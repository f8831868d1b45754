"""OpenAI-compatible request bodies (pydantic), and the one error type of the HTTP layer.

Every failure leaves the server as `APIError` → `{"error": {...}}` with its status;
`api_error()` is the one place where the engine's typed errors get their status.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from app.engine.errors import EngineDead, InvalidParameter, QueueFull
from app.engine.sampling_params import SamplingParams


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


def from_validation_error(e: ValidationError) -> APIError:
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    value = err.get("input")
    return APIError(400, f"invalid value for '{param}': {value!r}: {err['msg']}", param)


def api_error(e: Exception, retry_after_seconds: int = 1) -> APIError | None:
    """The HTTP form of an engine error; None for an error that is a bug (→ 500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InvalidParameter):
        return APIError(400, str(e), e.param)
    if isinstance(e, QueueFull):
        return APIError(503, f"server is overloaded: {e}", None, "service_unavailable",
                        "queue_full", {"Retry-After": str(retry_after_seconds)})
    if isinstance(e, EngineDead):
        return APIError(503, str(e), None, "service_unavailable")
    return None


def parse(model_cls: type, body: Any, prefix: str | None = None):
    """Build a pydantic model or SamplingParams from JSON, as a 400 APIError on failure."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", None)
    try:
        if issubclass(model_cls, BaseModel):
            return model_cls.model_validate(body)
        return model_cls(**body)
    except ValidationError as e:
        raise from_validation_error(e) from e
    except InvalidParameter as e:
        raise APIError(400, str(e), f"{prefix}.{e.param}" if prefix else e.param) from e
    except TypeError as e:
        raise APIError(400, str(e), prefix) from e


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Sampling fields shared by both OpenAI endpoints, plus vLLM's extensions."""

    model_config = ConfigDict(extra="ignore")

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
    priority: int = 0
    request_id: str | None = None

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


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


class GenerateRequest(BaseModel):
    """SGLang's native /generate body."""

    model_config = ConfigDict(extra="ignore")
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False
    rid: str | None = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


class AbortRequest(BaseModel):
    rid: str


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


ChatRole = Literal["system", "user", "assistant", "tool"]
