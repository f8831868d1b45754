"""A/B of a Q6_K layer's kernels (Q8_16 blocks, `q8_16_blocks.h`) per row count: the exact
kernel, the int8 one (x quantized per super-block of 256) and the unpacked route (the
panels widened to float32 per call, multiplied by oneDNN), on a 1.7B Q4_K_M's Q6_K
shapes, interleaved in one process so host noise hits all alike.
`routing.INT8_ONLY_MAX_ROWS` reads from it which rows the int8 kernel takes where it
gains at the fewest only (AVX2).

    RIDGELINE_CPU_ISA=avx2 python -m benchmarks.cpu_q8_16_int8_ab [--copies 4] [--reps 5] [OUT.json]

`--copies` distinct weights per shape (the 1.7B file has 12 `ffn_down` in Q6_K and the
head): a host's last-level cache can hold a few, which flatters the fewest rows; the
model's own step (`torch.profiler` on the model thread) is the check.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from gpu.cpu.capabilities import describe, resolve
from gpu.cpu.panel_blocks import PanelBlocks
from tests.test_gguf_types import random_blocks, rewritten

SHAPES = {"ffn_down": (2048, 8192), "lm_head": (49152, 2048)}  # (N, K)
ROWS = (1, 2, 4, 8, 16, 64, 128, 256)


def kernels(ops, weights: list[PanelBlocks], n: int, k: int) -> dict:
    """Each variant: x through every copy of the shape's weight."""
    panels = weights[0].tensors[0].shape[0]
    scratch = torch.empty(k, panels * 32)

    def unpacked(x, w):
        ops.q8_16_unpack(*w.tensors, 0, panels, scratch)
        return x @ scratch

    return {"exact": lambda x: [ops.q8_16_linear(x, *w.tensors, n) for w in weights],
            "int8": lambda x: [ops.q8_16_linear_int8(x, *w.tensors, n) for w in weights],
            "unpacked": lambda x: [unpacked(x, w) for w in weights]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--copies", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("out", nargs="?")
    a = ap.parse_args()
    caps = resolve()
    ops = torch.ops.ridgeline_cpu
    if not caps.has("q8_16_linear_int8"):
        raise SystemExit("this build has no q8_16_linear_int8")
    print(describe(caps))
    results = {}
    for name, (n, k) in SHAPES.items():
        weights = [PanelBlocks.of(rewritten("Q6_K", random_blocks("Q6_K", n, k, seed=i), n))
                   for i in range(a.copies)]
        variants = kernels(ops, weights, n, k)
        for rows in ROWS:
            x = torch.randn(rows, k)
            times = {v: [] for v in variants}
            for rep in range(a.reps):
                order = list(variants)[rep % 3:] + list(variants)[:rep % 3]
                for v in order:
                    variants[v](x)  # warm
                    t0 = time.perf_counter()
                    variants[v](x)
                    times[v].append((time.perf_counter() - t0) * 1e3)
            ms = {v: statistics.median(t) for v, t in times.items()}
            results[f"{name} rows={rows}"] = ms
            print(f"{name} {n}x{k} rows {rows:4d}: " + ", ".join(
                f"{v} {t:.2f} ms" for v, t in ms.items())
                + f"; int8/exact {ms['int8'] / ms['exact']:.2f}", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"capabilities": describe(caps), "copies": a.copies, "ms": results}, f,
                      indent=1)


if __name__ == "__main__":
    main()
