"""What a caller receives: a delta per step while streaming, the whole text at the end,
and what each step reports about itself."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None
    first_token_time: float | None
    finished_time: float | None
    num_preemptions: int = 0
    prefill_tokens: int = 0  # computed for it, recomputes included (wasted if it aborts)

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass
class RequestSpecDecodeMetrics:
    """One request's verifications under speculative decoding, on its final output with
    `--per-request-spec-decode-metrics summary|detailed` (vLLM's class of the same name;
    `to_dict` is the response's `metrics.speculative_decoding`). `histogram[j]`: the
    steps that accepted exactly j drafts; `detailed` also keeps each step's accepted and
    drafted counts, in order (O(steps) memory, hence its own level)."""

    num_spec_tokens: int
    histogram: list[int]
    num_draft_tokens: int = 0
    per_step_accepted: list[int] | None = None
    per_step_drafted: list[int] | None = None

    @classmethod
    def new(cls, num_spec_tokens: int, detailed: bool) -> RequestSpecDecodeMetrics:
        return cls(num_spec_tokens, [0] * (num_spec_tokens + 1),
                   per_step_accepted=[] if detailed else None,
                   per_step_drafted=[] if detailed else None)

    def observe(self, drafted: int, accepted: int) -> None:
        self.histogram[accepted] += 1
        self.num_draft_tokens += drafted
        if self.per_step_accepted is not None:
            self.per_step_accepted.append(accepted)
            self.per_step_drafted.append(drafted)

    def to_dict(self) -> dict:
        """vLLM's `SpeculativeDecodingMetrics`: the mean acceptance length counts the
        target's own token (1.0: no draft kept, or no step drafted); the acceptance rate
        counts drafts only."""
        steps = sum(self.histogram)
        accepted = sum(j * count for j, count in enumerate(self.histogram))
        out = {"mean_acceptance_length": 1.0 + accepted / steps if steps else 1.0,
               "draft_acceptance_rate": (accepted / self.num_draft_tokens
                                         if self.num_draft_tokens else 0.0),
               "acceptance_histogram": list(self.histogram), "num_spec_steps": steps,
               "num_accepted_draft_tokens": accepted,
               "num_draft_tokens": self.num_draft_tokens,
               "num_spec_tokens": self.num_spec_tokens}
        if self.per_step_accepted is not None:
            out["per_step_accepted"] = list(self.per_step_accepted)
            out["per_step_drafted"] = list(self.per_step_drafted)
        return out


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    text: str  # the whole generated text; filled in on the final output only
    token_ids: list[int]  # every generated token so far
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None  # what went wrong, with finish_reason "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that matched
    logprobs: list | None = None  # per generated token: (logprob, [(id, logprob), ...])
    delta_logprobs: list | None = None  # the entries for delta_token_ids only
    # Per prompt position (first None): (logprob, rank, [(id, logprob), ...]); on the
    # first and the final output of a request that asked for them.
    prompt_logprobs: list | None = None
    metrics: RequestMetrics | None = None
    # On the final output, with --per-request-spec-decode-metrics (vLLM's
    # CompletionOutput.spec_decode_metrics).
    spec_decode_metrics: RequestSpecDecodeMetrics | None = None


@dataclass(frozen=True)
class StepStats:
    """What one step did and left behind; shipped with its outputs (vLLM v1's habit),
    so the loop records them instead of reading the scheduler's counters."""

    prompt_tokens: int = 0  # prefill tokens computed (recompute after preemption included)
    generation_tokens: int = 0
    preemptions: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0  # tokens of requests started this step, looked up
    prefix_cache_hits: int = 0  # ... found in the prefix cache
    # Where the step sat on the roofline (gpu/roofline.py): its work from the batch's
    # shape and the model thread's time for it; 0 for steps that did not run.
    model_seconds: float = 0.0
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    # Speculative decoding: the step's verifications (vLLM's spec_decode_* counts);
    # accepted_per_pos[i]: drafts at position i the target accepted.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


@dataclass
class StepOutputs:
    outputs: list[RequestOutput]
    stats: StepStats
