"""The device's two roofs, measured once at start: copy bandwidth and matmul throughput.

Spec sheets give peaks no kernel reaches, and on a CPU (or a shared VM) nobody knows
them; a measurement takes a few hundred milliseconds and is what the roofline of
`gpu/roofline.py` is drawn against. Both are best-of-a-few figures in the conditions
the model runs in (its dtype, its torch threads):

- bandwidth: a device-to-device copy of a buffer as large as the weights (bounded; on
  CPU twice the last-level cache, 64-256 MiB: the copy's reads and writes span four
  times the cache, and a larger buffer only adds page faults to the start at the same
  GB/s), counting the bytes
  read and the bytes written, as a step's traffic is counted;
- matmul: a square matmul in the served dtype through `F.linear`, the model's own
  path (1024 on CPU, 8192 on CUDA: large enough to reach the plateau). With
  `--int8-activations` the model's own path is the int8 kernel on Q4_1 blocks, so that
  is what is timed: against fp32's peak its prefill steps read an MFU above 100 %.

Measured once per process and device: the engines of one process (tests) share it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu.roofline import DevicePeaks

log = logging.getLogger("ridgeline.peaks")

MiB = 1 << 20
_MEASURED: dict[tuple, DevicePeaks] = {}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best_seconds(device: torch.device, fn: Callable[[], object], min_iters: int = 2,
                  budget_s: float = 0.05) -> float:
    """The fastest of a few timed calls after one warm-up (noise only ever slows a call)."""
    fn()
    _sync(device)
    best, spent, iters = float("inf"), 0.0, 0
    while iters < min_iters or (spent < budget_s and iters < 20):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        dt = time.perf_counter() - t0
        best, spent, iters = min(best, dt), spent + dt, iters + 1
    return best


def copy_buffer_bytes(device: torch.device, weights_bytes: int) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(max(64 * MiB, min(1024 * MiB, weights_bytes, free // 8)))
    return max(64 * MiB, min(256 * MiB, 2 * _last_level_cache_bytes()))


def _last_level_cache_bytes() -> int:
    """The CPU's largest cache as Linux reports it (0 where it does not)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KM")) * scale)
        except ValueError:
            continue
    return max(sizes, default=0)


def measure_peaks(device: torch.device, dtype: torch.dtype, weights_bytes: int = 0,
                  int8_kernels=None) -> DevicePeaks:
    """Measure (or recall) the device's copy bandwidth and matmul throughput (through
    the C++ `int8_kernels` when the model's matmuls run there)."""
    key = (str(device), dtype, torch.get_num_threads(), int8_kernels is not None)
    if key in _MEASURED:
        return _MEASURED[key]
    t_start = time.perf_counter()
    n = copy_buffer_bytes(device, weights_bytes)
    copy_s = _copy_seconds(device, n)
    m = 8192 if device.type == "cuda" else 1024
    mm_s = (_int8_matmul_seconds(int8_kernels, m) if int8_kernels is not None
            else _matmul_seconds(device, dtype, m))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    name = str(dtype).removeprefix("torch.") + (
        " with int8 activations" if int8_kernels is not None else "")
    threads = f", {torch.get_num_threads()} threads" if device.type == "cpu" else ""
    peaks = DevicePeaks(
        bandwidth=2 * n / copy_s, flops=2 * m**3 / mm_s, device=_describe(device), dtype=name,
        how=f"measured in {time.perf_counter() - t_start:.2f} s: a {n // MiB} MiB copy, "
            f"a {m}x{m}x{m} {name} matmul{threads}")
    _MEASURED[key] = peaks
    return peaks


def _copy_seconds(device: torch.device, n: int) -> float:
    src = torch.ones(n, dtype=torch.uint8, device=device)  # touched: no zero-page reads
    dst = torch.zeros_like(src)
    return _best_seconds(device, lambda: dst.copy_(src))


def _matmul_seconds(device: torch.device, dtype: torch.dtype, m: int) -> float:
    x = torch.randn(m, m, device=device, dtype=dtype)
    w = torch.randn(m, m, device=device, dtype=dtype)
    return _best_seconds(device, lambda: F.linear(x, w))


def _int8_matmul_seconds(kernels, m: int) -> float:
    """An m x m x m matmul as `--int8-activations` runs it: x quantized to int8 against
    Q4_1 blocks (random levels; f16 scales, as `PanelBlocks` requires)."""
    from gpu.cpu.panel_blocks import PanelBlocks
    from models.gguf_blocks import QuantizedWeight

    blocks = m // 32
    weight = QuantizedWeight("q4_1", torch.randint(0, 256, (m, m // 2), dtype=torch.uint8),
                             torch.rand(m, blocks).half().float(),
                             torch.rand(m, blocks).half().float())
    tensors = PanelBlocks.of(weight).tensors
    x = torch.randn(m, m)
    return _best_seconds(torch.device("cpu"), lambda: kernels.q4_1_linear_int8(x, *tensors, m))


def _describe(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.backends.cpu.get_cpu_capability()})"
