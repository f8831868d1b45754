"""A request's life on the event loop: tokens, progress through the cache, status."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from app.engine.sampling_params import SamplingParams
from gpu.batch import SamplingRow


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, to recompute its cache from scratch
    FINISHED_STOPPED = "stop"  # EOS, a stop token id, or a stop string
    FINISHED_LENGTH = "length"  # max_tokens or max_model_len
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # its step or its sampling failed; the engine goes on
    FINISHED_SHED = "shed"  # left the queue unstarted: it could not make its deadline

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
            RequestStatus.FINISHED_ERROR,
            RequestStatus.FINISHED_SHED,
        )

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.finished else None


@dataclass
class RequestTimes:
    arrival: float = field(default_factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass(frozen=True)
class RequestSLO:
    """What the client needs (see `admission.py`); each optional."""

    ttft_deadline: float | None = None  # time.monotonic() by which the first token is due
    tpot_target: float | None = None  # seconds per output token
    # time.monotonic() by which the whole answer is due: a client timeout on a request
    # whose answer is one piece (not streamed) and whose max_tokens the client chose.
    deadline: float | None = None


@dataclass(eq=False)
class Request:
    """One generation. `num_computed_tokens` counts tokens whose K/V are in the cache.

    Invariant: 0 <= num_computed_tokens <= num_tokens, and the request needs a
    sampled token exactly when a step brings num_computed_tokens up to num_tokens.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    priority: int = 0  # lower value = more important (vLLM's convention)
    arrival_seq: int = 0  # tie-breaker: admission order
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    times: RequestTimes = field(default_factory=RequestTimes)
    sampling: SamplingRow | None = None  # built by the core at admission
    slo: RequestSLO = RequestSLO()
    num_prefilled: int = 0  # prefill tokens computed for it, recomputes included
    # Prefix cache: the names of its full blocks (a hash chain), and how many of its
    # blocks are named in the cache index.
    block_names: list[int] = field(default_factory=list)
    num_registered_blocks: int = 0
    # With params.prompt_logprobs: per prompt position, (logprob, rank, top pairs); the
    # first position has none (None).
    prompt_logprobs: list | None = None
    grammar: Any = None  # an xgrammar GrammarMatcher, with params.structured
    spec: Any = None  # its drafting record under speculative decoding (`SpecProgress`)
    lora_id: int = 0  # its LoRA adapter (`app/engine/loras.py`); 0: the base model

    @property
    def cache_key(self) -> Any:
        """What its prefix-cache block names are keyed by besides tokens: the cache salt,
        and the adapter (KV computed under one adapter is never another's)."""
        salt = self.params.cache_salt
        return salt if not self.lora_id else (salt, "lora", self.lora_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def tokens_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
