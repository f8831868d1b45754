"""The one-row Q8_0 LM head (`q8_0_linear`, SmolLM2's 49152 x 576, bf16 x) against a
plain read of the same bytes, with its weights in cache (called again and again) and out
of it (a 1.2 GB sum between calls evicts them), as in a decode step, where the layers'
weights have pushed the head's out by the time it runs.

    python benchmarks/lm_head_cold.py [--calls 60]

Why: the head's rate alone, warm, says little about its share of a step; cold it waits
on memory, and the gap to the plain read is what a read-ahead can win. Calls of the two
are alternated so host noise hits both alike; prints medians (ms) and GB/s. The plain
read is torch's sum of the levels viewed as float32 and of the scales: vectorized and on
every thread, where an integer sum is neither.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from host import describe

from benchmarks.cpu_quant_linear_ab import random_weight
from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.panel_blocks import PanelBlocks
from models.gguf_blocks import QuantizedWeight

N, K = 49152, 576


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=60)
    a = ap.parse_args()
    torch.manual_seed(0)
    kernels = cpu_kernels()
    q, _ = random_weight(N, K, "q8_0")
    panels = PanelBlocks.of(QuantizedWeight("q8_0", *q, None))
    qweight, scales = panels.tensors
    x = torch.randn(1, K).bfloat16()
    big = torch.ones(1200 * 2**20 // 4)  # summed between cold calls: evicts the head
    level_words = qweight.view(torch.float32)
    nbytes = qweight.numel() + scales.numel() * 4
    sides = {"head": lambda: kernels.q8_0_linear(x, qweight, scales, N),
             "read": lambda: (level_words.sum(), scales.sum())}
    report = {"host": describe(), "bytes": nbytes}
    for cold in (False, True):
        times: dict[str, list[float]] = {s: [] for s in sides}
        for i in range(a.calls * (1 if cold else 4)):
            for side in sorted(sides, reverse=bool(i % 2)):
                if cold:
                    big.sum()
                t = time.perf_counter()
                sides[side]()
                times[side].append(time.perf_counter() - t)
        med = {s: statistics.median(v) * 1e3 for s, v in times.items()}
        key = "cold" if cold else "warm"
        report[key] = {s: round(ms, 3) for s, ms in med.items()}
        print(f"{key}: " + ", ".join(f"{s} {ms:.3f} ms ({nbytes / ms / 1e6:.1f} GB/s)"
                                     for s, ms in med.items()))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
