"""`x-request-id`: every response carries one, and the request's log lines carry it too.

A client (or a proxy, or vllm-router) that sends `x-request-id` gets its own id back, so
it can find its request in our logs; anyone else gets a fresh one. The id is bound into
structlog's context variables for the request's task (`x_request_id`), so every line
logged while serving it — by the route, and by the engine loop, which logs a request's
end in the context its caller queued it from — names it. An id that is too long or has
characters outside a conservative set is replaced, not refused: the header is
bookkeeping, and logs must not carry what a client injects.

The same middleware writes the access log: one line per request when it ends (method,
path, status, duration, and the id from the context), at info, with the reason of an
error answer (`error`, as the answer's message says it), as vLLM's server prints its
access lines through uvicorn; `--disable-uvicorn-access-log` turns them off.

Pure ASGI rather than Starlette's BaseHTTPMiddleware: that one runs the route in a
separate task and buffers nothing well for SSE streams.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

import structlog
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("ridgeline.access")

HEADER = "x-request-id"
MAX_LEN = 128
_SANE = re.compile(rf"[A-Za-z0-9._:/+=@-]{{1,{MAX_LEN}}}")


def is_sane(given: str | None) -> bool:
    """An id a log line may carry verbatim."""
    return given is not None and _SANE.fullmatch(given) is not None


def choose_request_id(given: str | None) -> str:
    """The client's id when it is sane, else a fresh one."""
    return given if is_sane(given) else uuid.uuid4().hex


class RequestIdMiddleware:
    def __init__(self, app: ASGIApp, access_log: bool = True) -> None:
        self.app, self.access_log = app, access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = choose_request_id(Headers(scope=scope).get(HEADER))
        scope.setdefault("state", {})["request_id"] = request_id
        started, status = time.perf_counter(), [0]

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)[HEADER] = request_id
                status[0] = message["status"]
            await send(message)

        with structlog.contextvars.bound_contextvars(x_request_id=request_id):
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                if self.access_log:
                    self._log(scope, status[0], time.perf_counter() - started)

    @staticmethod
    def _log(scope: Scope, status: int, seconds: float) -> None:
        """The access line; an error answer's reason with it (`app.py` `_error` notes it)."""
        extra = {"method": scope["method"], "path": scope["path"], "status": status,
                 "duration_ms": round(seconds * 1e3, 1)}
        if (reason := scope["state"].get("error")) is not None:
            extra["error"] = reason
        log.info("%s %s %d", scope["method"], scope["path"], status, extra=extra)
