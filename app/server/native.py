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
from app.engine.sampling_params import SamplingParams
from app.server.protocol import (
    AbortRequest,
    APIError,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    parse,
)
from app.server.state import engine
from app.server.streaming import collect, merge, queue_all, sse
from models.tokenizer import apply_chat_template

_SGLANG_NAMES: dict[str, str] = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
_SAMPLING_KEYS = set(SamplingParams.__dataclass_fields__)


async def generate(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    req = parse(GenerateRequest, body)
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "give exactly one of 'text' or 'input_ids'", "text")
    tok = engine(request).core.tokenizer
    ids = tok.encode(req.text) if req.text is not None else req.input_ids
    sp = {_SGLANG_NAMES.get(k, k): v for k, v in req.sampling_params.items()}
    unknown = sorted(set(sp) - _SAMPLING_KEYS)
    if unknown:
        raise APIError(400, f"unknown sampling parameter(s): {unknown}", "sampling_params")
    sp.setdefault("max_tokens", 128)
    params = parse(SamplingParams, sp, prefix="sampling_params")
    (stream,) = queue_all(engine(request), [ids], params, 0, req.rid)

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
            async for _, out in merge([stream]):
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
    if req.messages is not None:
        ids = apply_chat_template(core.tokenizer,
                                  [m.model_dump(exclude_none=True) for m in req.messages])
    else:
        ids = core.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": core.max_model_len})


async def detokenize(request: Request, body: dict) -> JSONResponse:
    req = parse(DetokenizeRequest, body)
    core = engine(request).core
    vocab = core.model_config.vocab_size
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"token ids outside the vocabulary [0, {vocab}): {bad[:5]}",
                       "tokens")
    return JSONResponse({"prompt": core.tokenizer.decode(req.tokens)})


async def abort_request(request: Request, body: dict) -> JSONResponse:
    req = parse(AbortRequest, body)
    return JSONResponse({"rid": req.rid, "aborted": engine(request).abort(req.rid)})
