"""Paired A/B of SmolLM2's linear layers on CPU: fp32 `F.linear`, oneDNN-packed fp32, and
the C++ kernels reading the GGUF-quantized weights (Q4_1 layers, Q8_0 LM head), and
where the kernels have int8 paths (AVX512-VNNI or AVX2) the same blocks with x quantized to int8
(`--int8-activations`), in one process, interleaved, so host noise hits all alike.

    python benchmarks/cpu_quant_linear_ab.py [--threads 2] [--reps 5] [--flush] [OUT.json]

Why a whole model's worth of weights: a decode step streams 30 layers of weights, and
whether they come from DRAM or the last-level cache decides the cost at a few rows. So
each variant holds 30 distinct copies of every layer shape plus the LM head, exactly as
large as the model in that form (fp32 ~540 MB, which no cache holds; quantized ~110 MB,
which a large L3 may), and one sample is one "step": every layer's four linears in
order, then the LM head, each call timed on its own and summed per shape. `--flush`
reads 1 GiB between steps (untimed), as if the rest of the step (KV cache, other work)
had evicted everything: the pessimistic, all-from-DRAM case.

Per M: `reps` rounds of every variant (the order rotated each round), each the median of
`steps` steps. Reports medians per shape (ms per 30 layers; the LM head per call), the
ratios quant/packed and quant/plain, and per shape the first M at which the quantized
kernel is no longer faster than the better fp32 variant.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.panel_blocks import PanelBlocks
from models.gguf_blocks import QuantizedWeight

LAYERS = 30
BLOCK = 32
# name: (N, K, format); the four per layer, then the tied LM head once.
SHAPES = {"qkv": (960, 576, "q4_1"), "o_proj": (576, 576, "q4_1"),
          "gate_up": (3072, 576, "q4_1"), "down": (576, 1536, "q4_1"),
          "lm_head": (49152, 576, "q8_0")}
ROWS = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128]
VARIANTS = ("plain", "packed", "quant", "int8")  # int8: AVX512-VNNI or AVX2


def random_weight(n: int, k: int, fmt: str):
    """Quantized tensors in the GGUF's row order and their exact fp32 dequantization."""
    nb = k // BLOCK
    scales = (torch.randn(n, nb) * 0.02).half().float()
    if fmt == "q4_1":
        qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
        mins = (torch.randn(n, nb) * 0.1).half().float()
        blocks = qweight.view(n, nb, 16)
        q = torch.cat([blocks & 0x0F, blocks >> 4], dim=2).float()
        w = (scales[:, :, None] * q + mins[:, :, None]).reshape(n, k)
        return (qweight, scales, mins), w
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    w = (qweight.view(n, nb, BLOCK).float() * scales[:, :, None]).reshape(n, k)
    return (qweight, scales), w


def build_model(kernels, variants):
    """Per variant, per shape: a list of callables taking x (one per layer copy)."""
    model: dict[str, dict[str, list]] = {v: {} for v in variants}
    for name, (n, k, fmt) in SHAPES.items():
        copies = 1 if name == "lm_head" else LAYERS
        quant_op = getattr(kernels, f"{fmt}_linear")
        int8_op = getattr(kernels, f"{fmt}_linear_int8")
        for v in variants:
            model[v][name] = []
        for _ in range(copies):
            q, w = random_weight(n, k, fmt)
            q = (*PanelBlocks.of(QuantizedWeight(fmt, *q, *(None,) * (3 - len(q)))).tensors, n)
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            model["plain"][name].append(lambda x, w=w: F.linear(x, w))
            model["packed"][name].append(
                lambda x, p=packed: torch.ops.mkldnn._linear_pointwise(x, p, None, "none",
                                                                       [None], ""))
            model["quant"][name].append(lambda x, q=q, op=quant_op: op(x, *q))
            if "int8" in model:
                model["int8"][name].append(lambda x, q=q, op=int8_op: op(x, *q))
    return model


def check_agreement(model, xs) -> None:
    """The exact variants to rounding; int8 within x's quantization (~1 % of the range)."""
    for name in SHAPES:
        ref = model["plain"][name][0](xs[name])
        for v in ("packed", "quant"):
            torch.testing.assert_close(model[v][name][0](xs[name]), ref, rtol=1e-4, atol=1e-3)
        if "int8" in model:
            err = (model["int8"][name][0](xs[name]) - ref).abs().max() / ref.abs().max()
            assert err < 2e-2, f"int8 {name}: relative error {err:.3g}"


def time_step(layers: dict[str, list], xs: dict[str, torch.Tensor], flush) -> dict[str, float]:
    """One decode step's linears, layer by layer; ms per shape (summed over layers)."""
    if flush is not None:
        flush.sum()
    total = dict.fromkeys(SHAPES, 0.0)
    for i in range(LAYERS):
        for name in ("qkv", "o_proj", "gate_up", "down"):
            t = time.perf_counter()
            layers[name][i](xs[name])
            total[name] += time.perf_counter() - t
    t = time.perf_counter()
    layers["lm_head"][0](xs["lm_head"])
    total["lm_head"] += time.perf_counter() - t
    return {name: s * 1e3 for name, s in total.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rows", default=",".join(map(str, ROWS)))
    ap.add_argument("--flush", action="store_true", help="read 1 GiB between steps")
    ap.add_argument("out", nargs="?", default="bench_results/cpu_quant_linear.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    kernels = cpu_kernels()
    assert kernels is not None, "the C++ kernels did not build"
    variants = VARIANTS if kernels.int8_linear_supported() else VARIANTS[:3]
    model = build_model(kernels, variants)
    flush = torch.ones(2**28) if a.flush else None
    rows = []
    with torch.inference_mode():
        for m in map(int, a.rows.split(",")):
            xs = {name: torch.randn(m, k) for name, (_, k, _) in SHAPES.items()}
            check_agreement(model, xs)
            for v in variants:  # warm-up
                time_step(model[v], xs, flush)
            samples = {v: {name: [] for name in SHAPES} for v in variants}
            for rep in range(a.reps):
                first = rep % len(variants)  # rotate who goes first
                for v in variants[first:] + variants[:first]:
                    steps = [time_step(model[v], xs, flush) for _ in range(a.steps)]
                    for name in SHAPES:
                        samples[v][name].append(statistics.median(s[name] for s in steps))
            for name in SHAPES:
                ms = {v: statistics.median(samples[v][name]) for v in variants}
                row = {"shape": name, "N": SHAPES[name][0], "K": SHAPES[name][1],
                       "format": SHAPES[name][2], "M": m, "threads": a.threads,
                       "flush": a.flush, "calls": 1 if name == "lm_head" else LAYERS,
                       **{f"{v}_ms": t for v, t in ms.items()},
                       "quant_over_packed": ms["quant"] / ms["packed"],
                       "quant_over_plain": ms["quant"] / ms["plain"],
                       "samples_ms": {v: samples[v][name] for v in variants}}
                int8 = ""
                if "int8" in ms:
                    row["int8_over_quant"] = ms["int8"] / ms["quant"]
                    row["int8_over_packed"] = ms["int8"] / ms["packed"]
                    int8 = (f" | int8 {ms['int8']:8.3f} ms, /quant {row['int8_over_quant']:.2f}"
                            f" /packed {row['int8_over_packed']:.2f}")
                rows.append(row)
                print(f"M={m:4d} {name:8s} plain {ms['plain']:8.3f}  packed {ms['packed']:8.3f}"
                      f"  quant {ms['quant']:8.3f} ms | quant/packed "
                      f"{row['quant_over_packed']:.2f}  quant/plain {row['quant_over_plain']:.2f}"
                      + int8, flush=True)
    crossover = {}
    for name in SHAPES:
        losing = [r["M"] for r in rows if r["shape"] == name
                  and r["quant_ms"] >= min(r["plain_ms"], r["packed_ms"])]
        crossover[name] = min(losing) if losing else None
    print("first M where quant is not faster than the better fp32 variant:", crossover)
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"rows": rows, "crossover_M": crossover}, indent=1))


if __name__ == "__main__":
    main()
