"""Paired A/B of a bf16 model's linears on a CPU with AMX: oneDNN's packed bf16 weight, the
GGUF's blocks on the tile unit (Q4_1 layers: `quant_linear_amx_table.cpp`; the Q8_0 LM
head: `quant_linear_amx.cpp`) and
the blocks widened to float32 (`quant_linear.cpp`, the route of the fewest rows), per row
count, in one process, interleaved, so host noise hits all alike.

    python benchmarks/cpu_amx_linear_ab.py [--rows 2,3,4,8,16,32,64] [--reps 5] [OUT.json]

SmolLM2-135M's shapes, 30 copies of each layer shape (a step's worth of weights, as
`cpu_quant_linear_ab.py` holds them, so they come from memory as in a step) and one LM
head. One sample: every copy of a shape called once, in order (ms per 30 layers; the
head per call). Per row count, `reps` rounds of the variants in rotated order; medians.
The thresholds of `gpu/cpu/routing.py` (`AMX_ROWS`) come from here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from cpu_quant_linear_ab import LAYERS, SHAPES, random_weight
from host import describe

from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.panel_blocks import PanelBlocks
from models.gguf_blocks import QuantizedWeight

VARIANTS = ("packed", "amx", "blocks")


def build(kernels) -> dict[str, dict[str, list]]:
    """Per shape, per variant: one callable per layer copy."""
    model: dict[str, dict[str, list]] = {}
    for name, (n, k, fmt) in SHAPES.items():
        model[name] = {v: [] for v in VARIANTS}
        for _ in range(1 if name == "lm_head" else LAYERS):
            q, w = random_weight(n, k, fmt)
            panels = PanelBlocks.of(QuantizedWeight(fmt, *q, *(None,) * (3 - len(q))))
            blocks = (*panels.tensors, n)
            tiles = ((panels.dot_pairs(kernels), *panels.tensors[1:], n) if fmt == "q4_1"
                     else blocks)
            packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 64)
            model[name]["packed"].append(
                lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none",
                                                                       [None], ""))
            for v, op, args in (("amx", getattr(kernels, f"{fmt}_linear_amx"), tiles),
                                ("blocks", getattr(kernels, f"{fmt}_linear"), blocks)):
                model[name][v].append(lambda x, q=args, op=op: op(x, *q))
            model[name]["weight"] = w.bfloat16()  # the last copy's, for the check
    return model


def check(model, name: str, x: torch.Tensor) -> None:
    """Each variant is the product of the bf16 weights (the first copy's) to rounding."""
    want = x.double() @ model[name]["weight"].double().T
    for v in VARIANTS:
        got = model[name][v][-1](x).double()
        err = ((got - want).abs().max() / want.abs().max()).item()
        assert err < 1e-2, f"{v} {name} rows {x.shape[0]}: relative error {err:.3g}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", default="2,3,4,8,16,32,64")
    ap.add_argument("out", nargs="?", default="bench_results/cpu_amx_linear.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    kernels = cpu_kernels()
    assert kernels is not None and hasattr(kernels, "q8_0_linear_amx") \
        and kernels.amx_usable(), "needs the C++ kernels built with AMX, and Linux's grant"
    model = build(kernels)
    print(describe())
    rows = []
    with torch.inference_mode():
        for m in map(int, a.rows.split(",")):
            xs = {name: torch.randn(m, k).bfloat16() for name, (_, k, _) in SHAPES.items()}
            samples = {name: {v: [] for v in VARIANTS} for name in SHAPES}
            for name in SHAPES:
                check(model, name, xs[name])
            for rep in range(a.reps + 1):  # round 0 warms up
                first = rep % len(VARIANTS)
                for v in VARIANTS[first:] + VARIANTS[:first]:
                    for name in SHAPES:
                        t = time.perf_counter()
                        for call in model[name][v]:
                            call(xs[name])
                        if rep:
                            samples[name][v].append((time.perf_counter() - t) * 1e3)
            for name in SHAPES:
                ms = {v: statistics.median(samples[name][v]) for v in VARIANTS}
                rows.append({"shape": name, "N": SHAPES[name][0], "K": SHAPES[name][1],
                             "format": SHAPES[name][2], "M": m, "threads": a.threads,
                             **{f"{v}_ms": t for v, t in ms.items()},
                             "amx_over_packed": ms["amx"] / ms["packed"],
                             "samples_ms": samples[name]})
                print(f"M={m:3d} {name:8s} packed {ms['packed']:7.3f}  amx {ms['amx']:7.3f}"
                      f"  blocks {ms['blocks']:7.3f} ms | amx/packed "
                      f"{ms['amx'] / ms['packed']:.2f}", flush=True)
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": describe(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
