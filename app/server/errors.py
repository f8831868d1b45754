"""The one error type of the HTTP layer, and the one place errors get their status.

Every failure leaves the server as `APIError` → `{"error": {"message", "type",
"param", "code"}}` (OpenAI's shape) with its status; `api_error()` maps the engine's
typed errors (`app/engine/errors.py`), and `from_validation_error()` pydantic's.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ValidationError

from app.engine.errors import (
    AdapterInUse,
    AdapterNotFound,
    ContextTooLong,
    EngineDead,
    InvalidParameter,
    QueueFull,
    RequestFailed,
    RequestShed,
)
from app.engine.sampling_params import SamplingParams


class APIError(Exception):
    """An error the HTTP layer turns into `{"error": {...}}` with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None, cause: Exception | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type_, code, headers or {}
        self.cause = cause  # the engine's error, for an API that words it its own way

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
    errors = e.errors(include_url=False)
    # An unknown or refused key below a union (a content part, a named tool_choice) comes
    # after the other members' type errors; it is the one that says what is wrong.
    err = next((x for x in errors if x["type"] in ("extra_forbidden", "not_supported")),
               errors[0])
    loc = [str(p) for p in err["loc"] if not _is_union_tag(str(p))]
    param = ".".join(([prefix] if prefix else []) + loc) or None
    value = repr(err.get("input"))
    if len(value) > 80:
        value = value[:80] + "..."
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "not_supported":  # a field accepted only at its "off" value
        field = ".".join(([prefix] if prefix else []) + loc + [err["ctx"]["field"]])
        return APIError(400, msg, field)
    if err["type"] == "extra_forbidden":  # OpenAI's words; param is the field's container
        container = ".".join(([prefix] if prefix else []) + loc[:-1]) or None
        return APIError(400, f"Unrecognized request argument supplied: {param}", container)
    return APIError(400, f"invalid value for '{param}': {value}: {msg}", param)


def api_error(e: Exception, retry_after_seconds: int = 1) -> APIError | None:
    """The HTTP form of an engine error; None for an error that is a bug (→ 500)."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextTooLong):
        return APIError(400, str(e), e.param, "invalid_request_error",
                        "context_length_exceeded", cause=e)
    if isinstance(e, InvalidParameter):
        return APIError(400, str(e), e.param)
    if isinstance(e, AdapterNotFound):
        return APIError(404, str(e), "model", "invalid_request_error", "model_not_found")
    if isinstance(e, AdapterInUse):
        return APIError(409, str(e), "lora_name", "invalid_request_error", "adapter_in_use")
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
