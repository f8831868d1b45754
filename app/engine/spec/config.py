"""`--speculative-config`: vLLM's JSON keys, parsed once into a frozen config.

A bad key or value fails at start, naming it. The keys are vLLM's where the meaning is
the same (`method`, `num_speculative_tokens`, `prompt_lookup_min`, `prompt_lookup_max`,
`disable_by_batch_size`); the per-request back-off (`min_acceptance_rate`) is ours.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram",)  # vLLM's "suffix" and "draft_model" are not built yet
NGRAM_DEFAULT = 5  # vLLM's prompt_lookup_max and _min when neither is given
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 0  # required
    # The n-gram proposer matches the sequence's last n tokens, n from max down to min.
    # One given: the other takes its value (vLLM's rule); neither: both NGRAM_DEFAULT.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # Running requests at or above which no request speculates: a large batch is no
    # longer memory-bound, and the drafts' extra rows cost real compute there.
    disable_by_batch_size: int | None = 8
    # Per request: below this share of drafted tokens accepted (a running average), the
    # request stops drafting for a while (doubling pauses; 0: never pause).
    min_acceptance_rate: float = 0.2

    def __post_init__(self) -> None:
        def fail(why: str) -> None:
            raise ValueError(f"--speculative-config: {why}")

        if self.method not in METHODS:
            fail(f"method must be one of {METHODS} (suffix and draft_model are not built "
                 f"yet), got {self.method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            fail(f"num_speculative_tokens must be an int in [1, {MAX_SPECULATIVE_TOKENS}], "
                 f"got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = NGRAM_DEFAULT
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        for name, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                fail(f"{name} must be an int >= 1, got {value!r}")
        if lo > hi:
            fail(f"prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            fail(f"disable_by_batch_size must be an int >= 1 or null, got {b!r}")
        if not isinstance(self.min_acceptance_rate, (int, float)) \
                or not 0.0 <= self.min_acceptance_rate < 1.0:
            fail(f"min_acceptance_rate must be in [0, 1), got {self.min_acceptance_rate!r}")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig | None
              ) -> SpeculativeConfig | None:
        """From the flag's JSON, `LLM(speculative_config={...})`'s dict, or a config."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            if not value.strip():
                return None
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(f"--speculative-config must be a JSON object, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown} (known: "
                             f"{sorted(known)})")
        if "num_speculative_tokens" not in value:
            raise ValueError("--speculative-config: num_speculative_tokens is required")
        return cls(**value)
