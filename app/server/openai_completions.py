"""/v1/completions and its render route, in three steps: the request becomes a
`CompletionPlan`, then the plan's outputs become a stream of chunks or a full response.

Choice `i` is sample `i % n` of prompt `i // n` (`streaming.queue_all`).
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
from app.server.body_checks import answer
from app.server.errors import APIError, parse
from app.server.logprobs import (
    completion_logprobs,
    output_entries,
    prompt_entries,
    vllm_prompt_logprobs,
)
from app.server.openai import (
    Envelope,
    StreamUsage,
    finish,
    rendered,
    request_metrics,
    total_usage,
)
from app.server.protocol import CompletionRequest
from app.server.state import check_model, default_max_tokens, engine
from app.server.streaming import collect, queue_all, sse, started
from app.server.structured import compiled, from_openai


async def completions(request: Request, body: dict) -> JSONResponse | EventSourceResponse:
    plan = await plan_completion(request, parse(CompletionRequest, body))
    streams = queue_all(request, plan.prompts, plan.params, plan.req.priority, plan.call_id,
                        plan.req.request_id, whole_answer=not plan.req.stream)
    if plan.req.stream:
        return sse(completion_chunks(plan, await started(request, streams)))
    finals = await collect(request, streams)
    return await answer(lambda: completion_response(plan, finals),
                        plan.req.prompt_logprobs is not None)


async def completions_render(request: Request, body: dict) -> JSONResponse:
    """The token ids `/v1/completions` would run on, one entry per prompt."""
    req = parse(CompletionRequest, body)
    model = check_model(request, req.model)
    return JSONResponse([rendered(req, model, p) for p in await tokenized(request, req)])


# -- 1. request -> plan --------------------------------------------------------------------


@dataclass(frozen=True)
class CompletionPlan:
    """A checked /v1/completions request: what to run and how to answer it."""

    req: CompletionRequest
    envelope: Envelope
    call_id: str
    prompts: list[list[int]]
    params: SamplingParams
    tokenizer: Any
    # echo with max_tokens 0 scores the prompt alone (vLLM's rule): one token is still
    # generated, and counted, but not returned.
    prompt_only: bool
    echoed: list[str] | None  # each prompt's text, put in front of its choices' text

    def text_and_entries(self, i: int, out: RequestOutput, first: bool) -> tuple[str, list]:
        """Choice `i`'s text and logprob entries in `out`, with the prompt in front of
        the choice's first text when echoed."""
        entries = output_entries(out, delta_only=not first or self.req.stream)
        text = out.delta_text if self.req.stream else out.text
        if self.prompt_only:
            entries, text = [], ""
        if self.echoed is not None and first:
            prompt = self.prompts[i // self.params.n]
            entries = prompt_entries(prompt, out.prompt_logprobs) + entries
            text = self.echoed[i // self.params.n] + text
        return text, entries

    def logprobs(self, entries: list, offset: int = 0) -> dict | None:
        if self.req.logprobs is None:
            return None
        return completion_logprobs(self.tokenizer, entries, offset)


async def tokenized(request: Request, req: CompletionRequest) -> list[list[int]]:
    """The prompts as token ids: `prompt` is one prompt or a list, each text or ids."""
    raw = req.prompt
    if isinstance(raw, str) or (raw and all(isinstance(p, int) for p in raw)):
        raw = [raw]  # one prompt, as text or as token ids
    inputs = engine(request).inputs
    return [await inputs.tokenize(p, add_special_tokens=req.add_special_tokens)
            if isinstance(p, str) else list(p) for p in raw]


async def plan_completion(request: Request, req: CompletionRequest) -> CompletionPlan:
    model = check_model(request, req.model)
    prompts = await tokenized(request, req)
    if not prompts:
        raise APIError(400, "prompt must not be empty", "prompt")
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
    envelope, call_id = Envelope.new("cmpl", req.request_id, model, "text_completion",
                                     "text_completion")
    inputs = engine(request).inputs
    echoed = [await inputs.detokenize(p, "echo") for p in prompts] if req.echo else None
    return CompletionPlan(req, envelope, call_id, prompts, params,
                          engine(request).core.tokenizer, prompt_only, echoed)


# -- 2. the stream ---------------------------------------------------------------------------


async def completion_chunks(plan: CompletionPlan, outputs: AsyncIterator[tuple[int, RequestOutput]]
                            ) -> AsyncIterator[dict]:
    req = plan.req
    counts = StreamUsage(plan.prompts, plan.params.n, req.continuous_usage)
    seen: set[int] = set()
    finals: list[RequestOutput | None] = [None] * len(counts.completion_tokens)
    offset = [0] * len(counts.completion_tokens)  # text sent so far: logprobs' text_offset
    async for i, out in outputs:
        counts.update(i, out)
        if out.finished:
            finals[i] = out
        first = i not in seen
        seen.add(i)
        text, entries = plan.text_and_entries(i, out, first)
        # One event per step that made tokens, even when their text is held back (a
        # partial UTF-8 character, a possible stop string), as vLLM does: clients time
        # inter-token latency by events.
        if text or out.delta_token_ids or out.finished or req.logprobs is not None:
            lp = plan.logprobs(entries, offset[i])
            offset[i] += len(text)
            yield plan.envelope.chunk([{"index": i, "text": text, "logprobs": lp,
                                        **finish(out)}], **counts.so_far(i))
    if req.include_usage:
        yield plan.envelope.chunk([], usage=counts.total(), **request_metrics(finals))


# -- 3. the full response ----------------------------------------------------------------------


def completion_response(plan: CompletionPlan, finals: list[RequestOutput]) -> dict:
    choices = []
    for i, out in enumerate(finals):
        text, entries = plan.text_and_entries(i, out, first=True)
        choice = {"index": i, "text": text, "logprobs": plan.logprobs(entries), **finish(out)}
        if plan.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                plan.tokenizer, plan.prompts[i // plan.params.n], out.prompt_logprobs)
        choices.append(choice)
    n_out = sum(len(out.token_ids) for out in finals)
    return plan.envelope.full(choices, usage=total_usage(plan.prompts, n_out),
                              **request_metrics(finals))
