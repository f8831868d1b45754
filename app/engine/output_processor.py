"""From sampled tokens to what callers receive: text deltas, logprobs, finish reasons.

The one place that decides whether a request is finished: an EOS or stop token,
a stop string (matched across token boundaries), `max_tokens`, or `max_model_len`.
The core then tells the scheduler, which frees the request's blocks.

Per token the work is O(1) in the request's length: one short detokenizer
window, the stop matcher's held-back tail, one list append.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from app.engine.detokenizer import IncrementalDetokenizer
from app.engine.outputs import RequestMetrics, RequestOutput
from app.engine.request import Request, RequestStatus
from app.engine.stop import StopStringMatcher
from models.tokenizer import FastDecoder


@dataclass
class _Tracked:
    """Output-side state of one live request."""

    request: Request
    detok: IncrementalDetokenizer
    stop: StopStringMatcher
    logprobs: list | None
    stop_reason: str | int | None = None
    # Deltas handed out so far (stop strings cut); joined once, at the end.
    parts: list[str] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, decoder: FastDecoder, max_model_len: int):
        self._decoder = decoder
        self.max_model_len = max_model_len
        self._tracked: dict[str, _Tracked] = {}

    def add(self, req: Request) -> None:
        p = req.params
        self._tracked[req.request_id] = _Tracked(
            req,
            IncrementalDetokenizer(self._decoder, req.prompt_token_ids, p.skip_special_tokens),
            StopStringMatcher(list(p.stop), p.include_stop_str_in_output),
            [] if p.logprobs is not None else None,
        )

    def request(self, request_id: str) -> Request | None:
        tracked = self._tracked.get(request_id)
        return None if tracked is None else tracked.request

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracked

    def __len__(self) -> int:
        return len(self._tracked)

    def advance(self, req: Request, tokens: list[int], logprobs: list
                ) -> tuple[str, list[int], RequestStatus | None]:
        """Account the step's new tokens of `req` (already in its output; several under
        speculative decoding) one by one: their text delta, the tokens delivered, and
        the finished status if one of them ends the request (the caller applies it
        through the scheduler). The output is cut after a finishing token, so a stop or
        `max_tokens` is never passed."""
        tracked = self._tracked[req.request_id]
        before = req.num_output_tokens - len(tokens)
        text = []
        for j, token in enumerate(tokens):
            if tracked.logprobs is not None:
                tracked.logprobs.append(logprobs[j])
            delta, status = self._advance(tracked, token, before + j + 1)
            text.append(delta)
            if status is not None:
                del req.output_token_ids[before + j + 1:]
                return "".join(text), tokens[:j + 1], status
        return "".join(text), tokens, None

    def emit(self, req: Request, delta: str, delta_ids: list[int],
             error: str | None = None) -> RequestOutput:
        """The output for this step; the last one of a finished (or aborted) request."""
        if not req.is_finished:
            return self._output(self._tracked[req.request_id], delta, delta_ids, False)
        tracked = self._tracked.pop(req.request_id)
        req.times.finished = time.monotonic()
        out = self._output(tracked, delta, delta_ids, finished=True)
        out.error = error
        return out

    def _advance(self, tracked: _Tracked, token: int, num_output: int
                 ) -> tuple[str, RequestStatus | None]:
        """The token's text delta and whether it finishes the request."""
        req, p = tracked.request, tracked.request.params
        status = None
        if req.grammar is not None and not req.grammar.accept_token(token):
            return "", RequestStatus.FINISHED_ERROR
        if req.grammar is not None and req.grammar.is_terminated():
            status = RequestStatus.FINISHED_STOPPED  # its stop token: the grammar is complete
            delta = ""
        elif token in req.eos_token_ids or token in p.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                tracked.stop_reason = token
            delta = ""  # the stop token itself is not text
        elif num_output <= p.min_tokens:
            # Like vLLM, stop strings only count once min_tokens are out; text passes as is.
            delta = tracked.detok.add(token)
        else:
            delta, matched = tracked.stop.feed(tracked.detok.add(token))
            if matched:
                status = RequestStatus.FINISHED_STOPPED
                tracked.stop_reason = tracked.stop.matched_stop
        if status is None and (
            num_output >= p.max_tokens
            or req.num_prompt_tokens + num_output >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None and not tracked.stop.matched:
            tail, matched = tracked.stop.feed(tracked.detok.flush())
            delta += tail if matched else tail + tracked.stop.flush()
            if matched:  # the held-back tail completed a stop string after all
                status = RequestStatus.FINISHED_STOPPED
                tracked.stop_reason = tracked.stop.matched_stop
        return delta, status

    def _output(self, tracked: _Tracked, delta: str, delta_ids: list[int],
                finished: bool) -> RequestOutput:
        req = tracked.request
        if delta:
            tracked.parts.append(delta)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            text="".join(tracked.parts) if finished else "",
            token_ids=req.output_token_ids,
            delta_text=delta,
            delta_token_ids=delta_ids,
            finished=finished,
            finish_reason=req.status.finish_reason if finished else None,
            stop_reason=tracked.stop_reason,
            logprobs=tracked.logprobs,
            delta_logprobs=(tracked.logprobs[-len(delta_ids):]
                            if tracked.logprobs is not None and delta_ids else None),
            # Timings matter at the first token (TTFT) and at the end; not built per token.
            metrics=RequestMetrics(req.times.arrival, req.times.first_scheduled,
                                   req.times.first_token, req.times.finished,
                                   req.num_preemptions, req.num_prefilled)
            if finished or req.num_output_tokens == 1 else None,
            prompt_logprobs=req.prompt_logprobs
            if finished or req.num_output_tokens == 1 else None,
            spec_decode_metrics=req.spec.metrics if finished and req.spec is not None else None,
        )
