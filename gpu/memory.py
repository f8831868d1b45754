"""Where the KV pool comes from: the one place the memory arithmetic lives.

On CUDA the pool is what is left of `total × gpu_memory_utilization` after
weights (the draft model's too, under speculative decoding's `draft_model`), the peak
activations of a profiling forward (or of the draft model's largest call, if higher),
and the CUDA-graph estimate — or less, when memory was already in use as the runner started (another
process, or this one's CUDA context): `(1 - gpu_memory_utilization) × total` is always
left free. On CPU it is an explicit byte budget. Either way the numbers are
logged so that an operator can check each against the arithmetic. On CPU a model the
host cannot hold is refused before any weight is read (`check_host_memory`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from gpu.cpu.weight_arena import private_mapping

log = logging.getLogger("ridgeline.memory")

GiB = 1 << 30
DEFAULT_CPU_KV_BYTES = 1 * GiB


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    block_size: int
    bytes_per_token: int
    kv_bytes: int  # bytes the pool actually takes (whole blocks)
    weights_bytes: int
    max_model_len: int
    sliding_window: int | None = None  # the same window on every layer, else None

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def max_concurrency(self) -> float:
        """How many requests of max_model_len tokens fit at once."""
        return self.token_capacity / self.max_model_len

    @property
    def tokens_held_per_request(self) -> int:
        """KV a decoding request of max_model_len needs at once: all of it, or with a
        window on every layer only the blocks that overlap its last `window` positions."""
        if self.sliding_window is None:
            return self.max_model_len
        return min(self.max_model_len, window_kv_tokens(self.sliding_window, self.block_size))


def window_kv_tokens(window: int, block_size: int) -> int:
    """Slots of the blocks a sliding window can overlap: the W keys a new token sees
    (positions p - W + 1 .. p) span at most ceil((W - 1) / block_size) + 1 blocks."""
    return (-(-(window - 1) // block_size) + 1) * block_size


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes


def plan_kv_cache(
    *,
    bytes_per_token: int,
    block_size: int,
    max_model_len: int,
    weights_bytes: int,
    draft_bytes: int = 0,
    kv_cache_memory: int | None = None,
    total_device_bytes: int | None = None,
    free_device_bytes: int | None = None,
    gpu_memory_utilization: float = 0.9,
    peak_activation_bytes: int = 0,
    graph_bytes: int = 0,
    num_blocks: int | None = None,
    sliding_window: int | None = None,
    fit_max_model_len: bool = False,
) -> KVPlan:
    """Size the pool and log the arithmetic. Priority: num_blocks > kv_cache_memory > GPU.

    `free_device_bytes` is what was free before the weights loaded (None: all of it);
    `draft_bytes` is the draft model's weights, loaded beside the target's.
    `fit_max_model_len` (no length was asked for: `max_model_len` is the model's whole
    context): a pool that cannot hold one sequence of it lowers it, with a log line that
    says so and why, where an asked-for length it cannot hold is refused."""
    if num_blocks is not None:
        budget = num_blocks * block_size * bytes_per_token
    elif kv_cache_memory is not None:
        budget = kv_cache_memory
    elif total_device_bytes is not None:
        usable = int(total_device_bytes * gpu_memory_utilization)
        headroom = total_device_bytes - usable  # always left free
        free = total_device_bytes if free_device_bytes is None else free_device_bytes
        in_use = total_device_bytes - free
        usable = min(usable, free - headroom)
        budget = usable - (weights_bytes + draft_bytes + peak_activation_bytes + graph_bytes)
        draft = f"- draft model {draft_bytes / GiB:.2f} GiB " if draft_bytes else ""
        log.info(
            "GPU memory: total %.2f GiB x utilization %.2f (%.2f GiB already in use at start) "
            "- weights %.2f GiB %s- peak activations %.2f GiB - CUDA graphs %.2f GiB "
            "= %.2f GiB for the KV cache",
            total_device_bytes / GiB, gpu_memory_utilization, in_use / GiB, weights_bytes / GiB,
            draft, peak_activation_bytes / GiB, graph_bytes / GiB, budget / GiB,
        )
    else:
        budget = DEFAULT_CPU_KV_BYTES
    blocks = num_blocks if num_blocks is not None else budget // (block_size * bytes_per_token)
    plan = KVPlan(
        num_blocks=blocks,
        block_size=block_size,
        bytes_per_token=bytes_per_token,
        kv_bytes=blocks * block_size * bytes_per_token,
        weights_bytes=weights_bytes,
        max_model_len=max_model_len,
        sliding_window=sliding_window if sliding_window and sliding_window < max_model_len
        else None,
    )
    if plan.token_capacity < max_model_len and fit_max_model_len and plan.token_capacity:
        log.warning("max_model_len lowered from %d (the model's context) to %d: the KV cache "
                    "holds %d tokens (%.3f GiB); give it more (--kv-cache-memory / "
                    "--gpu-memory-utilization) or choose --max-model-len",
                    max_model_len, plan.token_capacity, plan.token_capacity, budget / GiB)
        return plan_kv_cache(
            bytes_per_token=bytes_per_token, block_size=block_size,
            max_model_len=plan.token_capacity, weights_bytes=weights_bytes,
            num_blocks=blocks, sliding_window=sliding_window)
    if plan.token_capacity < max_model_len:
        raise ValueError(
            f"the KV cache holds {plan.token_capacity} tokens ({budget / GiB:.3f} GiB at "
            f"{bytes_per_token} bytes/token), fewer than max_model_len={max_model_len}: "
            f"give it more memory (--kv-cache-memory / --gpu-memory-utilization) or lower "
            f"--max-model-len"
        )
    log.info("Model weights take %.2f GiB", weights_bytes / GiB)
    log.info("KV cache bytes per token: %d", bytes_per_token)
    log.info("Available KV cache memory: %.2f GiB", plan.kv_bytes / GiB)
    log.info("KV cache size: %d tokens (%d blocks of %d)", plan.token_capacity, blocks, block_size)
    log.info(
        "Maximum concurrency for %d tokens per request: %.2fx",
        max_model_len, plan.max_concurrency,
    )
    if plan.sliding_window is not None:
        held = plan.tokens_held_per_request
        log.info(
            "Sliding window of %d tokens on every layer: a request needs at most %d tokens "
            "of KV at a time instead of %d; freeing the blocks that leave its window raises "
            "the maximum concurrency at %d tokens per request to %.2fx",
            plan.sliding_window, held, max_model_len, max_model_len, plan.token_capacity / held,
        )
    return plan


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """One layer's K or V pool, all zeros, so that stale NaNs can never leak through a mask.

    On CPU it is a private anonymous memory mapping, which the kernel hands out as zero
    pages on first touch: the pool costs nothing at start (writing zeros would cost a
    pass over the whole budget), and memory no request ever used is never faulted in.
    The tensor keeps the mapping alive. Private, not mmap's default shared mapping:
    shared anonymous memory is shmem, slower to fault in, and outside the host's
    transparent-huge-page setting, which a private mapping follows (where it is
    `always`, the pool gets huge pages).

    The pool is not advised onto huge pages (MADV_HUGEPAGE) itself. Touched in advance
    they make the decode kernel faster, but the first touch is where they cost: with
    memory full of page cache, faulting them in can take seconds while the kernel
    compacts memory, and a server would pay that inside its first steps, as latency
    spikes."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    return torch.frombuffer(private_mapping(nbytes), dtype=dtype).view(shape)


def mem_available() -> int | None:
    """The host's MemAvailable (what can be allocated without swapping), or None."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def checkpoint_bytes(model_dir: str | Path) -> int:
    """Bytes of the weights on disk: the directory's safetensors, and the GGUF its blocks
    are read from (`models/gguf_blocks.py`), where it has one."""
    from models import gguf_blocks

    total = sum(p.stat().st_size for p in Path(model_dir).glob("*.safetensors"))
    blocks = gguf_blocks.load(model_dir)
    path = getattr(blocks, "gguf_path", None)
    return total + (Path(path).stat().st_size if path is not None else 0)


def check_host_memory(model_dir: str | Path, dense_bytes: int, kv_bytes: int | None) -> None:
    """Refuse, before any weight is read, a model whose weights and KV pool cannot fit in
    the host's available memory, with the arithmetic. The weights' floor is the smaller
    of the dense parameters in the serving dtype and the checkpoint on disk (a GGUF served
    from its blocks holds at least the file's bytes), so a model that fits is never
    refused; one that cannot fit is, rather than loading until the machine runs out."""
    available = mem_available()
    if available is None:
        return
    weights = min(dense_bytes, checkpoint_bytes(model_dir) or dense_bytes)
    kv = kv_bytes if kv_bytes is not None else DEFAULT_CPU_KV_BYTES
    if weights + kv > available:
        raise ValueError(
            f"this host cannot hold the model: its weights take at least {weights / GiB:.2f} "
            f"GiB and the KV cache {kv / GiB:.2f} GiB, {(weights + kv) / GiB:.2f} GiB in all, "
            f"but {available / GiB:.2f} GiB is available (MemAvailable): free memory, serve "
            "a smaller or more quantized model, or lower --kv-cache-memory")

