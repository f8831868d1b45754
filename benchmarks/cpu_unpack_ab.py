"""Where a layer that holds its blocks alone should stop reading them in place.

    python benchmarks/cpu_unpack_ab.py [--threads 2] [--reps 5] [--dtype bfloat16]

A GGUF's layers keep no dense copy (`gpu/cpu/linear.py`): a call of few rows reads the
blocks in place (the exact kernel, widened in registers: `blocks`; on AMX, `amx`), and a
call of more rows widens slices of panels into scratch and hands them to oneDNN
(`unpacked`). The blocks' kernels cost in proportion to the rows; the unpacked route
pays one widening pass per call and then multiplies at oneDNN's rate. This times the
routes side by side per row count, interleaved in one process, on a 1.7B model's shapes
(SmolLM2-1.7B: hidden 2048, MLP 8192) in each kernel format, and prints per format the
first row count at which `unpacked` wins: the numbers behind routing's
`BLOCKS_ONLY_MAX_ROWS`. The host's CPU and ISA are printed with the table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from host import describe

ROWS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
SHAPES = {"q4_1": (8192, 2048), "q8_0": (2048, 8192), "q8_16": (2048, 8192)}


def random_weight(fmt: str, n: int, k: int):
    from models.gguf_blocks import QuantizedWeight

    scales = (torch.randn(n, k // (16 if fmt == "q8_16" else 32)) * 0.01).half().float()
    if fmt == "q4_1":
        mins = (torch.randn(n, k // 32) * 0.1).half().float()
        return QuantizedWeight(fmt, torch.randint(0, 256, (n, k // 2), dtype=torch.uint8),
                               scales, mins)
    return QuantizedWeight(fmt, torch.randint(-128, 128, (n, k), dtype=torch.int8), scales,
                           None)


def routes_of(layer, tiled, blocks_op) -> dict:
    """name -> a call of the weight through that route: `layer` holds the panels (no AMX,
    so it keeps their levels), `tiled` the AMX kernel's copy where the host has AMX."""
    args = (*layer.quantized.tensors, layer.out_features)
    routes = {"blocks": lambda x: blocks_op(x, *args), "unpacked": layer._unpacked}
    if tiled.amx_rows is not None:
        routes["amx"] = lambda x: tiled._amx_op(x, *tiled._amx_args)
    return routes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from gpu.cpu.capabilities import describe as capabilities
    from gpu.cpu.capabilities import resolve
    from gpu.cpu.linear import PackedLinear

    caps = resolve()
    dtype = getattr(torch, args.dtype)
    print(describe(), "|", capabilities(caps))
    for fmt, (n, k) in SHAPES.items():
        q = random_weight(fmt, n, k)
        weight = torch.empty(n, k, dtype=dtype)
        layer = PackedLinear(weight, quantized=q, kernels=caps, blocks_only=True)
        tiled = PackedLinear(weight, quantized=q, kernels=caps, amx=caps.amx,
                             blocks_only=True)
        routes = routes_of(layer, tiled, caps.op(f"{fmt}_linear"))
        print(f"\n{fmt} [{n}, {k}], {args.dtype}: ms per call (median of {args.reps})")
        print("rows " + " ".join(f"{r:>9}" for r in routes))
        for rows in ROWS:  # oneDNN builds a kernel per new shape: not what is timed
            for fn in routes.values():
                fn(torch.randn(rows, k).to(dtype))
        first_win = None
        for rows in ROWS:
            x = torch.randn(rows, k).to(dtype)
            times: dict[str, list[float]] = {r: [] for r in routes}
            for _ in range(args.reps):
                for name, fn in routes.items():  # interleaved: the host's phase hits all
                    fn(x)
                    start = time.perf_counter()
                    fn(x)
                    times[name].append((time.perf_counter() - start) * 1e3)
            med = {r: statistics.median(t) for r, t in times.items()}
            best_in_place = min(v for r, v in med.items() if r != "unpacked")
            if first_win is None and med["unpacked"] < best_in_place:
                first_win = rows
            print(f"{rows:>4} " + " ".join(f"{med[r]:>9.2f}" for r in routes))
        print(f"{fmt}: unpacked first wins at {first_win} rows")


if __name__ == "__main__":
    main()
