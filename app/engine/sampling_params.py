"""Per-request sampling and stopping parameters, validated on construction."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from app.engine.errors import InvalidParameter
from app.engine.grammar import StructuredOutput

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# Below this a temperature is greedy (vLLM's _SAMPLING_EPS): dividing logits by 1e-300
# overflows to inf and softmax to NaN.
GREEDY_BELOW = 1e-5
# The ranges of the sampling numbers. Each reaches the model thread as a float32, so each
# must keep the arithmetic finite there and still mean something:
# - temperature: OpenAI's [0, 2]. Past 2 the distribution is noise, and a float32 cannot
#   hold a temperature past 3.4e38 at all (logits / inf: NaN where a token is banned).
# - top_p: OpenAI's [0, 1]; 0 keeps the most likely token alone.
# - repetition_penalty: a seen token's positive logit is divided by it, a negative one
#   multiplied. Below 1e-45 a float32 penalty is 0 (logits / 0: inf, then NaN, then
#   token 0 forever); at 0.01 a repeated token already outweighs every other, so that is
#   the floor. Over 1 it only damps: 10 is the ceiling (vLLM, HF: any positive value).
# - presence/frequency penalties: OpenAI's [-2, 2]; logit_bias values OpenAI's
#   [-100, 100]; min_p a fraction of the heaviest token's weight, [0, 1].
# With every bound at its edge (bias 100, penalty 0.01, temperature 1e-5) a logit of 1e3
# is scaled to about 1e10: finite in float32 with 28 orders of magnitude to spare.
TEMPERATURE_RANGE = (0.0, 2.0)
TOP_P_RANGE = (0.0, 1.0)
MIN_P_RANGE = (0.0, 1.0)
PENALTY_RANGE = (-2.0, 2.0)  # presence and frequency
REPETITION_PENALTY_RANGE = (0.01, 10.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# Stop strings are matched on the event loop for every token: bounded, so one request
# cannot make that work (or the matcher's tables) large. OpenAI allows 4.
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
# prompt_logprobs' entries in one answer (prompt tokens x (k + 1)): ~30 MB of JSON, built
# off the event loop; a 100k-token prompt at k = 20 would be ~2M entries, ~90 MB.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 18
MAX_N = 64  # choices per request; each is a sequence in the batch
MAX_LOGIT_BIAS = 1024


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
    prompt_logprobs: int | None = None  # per prompt position: its token's and the top k
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    structured: StructuredOutput | None = None  # the output must match this grammar
    cache_salt: str | None = None  # prefix-cache blocks are shared only within one salt
    lora_name: str | None = None  # the LoRA adapter to generate with (None: the base model)
    n: int = field(default=1)

    def __post_init__(self) -> None:
        # Accept lists (JSON, user code) but store tuples so params stay hashable/frozen.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if isinstance(self.logit_bias, dict):  # JSON object keys are strings: "50256" -> 50256
            try:
                object.__setattr__(self, "logit_bias", {
                    int(k) if isinstance(k, str) and k.strip().isdigit() else k: v
                    for k, v in self.logit_bias.items()})
            except ValueError:
                pass
        self._validate()
        if self.temperature < GREEDY_BELOW:  # vLLM's rule: 1e-300 would divide into NaN
            object.__setattr__(self, "temperature", 0.0)

    def _validate(self) -> None:
        """Types and ranges of every field, so nothing unbounded reaches the model thread.

        Vocabulary-dependent checks (token ids, top_k above the vocabulary) are the
        engine's, which knows the model (`EngineCore.validate`)."""
        def check(ok: bool, param: str, msg: str) -> None:
            if not ok:
                raise InvalidParameter(param, msg)

        for name in ("max_tokens", "min_tokens", "top_k", "n"):
            value = getattr(self, name)
            check(_is_int(value), name, f"{name} must be an integer, got {value!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            value = getattr(self, name)
            check(_is_number(value) and math.isfinite(value), name,
                  f"{name} must be a finite number, got {value!r}")
        check(self.max_tokens >= 1, "max_tokens",
              f"max_tokens must be at least 1, got {self.max_tokens}")
        check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
              f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        for name, (low, high) in (("temperature", TEMPERATURE_RANGE), ("top_p", TOP_P_RANGE),
                                  ("min_p", MIN_P_RANGE), ("presence_penalty", PENALTY_RANGE),
                                  ("frequency_penalty", PENALTY_RANGE),
                                  ("repetition_penalty", REPETITION_PENALTY_RANGE)):
            value = getattr(self, name)
            check(low <= value <= high, name,
                  f"{name} must be in [{low:g}, {high:g}], got {value!r}")
        check(self.top_k >= -1, "top_k",  # above the vocabulary: clamped by the engine
              f"top_k must be -1 (off), 0 (off) or positive, got {self.top_k}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop",
              f"stop strings must be non-empty strings, got {list(self.stop)[:MAX_STOP_STRINGS]}")
        check(len(self.stop) <= MAX_STOP_STRINGS, "stop",
              f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        longest = max(map(len, self.stop), default=0)
        check(longest <= MAX_STOP_STRING_CHARS, "stop",
              f"stop strings may have at most {MAX_STOP_STRING_CHARS} characters, got one of "
              f"{longest}")
        check(all(_is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
              f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)[:8]}")
        check(len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
              f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or (_is_int(value) and 0 <= value <= 20), name,
                  f"{name} must be in [0, 20], got {value}")
        check(1 <= self.n <= MAX_N, "n", f"n must be in [1, {MAX_N}], got {self.n}")
        bias = self.logit_bias or {}
        check(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS, "logit_bias",
              f"logit_bias maps at most {MAX_LOGIT_BIAS} token ids to a bias")
        check(all(_is_int(t) and t >= 0 for t in bias), "logit_bias",
              "logit_bias keys must be token ids (non-negative integers)")
        low, high = LOGIT_BIAS_RANGE
        check(all(_is_number(b) and low <= b <= high for b in bias.values()), "logit_bias",
              f"logit_bias values must be numbers in [{low:g}, {high:g}]")
        check(self.seed is None or (_is_int(self.seed) and INT64_MIN <= self.seed <= INT64_MAX),
              "seed", f"seed must be a 64-bit integer, got {self.seed!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            check(isinstance(getattr(self, name), bool), name,
                  f"{name} must be true or false, got {getattr(self, name)!r}")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def out_of_range(values: Mapping[str, Any]) -> dict[str, str]:
    """Which of these SamplingParams fields a request could not set, and why: a
    checkpoint's defaults (`generation_config.json`) must keep to the same ranges, or
    every request that leaves the field unset would be refused for a value it never sent."""
    refused = {}
    for name, value in values.items():
        try:
            SamplingParams(**{"max_tokens": 1, name: value})
        except InvalidParameter as e:
            refused[name] = str(e)
    return refused


def check_prompt_logprobs(params: SamplingParams, prompt_tokens: int) -> None:
    """The answer's prompt_logprobs (each prompt position's token and its top k) within
    `MAX_PROMPT_LOGPROB_ENTRIES`: 400 naming the field otherwise."""
    k = params.prompt_logprobs
    if k is not None and prompt_tokens * (k + 1) > MAX_PROMPT_LOGPROB_ENTRIES:
        raise InvalidParameter(
            "prompt_logprobs", f"prompt_logprobs={k} on a {prompt_tokens}-token prompt asks for "
            f"{prompt_tokens * (k + 1)} entries; at most {MAX_PROMPT_LOGPROB_ENTRIES} are "
            "answered (fewer per position, or a shorter prompt)")
