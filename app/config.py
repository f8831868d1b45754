"""Engine configuration: small frozen dataclasses validated on construction.

A bad value fails at start, naming the value and the limit, not deep in a step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREEMPTION_POLICIES = ("newest", "priority", "length")
DTYPES = ("float32", "bfloat16", "float16", "auto")

_SIZE_RE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_bytes(text: str | int) -> int:
    """'2GiB' → 2147483648, '512MB' → 512e6, 1000 → 1000."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot parse a byte size from {text!r} (examples: 1073741824, 2GiB)")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_queued_requests: int | None = None  # None: unbounded
    preemption_policy: str = "newest"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(
                f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.preemption_policy not in PREEMPTION_POLICIES:
            raise ValueError(
                f"preemption_policy must be one of {PREEMPTION_POLICIES}, "
                f"got {self.preemption_policy!r}"
            )
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; CPU default chosen by the memory planner
    gpu_memory_utilization: float = 0.9
    num_blocks_override: int | None = None  # tests: an exact pool size

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.num_blocks_override is not None and self.num_blocks_override < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks_override}")


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # None: the embedded default (SmolLM2-135M-Instruct)
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    device: str = "auto"
    seed: int = 0
    enforce_eager: bool = False
    attention_backend: str = "auto"  # auto | torch | triton
    max_model_len: int | None = None  # None: from the model, capped by scheduler default
    scheduler: SchedulerConfig = SchedulerConfig()
    cache: CacheConfig = CacheConfig()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(
                f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}"
            )
