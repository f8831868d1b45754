"""The OpenAI Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request becomes what `/v1/chat/completions` runs: its input items become chat
messages (`responses_input.py`) after the stored conversation of `previous_response_id`
and behind `instructions` (a system message), rendered by the chat template with the
function tools; then it takes the engine's one request path (`streaming.py`: the same
bounds, deadlines, abort on disconnect and metrics). The answer is the Response
object, or the typed events that build it (`responses_output.py`), streamed as OpenAI
streams them: an `event:` line naming each, a `sequence_number` in each, no `[DONE]`.
A completed response is kept (`store`, default true) in the bounded store
(`response_store.py`) for `previous_response_id`, `GET` and `DELETE`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse

from app.engine.errors import InvalidParameter
from app.engine.grammar import StructuredOutput
from app.engine.outputs import RequestOutput
from app.engine.sampling_params import SamplingParams
from app.server.auth import tenant_of
from app.server.body_checks import _at_most, off_loop_if_large
from app.server.errors import APIError, api_error, parse
from app.server.logprobs import chat_logprobs, output_entries
from app.server.protocol import now
from app.server.reasoning import ReasoningStream, compiled_for_answer
from app.server.response_store import ResponseStore
from app.server.responses_input import to_messages
from app.server.responses_output import OutputAssembler, item_id
from app.server.responses_protocol import (
    FunctionCallItem,
    MessageItem,
    NamedFunctionChoice,
    ReasoningItem,
    ResponsesRequest,
)
from app.server.state import check_model, default_max_tokens, engine, state
from app.server.streaming import collect, queue_all, started
from app.server.tools import ToolCallStream, grammar_for, template_supports_tools
from app.server.tools import render as render_tools

log = logging.getLogger("ridgeline.server")

# Request fields that name the engine's own: a range error names the Responses field.
_PARAM_NAMES = {"max_tokens": "max_output_tokens", "logprobs": "top_logprobs",
                "prompt": "input"}


def store_of(request: Request) -> ResponseStore:
    return request.app.state.response_store


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found.", param,
                    "invalid_request_error", "response_not_found")


async def create(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    _count_input(request, body)
    req = await off_loop_if_large(request, lambda: parse(ResponsesRequest, body))
    model = check_model(request, req.model)
    earlier: list[dict[str, Any]] = []
    if req.previous_response_id is not None:
        stored = store_of(request).get(req.previous_response_id, tenant_of(request))
        if stored is None:
            raise not_found(req.previous_response_id, "previous_response_id")
        earlier = stored.conversation
    conversation = earlier + await off_loop_if_large(request, lambda: to_messages(
        req.input, earlier))
    if not conversation:
        raise APIError(400, "input must not be empty", "input")
    limit = state(request).settings.max_chat_messages
    if len(conversation) > limit:  # a stored conversation counts as sent messages
        raise APIError(400, f"the conversation has {len(conversation)} messages; at most "
                       f"{limit} are accepted (the server's --max-chat-messages)",
                       "previous_response_id" if earlier else "input")
    request.state.body_entries = getattr(request.state, "body_entries", 0) + len(earlier)
    prompt, tool_grammar, tools, conversation = await _prompt(request, req, conversation)
    parser = state(request).settings.reasoning_parser
    if req.wants_logprobs and (tools or parser):
        raise APIError(400, "message.output_text.logprobs cannot be included while tools or "
                       "a reasoning parser are in play (the tokens would mix the answer's "
                       "text with calls or thinking)", "include")
    wanted = _text_format(req)
    if wanted is not None and tool_grammar is not None:
        raise APIError(400, "a required or named tool_choice constrains the output itself: "
                       "it cannot be combined with text.format", "tool_choice")
    # With a reasoning parser, grammars and tool calls apply to the answer after </think>.
    so = await compiled_for_answer(request, wanted or (
        (tool_grammar, "tool_choice") if tool_grammar else None), parser)
    params = _sampling_params(request, req, len(prompt), so)
    rid, created = item_id("resp"), now()
    try:
        streams = queue_all(request, [prompt], params, req.priority, rid, req.request_id,
                            whole_answer=not req.stream and req.max_output_tokens is not None)
    except (APIError, InvalidParameter) as e:  # named as this route names them
        error = api_error(e)
        error.param = _PARAM_NAMES.get(error.param, error.param)
        raise error from e
    tok = engine(request).core.tokenizer

    def response(status: str, assembler: OutputAssembler, out: RequestOutput | None,
                 error: dict | None = None) -> dict[str, Any]:
        cut = out is not None and out.finish_reason == "length"
        return {
            "id": rid, "object": "response", "created_at": created, "model": model,
            "status": status, "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": assembler.output, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "previous_response_id": req.previous_response_id,
            "parallel_tool_calls": req.parallel_tool_calls,
            "temperature": params.temperature, "top_p": params.top_p,
            "tools": [t.model_dump() for t in req.tools or ()],
            "tool_choice": (req.tool_choice.model_dump() if isinstance(
                req.tool_choice, NamedFunctionChoice) else req.tool_choice or "auto"),
            "text": {"format": req.text.format.model_dump(by_alias=True, exclude_none=True)
                     if req.text and req.text.format else {"type": "text"}},
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": None},
            "truncation": req.truncation or "disabled", "top_logprobs": req.top_logprobs,
            "store": req.store, "background": False, "metadata": req.metadata or {},
            "user": req.user, "usage": None if out is None else _usage(len(prompt), out),
        }

    def assembler() -> OutputAssembler:
        return OutputAssembler(ToolCallStream(req.parallel_tool_calls) if tools else None,
                               ReasoningStream(parser) if parser else None)

    def logprobs(out: RequestOutput, delta_only: bool) -> list | None:
        if not req.wants_logprobs:
            return None
        entries = chat_logprobs(tok, output_entries(out, delta_only))["content"]
        return [{**e, "bytes": list(e["token"].encode())} for e in entries]

    def finished(out: RequestOutput, built: OutputAssembler) -> dict[str, Any]:
        """The final Response object, stored when asked to be."""
        if out.finish_reason == "abort":
            done = response("failed", built, out, {"code": "server_error",
                                                   "message": "the request was aborted"})
        else:
            done = response("incomplete" if out.finish_reason == "length" else "completed",
                            built, out)
        if req.store:
            history = conversation + to_messages(_as_items(built.output), conversation)
            store_of(request).put(done, history, tenant_of(request))
        return done

    if not req.stream:
        (out,) = await collect(request, streams)
        built = assembler()
        built.feed_whole(out.text)
        built.close(cut_short=out.finish_reason == "length")
        if req.wants_logprobs:  # no tools, no thinking: the output is one message
            built.output[0]["content"][0]["logprobs"] = logprobs(out, delta_only=False)
        return JSONResponse(finished(out, built))

    outputs = await started(request, streams)

    async def events() -> AsyncIterator[dict[str, Any]]:
        built = assembler()
        yield {"type": "response.created", "response": response("in_progress", built, None)}
        yield {"type": "response.in_progress", "response": response("in_progress", built, None)}
        last = None
        try:
            async for _, out in outputs:
                last = out
                for event in built.feed(out.delta_text, logprobs(out, delta_only=True)):
                    yield event
            for event in built.close(cut_short=last.finish_reason == "length"):
                yield event
            done = finished(last, built)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # after the 200: the response failed, said in-band
            error = api_error(e)
            if error is None:
                log.exception("unexpected error in a streamed response")
                error = APIError(500, f"internal error: {type(e).__name__}")
            yield {"type": "response.failed", "response": response(
                "failed", built, last, {"code": "server_error", "message": error.message})}
            return
        # An incomplete response ends with `response.completed` too, as vLLM's does: the
        # openai SDK's stream helper finishes only on that event (its status tells).
        yield {"type": "response.failed" if done["status"] == "failed" else
               "response.completed", "response": done}
    return typed_sse(events())


async def retrieve(request: Request, body: None) -> JSONResponse:
    _no_query(request)
    response_id = request.path_params["response_id"]
    stored = store_of(request).get(response_id, tenant_of(request))
    if stored is None:
        raise not_found(response_id)
    return JSONResponse(stored.response)


async def delete(request: Request, body: None) -> JSONResponse:
    _no_query(request)
    response_id = request.path_params["response_id"]
    if not store_of(request).delete(response_id, tenant_of(request)):
        raise not_found(response_id)
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _count_input(request: Request, body: Any) -> None:
    """The chat route's counts, for input items and their parts, before validation."""
    items = body.get("input") if isinstance(body, dict) else None
    if not isinstance(items, list):
        return
    settings = state(request).settings
    _at_most(items, settings.max_chat_messages, "input", "--max-chat-messages")
    entries = len(items)
    for i, item in enumerate(items):
        parts = (item.get("content") if item.get("type", "message") == "message"
                 else item.get("output")) if isinstance(item, dict) else None
        if isinstance(parts, list):
            _at_most(parts, settings.max_content_parts, f"input.{i}.content",
                     "--max-content-parts")
            entries += len(parts)
    request.state.body_entries = getattr(request.state, "body_entries", 0) + entries


def _no_query(request: Request) -> None:
    """A stored response is returned as it was answered: `stream` and `include`
    cannot be applied to it afterwards."""
    for name in request.query_params:
        raise APIError(400, f"query parameter {name!r} is not supported here", name)


def typed_sse(events: AsyncIterator[dict[str, Any]]) -> EventSourceResponse:
    """OpenAI's framing for typed events: `event: <type>`, `data: {...}` with a
    `sequence_number` counting from 0, and no `[DONE]` at the end."""
    async def body() -> AsyncIterator[dict[str, str]]:
        async with contextlib.aclosing(events):
            number = 0
            async for event in events:
                event["sequence_number"] = number
                number += 1
                yield {"event": event["type"],
                       "data": json.dumps(event, separators=(",", ":"), ensure_ascii=False)}

    return EventSourceResponse(body(), ping=0, sep="\n")  # as `streaming.sse`, and why


async def _prompt(request: Request, req: ResponsesRequest, conversation: list[dict[str, Any]]
                  ) -> tuple[list[int], StructuredOutput | None, list | None, list[dict]]:
    """The prompt's token ids, the grammar `tool_choice` imposes, the tools in play, and
    the conversation the prompt holds (its oldest turns dropped by `truncation: auto`)."""
    tools = [t.chat_tool() for t in req.tools] if req.tools else None
    choice: Any = req.tool_choice if req.tool_choice is not None else (
        "auto" if tools else "none")
    if isinstance(choice, NamedFunctionChoice):
        choice = {"type": "function", "function": {"name": choice.name}}
    if choice not in ("none", "auto") and not tools:  # Codex sends auto with no tools
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    in_play = tools if choice != "none" else None
    try:
        grammar = grammar_for(in_play, choice, req.parallel_tool_calls) if in_play else None
    except ValueError as e:
        raise APIError(400, str(e), "tool_choice") from e
    inputs = engine(request).inputs
    native = template_supports_tools(engine(request).core.tokenizer)
    system = [{"role": "system", "content": req.instructions}] if req.instructions else []
    kwargs_extra = {"reasoning_effort": req.reasoning.effort} if (
        req.reasoning and req.reasoning.effort) else {}

    async def render(messages: list[dict[str, Any]]) -> list[int]:
        rendered, kwargs = await off_loop_if_large(request, lambda: render_tools(
            system + messages, in_play, native))
        return await inputs.apply_chat_template(rendered, True, param="input",
                                                **kwargs, **kwargs_extra)

    prompt = await render(conversation)
    room = engine(request).core.max_model_len - (req.max_output_tokens or 1)
    if req.truncation == "auto" and len(prompt) > room:
        conversation, prompt = await _truncated(render, conversation, room)
    return prompt, grammar, in_play, conversation


async def _truncated(render, conversation: list[dict[str, Any]], room: int):
    """`truncation: auto`: the fewest oldest messages dropped for the prompt to fit, found
    by bisection (a few renders, not one per message). A conversation does not start
    with a tool result whose call was dropped."""
    def rest(k: int) -> list[dict[str, Any]]:
        kept = conversation[k:]
        while kept and kept[0]["role"] == "tool":
            kept = kept[1:]
        return kept

    low, high, best = 1, len(conversation) - 1, None
    while low <= high:
        mid = (low + high) // 2
        kept = rest(mid)
        prompt = await render(kept) if kept else None
        if prompt is not None and len(prompt) <= room:
            best, high = (kept, prompt), mid - 1
        else:
            low = mid + 1
    if best is None:
        raise APIError(400, f"the input does not fit in {room} tokens even with only its "
                       "last message", "input")
    return best


def _text_format(req: ResponsesRequest) -> tuple[StructuredOutput, str] | None:
    fmt = req.text.format if req.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutput("json_object"), "text.format"
    if fmt.schema_ is None:
        raise APIError(400, "text.format of type json_schema needs a schema",
                       "text.format.schema")
    try:
        return StructuredOutput.json_schema(fmt.schema_), "text.format.schema"
    except (ValueError, TypeError) as e:
        raise APIError(400, f"text.format.schema is not a JSON schema: {e}",
                       "text.format.schema") from e


def _sampling_params(request: Request, req: ResponsesRequest, prompt_len: int,
                     so: StructuredOutput | None) -> SamplingParams:
    """As the chat route builds them: the checkpoint's generation_config.json fills
    what the request left unset."""
    knobs = {k: getattr(req, k) for k in ("temperature", "top_p") if getattr(req, k) is not None}
    knobs = engine(request).core.generation_defaults.apply(knobs)
    try:
        return SamplingParams(
            max_tokens=default_max_tokens(request, req.max_output_tokens, prompt_len),
            temperature=knobs.get("temperature", 1.0), top_p=knobs.get("top_p", 1.0),
            top_k=knobs.get("top_k", 0), min_p=knobs.get("min_p", 0.0),
            repetition_penalty=knobs.get("repetition_penalty", 1.0),
            logprobs=(req.top_logprobs or 0) if req.wants_logprobs else None,
            structured=so, cache_salt=req.cache_salt)
    except InvalidParameter as e:
        raise APIError(400, str(e), _PARAM_NAMES.get(e.param, e.param)) from e


def _usage(prompt_tokens: int, out: RequestOutput) -> dict[str, Any]:
    n = len(out.token_ids)
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": n, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + n}


def _as_items(output: list[dict[str, Any]]) -> list:
    """This response's output items as input items: the next turn's history."""
    kinds = {"message": MessageItem, "function_call": FunctionCallItem,
             "reasoning": ReasoningItem}
    return [kinds[item["type"]].model_validate(item) for item in output
            if item["type"] in kinds]
