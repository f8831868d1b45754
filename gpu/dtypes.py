"""The device and dtype a model is served in: `--device` and `--dtype auto` resolved.

One home for the choice, because the engine (the start-up log's reason), the plan (the
memory arithmetic before anything loads) and the model thread all make it and must
agree.
"""

from __future__ import annotations

import torch

from gpu.cpu.capabilities import onednn

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    return choose_dtype(name, device)[0]


def choose_dtype(name: str, device: torch.device, *, int8_activations: bool | None = False
                 ) -> tuple[torch.dtype, str]:
    """The dtype weights and KV are served in, and why (for the start-up log). The
    engine decides once and hands the model thread the result."""
    if name != "auto":
        return DTYPES[name], "asked for with --dtype"
    if device.type != "cuda":
        if int8_activations:
            return torch.float32, "auto: float32, the dtype --int8-activations runs in"
        return cpu_auto_dtype()
    if not torch.cuda.is_bf16_supported():
        return torch.float16, "auto: float16 on a CUDA device without bfloat16"
    return torch.bfloat16, "auto: bfloat16 on CUDA, half the bytes of float32"


def cpu_auto_dtype() -> tuple[torch.dtype, str]:
    """`--dtype auto` on CPU: bfloat16 where oneDNN multiplies bf16 (AMX, AVX512-BF16,
    AVX-NE-CONVERT), float32 elsewhere. Where bf16 arithmetic exists, bfloat16 is the
    faster path under load (docs/benchmarks.md runs both dtypes side by side), and
    SmolLM2's perplexity under it stays within the tolerance
    `tests/test_dtype_tolerance.py` holds it to (`docs/cpu.md`,
    "Which dtype `auto` picks"); elsewhere bf16 multiplies in float32 and gains nothing."""
    if onednn()[1]:
        return torch.bfloat16, ("auto: bfloat16 on a CPU with bf16 arithmetic (faster under "
                                "load; --dtype float32 for float32's exact tokens)")
    return torch.float32, ("auto: float32 on a CPU without bf16 arithmetic (a GGUF's layers "
                           "with int8 activations unless --no-int8-activations)")


def auto_serves_float32(name: str, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether `--dtype auto` (`name`) resolved to float32 on a CPU: a CPU without bf16
    arithmetic, where float32 was not asked for, so the defaults below may trade some of
    its exactness as bf16 does elsewhere."""
    return name == "auto" and device.type == "cpu" and dtype == torch.float32


def int8_activations_asked(asked: bool | None, name: str, dtype: torch.dtype,
                           device: torch.device) -> bool | None:
    """`--int8-activations` as the model thread takes it: as asked where it was; unset,
    None ("where the model's layers can": a GGUF's blocks and int8 kernels) where `--dtype
    auto` serves float32 on a CPU, else off. Why: a CPU without bf16 arithmetic (AVX2)
    has no half-width multiply to trade float32's exactness for, as bf16 is elsewhere;
    int8 x against the file's blocks is its trade, llama.cpp's in every call (x rounded
    per block of 32, finer than llama.cpp's K-quant path), at ~0.6x the exact kernels'
    time from a few rows up and less memory traffic at one (docs/cpu.md). `--dtype
    float32` asks for the exact path, so it stays exact."""
    if asked is not None:
        return asked
    return None if auto_serves_float32(name, dtype, device) else False


def kv_cache_dtype_asked(name: str, dtype_name: str, dtype: torch.dtype,
                         device: torch.device) -> str:
    """`--kv-cache-dtype` as the model thread takes it: as asked where it was; `auto` is
    bfloat16 where `--dtype auto` serves float32 on a CPU, else the model's. Why: as with
    int8 activations above, float32 there is not asked for but the lack of bf16
    arithmetic; a bf16 pool holds twice the tokens in `--kv-cache-memory` and halves a
    decode step's attention reads, attention still computing in float32, at a perplexity
    cost two orders of magnitude below int8 x's (docs/benchmarks.md, "CPU opt-in
    trades"). `--dtype float32` keeps the cache float32."""
    if name != "auto":
        return name
    return "bfloat16" if auto_serves_float32(dtype_name, dtype, device) else "auto"


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV pool's dtype: the model's, or bfloat16 under a float32 model on CPU (the C++
    attention kernels widen it to float32 as they read; elsewhere it is refused, naming
    why, rather than run in another dtype than asked)."""
    if name == "auto" or DTYPES.get(name) == dtype:
        return dtype
    if name == "bfloat16" and dtype == torch.float32 and device.type == "cpu":
        return torch.bfloat16
    raise ValueError(f"--kv-cache-dtype {name} is for a float32 model on CPU; this one is "
                     f"{str(dtype).removeprefix('torch.')} on {device} (use auto)")
