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
from app.server.body_checks import off_loop_if_large
from app.server.errors import APIError, parse
from app.server.logprobs import (
    chat_logprobs,
    completion_logprobs,
    output_entries,
    prompt_entries,
    vllm_prompt_logprobs,
)
from app.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    new_id,
    now,
    usage,
)
from app.server.reasoning import ChoiceReasoning, ReasoningStream, compiled_for_answer
from app.server.state import check_model, default_max_tokens, engine, state
from app.server.streaming import collect, queue_all, sse, started, unless_disconnected
from app.server.structured import compiled, from_openai
from app.server.tools import (
    ToolCallStream,
    ToolSchemaError,
    check_enforced_schemas,
    grammar_for,
    template_supports_tools,
)
from app.server.tools import parse as parse_tool_calls
from app.server.tools import render as render_tools


async def models(request: Request, body: None) -> JSONResponse:
    core = engine(request).core
    return JSONResponse({"object": "list", "data": [{
        "id": state(request).model_names[0], "object": "model", "created": now(),
        "owned_by": "ridgeline", "root": state(request).model_names[0],
        "max_model_len": core.max_model_len}]})


def response_id(prefix: str, call_id: str, request_id: str | None) -> str:
    """The response's `id`: built from the client's `request_id` when it sent one, as
    vLLM's is; else the call's id, which `/abort_request` takes."""
    return f"{prefix}-{request_id}" if request_id else call_id


# -- /v1/completions ---------------------------------------------------------------------


async def completions(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    req = parse(CompletionRequest, body)
    model = check_model(request, req.model)
    tok, inputs = engine(request).core.tokenizer, engine(request).inputs
    raw = req.prompt
    if isinstance(raw, str) or (raw and all(isinstance(p, int) for p in raw)):
        raw = [raw]  # one prompt, as text or as token ids
    prompts = [await inputs.tokenize(p, add_special_tokens=req.add_special_tokens)
               if isinstance(p, str) else list(p) for p in raw]
    if not prompts:
        raise APIError(400, "prompt must not be empty", "prompt")
    # echo with max_tokens 0 scores the prompt alone (vLLM's rule): one token is still
    # generated, and counted, but not returned.
    prompt_only = req.echo and req.max_tokens == 0
    if req.max_tokens == 0 and not req.echo:
        raise APIError(400, "max_tokens must be at least 1 (0 only with echo)", "max_tokens")
    longest = max(map(len, prompts))
    # With echo, logprobs cover the prompt too, as OpenAI's and vLLM's do.
    params = req.sampling_params(
        1 if prompt_only else default_max_tokens(request, req.max_tokens, longest),
        req.logprobs, req.logprobs if req.echo and req.logprobs is not None else None,
        structured=await compiled(request, from_openai(req)),
        defaults=engine(request).core.generation_defaults)
    call_id, created = new_id("cmpl"), now()
    streams = queue_all(request, prompts, params, req.priority, call_id, req.request_id,
                        whole_answer=not req.stream)
    n = params.n
    rid = response_id("cmpl", call_id, req.request_id)
    prompt_texts = [await inputs.detokenize(p, "echo") for p in prompts] if req.echo else None

    def chunk(choices: list[dict], **extra) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": model,
                "choices": choices, **extra}

    def echoed(i: int, out: RequestOutput, first: bool) -> tuple[str, list]:
        """The choice's text and logprob entries, with the prompt in front where echoed."""
        entries = output_entries(out, delta_only=not first or req.stream)
        text = out.delta_text if req.stream else out.text
        if prompt_only:
            entries, text = [], ""
        if req.echo and first:
            prompt = prompts[i // n]
            entries = prompt_entries(prompt, out.prompt_logprobs) + entries
            text = prompt_texts[i // n] + text
        return text, entries

    if req.stream:
        outputs = await started(request, streams)

        async def events() -> AsyncIterator[dict]:
            n_out, seen, offset = [0] * len(streams), set(), [0] * len(streams)
            async for i, out in outputs:
                n_out[i] = len(out.token_ids)
                first = i not in seen
                seen.add(i)
                text, entries = echoed(i, out, first)
                # One event per step that made tokens, even when their text is held back
                # (a partial UTF-8 character, a possible stop string), as vLLM does:
                # clients time inter-token latency by events.
                if text or out.delta_token_ids or out.finished or req.logprobs is not None:
                    lp = None
                    if req.logprobs is not None:
                        lp = completion_logprobs(tok, entries, offset[i])
                    offset[i] += len(text)
                    so_far = ({"usage": usage(len(prompts[i // n]), n_out[i])}
                              if req.continuous_usage else {})
                    yield chunk([{"index": i, "text": text, "logprobs": lp,
                                  "finish_reason": out.finish_reason if out.finished else None,
                                  "stop_reason": out.stop_reason if out.finished else None}],
                                **so_far)
            if req.include_usage:
                yield chunk([], usage=usage(sum(map(len, prompts)), sum(n_out)))
        return sse(events())

    finals = await collect(request, streams)
    choices = []
    for i, o in enumerate(finals):
        text, entries = echoed(i, o, first=True)
        choice = {"index": i, "text": text,
                  "logprobs": completion_logprobs(tok, entries) if req.logprobs is not None
                  else None,
                  "finish_reason": o.finish_reason, "stop_reason": o.stop_reason}
        if req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(tok, prompts[i // n],
                                                             o.prompt_logprobs)
        choices.append(choice)
    n_out = sum(len(o.token_ids) for o in finals)
    return JSONResponse(chunk(choices, usage=usage(sum(map(len, prompts)), n_out)))


# -- /v1/chat/completions ------------------------------------------------------------------


async def chat_completions(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    req = await off_loop_if_large(request, lambda: parse(ChatCompletionRequest, body))
    model = check_model(request, req.model)
    tok = engine(request).core.tokenizer
    prompt, tool_so, tool_list = await _chat_prompt(request, req)
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
    call_id, created = new_id("chatcmpl"), now()
    streams = queue_all(request, [prompt], params, req.priority, call_id, req.request_id,
                        whole_answer=not req.stream and req.max_tokens is not None)
    rid = response_id("chatcmpl", call_id, req.request_id)

    def chunk(choices: list[dict], **extra) -> dict:
        return {"id": rid, "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": choices, **extra}

    def finish_reason(out: RequestOutput, called: bool) -> str | None:
        return "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason

    if req.stream:
        outputs = await started(request, streams)

        async def events() -> AsyncIterator[dict]:
            n_out = [0] * len(streams)

            def so_far(i: int) -> dict:  # vLLM's continuous_usage_stats
                return {"usage": usage(len(prompt), n_out[i])} if req.continuous_usage else {}

            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                          "logprobs": None, "finish_reason": None}
                         for i in range(len(streams))], **so_far(0))
            parsers = [ToolCallStream(req.parallel_tool_calls) if tool_list else None
                       for _ in streams]
            reasoners = [ChoiceReasoning(parser, req.include_reasoning, req.stream_reasoning)
                         if parser else None for _ in streams]
            async for i, out in outputs:
                n_out[i] = len(out.token_ids)
                text, calls, thought = out.delta_text, [], ""
                if reasoners[i] is not None:
                    thought, text = reasoners[i].feed(text, out.finished)
                if parsers[i] is not None:
                    text, calls = parsers[i].feed(text)
                    if out.finished:
                        text += parsers[i].finish(out.finish_reason == "length")
                # As for completions, one event per step that made tokens; a tool parser
                # holds text back on purpose, and then only what it lets out is sent.
                tokens = parsers[i] is None and not thought and bool(out.delta_token_ids)
                if text or calls or thought or tokens or out.finished or req.logprobs:
                    delta: dict = {"content": text} if text or tokens else {}
                    if thought:
                        delta["reasoning_content"] = thought
                    if calls:
                        delta["tool_calls"] = calls
                    lp = (chat_logprobs(tok, output_entries(out, delta_only=True))
                          if req.logprobs else None)
                    called = bool(parsers[i] and parsers[i].calls)
                    yield chunk([{"index": i, "delta": delta, "logprobs": lp,
                                  "finish_reason": finish_reason(out, called)
                                  if out.finished else None,
                                  "stop_reason": out.stop_reason if out.finished else None}],
                                **so_far(i))
            if req.include_usage:
                yield chunk([], usage=usage(len(prompt), sum(n_out)))
        return sse(events())

    finals = await collect(request, streams)
    choices = []
    for i, o in enumerate(finals):
        message: dict = {"role": "assistant", "content": o.text}
        calls: list = []
        if parser:
            reasoning, message["content"] = ReasoningStream(parser).split(o.text)
            if req.include_reasoning:
                message["reasoning_content"] = reasoning
        if tool_list and message["content"]:
            message["content"], calls = parse_tool_calls(
                message["content"], req.parallel_tool_calls, o.finish_reason == "length")
            if calls:
                message["tool_calls"] = calls
        choices.append({"index": i, "message": message,
                        "logprobs": chat_logprobs(tok, output_entries(o)) if req.logprobs
                        else None,
                        "finish_reason": finish_reason(o, bool(calls)),
                        "stop_reason": o.stop_reason})
    response = {
        "id": rid, "object": "chat.completion", "created": created, "model": model,
        "choices": choices,
        "usage": usage(len(prompt), sum(len(o.token_ids) for o in finals)),
    }
    if req.prompt_logprobs is not None:  # vLLM puts it beside the choices for chat
        response["prompt_logprobs"] = vllm_prompt_logprobs(tok, prompt, finals[0].prompt_logprobs)
    return JSONResponse(response)


async def _chat_prompt(request: Request, req: ChatCompletionRequest):
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


# -- render: the token ids a request would run on (vllm-router's prefix routing) ------------


async def chat_render(request: Request, body: dict) -> JSONResponse:
    """What `/v1/chat/completions` would feed the model, without running it: vLLM's
    render endpoint, which vllm-router calls on every replica to route by prefix."""
    req = await off_loop_if_large(request, lambda: parse(ChatCompletionRequest, body))
    model = check_model(request, req.model)
    prompt, _, _ = await _chat_prompt(request, req)
    return JSONResponse(_rendered(req, model, prompt))


async def completions_render(request: Request, body: dict) -> JSONResponse:
    req = parse(CompletionRequest, body)
    model = check_model(request, req.model)
    inputs = engine(request).inputs
    raw = req.prompt
    if isinstance(raw, str) or (raw and all(isinstance(p, int) for p in raw)):
        raw = [raw]
    prompts = [await inputs.tokenize(p, add_special_tokens=req.add_special_tokens)
               if isinstance(p, str) else list(p) for p in raw]
    return JSONResponse([_rendered(req, model, p) for p in prompts])


def _rendered(req, model: str, token_ids: list[int]) -> dict:
    return {"request_id": req.request_id or new_id("render"), "token_ids": token_ids,
            "model": model, "stream": req.stream, "priority": req.priority,
            "cache_salt": req.cache_salt}
