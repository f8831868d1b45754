"""Per-request sampling and stopping parameters, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.engine.errors import InvalidParameter


@dataclass(frozen=True)
class SamplingParams:
    """What to generate and when to stop, with vLLM's names and meanings.

    temperature 0 means greedy. `stop` strings are matched on the text and cut
    from the output; `stop_token_ids`, like EOS, end the request (the token is
    not shown as text). `min_tokens` masks EOS and stop ids until reached.
    `seed` makes sampling reproducible regardless of the batch it runs in.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: int | None = None
    n: int = field(default=1)

    def __post_init__(self) -> None:
        # Accept lists (JSON, user code) but store tuples so params stay hashable/frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise InvalidParameter(param, msg)

        check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            f"max_tokens must be at least 1, got {self.max_tokens}",
        )
        check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
        )
        check(self.temperature >= 0.0, "temperature",
              f"temperature must be non-negative, got {self.temperature}")
        check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        check(self.top_k == -1 or self.top_k >= 0, "top_k",
              f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
              f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
              f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(self.repetition_penalty > 0.0, "repetition_penalty",
              f"repetition_penalty must be positive, got {self.repetition_penalty}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop",
              f"stop strings must be non-empty strings, got {list(self.stop)}")
        check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)}")
        check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs",
              f"logprobs must be in [0, 20], got {self.logprobs}")
        check(self.n == 1, "n", f"only n=1 is supported, got {self.n}")
        check(self.seed is None or isinstance(self.seed, int), "seed",
              f"seed must be an integer, got {self.seed!r}")
