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


class QueueFull(EngineError):
    """The waiting queue is at max_queued_requests; the server answers 503 + Retry-After."""


class EngineDead(EngineError):
    """The model thread failed or the server is shutting down; no request can progress (503)."""
