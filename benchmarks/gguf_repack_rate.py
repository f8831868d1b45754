"""How fast the load rewrites a GGUF's blocks into the kernels' panels: the C++ op
`gguf_repack_panels_` alone, on random blocks of Llama-3.1-8B's shapes, its outputs
already touched (so no page faults: the rewrite's own work, which every start pays per
gigabyte of the file).

    python benchmarks/gguf_repack_rate.py [--reps 5] [--out OUT.json]

Shapes: a Q4_K MLP weight (14336 x 4096, and 4096 x 14336 as the down projection), as
a layer on the dot-product or AMX kernels holds it (pairs, codes and supers; no panel
levels), and a Q6_K down projection (6-bit panel levels, codes and supers). Reports the
best of `reps` calls per shape, in ms and in GB/s of the file's bytes, with the host's
CPU and ISA and torch's thread count.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from host import describe

from gpu.cpu.kernels.build import cpu_kernels

Q4_K_BYTES, Q6_K_BYTES, QK = 144, 210, 256


def q4_k(n: int, k: int):
    """A call rewriting random Q4_K rows (d = 1, dmin = 0.5) into pairs, codes, supers."""
    raw = torch.randint(0, 256, (n, k // QK * Q4_K_BYTES), dtype=torch.uint8)
    raw.view(n, k // QK, Q4_K_BYTES)[:, :, :4] = torch.tensor([0, 0x3C, 0, 0x38],
                                                              dtype=torch.uint8)
    p = -(-n // 32)
    pairs = torch.zeros(p, k // 32, 4, 32, dtype=torch.int32)
    codes = torch.zeros(p, k // 32, 2, 32, dtype=torch.uint8)
    supers = torch.zeros(p, k // QK, 2, 32)
    op = torch.ops.ridgeline_cpu.gguf_repack_panels_
    return lambda: op("Q4_K", raw, None, None, None, None, pairs, codes, supers, 0), raw.numel()


def q6_k(n: int, k: int):
    """A call rewriting random Q6_K rows (d = 1) into packed levels, codes, supers."""
    raw = torch.randint(0, 256, (n, k // QK * Q6_K_BYTES), dtype=torch.uint8)
    raw.view(n, k // QK, Q6_K_BYTES)[:, :, 208:] = torch.tensor([0, 0x3C], dtype=torch.uint8)
    p = -(-n // 32)
    levels = torch.zeros(p, k // 32 * 24, 32, dtype=torch.uint8)
    codes = torch.zeros(p, k // 16, 32, dtype=torch.int8)
    supers = torch.zeros(p, k // QK, 32)
    op = torch.ops.ridgeline_cpu.gguf_repack_panels_
    return lambda: op("Q6_K", raw, None, levels, None, None, None, codes, supers, 0), raw.numel()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if cpu_kernels() is None:
        raise SystemExit("the C++ CPU kernels are not built on this host")
    torch.manual_seed(0)
    shapes = {"Q4_K 14336x4096": q4_k(14336, 4096), "Q4_K 4096x14336": q4_k(4096, 14336),
              "Q6_K 4096x14336": q6_k(4096, 14336)}
    results = []
    for name, (call, nbytes) in shapes.items():
        call()  # outputs touched, code warm
        best = float("inf")
        for _ in range(a.reps):
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
        results.append({"shape": name, "ms": best * 1e3, "file_gb_per_s": nbytes / best / 1e9})
        print(f"{name:18s} {best * 1e3:7.1f} ms  {nbytes / best / 1e9:5.2f} GB/s of the file")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"host": describe(), "threads": torch.get_num_threads(),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
