"""Anthropic's Messages API: `POST /v1/messages` and `/v1/messages/count_tokens`.

Claude Code and the anthropic SDKs speak it. A body (`anthropic_protocol.py`) becomes
a chat completion body and takes the chat route's own path: the chat template, tool
rendering and forcing (`tool_choice` any/tool → the tools' grammar), the same checks
and bounds (`queue_all`), deadlines, abort on disconnect, metrics. The output is parsed
as chat's is (reasoning, then tool calls in the answer) and answered in Anthropic's
shape: content blocks (`thinking`, `text`, `tool_use`), `stop_reason`, `usage`; a
stream is Anthropic's typed SSE events. Errors take Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`, `anthropic_error`), and the API key
may come as `x-api-key`, as Anthropic's clients send it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse

from app.engine.errors import ContextTooLong
from app.engine.outputs import RequestOutput
from app.server.anthropic_protocol import CountTokensRequest, MessagesRequest, chat_body
from app.server.errors import APIError, api_error, parse
from app.server.openai_chat import chat_prompt
from app.server.protocol import ChatCompletionRequest, new_id
from app.server.reasoning import ChoiceReasoning, ReasoningStream, compiled_for_answer
from app.server.state import check_model, engine, state
from app.server.streaming import collect, queue_all, started
from app.server.structured import from_openai
from app.server.tools import ToolCallStream
from app.server.tools import parse as parse_tool_calls

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error", 408: "timeout_error",
               413: "request_too_large", 415: "invalid_request_error",
               429: "rate_limit_error", 503: "overloaded_error"}


def anthropic_error(e: APIError) -> dict[str, Any]:
    """An error in Anthropic's shape; the message names the field, as ours do. A context
    overflow is worded as Anthropic's API words it, which its clients match."""
    message = e.message if e.param is None or e.param in e.message else \
        f"{e.param}: {e.message}"
    if isinstance(over := e.cause, ContextTooLong):
        message = (f"prompt is too long: {over.prompt_tokens} tokens > {over.max_model_len} "
                   "maximum" if over.prompt_tokens >= over.max_model_len else
                   f"input length and `max_tokens` exceed context limit: {over.prompt_tokens}"
                   f" + {over.completion_tokens} > {over.max_model_len}, decrease input "
                   "length or `max_tokens` and try again")
    return {"type": "error", "error": {"type": ERROR_TYPES.get(e.status, "api_error"),
                                       "message": message}}


async def _prepare(request: Request, req: CountTokensRequest, extra: dict[str, Any]):
    """The chat request this body is, its prompt, the tools' grammar and the tools."""
    chat = parse(ChatCompletionRequest, chat_body(req) | extra)
    prompt, tool_so, tool_list = await chat_prompt(request, chat)
    return chat, prompt, tool_so, tool_list


async def count_tokens(request: Request, body: dict) -> JSONResponse:
    req = parse(CountTokensRequest, body)
    check_model(request, req.model)
    _, prompt, _, _ = await _prepare(request, req, {})
    return JSONResponse({"input_tokens": len(prompt)})


async def messages(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    req = parse(MessagesRequest, body)
    model = check_model(request, req.model)
    if req.thinking is not None and req.thinking.budget_tokens is not None \
            and req.thinking.budget_tokens >= req.max_tokens:
        raise APIError(400, "thinking.budget_tokens must be less than max_tokens",
                       "thinking.budget_tokens")
    knobs = {k: getattr(req, k) for k in ("temperature", "top_p", "top_k")
             if getattr(req, k) is not None}
    chat, prompt, tool_so, tool_list = await _prepare(request, req, {
        "max_tokens": req.max_tokens, "stop": req.stop_sequences, **knobs})
    wanted = from_openai(chat)
    if wanted is not None and tool_so is not None:
        raise APIError(400, "a tool_choice of any or tool constrains the output itself: it "
                       "cannot be combined with an output format", "tool_choice")
    parser = state(request).settings.reasoning_parser
    so = await compiled_for_answer(request, wanted or ((tool_so, "tools") if tool_so else None),
                                   parser)
    params = chat.sampling_params(req.max_tokens, None, structured=so,
                                  defaults=engine(request).core.generation_defaults)
    call_id = new_id("msg")
    streams = queue_all(request, [prompt], params, 0, call_id, None, whole_answer=not req.stream)
    reply = _Reply(call_id.replace("msg-", "msg_"), model, len(prompt), req.stop_sequences or [],
                   parser, tool_list is not None, chat.parallel_tool_calls)
    if req.stream:
        return _sse(reply.events(await started(request, streams)))
    (final,) = await collect(request, streams)
    return JSONResponse(reply.message(final))


class _Reply:
    """One answer in Anthropic's shape, whole or as a stream of events."""

    def __init__(self, msg_id: str, model: str, input_tokens: int, stops: list[str],
                 parser: str | None, tools: bool, parallel: bool):
        self.id, self.model, self.input_tokens, self.stops = msg_id, model, input_tokens, stops
        self.parser, self.tools, self.parallel = parser, tools, parallel

    def _stop(self, out: RequestOutput, called: bool) -> tuple[str, str | None]:
        if called and out.finish_reason == "stop":
            return "tool_use", None
        if out.finish_reason == "length":
            return "max_tokens", None
        if isinstance(out.stop_reason, str) and out.stop_reason in self.stops:
            return "stop_sequence", out.stop_reason
        return "end_turn", None

    def _envelope(self, content: list, stop: tuple[str | None, str | None],
                  output_tokens: int) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model,
                "content": content, "stop_reason": stop[0], "stop_sequence": stop[1],
                "usage": {"input_tokens": self.input_tokens, "output_tokens": output_tokens}}

    def message(self, out: RequestOutput) -> dict[str, Any]:
        reasoning, text = (ReasoningStream(self.parser).split(out.text) if self.parser
                           else (None, out.text))
        content: list[dict[str, Any]] = []
        if reasoning:
            content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
        calls: list[dict] = []
        if self.tools and text:
            text, calls = parse_tool_calls(text, self.parallel, out.finish_reason == "length")
        uses = []
        for c in calls:
            name, arguments = c["function"]["name"], c["function"]["arguments"]
            try:
                args = json.loads(arguments)
            except ValueError:
                args = None
            if isinstance(args, dict):
                uses.append({"type": "tool_use", "id": _tool_id(c["id"]), "name": name,
                             "input": args})
            else:  # Anthropic's input is an object: anything else stays the model's text
                text = "\n".join(filter(None, [text, json.dumps(
                    {"name": name, "arguments": arguments})]))
        if text:
            content.append({"type": "text", "text": text})
        content += uses
        calls = uses
        return self._envelope(content, self._stop(out, bool(calls)), len(out.token_ids))

    async def events(self, outputs: AsyncIterator[tuple[int, RequestOutput]]
                     ) -> AsyncIterator[tuple[str, dict]]:
        yield "message_start", {"type": "message_start",
                                "message": self._envelope([], (None, None), 0)}
        yield "ping", {"type": "ping"}
        blocks = _Blocks()
        reasoner = ChoiceReasoning(self.parser) if self.parser else None
        tool_stream = ToolCallStream(self.parallel) if self.tools else None
        async for _, out in outputs:
            thought, text, calls = "", out.delta_text, []
            if reasoner is not None:
                thought, text = reasoner.feed(text, out.finished)
            if tool_stream is not None:
                text, calls = tool_stream.feed(text)
                if out.finished:
                    text += tool_stream.finish(out.finish_reason == "length")
            if thought:
                for event in blocks.delta("thinking", {"type": "thinking_delta",
                                                       "thinking": thought}):
                    yield event
            for event in blocks.text(text):
                yield event
            for call in calls:
                for event in blocks.tool(call):
                    yield event
            if out.finished:
                for event in blocks.close():
                    yield event
                stop = self._stop(out, bool(tool_stream and tool_stream.calls))
                yield "message_delta", {
                    "type": "message_delta",
                    "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                    "usage": {"input_tokens": self.input_tokens,
                              "output_tokens": len(out.token_ids)}}
                yield "message_stop", {"type": "message_stop"}


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class _Blocks:
    """The stream's content blocks: one open at a time, a new one when the kind changes.
    Whitespace between blocks (the newline after a tool call) opens none."""

    def __init__(self):
        self.index, self.kind, self._space = -1, None, ""

    def close(self) -> list[tuple[str, dict]]:
        if self.kind is None:
            return []
        self.kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _open(self, kind: str, block: dict) -> list[tuple[str, dict]]:
        events = self.close()
        self.index, self.kind = self.index + 1, kind
        return events + [("content_block_start", {"type": "content_block_start",
                                                  "index": self.index, "content_block": block})]

    def delta(self, kind: str, delta: dict) -> list[tuple[str, dict]]:
        events = []
        if self.kind != kind:
            start = {"thinking": {"type": "thinking", "thinking": "", "signature": ""},
                     "text": {"type": "text", "text": ""}}[kind]
            events = self._open(kind, start)
        return events + [("content_block_delta", {"type": "content_block_delta",
                                                  "index": self.index, "delta": delta})]

    def text(self, text: str) -> list[tuple[str, dict]]:
        if self.kind != "text" and not text.strip():
            self._space += text
            return []
        if not text:
            return []
        text, self._space = self._space + text if self.kind == "text" else text.lstrip(), ""
        return self.delta("text", {"type": "text_delta", "text": text})

    def tool(self, call: dict) -> list[tuple[str, dict]]:
        events = []
        if "id" in call:  # a new call: its id and name first
            events = self._open("tool_use", {"type": "tool_use", "id": _tool_id(call["id"]),
                                             "name": call["function"]["name"], "input": {}})
        piece = call["function"].get("arguments", "")
        if piece:
            events.append(("content_block_delta", {
                "type": "content_block_delta", "index": self.index,
                "delta": {"type": "input_json_delta", "partial_json": piece}}))
        return events


def _sse(events: AsyncIterator[tuple[str, dict]]) -> EventSourceResponse:
    """Anthropic's framing: `event: <type>` and `data: <json>`; an error after the 200 is
    an `error` event, as Anthropic sends one."""
    async def body() -> AsyncIterator[dict]:
        try:
            async with contextlib.aclosing(events):
                async for kind, data in events:
                    yield {"event": kind, "data": json.dumps(data, separators=(",", ":"))}
        except Exception as e:  # after the 200: tell the client in-band
            error = api_error(e) or APIError(500, str(e), None, "server_error")
            yield {"event": "error", "data": json.dumps(anthropic_error(error))}

    return EventSourceResponse(body(), ping=0, sep="\n")
