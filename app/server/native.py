"""Native routes: SGLang's /generate, and /tokenize, /detokenize, /abort_request.

/generate takes SGLang's body (`text` or `input_ids`, `sampling_params` with
SGLang's names mapped to ours) and answers with SGLang's shape: cumulative
`text` per streamed event and a `meta_info` block.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse

from app.engine.outputs import RequestOutput
from app.server.auth import is_admin
from app.server.body_checks import off_loop_if_large
from app.server.errors import APIError, parse, parse_params
from app.server.logprobs import output_entries, prompt_entries
from app.server.native_protocol import (
    AbortRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
)
from app.server.state import engine
from app.server.streaming import collect, queue_all, sse, started, unless_disconnected
from app.server.structured import compiled, from_sglang


async def generate(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    req = parse(GenerateRequest, body)
    if (req.text is None) == (req.input_ids is None):
        raise APIError(400, "give exactly one of 'text' or 'input_ids'", "text")
    inputs = engine(request).inputs
    ids = await inputs.tokenize(req.text, "text") if req.text is not None else req.input_ids
    structured = await compiled(request, from_sglang(req.sampling_params))
    logprobs = req.top_logprobs_num if req.return_logprob else None
    prompt_logprobs = logprobs if req.return_logprob and req.logprob_start_len >= 0 else None
    params = parse_params(lambda: req.sampling_params.to_params(
        structured=structured, logprobs=logprobs, prompt_logprobs=prompt_logprobs),
        "sampling_params")
    call_id = uuid.uuid4().hex  # SGLang's rids are bare hex
    (stream,) = queue_all(request, [ids], params, 0, call_id, req.rid,
                          whole_answer=not req.stream)

    def result(out: RequestOutput, text: str, output_ids: list[int], entries: list) -> dict:
        reason = None
        if out.finished:
            reason = {"type": out.finish_reason, "matched": out.stop_reason}
        meta = {"id": req.rid or call_id, "prompt_tokens": len(ids),
                "completion_tokens": len(output_ids), "finish_reason": reason}
        if req.return_logprob:  # SGLang's triples: [logprob, token id, text (None)]
            meta["output_token_logprobs"] = [[lp, t, None] for t, lp, _ in entries]
            meta["output_top_logprobs"] = [[[v, i, None] for i, v in top or ()]
                                           for _, _, top in entries]
            if out.prompt_logprobs is not None:
                start = req.logprob_start_len
                meta["input_token_logprobs"] = [
                    [lp, t, None] for t, lp, _ in prompt_entries(ids, out.prompt_logprobs)[start:]]
        return {"text": text, "output_ids": output_ids, "meta_info": meta}

    if req.stream:
        outputs = await started(request, [stream])

        async def events() -> AsyncIterator[dict]:
            text, output_ids, entries = "", [], []
            async for _, out in outputs:
                # SGLang streams cumulative text; build it from the deltas, since the
                # request's live token list may already be ahead of this event.
                text += out.delta_text
                output_ids += out.delta_token_ids
                entries += output_entries(out, delta_only=True)
                yield result(out, text, list(output_ids), entries)
        return sse(events())
    (out,) = await collect(request, [stream])
    return JSONResponse(result(out, out.text, list(out.token_ids), output_entries(out)))


async def tokenize(request: Request, body: dict) -> JSONResponse:
    req = await off_loop_if_large(request, lambda: parse(TokenizeRequest, body))
    core = engine(request).core
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of 'prompt' or 'messages'", "prompt")
    inputs = engine(request).inputs
    if req.messages is not None:
        kwargs = {} if req.chat_template is None else {"chat_template": req.chat_template}
        messages = await off_loop_if_large(
            request, lambda: [m.template_dict() for m in req.messages])
        ids = await unless_disconnected(request, inputs.apply_chat_template(
            messages, req.add_generation_prompt, **kwargs))
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
    """SGLang's abort, where a client cannot abort what is not its own.

    `rid` is the id a call was answered with when the client chose none (OpenAI's `id`,
    SGLang's `meta_info.id`): the server's, unguessable, so whoever holds it is the owner
    or was given it. An id a client chose (`request_id`, `rid`) is only a label: it aborts
    the requests that carry it, and `abort_all` aborts everything, only for a caller with
    `--admin-api-key`. A client that leaves aborts its own requests without any of this."""
    req = parse(AbortRequest, body)
    admin = is_admin(request)
    if req.abort_all:
        if not admin:
            raise APIError(403, "abort_all needs the admin key (--admin-api-key)",
                           "abort_all", "permission_error", "admin_key_required")
        return JSONResponse({"rid": req.rid, "aborted": engine(request).abort_all() > 0})
    if not req.rid:
        raise APIError(400, "give the rid to abort, or abort_all", "rid")
    aborted = engine(request).abort_call(req.rid, by_label=admin)
    return JSONResponse({"rid": req.rid, "aborted": aborted > 0})


async def tokenizer_info(request: Request, body: None) -> JSONResponse:
    """vLLM's /tokenizer_info: the tokenizer's configuration, so that clients (lm-eval's
    API models among them) tokenize with the server instead of downloading it."""
    core = engine(request).core
    tok = core.tokenizer
    info: dict[str, Any] = {}
    for key, value in getattr(tok, "init_kwargs", {}).items():
        if key in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path"):
            continue
        value = getattr(value, "content", value)  # AddedToken -> its text
        try:
            json.dumps(value)
        except TypeError:
            continue
        info[key] = value
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        token = getattr(tok, name, None)
        if token is not None:
            info[name] = getattr(token, "content", token)
    info["tokenizer_class"] = getattr(tok, "tokenizer_class", type(tok).__name__)
    info["model_max_length"] = core.max_model_len
    if getattr(tok, "chat_template", None):
        info["chat_template"] = tok.chat_template
    return JSONResponse(info)
