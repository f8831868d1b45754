"""Paired A/B of a bf16 model's few-row calls on SmolLM2's Q4_1 layers: the float32
blocks kernel (`q4_1_linear`, bf16 x widened, sums rounded to bf16), the AVX512-BF16
dot-product kernel (`q4_1_linear_bf16`) and, where the CPU has it, the AMX kernel
(`q4_1_linear_amx`), in one process, interleaved, so host noise hits all alike.

    python benchmarks/cpu_quant_bf16_ab.py [--threads 2] [--reps 7] [--rows 1,2,3,4] [OUT.json]

As `cpu_quant_linear_ab.py`: 30 distinct copies of every layer shape (a step's worth
of weights, ~80 MB of panels), one sample is one "step" of every layer's four linears
in order, each call timed and summed per shape. Per row count: `reps` rounds of every
variant (the order rotated each round), each the median of `steps` steps; reports the
median per shape (ms per 30 layers) and the ratio dot / blocks.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.cpu_quant_linear_ab import LAYERS, SHAPES, random_weight
from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.panel_blocks import PanelBlocks
from models.gguf_blocks import QuantizedWeight

LAYER_SHAPES = [name for name, (_, _, fmt) in SHAPES.items() if fmt == "q4_1"]
OPS = {"blocks": "q4_1_linear", "dot": "q4_1_linear_bf16", "amx": "q4_1_linear_amx"}


def build(kernels, variants):
    """Per variant: its op and, per shape, 30 copies of its arguments."""
    weights, dot_weights = {}, {}
    for name in LAYER_SHAPES:
        n, k, fmt = SHAPES[name]
        weights[name], dot_weights[name] = [], []
        for _ in range(LAYERS):
            q, _w = random_weight(n, k, fmt)
            panels = PanelBlocks.of(QuantizedWeight(fmt, *q))
            weights[name].append((*panels.tensors, n))
            dot_weights[name].append((panels.dot_pairs(), *panels.tensors[1:], n))
    ops = {v: getattr(kernels, OPS[v]) for v in variants}
    # The dot and AMX kernels read the levels regrouped (`PanelBlocks.dot_pairs`).
    own = {"dot": dot_weights, "amx": dot_weights}
    return {v: own.get(v, weights) for v in variants}, ops


def time_step(op, weights, xs) -> dict[str, float]:
    total = dict.fromkeys(LAYER_SHAPES, 0.0)
    for i in range(LAYERS):
        for name in LAYER_SHAPES:
            t = time.perf_counter()
            op(xs[name], *weights[name][i])
            total[name] += time.perf_counter() - t
    return {name: s * 1e3 for name, s in total.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", default="1,2,3,4")
    ap.add_argument("out", nargs="?", default="bench_results/cpu_quant_bf16.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    kernels = cpu_kernels()
    assert kernels is not None, "the C++ kernels did not build"
    assert hasattr(kernels.namespace, "q4_1_linear_bf16"), "no AVX512-BF16 kernel here"
    variants = [v for v in OPS if hasattr(kernels.namespace, OPS[v])]
    if "amx" in variants and not kernels.amx_usable():
        variants.remove("amx")
    args, ops = build(kernels, variants)
    rows = []
    with torch.inference_mode():
        for m in map(int, a.rows.split(",")):
            xs = {name: torch.randn(m, SHAPES[name][1]).to(torch.bfloat16)
                  for name in LAYER_SHAPES}
            for name in LAYER_SHAPES:  # agree to bf16 rounding (AMX: of the weights too)
                ref = ops["blocks"](xs[name], *args["blocks"][name][0]).float()
                for v in variants:
                    out = ops[v](xs[name], *args[v][name][0]).float()
                    err = (out - ref).abs().max() / ref.abs().max()
                    assert err < 2e-2, f"{v} {name}: relative error {err:.3g}"
            for v in variants:  # warm-up
                time_step(ops[v], args[v], xs)
            samples = {v: {name: [] for name in LAYER_SHAPES} for v in variants}
            for rep in range(a.reps):
                first = rep % len(variants)
                for v in variants[first:] + variants[:first]:
                    steps = [time_step(ops[v], args[v], xs) for _ in range(a.steps)]
                    for name in LAYER_SHAPES:
                        samples[v][name].append(statistics.median(s[name] for s in steps))
            total = {v: 0.0 for v in variants}
            for name in LAYER_SHAPES:
                ms = {v: statistics.median(samples[v][name]) for v in variants}
                for v in variants:
                    total[v] += ms[v]
                rows.append({"shape": name, "N": SHAPES[name][0], "K": SHAPES[name][1],
                             "M": m, "threads": a.threads, **{f"{v}_ms": t for v, t in ms.items()},
                             "dot_over_blocks": ms["dot"] / ms["blocks"],
                             "samples_ms": {v: samples[v][name] for v in variants}})
                print(f"M={m} {name:8s} " + "  ".join(f"{v} {ms[v]:7.3f}" for v in variants)
                      + f" ms | dot/blocks {ms['dot'] / ms['blocks']:.2f}", flush=True)
            print(f"M={m} all 4    " + "  ".join(f"{v} {total[v]:7.3f}" for v in variants)
                  + f" ms | dot/blocks {total['dot'] / total['blocks']:.2f}", flush=True)
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
