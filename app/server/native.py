"""Native routes: SGLang's /generate, and /tokenize, /detokenize, /abort_request.

/generate takes SGLang's body (`text` or `input_ids`, `sampling_params` with
SGLang's names mapped to ours) and answers with SGLang's shape: cumulative
`text` per streamed event and a `meta_info` block.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse

from app.engine.outputs import RequestOutput
from app.server.protocol import (
    AbortRequest,
    APIError,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    parse,
    parse_params,
)
from app.server.state import engine
from app.server.streaming import collect, queue_all, sse, started


async def generate(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    req = parse(GenerateRequest, body)
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "give exactly one of 'text' or 'input_ids'", "text")
    inputs = engine(request).inputs
    ids = await inputs.tokenize(req.text, "text") if req.text is not None else req.input_ids
    params = parse_params(req.sampling_params.to_params, "sampling_params")
    (stream,) = queue_all(request, [ids], params, 0, req.rid)

    def result(out: RequestOutput, text: str, output_ids: list[int]) -> dict:
        reason = None
        if out.finished:
            reason = {"type": out.finish_reason, "matched": out.stop_reason}
        return {"text": text, "output_ids": output_ids, "meta_info": {
            "id": out.request_id, "prompt_tokens": len(ids),
            "completion_tokens": len(output_ids), "finish_reason": reason}}

    if req.stream:
        outputs = await started(request, [stream])

        async def events() -> AsyncIterator[dict]:
            text, output_ids = "", []
            async for _, out in outputs:
                # SGLang streams cumulative text; build it from the deltas, since the
                # request's live token list may already be ahead of this event.
                text += out.delta_text
                output_ids += out.delta_token_ids
                yield result(out, text, list(output_ids))
        return sse(events())
    (out,) = await collect(request, [stream])
    return JSONResponse(result(out, out.text, list(out.token_ids)))


async def tokenize(request: Request, body: dict) -> JSONResponse:
    req = parse(TokenizeRequest, body)
    core = engine(request).core
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
    inputs = engine(request).inputs
    if req.messages is not None:
        ids = await inputs.apply_chat_template([m.template_dict() for m in req.messages],
                                               req.add_generation_prompt)
    else:
        ids = await inputs.tokenize(req.prompt, add_special_tokens=req.add_special_tokens)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": core.max_model_len})


async def detokenize(request: Request, body: dict) -> JSONResponse:
    req = parse(DetokenizeRequest, body)
    core = engine(request).core
    vocab = core.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                       "tokens")
    return JSONResponse({"prompt": await engine(request).inputs.detokenize(req.tokens)})


async def abort_request(request: Request, body: dict) -> JSONResponse:
    req = parse(AbortRequest, body)
    return JSONResponse({"rid": req.rid, "aborted": engine(request).abort(req.rid)})
