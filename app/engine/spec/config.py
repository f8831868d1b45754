"""`--speculative-config`: vLLM's JSON keys, parsed once into a frozen config.

A bad key or value fails at start, naming it. The keys are vLLM's where the meaning is
the same (`method`, `num_speculative_tokens`, `prompt_lookup_min`, `prompt_lookup_max`,
the `suffix_decoding_*` keys with vLLM's defaults, `model`, `disable_by_batch_size`);
the per-request back-off (`min_acceptance_rate`) and the draft model's window
(`draft_window`) are ours.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
NGRAM_DEFAULT = 5  # vLLM's prompt_lookup_max and _min when neither is given
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    # Required, except for suffix: there it defaults to the tree depth (vLLM's rule).
    num_speculative_tokens: int = 0
    # The n-gram proposer matches the sequence's last n tokens, n from max down to min.
    # One given: the other takes its value (vLLM's rule); neither: both NGRAM_DEFAULT.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # Suffix decoding (vLLM's keys and defaults): the trees' depth, which bounds the
    # match plus the draft; the requests whose outputs the global tree keeps (0: none,
    # oldest evicted first); the draft's length per matched token; the lowest estimated
    # probability (a frequency ratio) a drafted token may have.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Draft model: a model directory (or anything `--model` takes) sharing the
    # target's vocabulary, and the recent tokens it reads to draft (ours: it keeps no
    # KV cache and recomputes this window for each draft token).
    model: str | None = None
    draft_window: int = 128
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
            fail(f"method must be one of {METHODS}, got {self.method!r}")
        self._check_suffix(fail)
        if self.method == "suffix" and not self.num_speculative_tokens:
            object.__setattr__(self, "num_speculative_tokens", min(
                self.suffix_decoding_max_tree_depth, MAX_SPECULATIVE_TOKENS))
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
        if self.method == "draft_model" and not self.model:
            fail("method draft_model needs \"model\": the draft model's path or name")
        if self.method != "draft_model" and self.model is not None:
            fail(f"\"model\" is for method draft_model, not {self.method!r}")
        if not _is_int(self.draft_window) or not 8 <= self.draft_window <= 4096:
            fail(f"draft_window must be an int in [8, 4096], got {self.draft_window!r}")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            fail(f"disable_by_batch_size must be an int >= 1 or null, got {b!r}")
        if not isinstance(self.min_acceptance_rate, (int, float)) \
                or not 0.0 <= self.min_acceptance_rate < 1.0:
            fail(f"min_acceptance_rate must be in [0, 1), got {self.min_acceptance_rate!r}")

    def _check_suffix(self, fail) -> None:
        depth = self.suffix_decoding_max_tree_depth
        if not _is_int(depth) or not 2 <= depth <= 256:
            fail(f"suffix_decoding_max_tree_depth must be an int in [2, 256], got {depth!r}")
        cached = self.suffix_decoding_max_cached_requests
        if not _is_int(cached) or cached < 0:
            fail(f"suffix_decoding_max_cached_requests must be an int >= 0 (0: no global "
                 f"tree), got {cached!r}")
        factor = self.suffix_decoding_max_spec_factor
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            fail(f"suffix_decoding_max_spec_factor must be a number > 0, got {factor!r}")
        prob = self.suffix_decoding_min_token_prob
        if not isinstance(prob, (int, float)) or isinstance(prob, bool) or not 0 <= prob <= 1:
            fail(f"suffix_decoding_min_token_prob must be in [0, 1], got {prob!r}")

    def verify_shape(self) -> dict[str, int | None]:
        """What the model thread needs to capture verify steps (`gpu/verify_graphs.py`)
        and to profile the draft model's largest call, by `RunnerSpec`'s field names:
        drafts per row, the batch size that stops them, the draft model's window."""
        return {"num_speculative_tokens": self.num_speculative_tokens,
                "disable_by_batch_size": self.disable_by_batch_size,
                "draft_window": self.draft_window}

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
        if "num_speculative_tokens" not in value and value.get("method") != "suffix":
            raise ValueError("--speculative-config: num_speculative_tokens is required")
        return cls(**value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
