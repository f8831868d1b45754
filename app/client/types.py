"""What the client returns and raises, and how it reads an SSE stream.

Kept apart from the transport in `app/client.py` (connections, retries) because
these are the types callers touch: typed results, typed deltas, and the
`Stream` whose closing is how a server learns to abort a request.
"""

from __future__ import annotations

import asyncio
import json
from collections import deque
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any

import aiohttp


class ClientError(Exception):
    """Base of every error this client raises."""


class APIConnectionError(ClientError):
    """The server could not be reached, or the connection broke mid-response."""


class APITimeoutError(APIConnectionError):
    """No byte arrived from the server within the client's timeout."""


class APIStatusError(ClientError):
    """An HTTP error status, with the server's `{"error": {...}}` body parsed."""

    def __init__(self, status: int, body: Any, headers: dict[str, str] | None = None):
        err = body.get("error") if isinstance(body, dict) else None
        err = err if isinstance(err, dict) else {}
        self.status, self.body, self.headers = status, body, headers or {}
        self.message: str = err.get("message") or (body if isinstance(body, str) else "")
        self.type: str | None = err.get("type")
        self.param: str | None = err.get("param")
        self.code: str | None = err.get("code")
        super().__init__(f"HTTP {status}: {self.message}" + (f" (param {self.param})"
                                                             if self.param else ""))


class APIStreamError(APIStatusError):
    """An error event sent in-band after the stream had started (status was 200)."""

    def __init__(self, body: Any):
        super().__init__(200, body)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @staticmethod
    def of(d: dict) -> Usage:
        p, c = int(d.get("prompt_tokens", 0)), int(d.get("completion_tokens", 0))
        return Usage(p, c, int(d.get("total_tokens", p + c)))


@dataclass(frozen=True)
class Delta:
    """One streamed event for choice `index`.

    `tokens` is the count of completion tokens so far: exact where the server
    says so (SGLang's /generate, the final usage event), else the number of text
    events received (one token each, except where the detokenizer held back
    part of a UTF-8 character). The final event of a stream that asked for
    usage carries `usage` and no text.
    """

    text: str
    index: int = 0
    tokens: int = 0
    finish_reason: str | None = None
    usage: Usage | None = None


@dataclass(frozen=True)
class Completion:
    """A non-streamed result; `raw` is the server's JSON."""

    text: str
    finish_reason: str | None
    usage: Usage | None
    texts: list[str] = field(default_factory=list)
    raw: dict = field(default_factory=dict)


Parser = Callable[[dict], list[Delta]]


class OpenAIParser:
    """Chunks of /v1/completions (`text`) and /v1/chat/completions (`delta.content`)."""

    def __init__(self, chat: bool):
        self.chat = chat
        self.counts: dict[int, int] = {}

    def __call__(self, event: dict) -> list[Delta]:
        out = []
        for ch in event.get("choices") or []:
            i = ch.get("index", 0)
            text = ((ch.get("delta") or {}).get("content") if self.chat else ch.get("text")) or ""
            reason = ch.get("finish_reason")
            if not text and reason is None:
                continue  # the chat role announcement, or a keep-alive
            self.counts[i] = self.counts.get(i, 0) + (1 if text else 0)
            out.append(Delta(text, i, self.counts[i], reason))
        if event.get("usage"):
            usage = Usage.of(event["usage"])
            out.append(Delta("", 0, usage.completion_tokens, None, usage))
        return out


class GenerateParser:
    """SGLang's /generate streams the cumulative text; turn it into deltas."""

    def __init__(self) -> None:
        self.text = ""

    def __call__(self, event: dict) -> list[Delta]:
        text, meta = event.get("text", ""), event.get("meta_info") or {}
        delta, self.text = text[len(self.text):], text
        reason = meta.get("finish_reason")
        reason = reason.get("type") if isinstance(reason, dict) else reason
        n = int(meta.get("completion_tokens", len(event.get("output_ids") or [])))
        usage = None
        if reason is not None:
            usage = Usage(int(meta.get("prompt_tokens", 0)), n,
                          int(meta.get("prompt_tokens", 0)) + n)
        return [Delta(delta, 0, n, reason, usage)]


class Stream:
    """Async iterator of `Delta`s over one SSE response; the request was sent once."""

    def __init__(self, response: aiohttp.ClientResponse, parse: Parser):
        self._resp = response
        self._parse = parse
        self._pending: deque[Delta] = deque()
        self._done = False
        self.usage: Usage | None = None

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Delta:
        try:
            while not self._pending:
                if self._done:
                    raise StopAsyncIteration
                data = await self._next_data()
                if data is None:
                    raise APIConnectionError("the stream ended before [DONE]")
                if data.strip() == "[DONE]":
                    self._done = True
                    await self._finish()
                    continue
                try:
                    event = json.loads(data)
                except ValueError as e:
                    raise ClientError(f"malformed stream event: {data[:80]!r}") from e
                if isinstance(event, dict) and "error" in event:
                    raise APIStreamError(event)
                self._pending.extend(self._parse(event))
        except StopAsyncIteration:
            raise
        except BaseException:
            await self.aclose()
            raise
        delta = self._pending.popleft()
        if delta.usage is not None:
            self.usage = delta.usage
        return delta

    async def _next_data(self) -> str | None:
        """The next event's `data` (lines joined), or None at end of body."""
        lines: list[str] = []
        while True:
            try:
                raw = await self._resp.content.readline()
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
                raise APIConnectionError(f"the stream broke: {e!r}") from e
            except asyncio.TimeoutError as e:
                raise APITimeoutError("no event within the timeout") from e
            if not raw:
                return "\n".join(lines) if lines else None
            line = raw.decode().rstrip("\r\n")
            if not line:
                if lines:
                    return "\n".join(lines)
                continue
            name, _, value = line.partition(":")
            if name == "data":
                lines.append(value[1:] if value.startswith(" ") else value)
            # comments (": ping") and other fields (event:, id:) carry nothing we use

    async def _finish(self) -> None:
        """Read to the end of the body so the connection can be reused."""
        try:
            await self._resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        self._resp.release()

    async def aclose(self) -> None:
        """Close the connection: a server that streams for us aborts the request."""
        self._done = True
        self._resp.close()

    async def __aenter__(self) -> Stream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:  # a stream left by `break` and dropped: close it now
        try:
            if not self._resp.closed and not self._done:
                self._resp.close()
        except Exception:
            pass


class Call:
    """What `completions`, `chat` and `generate` return: await it for the result (a
    `Completion`, or a `Stream` when streaming), or enter it with `async with` for a
    stream that is closed as the block is left, by a `break`, a `return` or an
    exception, so that the server aborts the request at once:

        async with client.chat(messages, stream=True) as stream:
            async for delta in stream:
                if enough(delta):
                    break  # the block ends: the connection closes, the server aborts

    An awaited stream left by a bare `break` stays open, with the request running on
    the server, for as long as the caller holds it (`async for` does not close an
    iterator it leaves); `aclose()` or the `async with` form closes it."""

    def __init__(self, call: Awaitable[Completion | Stream]):
        self._call = call
        self._result: Completion | Stream | None = None

    def __await__(self) -> Generator[Any, None, Completion | Stream]:
        return self._call.__await__()

    async def __aenter__(self) -> Completion | Stream:
        self._result = await self._call
        return self._result

    async def __aexit__(self, *exc: object) -> None:
        if isinstance(self._result, Stream):
            await self._result.aclose()
