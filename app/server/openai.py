"""What the OpenAI routes share, and /v1/models.

Each generation route (`openai_completions.py`, `openai_chat.py`) reads as three steps:
the request becomes a plan (prompts, sampling params, ids, what to echo, parse or
split), the plan's outputs become a stream of chunks or one full response. The pieces
both shapes are built from live here, written once: the envelope every chunk and
response carries, a choice's finish and stop reasons, and the token counts in `usage`.
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import JSONResponse

from app.engine.outputs import RequestOutput
from app.server.protocol import new_id, now, usage
from app.server.state import engine, state


async def models(request: Request, body: None) -> JSONResponse:
    """The served model, then each LoRA adapter with the model as its `parent` and its
    directory as `root` (vLLM's shape)."""
    core, base = engine(request).core, state(request).model_names[0]
    created = now()
    data = [{"id": base, "object": "model", "created": created, "owned_by": "ridgeline",
             "root": base, "parent": None, "max_model_len": core.max_model_len}]
    for a in (core.loras.adapters.values() if core.loras is not None else ()):
        data.append({"id": a.name, "object": "model", "created": created,
                     "owned_by": "ridgeline", "root": a.path, "parent": base,
                     "max_model_len": core.max_model_len})
    return JSONResponse({"object": "list", "data": data})


def response_id(prefix: str, call_id: str, request_id: str | None) -> str:
    """The response's `id`: built from the client's `request_id` when it sent one, as
    vLLM's is; else the call's id, which `/abort_request` takes."""
    return f"{prefix}-{request_id}" if request_id else call_id


@dataclass(frozen=True)
class Envelope:
    """The fields around the choices of every chunk and of the full response."""

    id: str
    created: int
    model: str
    chunk_object: str  # "object" of a streamed chunk
    full_object: str  # "object" of the full response

    @classmethod
    def new(cls, prefix: str, request_id: str | None, model: str, chunk_object: str,
            full_object: str) -> tuple[Envelope, str]:
        """The envelope of a new call, and the call's id (the engine's request id)."""
        call_id, created = new_id(prefix), now()
        return cls(response_id(prefix, call_id, request_id), created, model, chunk_object,
                   full_object), call_id

    def chunk(self, choices: list[dict], **extra) -> dict:
        return self._body(self.chunk_object, choices, extra)

    def full(self, choices: list[dict], **extra) -> dict:
        return self._body(self.full_object, choices, extra)

    def _body(self, obj: str, choices: list[dict], extra: dict) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}


def finish(out: RequestOutput, called: bool = False) -> dict:
    """A choice's `finish_reason` and `stop_reason`: null until its last output. A stop
    after tool calls were parsed out of the text is "tool_calls", as OpenAI reports it."""
    if not out.finished:
        return {"finish_reason": None, "stop_reason": None}
    reason = "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason
    return {"finish_reason": reason, "stop_reason": out.stop_reason}


def total_usage(prompts: list[list[int]], completion_tokens: int) -> dict[str, int]:
    """A call's `usage`: each prompt counts once, however many samples (`n`) it has."""
    return usage(sum(map(len, prompts)), completion_tokens)


def request_metrics(finals: list[RequestOutput | None]) -> dict:
    """The call's `metrics` field, as vLLM's: `speculative_decoding` (each request's
    acceptance, with --per-request-spec-decode-metrics), only for a call of one sequence
    (one prompt, n = 1): for several it would describe one of them. In a stream it rides
    on the final usage chunk."""
    if len(finals) != 1 or finals[0] is None or finals[0].spec_decode_metrics is None:
        return {}
    return {"metrics": {"speculative_decoding": finals[0].spec_decode_metrics.to_dict()}}


class StreamUsage:
    """Token counts while a stream runs: vLLM's `continuous_usage_stats` on each chunk
    (the choice's prompt and its tokens so far), and the final `include_usage` chunk."""

    def __init__(self, prompts: list[list[int]], n: int, continuous: bool):
        self.prompts, self.n, self.continuous = prompts, n, continuous
        self.completion_tokens = [0] * (len(prompts) * n)

    def update(self, i: int, out: RequestOutput) -> None:
        # The deltas, not len(out.token_ids): that list is the request's own and may
        # already hold the next step's token when this output is read.
        self.completion_tokens[i] += len(out.delta_token_ids)

    def so_far(self, i: int) -> dict:
        """The extra fields of choice `i`'s chunk: its usage when asked for each chunk."""
        if not self.continuous:
            return {}
        return {"usage": usage(len(self.prompts[i // self.n]), self.completion_tokens[i])}

    def total(self) -> dict[str, int]:
        return total_usage(self.prompts, sum(self.completion_tokens))


def rendered(req, model: str, token_ids: list[int]) -> dict:
    """One prompt as the render routes return it (vllm-router routes by its prefix)."""
    return {"request_id": req.request_id or new_id("render"), "token_ids": token_ids,
            "model": model, "stream": req.stream, "priority": req.priority,
            "cache_salt": req.cache_salt}
