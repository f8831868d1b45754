"""The engine's typed errors. The HTTP layer maps each to a status in one place
(`app/server/protocol.py`); the offline `LLM` lets them propagate."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidParameter(EngineError, ValueError):
    """A request parameter is out of range; `param` names it for the HTTP error body (400)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class ContextTooLong(InvalidParameter):
    """The prompt, or the prompt and the tokens asked for, do not fit the model's context
    (400, OpenAI's and vLLM's `context_length_exceeded`, in vLLM's words, which clients
    match to trim or compact a conversation)."""

    def __init__(self, param: str, max_model_len: int, prompt_tokens: int,
                 completion_tokens: int):
        super().__init__(param, (
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + completion_tokens} tokens ({prompt_tokens} in the "
            f"messages, {completion_tokens} in the completion). Please reduce the length of "
            "the messages or completion."))
        self.max_model_len, self.prompt_tokens = max_model_len, prompt_tokens
        self.completion_tokens = completion_tokens


class AdapterNotFound(EngineError):
    """No LoRA adapter (and no model) of that name is served (404, OpenAI's
    `model_not_found`)."""


class AdapterInUse(EngineError):
    """A LoRA adapter cannot be unloaded while requests run or wait on it (409): they
    finish on the weights they started with, and the unload is asked for again."""


class QueueFull(EngineError):
    """Refused at arrival: the queue is at max_queued_requests (`reason` "queue_full"), or
    the request could not start before its deadline ("deadline"). 503 + Retry-After."""

    def __init__(self, message: str, reason: str = "queue_full",
                 retry_after: float | None = None):
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class RequestShed(EngineError):
    """Taken out of the queue unstarted: it could no longer make its deadline (503)."""

    def __init__(self, message: str, retry_after: float | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class EngineDead(EngineError):
    """The model thread failed or the server is shutting down; no request can progress (503)."""


class RequestFailed(EngineError):
    """This request's step or sampling failed; the engine went on without it (500)."""
