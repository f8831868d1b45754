"""Paired A/B of one layer's paged prefill attention on CPU: the C++ FMA kernel
(`paged_prefill_`), the bf16 kernels (`paged_prefill_amx_` on the tile unit and
`paged_prefill_bf16_` by AVX512-BF16 dot products, bf16 only, each where built) and a
block gather plus torch's SDPA (the torch path's cost), in one process, interleaved.

    python benchmarks/cpu_prefill_ab.py [--threads 2] [--reps 7] [--shapes 15,64,832 ..]
                                        [OUT.json]

A shape is (sequences, new tokens each, context each): the new tokens are the last of
the context, the rest a cached prefix (15,64,832: the chat load's wave, 64 new tokens
after a 768-token shared prefix). SmolLM2-135M's heads (9 query, 3 KV, dim 64), pool
blocks of 16 shuffled as a scheduler leaves them. Each round times every variant (the
order rotated each round), each sample the median of `--calls` calls; reports the
medians, the per-round ratios to the FMA kernel (and SDPA's to each bf16 kernel), and
the host's CPU and ISA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from host import describe

from gpu.cpu.kernels.build import cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = ["15,64,832", "1,512,512", "1,2048,2048", "2,256,1024", "4,16,1024", "32,16,128"]


def variants(kernels, dtype: torch.dtype, seqs: int, new: int, context: int):
    """{name: a call computing the layer's attention} over one random pool."""
    num_blocks = seqs * context // BLOCK + 8
    kc = torch.randn(KV_HEADS, num_blocks * BLOCK, HEAD_DIM, dtype=dtype)
    vc = torch.randn_like(kc)
    tables = torch.randperm(num_blocks)[: seqs * context // BLOCK].view(seqs, -1)
    tables = tables.to(torch.int32)
    q = torch.randn(seqs * new, HEADS, HEAD_DIM, dtype=dtype)
    args = (tables, torch.arange(seqs, dtype=torch.int32) * new,
            torch.full((seqs,), new, dtype=torch.int32),
            torch.full((seqs,), context, dtype=torch.int32), BLOCK, HEAD_DIM**-0.5, 0)
    pos = torch.arange(context)
    mask = pos[None, :] <= (context - new + torch.arange(new))[:, None]

    def kernel(op):
        def call():
            out = torch.empty_like(q)
            op(out, q, kc, vc, *args)
            return out
        return call

    def sdpa():
        by_block = (KV_HEADS, -1, BLOCK * HEAD_DIM)
        shape = (KV_HEADS, seqs, context, HEAD_DIM)
        kg = kc.view(by_block).index_select(1, tables.flatten().long()).view(shape)
        vg = vc.view(by_block).index_select(1, tables.flatten().long()).view(shape)
        o = F.scaled_dot_product_attention(
            q.view(seqs, new, HEADS, HEAD_DIM).transpose(1, 2), kg.transpose(0, 1),
            vg.transpose(0, 1), attn_mask=mask[None, None], scale=HEAD_DIM**-0.5,
            enable_gqa=True)
        return o.transpose(1, 2).reshape(seqs * new, HEADS, HEAD_DIM)

    calls = {"fma": kernel(kernels.paged_prefill_)}
    for name, op in (("amx", "paged_prefill_amx_"), ("dot", "paged_prefill_bf16_")):
        if dtype == torch.bfloat16 and hasattr(kernels.namespace, op):
            calls[name] = kernel(getattr(kernels, op))
    calls["sdpa"] = sdpa
    return calls


def time_call(call, calls: int) -> float:
    times = []
    for _ in range(calls):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("out", nargs="?", default="bench_results/cpu_prefill_ab.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    kernels = cpu_kernels()
    assert kernels is not None, "the C++ kernels did not build"
    dtype = getattr(torch, a.dtype)
    rows = []
    for shape in a.shapes:
        seqs, new, context = map(int, shape.split(","))
        calls = variants(kernels, dtype, seqs, new, context)
        names = list(calls)
        for call in calls.values():  # warm: first-touch of buffers, thread start
            call()
        ms: dict[str, list[float]] = {v: [] for v in names}
        for rep in range(a.reps):
            first = rep % len(names)
            for v in names[first:] + names[:first]:
                ms[v].append(time_call(calls[v], a.calls))
        row = {"dtype": a.dtype, "threads": a.threads, "seqs": seqs, "new_tokens": new,
               "context": context, **{f"{v}_ms": statistics.median(t) for v, t in ms.items()},
               "samples_ms": ms}
        for v in names[1:]:
            # Median of the per-round ratios: each pair ran back to back.
            row[f"fma_over_{v}"] = statistics.median(
                f / x for f, x in zip(ms["fma"], ms[v], strict=True))
        bf16 = [v for v in ("amx", "dot") if v in ms]
        for v in bf16:
            row[f"sdpa_over_{v}"] = statistics.median(
                x / y for x, y in zip(ms["sdpa"], ms[v], strict=True))
        rows.append(row)
        print(f"{a.dtype} threads={a.threads} {shape}: " + ", ".join(
            f"{v} {row[f'{v}_ms']:.2f} ms" for v in names) + " | " + ", ".join(
            f"fma/{v} {row[f'fma_over_{v}']:.2f}" for v in names[1:])
            + "".join(f", sdpa/{v} {row[f'sdpa_over_{v}']:.2f}" for v in bf16), flush=True)
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"host": describe(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
