"""What every generation route shares: queueing, merging streams, SSE, disconnects.

Each handler validates, tokenizes and queues before answering, so a bad
request gets a 4xx status, never a broken stream. Streams are SSE (`data:
{json}` then `data: [DONE]`); an error after the stream has started is sent as
`data: {"error": ...}` followed by `data: [DONE]`. A client that leaves aborts
its requests at once, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import replace
from typing import TypeVar

from sse_starlette import EventSourceResponse
from starlette.requests import Request

from app.config import ServerSettings
from app.engine.outputs import RequestOutput
from app.engine.request_stream import RequestGroup, RequestStream
from app.engine.sampling_params import SamplingParams
from app.server.auth import tenant_of
from app.server.deadlines import request_slo
from app.server.errors import APIError, error_body
from app.server.request_id import is_sane
from app.server.state import state

# The default bound on one request's tokens, in full contexts: n = 64 (OpenAI's most
# samples per prompt here) of the longest requests still fit.
MAX_CONTEXTS_PER_REQUEST = 64
T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before a non-streamed result was ready."""


def queue_all(request: Request, prompts: list[list[int]], params: SamplingParams,
              priority: int, call_id: str, label: str | None, whole_answer: bool = False
              ) -> list[RequestStream]:
    """Queue every prompt `params.n` times, or none: a failure aborts the ones queued.

    Choice `i * n + j` is prompt i's j-th sample (OpenAI's and vLLM's order). Each is
    its own sequence with its own sampling stream (a seed becomes seed + j, so seeded
    choices are reproducible and differ); they share the prompt's KV blocks through
    the prefix cache. Each sequence is a request to the engine, so the queue bound and
    the deadline checks count sequences: the last of a many-sequence request is checked
    behind all the others, and its refusal (503) refuses the whole request.
    `whole_answer`: the answer is one piece of a length the client chose (its timeout
    then bounds the whole request, `deadlines.py`).

    Engine ids are the server's: `call_id` (unguessable: `protocol.new_id`) for the
    first sequence, `call_id-i` for the others, and `/abort_request` takes `call_id`.
    The client's own `request_id`/`rid` is only a `label` for the log lines (when
    sane, like `x-request-id`) and the admin's abort: two clients may send the same."""
    st = state(request)
    if (lora := getattr(request.state, "lora_name", None)) is not None:  # `check_model`
        params = replace(params, lora_name=lora)
    if tenant := tenant_of(request):  # the prefix cache and the drafts, scoped by key too
        params = replace(params, cache_salt=f"{tenant}:{params.cache_salt or ''}")
    n = params.n
    if params.stop:
        st.engine.inputs.need_tokenizer("stop")  # stop strings are matched in the text
    check_size(prompts, params, st.settings, st.engine.core.max_model_len)
    engine, slo = st.engine, request_slo(request, st.settings, whole_answer)
    streams: list[RequestStream] = []
    try:
        for i, ids in enumerate(prompts):
            group = RequestGroup(n)  # vLLM's parent request: its n sequences, for metrics
            for j in range(n):
                index = i * n + j
                child = params if n == 1 else replace(
                    params, n=1, seed=None if params.seed is None else params.seed + j)
                rid = call_id if index == 0 else f"{call_id}-{index}"
                streams.append(engine.add_request(ids, child, rid, priority, slo, group,
                                                  call_id, label if is_sane(label) else None))
    except BaseException:
        for s in streams:
            engine.abort(s.request_id)
        raise
    return streams


def check_size(prompts: list[list[int]], params: SamplingParams,
               settings: ServerSettings, max_model_len: int) -> None:
    """What one request may put in flight: its sequences (prompts × n) and its tokens
    (its prompts' tokens, computed once each and shared by their n samples through the
    prefix cache, plus sequences × max_tokens). Each limit alone (256 prompts, n ≤ 64,
    max_model_len) still allows a product that holds the engine for minutes."""
    seqs = len(prompts) * params.n
    param = "n" if params.n > 1 else "prompt"
    if seqs > settings.max_seqs_per_request:
        raise APIError(400, f"this request asks for {seqs} sequences ({len(prompts)} prompts "
                       f"x n={params.n}); the server takes at most "
                       f"{settings.max_seqs_per_request} per request", param)
    tokens = sum(map(len, prompts)) + seqs * params.max_tokens
    limit = settings.max_tokens_per_request or MAX_CONTEXTS_PER_REQUEST * max_model_len
    if tokens > limit:
        raise APIError(400, f"this request asks for {tokens} tokens (prompts plus {seqs} "
                       f"sequences x max_tokens={params.max_tokens}); the server takes at "
                       f"most {limit} per request",
                       "max_tokens" if params.max_tokens > 1 else param)


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams; leaving early aborts them all."""
    if len(streams) == 1:
        # aclosing: when our consumer leaves, close the stream now (its finally aborts
        # the request) rather than whenever the generator is collected.
        async with contextlib.aclosing(aiter(streams[0])) as outputs:
            async for out in outputs:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
        except BaseException as e:  # forwarded to the consumer
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def started(request: Request, streams: list[RequestStream]
                  ) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The merged outputs of a streamed response, once the first one is out.

    The 200 and the SSE headers wait for the first output, so that a request refused
    while it waits (shed at its deadline: 503 + Retry-After) gets a real status that
    clients and routers can retry on, not an error inside a 200 stream. A client that
    leaves meanwhile aborts its requests at once.
    """
    outputs = merge(streams)
    nxt = asyncio.ensure_future(anext(outputs))
    watcher = asyncio.create_task(_until_disconnect(request))
    await asyncio.wait({nxt, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if not nxt.done():
        nxt.cancel()  # the merge's own cleanup aborts the requests
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await nxt
        await outputs.aclose()
        raise ClientDisconnected()
    watcher.cancel()
    first = nxt.result()  # raises what ended the request before it began (503, 500)

    async def chained() -> AsyncIterator[tuple[int, RequestOutput]]:
        async with contextlib.aclosing(outputs):
            yield first
            async for item in outputs:
                yield item
    return chained()


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result, or `ClientDisconnected` as soon as the client leaves: the work is
    cancelled then (a chat template's render kills its worker process)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.create_task(_until_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def collect(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """Run to completion, aborting everything if the client goes away first."""
    async def run() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in merge(streams):
            if out.finished:
                finals[i] = out
        return finals  # type: ignore[return-value]

    task = asyncio.create_task(run())
    watcher = asyncio.create_task(_until_disconnect(request))
    await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():
        watcher.cancel()
        return task.result()
    task.cancel()  # the client left: the streams' finally blocks abort their requests
    raise ClientDisconnected()


def sse(events: AsyncIterator[dict]) -> EventSourceResponse:
    async def body() -> AsyncIterator[dict]:
        try:
            async with contextlib.aclosing(events):
                async for event in events:
                    yield {"data": json.dumps(event, separators=(",", ":"))}
        except asyncio.CancelledError:
            raise
        except Exception as e:  # after the 200: tell the client in-band, then end
            status_type = "server_error" if not isinstance(e, APIError) else e.type
            yield {"data": json.dumps(error_body(str(e), status_type))}
        yield {"data": "[DONE]"}

    # "\n" line ends, as OpenAI and vLLM send them: clients that split events on "\n\n"
    # (vLLM's own benchmark client among them) lose events framed with "\r\n". And no
    # keep-alive pings, which neither sends: that client strips each read's trailing
    # newlines, so a `: ping` comment glued every later event to itself and dropped
    # them (52 of 128 tokens per request lost under load). Tokens arrive every step.
    return EventSourceResponse(body(), ping=0, sep="\n")
