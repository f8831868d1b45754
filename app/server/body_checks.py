"""What a request body may carry, checked on the parsed JSON before any model validation.

Chat templates. A template is code the server runs, so one sent by a client
(`chat_template`, or `chat_template_kwargs.chat_template`, which transformers would read
as the template too) is refused with a 400 naming it unless the operator passed
`--trust-request-chat-template`, as vLLM refuses it. Even then its render is bounded
(`app/engine/renderer.py`).

Counts.
The byte limit (`--max-request-body-bytes`) bounds a body's size, not the work one of
its bytes can buy: 4 MiB holds 100,000 empty chat messages, and each one costs its
share of model validation, message copies, the template's loop and the tokeniser. So
the lists whose entries each cost that work are counted first, by a walk of the parsed
JSON that costs nothing next to them, and a body over a count is a 400 naming the list
before any of that work starts. Within the counts a body can still hold ~150,000
content parts (~1.5 s of validation): a body of many entries is validated, and its
messages prepared for the template, on a worker thread (`off_loop_if_large`), where
the validators' Python steps let the event loop run between them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse

from app.config import ServerSettings
from app.server.errors import APIError

T = TypeVar("T")
# Entries (messages, content parts, tools) from which a body's validation and message
# preparation leave the event loop: ~10 µs each, so a few milliseconds below it.
OFF_LOOP_ENTRIES = 512


def check_body(body: Any, settings: ServerSettings) -> int:
    """Refuse an untrusted chat template, and too many messages, parts or tools; return
    how many of them the body holds."""
    if not isinstance(body, dict):
        return 0  # the body models refuse it
    if not settings.trust_request_chat_template:
        _no_request_template(body)
    entries = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        _at_most(messages, settings.max_chat_messages, "messages", "--max-chat-messages")
        entries += len(messages)
        for i, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                _at_most(content, settings.max_content_parts, f"messages.{i}.content",
                         "--max-content-parts")
                entries += len(content)
    tools = body.get("tools")
    if isinstance(tools, list):
        _at_most(tools, settings.max_tools, "tools", "--max-tools")
        entries += len(tools)
    return entries


async def off_loop_if_large(request: Request, work: Callable[[], T]) -> T:
    """`work()` on a thread when the request's body holds many entries, else here."""
    if getattr(request.state, "body_entries", 0) < OFF_LOOP_ENTRIES:
        return work()
    return await asyncio.to_thread(work)


async def answer(build: Callable[[], dict], large: bool) -> JSONResponse:
    """The JSON answer `build()` makes, built and serialised on a thread where it can be
    large (prompt_logprobs: up to `MAX_PROMPT_LOGPROB_ENTRIES` entries), else here."""
    if not large:
        return JSONResponse(build())
    return await asyncio.to_thread(lambda: JSONResponse(build()))


def _no_request_template(body: dict) -> None:
    kwargs = body.get("chat_template_kwargs")
    for param, value in (("chat_template", body.get("chat_template")),
                         ("chat_template_kwargs.chat_template",
                          kwargs.get("chat_template") if isinstance(kwargs, dict) else None)):
        if value is not None:
            raise APIError(400, f"{param}: a chat template passed with the request is refused; "
                           "the server runs only its own unless started with "
                           "--trust-request-chat-template", param)


def _at_most(items: list, limit: int, param: str, flag: str) -> None:
    if len(items) > limit:
        raise APIError(400, f"{param} has {len(items)} entries; at most {limit} are accepted "
                       f"(the server's {flag})", param)
