"""What a caller of the engine holds for one request: its stream of deltas, and the group
of n sequences it belongs to. The engine loop (`async_engine.py`) fills the streams."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from app.engine.errors import RequestFailed, RequestShed
from app.engine.outputs import RequestOutput

if TYPE_CHECKING:
    from app.engine.async_engine import AsyncEngine


class RequestGroup:
    """The n sequences a client asked for with one request (the server queues each as
    its own request): vLLM's `request_params_n` and `request_max_num_generation_tokens`
    are observed once, when the last of them ends."""

    def __init__(self, n: int):
        self.n = self.remaining = n
        self.max_generation_tokens = 0

    def end(self, generated: int) -> bool:
        """One sequence ended; True when it was the last."""
        self.max_generation_tokens = max(self.max_generation_tokens, generated)
        self.remaining -= 1
        return self.remaining == 0


def labelled(stream: RequestStream) -> dict[str, str]:
    """The client's own id, for the request's log lines."""
    return {} if stream.label is None else {"client_request_id": stream.label}


class RequestStream:
    """What a caller iterates: the request's deltas, ending with a finished one.

    It keeps the caller's context (`contextvars`), so the engine's log lines about the
    request carry what the caller bound for its logs (the server binds x_request_id).
    `call_id` names every sequence of one client call (its n choices, its prompts): what
    the caller was given to abort it by; `label` is the id the client chose, if any, which
    names nothing in the engine (two clients may choose the same)."""

    def __init__(self, engine: AsyncEngine, request_id: str, max_tokens: int = 0,
                 group: RequestGroup | None = None, call_id: str | None = None,
                 label: str | None = None):
        self.request_id = request_id
        self.call_id = call_id or request_id
        self.label = label
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._engine = engine
        self.last_token_time: float | None = None
        self.finished = False
        self.max_tokens = max_tokens
        self.group = group or RequestGroup(1)
        self.context = contextvars.copy_context()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestOutput]:
        try:
            while True:
                item = await self.queue.get()
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                if item.error is not None:  # finished with finish_reason "error" or "shed"
                    self.finished = True
                    if item.finish_reason == "shed":
                        raise RequestShed(item.error, self._engine.core.predicted_wait())
                    raise RequestFailed(item.error)
                yield item
                if item.finished:
                    self.finished = True
                    return
        finally:
            if not self.finished:  # consumer left early: cancelled, closed, disconnected
                self._engine.abort(self.request_id)
