"""/v1/chat/completions and its render route, in three steps: the request becomes a
`ChatPlan`, then the plan's outputs become a stream of chunks or a full response.

One prompt, `n` choices. With a reasoning parser the thinking is split off the answer
(`reasoning.py`); with tools in play their calls are parsed out of the answer
(`tools.py`). `chat_prompt` is shared with the Anthropic route.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from sse_starlette import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse

from app.engine.outputs import RequestOutput
from app.engine.sampling_params import SamplingParams
from app.server.body_checks import answer, off_loop_if_large
from app.server.errors import APIError, parse
from app.server.logprobs import chat_logprobs, output_entries, vllm_prompt_logprobs
from app.server.openai import (
    Envelope,
    StreamUsage,
    finish,
    rendered,
    request_metrics,
    total_usage,
)
from app.server.protocol import ChatCompletionRequest, NamedToolChoice
from app.server.reasoning import ChoiceReasoning, ReasoningStream, compiled_for_answer
from app.server.state import check_model, default_max_tokens, engine, state
from app.server.streaming import collect, queue_all, sse, started, unless_disconnected
from app.server.structured import from_openai
from app.server.tools import (
    ToolCallStream,
    ToolSchemaError,
    check_enforced_schemas,
    grammar_for,
    template_supports_tools,
)
from app.server.tools import parse as parse_tool_calls
from app.server.tools import render as render_tools


async def chat_completions(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    plan = await plan_chat(request, await off_loop_if_large(
        request, lambda: parse(ChatCompletionRequest, body)))
    req = plan.req
    streams = queue_all(request, [plan.prompt], plan.params, req.priority, plan.call_id,
                        req.request_id, whole_answer=not req.stream and req.max_tokens is not None)
    if req.stream:
        return sse(chat_chunks(plan, await started(request, streams)))
    finals = await collect(request, streams)
    return await answer(lambda: chat_response(plan, finals), req.prompt_logprobs is not None)


async def chat_render(request: Request, body: dict) -> JSONResponse:
    """What `/v1/chat/completions` would feed the model, without running it: vLLM's
    render endpoint, which vllm-router calls on every replica to route by prefix."""
    req = await off_loop_if_large(request, lambda: parse(ChatCompletionRequest, body))
    model = check_model(request, req.model)
    prompt, _, _ = await chat_prompt(request, req)
    return JSONResponse(rendered(req, model, prompt))


# -- 1. request -> plan --------------------------------------------------------------------


@dataclass(frozen=True)
class ChatPlan:
    """A checked /v1/chat/completions request: what to run and how to answer it."""

    req: ChatCompletionRequest
    envelope: Envelope
    call_id: str
    prompt: list[int]
    params: SamplingParams
    tokenizer: Any
    tools: list[dict] | None  # the tools in play: their calls are parsed out of the answer
    reasoning_parser: str | None  # splits the thinking off the answer when set

    def logprobs(self, out: RequestOutput, delta_only: bool = False) -> dict | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.tokenizer, output_entries(out, delta_only=delta_only))


async def plan_chat(request: Request, req: ChatCompletionRequest) -> ChatPlan:
    model = check_model(request, req.model)
    prompt, tool_so, tools = await chat_prompt(request, req)
    wanted = from_openai(req)
    if wanted is not None and tool_so is not None:
        raise APIError(400, "a required or named tool_choice constrains the output itself: "
                       "it cannot be combined with a structured output", "tool_choice")
    # With a reasoning parser, grammars and tool calls apply to the answer after </think>.
    parser = state(request).settings.reasoning_parser if req.separate_reasoning else None
    so = await compiled_for_answer(request, wanted or ((tool_so, "tools") if tool_so else None),
                                   parser)
    if req.max_completion_tokens is not None:
        req.max_tokens = req.max_completion_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    params = req.sampling_params(default_max_tokens(request, req.max_tokens, len(prompt)), top,
                                 structured=so, defaults=engine(request).core.generation_defaults)
    envelope, call_id = Envelope.new("chatcmpl", req.request_id, model, "chat.completion.chunk",
                                     "chat.completion")
    return ChatPlan(req, envelope, call_id, prompt, params, engine(request).core.tokenizer,
                    tools, parser)


async def chat_prompt(request: Request, req: ChatCompletionRequest
                      ) -> tuple[list[int], str | None, list[dict] | None]:
    """The prompt's token ids, the grammar a tool_choice imposes, and the tools in play."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if isinstance(choice, NamedToolChoice):
        choice = choice.model_dump()
    if choice != "none" and not tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message needs add_generation_prompt false",
                       "continue_final_message")
    in_play = tools if choice != "none" else None
    try:
        check_enforced_schemas(in_play or [], choice)
    except ToolSchemaError as e:
        raise APIError(400, f"{e.param}: {e}", e.param) from e
    native = template_supports_tools(engine(request).core.tokenizer, req.chat_template)
    messages, kwargs = await off_loop_if_large(request, lambda: render_tools(
        [m.template_dict() for m in req.messages], in_play, native))
    kwargs |= req.template_kwargs()
    if req.documents is not None:
        kwargs["documents"] = req.documents
    if req.chat_template is not None:
        kwargs["chat_template"] = req.chat_template
    if req.continue_final_message:
        kwargs["continue_final_message"] = True
    prompt = await unless_disconnected(request, engine(request).inputs.apply_chat_template(
        messages, req.add_generation_prompt, **kwargs))
    try:
        grammar = grammar_for(in_play, choice, req.parallel_tool_calls) if in_play else None
    except ValueError as e:
        raise APIError(400, str(e), "tool_choice") from e
    return prompt, grammar, in_play


# -- 2. the stream ---------------------------------------------------------------------------


class ChoiceDeltas:
    """One choice's deltas as its outputs arrive: the thinking split off, tool calls
    parsed out; both hold text back until they know what it is."""

    def __init__(self, plan: ChatPlan):
        req = plan.req
        self.tools = ToolCallStream(req.parallel_tool_calls) if plan.tools else None
        self.reasoning = (ChoiceReasoning(plan.reasoning_parser, req.include_reasoning,
                                          req.stream_reasoning)
                          if plan.reasoning_parser else None)

    @property
    def called(self) -> bool:
        return bool(self.tools and self.tools.calls)

    def delta(self, out: RequestOutput, always: bool) -> dict | None:
        """The chunk's `delta` for `out`, or None when there is nothing to send (`always`:
        send one even then, for its logprobs)."""
        text, calls, thought = out.delta_text, [], ""
        if self.reasoning is not None:
            thought, text = self.reasoning.feed(text, out.finished)
        if self.tools is not None:
            text, calls = self.tools.feed(text)
            if out.finished:
                text += self.tools.finish(out.finish_reason == "length")
        # As for completions, one event per step that made tokens; a tool parser holds
        # text back on purpose, and then only what it lets out is sent.
        tokens = self.tools is None and not thought and bool(out.delta_token_ids)
        if not (text or calls or thought or tokens or out.finished or always):
            return None
        delta: dict = {"content": text} if text or tokens else {}
        if thought:
            delta["reasoning_content"] = thought
        if calls:
            delta["tool_calls"] = calls
        return delta


async def chat_chunks(plan: ChatPlan, outputs: AsyncIterator[tuple[int, RequestOutput]]
                      ) -> AsyncIterator[dict]:
    req, n = plan.req, plan.params.n
    counts = StreamUsage([plan.prompt], n, req.continuous_usage)
    yield plan.envelope.chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                "logprobs": None, "finish_reason": None} for i in range(n)],
                              **counts.so_far(0))
    choices = [ChoiceDeltas(plan) for _ in range(n)]
    finals: list[RequestOutput | None] = [None] * n
    async for i, out in outputs:
        counts.update(i, out)
        if out.finished:
            finals[i] = out
        delta = choices[i].delta(out, always=bool(req.logprobs))
        if delta is not None:
            yield plan.envelope.chunk([{"index": i, "delta": delta,
                                        "logprobs": plan.logprobs(out, delta_only=True),
                                        **finish(out, choices[i].called)}],
                                      **counts.so_far(i))
    if req.include_usage:
        yield plan.envelope.chunk([], usage=counts.total(), **request_metrics(finals))


# -- 3. the full response ----------------------------------------------------------------------


def chat_message(plan: ChatPlan, out: RequestOutput) -> dict:
    """The assistant's message: its answer, the thinking beside it, the tool calls."""
    message: dict = {"role": "assistant", "content": out.text}
    if plan.reasoning_parser:
        reasoning, message["content"] = ReasoningStream(plan.reasoning_parser).split(out.text)
        if plan.req.include_reasoning:
            message["reasoning_content"] = reasoning
    if plan.tools and message["content"]:
        message["content"], calls = parse_tool_calls(
            message["content"], plan.req.parallel_tool_calls, out.finish_reason == "length")
        if calls:
            message["tool_calls"] = calls
    return message


def chat_response(plan: ChatPlan, finals: list[RequestOutput]) -> dict:
    choices = []
    for i, out in enumerate(finals):
        message = chat_message(plan, out)
        choices.append({"index": i, "message": message, "logprobs": plan.logprobs(out),
                        **finish(out, called="tool_calls" in message)})
    n_out = sum(len(out.token_ids) for out in finals)
    response = plan.envelope.full(choices, usage=total_usage([plan.prompt], n_out),
                                  **request_metrics(finals))
    if plan.req.prompt_logprobs is not None:  # vLLM puts it beside the choices for chat
        response["prompt_logprobs"] = vllm_prompt_logprobs(plan.tokenizer, plan.prompt,
                                                           finals[0].prompt_logprobs)
    return response
