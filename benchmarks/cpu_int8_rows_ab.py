"""Where int8 x pays on a CPU without AMX: a GGUF model's first layer and LM head, each
linear's kernels side by side per row count, as the model holds them (and, on a CPU with
AMX, the tile kernels' rate per row count: a prompt's calls of many rows).

    RIDGELINE_CPU_ISA=avx512 python benchmarks/cpu_int8_rows_ab.py GGUF
        [--rows 1,2,3,4,8,16,64,256] [--reps 5] [--x-dtype bfloat16] [--out OUT.json]

The engine loads the file as it serves it (default flags), and on its model thread each
`PackedLinear` of layer 0 and the LM head is called through every kernel it holds
blocks for: the bf16 dot-product kernel (Q4_1 layers, where the CPU has AVX512-BF16),
the blocks' exact kernel, the int8 kernel (`quant_linear_int8.cpp`) and, where the
layer holds it, the AMX kernel (`quant_linear_amx_table.cpp`, `quant_linear_amx.cpp`);
the same x: bf16, or float32 (`--x-dtype float32`) as the layers see it where `auto`
serves float32 (AVX2).
A kernel that cannot read the layer's layout (the exact kernel on a Q4_K layer held as
pairs alone, on AVX2) is left out of that layer's row.
Per row count the kernels take turns, `reps` rounds, the median kept; the table gives
ms per call, GMAC/s, and int8's time over the best other kernel's. `gpu/cpu/routing.py`
`INT8_MIN_ROWS` is the row count from which int8 wins on every layer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from host import describe

from app.llm import LLM
from gpu.cpu.linear import PackedLinear

DOT_MAX_ROWS = 4  # the dot-product kernel takes at most this many rows
KERNELS = ("dot", "exact", "int8", "amx")


def kernels(m: PackedLinear, rows: int) -> dict:
    """The layer's kernels over its blocks for `rows` rows, by name, each with its bound
    arguments."""
    out = {}
    if m._dot_op is not None and rows <= DOT_MAX_ROWS:
        out["dot"] = (m._dot_op, m._dot_args)
    fmt = m.quantized.format
    exact_op = getattr(torch.ops.ridgeline_cpu, f"{fmt}_linear", None)
    int8_op = getattr(torch.ops.ridgeline_cpu, f"{fmt}_linear_int8", None)
    if exact_op is not None:
        out["exact"] = (exact_op, m._quantized_args)
    if int8_op is not None:
        out["int8"] = (int8_op, m._quantized_args)
    if m._amx_op is not None:
        out["amx"] = (m._amx_op, m._amx_args)
    return out


def time_call(op, x, args, reps: int) -> float:
    op(x, *args)
    start = time.perf_counter()
    for _ in range(reps):
        op(x, *args)
    return (time.perf_counter() - start) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--rows", default="1,2,3,4,8,16,64,256")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--x-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows_list = [int(r) for r in a.rows.split(",")]
    engine = LLM(model=a.gguf, max_model_len=2048).engine

    def run(runner) -> list[dict]:
        layers = [(n, m) for n, m in runner.model.named_modules()
                  if isinstance(m, PackedLinear) and m.quantized is not None
                  and (n.startswith("layers.0.") or n == "lm_head")]
        results = []
        for name, m in layers:
            for rows in rows_list:
                x = torch.randn(rows, m.in_features).to(getattr(torch, a.x_dtype))
                ks = kernels(m, rows)
                samples = {k: [] for k in ks}
                for _ in range(a.reps):
                    for k, (op, args) in list(ks.items()):
                        try:
                            samples[k].append(time_call(op, x, args, 3))
                        except RuntimeError:  # this layout is not the kernel's here
                            del ks[k], samples[k]
                ms = {k: statistics.median(v) * 1e3 for k, v in samples.items()}
                results.append({"layer": name, "format": m.quantized.format,
                                "N": m.out_features, "K": m.in_features, "rows": rows,
                                "ms": ms})
        return results

    results = engine.worker.call(run).result()
    print(f"{'layer':36s} {'fmt':6s} {'rows':>5s} " + " ".join(
        f"{k:>16s}" for k in KERNELS) + "  int8/best other")
    for r in results:
        macs = r["rows"] * r["N"] * r["K"]
        cells = " ".join(f"{r['ms'][k]:7.3f} {macs / r['ms'][k] / 1e6:6.1f}G"
                         if k in r["ms"] else f"{'-':>16s}" for k in KERNELS)
        others = [v for k, v in r["ms"].items() if k != "int8"]
        ratio = f"{r['ms']['int8'] / min(others):.2f}" if "int8" in r["ms"] and others else "-"
        print(f"{r['layer']:36s} {r['format']:6s} {r['rows']:5d} {cells}  {ratio}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"host": describe(), "isa_cap": os.environ.get("RIDGELINE_CPU_ISA", "native"),
                       "x_dtype": a.x_dtype,
                       "gguf": a.gguf, "threads": torch.get_num_threads(),
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
