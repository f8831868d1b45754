"""Generation endpoints: OpenAI completions and chat, SGLang's native /generate.

Each handler validates, tokenizes and queues before answering, so a bad
request gets a 4xx status, never a broken stream. Streams are SSE (`data:
{json}` then `data: [DONE]`); an error after the stream has started is sent as
`data: {"error": ...}` followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse

from app.engine import AsyncEngine, RequestStream
from app.outputs import RequestOutput
from app.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    error_body,
    new_id,
    now,
    parse,
    usage,
)
from app.sampling_params import SamplingParams
from models.tokenizer import apply_chat_template


class ClientDisconnected(Exception):
    """The client closed the connection before a non-streamed result was ready."""


def _engine(request: Request) -> AsyncEngine:
    return request.app.state.ridgeline.engine


def _check_model(request: Request, model: str | None) -> str:
    names = request.app.state.ridgeline.model_names
    if model is not None and model not in names:
        raise APIError(404, f"The model `{model}` does not exist.", "model",
                       "invalid_request_error", "model_not_found")
    return names[0]


def _max_tokens(engine: AsyncEngine, requested: int | None, prompt_len: int) -> int:
    return requested if requested is not None else max(1, engine.core.max_model_len - prompt_len)


def _queue_all(engine: AsyncEngine, prompts: list[list[int]], params: SamplingParams,
               priority: int, request_id: str | None) -> list[RequestStream]:
    """Queue every prompt or none: a failure aborts the ones already queued."""
    streams: list[RequestStream] = []
    try:
        for i, ids in enumerate(prompts):
            rid = None if request_id is None else (request_id if i == 0 else f"{request_id}-{i}")
            streams.append(engine.add_request(ids, params, rid, priority))
    except BaseException:
        for s in streams:
            engine.abort(s.request_id)
        raise
    return streams


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


async def _until_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
    """Run to completion, aborting everything if the client goes away first."""
    async def run() -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for i, out in _merge(streams):
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


def _sse(events: AsyncIterator[dict]) -> EventSourceResponse:
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

    return EventSourceResponse(body(), ping=15)


# -- /v1/completions ---------------------------------------------------------------------


async def completions(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    engine = _engine(request)
    req = parse(CompletionRequest, body)
    model = _check_model(request, req.model)
    tok = engine.core.tokenizer
    raw = req.prompt
    if isinstance(raw, str):
        prompts = [tok.encode(raw)]
    elif raw and all(isinstance(p, int) for p in raw):
        prompts = [list(raw)]
    else:
        prompts = [tok.encode(p) if isinstance(p, str) else list(p) for p in raw]
    if not prompts:
        raise APIError(400, "prompt must not be empty", "prompt")
    params = req.sampling_params(_max_tokens(engine, req.max_tokens, max(map(len, prompts))),
                                 req.logprobs)
    streams = _queue_all(engine, prompts, params, req.priority, req.request_id)
    rid, created = new_id("cmpl"), now()

    def chunk(choices: list[dict], **extra) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, **extra}

    if req.stream:
        async def events() -> AsyncIterator[dict]:
            n_out = [0] * len(streams)
            async for i, out in _merge(streams):
                n_out[i] = len(out.token_ids)
                if out.delta_text or out.finished or req.logprobs is not None:
                    lp = (_completion_logprobs(tok, out, delta_only=True)
                          if req.logprobs is not None else None)
                    yield chunk([{"index": i, "text": out.delta_text, "logprobs": lp,
                                  "finish_reason": out.finish_reason if out.finished else None,
                                  "stop_reason": out.stop_reason if out.finished else None}])
            if req.include_usage:
                yield chunk([], usage=usage(sum(map(len, prompts)), sum(n_out)))
        return _sse(events())

    finals = await _collect(request, streams)
    choices = [{"index": i, "text": (tok.decode(prompts[i]) if req.echo else "") + o.text,
                "logprobs": _completion_logprobs(tok, o) if req.logprobs is not None else None,
                "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
               for i, o in enumerate(finals)]
    n_out = sum(len(o.token_ids) for o in finals)
    return JSONResponse(chunk(choices, usage=usage(sum(map(len, prompts)), n_out)))


def _logprob_entries(out: RequestOutput, delta_only: bool) -> list[tuple[int, tuple | None]]:
    """(token id, (logprob, top pairs)) for the whole output or just this delta."""
    if delta_only:  # a snapshot: the live lists may already be ahead of this event
        return list(zip(out.delta_token_ids, out.delta_logprobs or []))
    return list(zip(out.token_ids, out.logprobs or []))


def _completion_logprobs(tok, out: RequestOutput, delta_only: bool = False) -> dict:
    entries = _logprob_entries(out, delta_only)
    return {
        "tokens": [tok.decode([t]) for t, _ in entries],
        "token_logprobs": [e[0] if e else None for _, e in entries],
        "top_logprobs": [{tok.decode([t]): lp for t, lp in e[1]} if e else None
                         for _, e in entries],
    }


def _chat_logprobs(tok, out: RequestOutput, delta_only: bool = False) -> dict:
    return {"content": [
        {"token": tok.decode([t]), "logprob": e[0] if e else None,
         "top_logprobs": [{"token": tok.decode([i]), "logprob": lp} for i, lp in e[1]]
         if e else []}
        for t, e in _logprob_entries(out, delta_only)]}


# -- /v1/chat/completions ------------------------------------------------------------------


async def chat_completions(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    engine = _engine(request)
    req = parse(ChatCompletionRequest, body)
    model = _check_model(request, req.model)
    tok = engine.core.tokenizer
    messages = [m.model_dump(exclude_none=True) for m in req.messages]
    try:
        prompt = apply_chat_template(tok, messages, req.add_generation_prompt)
    except Exception as e:  # template errors are the caller's input
        raise APIError(400, f"cannot apply the chat template: {e}", "messages") from e
    if req.max_completion_tokens is not None:
        req.max_tokens = req.max_completion_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(_max_tokens(engine, req.max_tokens, len(prompt)), top)
    streams = _queue_all(engine, [prompt], params, req.priority, req.request_id)
    rid, created = new_id("chatcmpl"), now()

    def chunk(choices: list[dict], **extra) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": choices, **extra}

    if req.stream:
        async def events() -> AsyncIterator[dict]:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
            n_out = 0
            async for _, out in _merge(streams):
                n_out = len(out.token_ids)
                if out.delta_text or out.finished or req.logprobs:
                    delta = {"content": out.delta_text} if out.delta_text else {}
                    lp = _chat_logprobs(tok, out, delta_only=True) if req.logprobs else None
                    yield chunk([{"index": 0, "delta": delta, "logprobs": lp,
                                  "finish_reason": out.finish_reason if out.finished else None,
                                  "stop_reason": out.stop_reason if out.finished else None}])
            if req.include_usage:
                yield chunk([], usage=usage(len(prompt), n_out))
        return _sse(events())

    (out,) = await _collect(request, streams)
    logprobs = _chat_logprobs(tok, out) if req.logprobs else None
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                     "logprobs": logprobs, "finish_reason": out.finish_reason,
                     "stop_reason": out.stop_reason}],
        "usage": usage(len(prompt), len(out.token_ids)),
    })


# -- /generate (SGLang native) --------------------------------------------------------------

_SGLANG_NAMES: dict[str, str] = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
_SAMPLING_KEYS = set(SamplingParams.__dataclass_fields__)


async def generate(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    engine = _engine(request)
    req = parse(GenerateRequest, body)
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "give exactly one of 'text' or 'input_ids'", "text")
    ids = engine.core.tokenizer.encode(req.text) if req.text is not None else req.input_ids
    sp = {_SGLANG_NAMES.get(k, k): v for k, v in req.sampling_params.items()}
    unknown = sorted(set(sp) - _SAMPLING_KEYS)
    if unknown:
        raise APIError(400, f"unknown sampling parameter(s): {unknown}", "sampling_params")
    sp.setdefault("max_tokens", 128)
    params = parse(SamplingParams, sp, prefix="sampling_params")
    (stream,) = _queue_all(engine, [ids], params, 0, req.rid)

    def result(out: RequestOutput, text: str, output_ids: list[int]) -> dict:
        reason = None
        if out.finished:
            reason = {"type": out.finish_reason, "matched": out.stop_reason}
        return {"text": text, "output_ids": output_ids, "meta_info": {
            "id": out.request_id, "prompt_tokens": len(ids),
            "completion_tokens": len(output_ids), "finish_reason": reason}}

    if req.stream:
        async def events() -> AsyncIterator[dict]:
            text, output_ids = "", []
            async for _, out in _merge([stream]):
                # SGLang streams cumulative text; build it from the deltas, since the
                # request's live token list may already be ahead of this event.
                text += out.delta_text
                output_ids += out.delta_token_ids
                yield result(out, text, list(output_ids))
        return _sse(events())
    (out,) = await _collect(request, [stream])
    return JSONResponse(result(out, out.text, list(out.token_ids)))


ROUTES: dict[str, Callable] = {
    "/v1/completions": completions,
    "/v1/chat/completions": chat_completions,
    "/generate": generate,
}
