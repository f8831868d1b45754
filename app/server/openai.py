"""The OpenAI routes: /v1/completions, /v1/chat/completions, /v1/models.

Bodies are validated by the pydantic models in `protocol.py`; queueing, SSE and
disconnects are shared with the native routes (`streaming.py`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse

from app.engine.outputs import RequestOutput
from app.server.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
    now,
    parse,
    usage,
)
from app.server.state import check_model, default_max_tokens, engine, state
from app.server.streaming import collect, queue_all, sse, started


async def models(request: Request, body: None) -> JSONResponse:
    core = engine(request).core
    return JSONResponse({"object": "list", "data": [{
        "id": state(request).model_names[0], "object": "model", "created": now(),
        "owned_by": "ridgeline", "root": state(request).model_names[0],
        "max_model_len": core.max_model_len}]})


# -- /v1/completions ---------------------------------------------------------------------


async def completions(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    req = parse(CompletionRequest, body)
    model = check_model(request, req.model)
    tok, inputs = engine(request).core.tokenizer, engine(request).inputs
    raw = req.prompt
    if isinstance(raw, str) or (raw and all(isinstance(p, int) for p in raw)):
        raw = [raw]  # one prompt, as text or as token ids
    prompts = [await inputs.tokenize(p) if isinstance(p, str) else list(p) for p in raw]
    if not prompts:
        raise APIError(400, "prompt must not be empty", "prompt")
    longest = max(map(len, prompts))
    params = req.sampling_params(default_max_tokens(request, req.max_tokens, longest),
                                 req.logprobs)
    streams = queue_all(request, prompts, params, req.priority, req.request_id)
    rid, created = new_id("cmpl"), now()

    def chunk(choices: list[dict], **extra) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, **extra}

    if req.stream:
        outputs = await started(request, streams)

        async def events() -> AsyncIterator[dict]:
            n_out = [0] * len(streams)
            async for i, out in outputs:
                n_out[i] = len(out.token_ids)
                if out.delta_text or out.finished or req.logprobs is not None:
                    lp = (_completion_logprobs(tok, out, delta_only=True)
                          if req.logprobs is not None else None)
                    yield chunk([{"index": i, "text": out.delta_text, "logprobs": lp,
                                  "finish_reason": out.finish_reason if out.finished else None,
                                  "stop_reason": out.stop_reason if out.finished else None}])
            if req.include_usage:
                yield chunk([], usage=usage(sum(map(len, prompts)), sum(n_out)))
        return sse(events())

    finals = await collect(request, streams)
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
    req = parse(ChatCompletionRequest, body)
    model = check_model(request, req.model)
    tok = engine(request).core.tokenizer
    prompt = await engine(request).inputs.apply_chat_template(
        [m.template_dict() for m in req.messages], req.add_generation_prompt)
    if req.max_completion_tokens is not None:
        req.max_tokens = req.max_completion_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(default_max_tokens(request, req.max_tokens, len(prompt)), top)
    streams = queue_all(request, [prompt], params, req.priority, req.request_id)
    rid, created = new_id("chatcmpl"), now()

    def chunk(choices: list[dict], **extra) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": choices, **extra}

    if req.stream:
        outputs = await started(request, streams)

        async def events() -> AsyncIterator[dict]:
            yield chunk([{"index": 0, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}])
            n_out = 0
            async for _, out in outputs:
                n_out = len(out.token_ids)
                if out.delta_text or out.finished or req.logprobs:
                    delta = {"content": out.delta_text} if out.delta_text else {}
                    lp = _chat_logprobs(tok, out, delta_only=True) if req.logprobs else None
                    yield chunk([{"index": 0, "delta": delta, "logprobs": lp,
                                  "finish_reason": out.finish_reason if out.finished else None,
                                  "stop_reason": out.stop_reason if out.finished else None}])
            if req.include_usage:
                yield chunk([], usage=usage(len(prompt), n_out))
        return sse(events())

    (out,) = await collect(request, streams)
    logprobs = _chat_logprobs(tok, out) if req.logprobs else None
    return JSONResponse({
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                     "logprobs": logprobs, "finish_reason": out.finish_reason,
                     "stop_reason": out.stop_reason}],
        "usage": usage(len(prompt), len(out.token_ids)),
    })
