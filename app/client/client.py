"""An aiohttp client for Ridgeline and any OpenAI-compatible server.

Why our own and not the openai SDK: the serving benchmark and the tests need to
see each SSE event the moment it arrives, to close a stream on purpose (the
server must then abort the request and free its KV blocks), and to retry an
overloaded server (503 or 429 with `Retry-After`) without ever sending a request
twice once its stream has begun — a repeated generation is not idempotent.

    async with AsyncClient("http://127.0.0.1:8000") as client:
        done = await client.completions("Hello", max_tokens=8, temperature=0)
        async with client.chat([{"role": "user", "content": "Hi"}], stream=True) as stream:
            async for delta in stream:
                print(delta.text, end="")

A stream is a `Stream` of `Delta`s. Closing it closes its HTTP connection, which
is how the server learns to abort. Open it with `async with` (as in the second
example) and leaving the block, by `break`, `return` or an exception, closes it
at once. A stream that was awaited instead stays open after a bare `break` for
as long as the caller holds it; `aclose()` closes it, and so does its garbage
collection once it is dropped.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from email.utils import parsedate_to_datetime
from typing import Any

import aiohttp

from app.client.types import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    Call,
    Completion,
    GenerateParser,
    OpenAIParser,
    Parser,
    Stream,
    Usage,
)

RETRY_STATUSES = (429, 503)
_SHORT_TIMEOUT = aiohttp.ClientTimeout(total=10)  # /health and /metrics answer at once or never


def parse_retry_after(value: str | None) -> float | None:
    """Retry-After as seconds (a number or an HTTP date), None when absent or unreadable."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


class AsyncClient:
    """One aiohttp session against `base_url` (without `/v1`).

    Retries (at most `max_retries` times) a 429 or 503, waiting at least the
    server's `Retry-After` (and giving up at once if that exceeds
    `max_backoff`), and a connection that failed before any byte of a
    response; backoff doubles from `backoff` seconds, with jitter so that a
    crowd of rejected clients does not return in step. `timeout` bounds
    connecting and each wait for a byte, not a whole (long) generation.
    `num_retries` counts retries made, for benchmarks and tests.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 max_retries: int = 3, *, backoff: float = 0.5, max_backoff: float = 30.0,
                 max_connections: int | None = None):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = aiohttp.ClientTimeout(total=None, sock_connect=timeout, sock_read=timeout)
        self.max_retries, self.backoff, self.max_backoff = max_retries, backoff, max_backoff
        self.max_connections = max_connections
        self.num_retries = 0
        self._session: aiohttp.ClientSession | None = None
        self._random = random.Random()

    # -- lifecycle ---------------------------------------------------------------------

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Tell the server how long we wait for a byte (the openai SDK sends the same
            # as x-stainless-read-timeout): it can refuse at once what it cannot answer
            # in time, instead of computing it for nobody.
            headers = {"X-Request-Timeout": f"{self.timeout.sock_read:g}"}
            if self.api_key:
                headers["Authorization"] = f"Bearer {self.api_key}"
            self._session = aiohttp.ClientSession(
                timeout=self.timeout, headers=headers,
                connector=aiohttp.TCPConnector(limit=self.max_connections or 0))
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- transport ---------------------------------------------------------------------

    def retry_delay(self, attempt: int, retry_after: float | None) -> float | None:
        """Seconds before retry number `attempt + 1`, or None to give up now."""
        if attempt >= self.max_retries:
            return None
        delay = min(self.max_backoff, self.backoff * 2 ** attempt)
        if retry_after is not None:
            if retry_after > self.max_backoff:
                return None
            delay = max(delay, retry_after)
        return delay * (1 + 0.25 * self._random.random())

    async def _send(self, method: str, path: str, body: Any = None,
                    headers: dict[str, str] | None = None) -> aiohttp.ClientResponse:
        """A response with a status below 400; the headers are read, the body is not."""
        session, attempt = self._get_session(), 0
        while True:
            try:
                resp = await session.request(method, self.base_url + path, json=body,
                                             headers=headers)
            except aiohttp.SocketTimeoutError as e:  # sent, unanswered: it may be running
                raise APITimeoutError(f"{method} {path}: no response within the timeout") from e
            except aiohttp.ClientConnectionError as e:  # no byte of a response yet
                delay = self.retry_delay(attempt, None)
                if delay is None:
                    raise APIConnectionError(f"{method} {path}: {e!r}") from e
            except aiohttp.ClientError as e:  # e.g. an invalid URL or a malformed response
                raise APIConnectionError(f"{method} {path}: {e!r}") from e
            else:
                if resp.status < 400:
                    return resp
                error = await self._status_error(resp)
                delay = None
                if resp.status in RETRY_STATUSES:
                    delay = self.retry_delay(attempt, parse_retry_after(
                        resp.headers.get("Retry-After")))
                if delay is None:
                    raise error
            attempt += 1
            self.num_retries += 1
            await asyncio.sleep(delay)

    @staticmethod
    async def _status_error(resp: aiohttp.ClientResponse) -> APIStatusError:
        try:
            text = await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            text = ""
        finally:
            resp.release()
        try:
            body: Any = json.loads(text)
        except ValueError:
            body = text
        return APIStatusError(resp.status, body, dict(resp.headers))

    async def _json(self, method: str, path: str, body: Any = None,
                    headers: dict[str, str] | None = None) -> Any:
        resp = await self._send(method, path, body, headers)
        try:
            return await resp.json(content_type=None)
        except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as e:
            raise APIConnectionError(f"{method} {path}: the response broke: {e!r}") from e
        except asyncio.TimeoutError as e:
            raise APITimeoutError(f"{method} {path}: the response stalled") from e
        finally:
            resp.release()

    async def _post(self, path: str, body: dict, stream: bool, parse: Parser,
                    headers: dict[str, str] | None = None) -> Any:
        if not stream:
            return await self._json("POST", path, body, headers)
        return Stream(await self._send("POST", path, body, headers), parse)

    # -- endpoints ---------------------------------------------------------------------

    def completions(self, prompt: str | list, *, model: str | None = None,
                    max_tokens: int | None = 16, stream: bool = False,
                    headers: dict[str, str] | None = None, **params: Any) -> Call:
        """POST /v1/completions; extra keyword arguments go into the body as they are,
        `headers` onto the request. Await the `Call`, or enter it (`async with`)."""
        body = _body(params, model, stream, prompt=prompt, max_tokens=max_tokens)
        return Call(self._openai("/v1/completions", body, stream, False, headers))

    def chat(self, messages: list[dict], *, model: str | None = None,
             max_tokens: int | None = None, stream: bool = False,
             headers: dict[str, str] | None = None, **params: Any) -> Call:
        """POST /v1/chat/completions."""
        body = _body(params, model, stream, messages=messages, max_tokens=max_tokens)
        return Call(self._openai("/v1/chat/completions", body, stream, True, headers))

    async def _openai(self, path: str, body: dict, stream: bool, chat: bool,
                      headers: dict[str, str] | None) -> Completion | Stream:
        out = await self._post(path, body, stream, OpenAIParser(chat=chat), headers)
        if stream:
            return out
        choices = out.get("choices", [])
        texts = ([(c.get("message") or {}).get("content") or "" for c in choices] if chat
                 else [c.get("text", "") for c in choices])
        return _completion(out, texts)

    def generate(self, text: str | None = None, *, input_ids: list[int] | None = None,
                 sampling_params: dict | None = None, stream: bool = False,
                 rid: str | None = None) -> Call:
        """POST /generate (SGLang's native API)."""
        body = _given(text=text, input_ids=input_ids, rid=rid,
                      sampling_params=sampling_params or {}, stream=stream)
        return Call(self._generate(body, stream))

    async def _generate(self, body: dict, stream: bool) -> Completion | Stream:
        out = await self._post("/generate", body, stream, GenerateParser())
        if stream:
            return out
        (d,) = GenerateParser()(out)  # a whole result reads like one final event
        return Completion(d.text, d.finish_reason, d.usage, [d.text], out)

    async def post_json(self, path: str, body: dict | None = None) -> Any:
        """POST any JSON route (`/abort_request`, vLLM's `/start_profile`, ...)."""
        return await self._json("POST", path, body or {})

    async def models(self) -> list[dict]:
        """GET /v1/models: the served models (`id`, `max_model_len`, ...)."""
        return (await self._json("GET", "/v1/models")).get("data", [])

    async def _get_text(self, path: str) -> tuple[int, str]:
        """A quick GET, never retried: (status, body), or (0, "") when unreachable."""
        try:
            async with self._get_session().get(self.base_url + path,
                                               timeout=_SHORT_TIMEOUT) as resp:
                return resp.status, await resp.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return 0, ""

    async def health(self) -> bool:
        """GET /health: True when the server is ready; never raises."""
        return (await self._get_text("/health"))[0] == 200

    async def metrics(self) -> str:
        """GET /metrics: the Prometheus text, or "" where the server has none."""
        status, text = await self._get_text("/metrics")
        return text if status == 200 else ""

    async def tokenize(self, prompt: str | None = None, *, messages: list[dict] | None = None,
                       model: str | None = None, add_special_tokens: bool = True) -> list[int]:
        """POST /tokenize: the token ids of a prompt or of chat messages."""
        body = _given(prompt=prompt, messages=messages, model=model,
                      add_special_tokens=add_special_tokens)
        return (await self._json("POST", "/tokenize", body))["tokens"]


def _given(**fields: Any) -> dict:
    return {k: v for k, v in fields.items() if v is not None}


def _body(params: dict, model: str | None, stream: bool, **fields: Any) -> dict:
    body = _given(**fields, model=model) | params
    if stream:
        body["stream"] = True
        body.setdefault("stream_options", {"include_usage": True})  # the final usage event
    return body


def _completion(out: dict, texts: list[str]) -> Completion:
    choices = out.get("choices") or [{}]
    usage = Usage.of(out["usage"]) if out.get("usage") else None
    return Completion(texts[0] if texts else "", choices[0].get("finish_reason"), usage, texts,
                      out)

