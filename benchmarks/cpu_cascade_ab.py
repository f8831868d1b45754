"""Paired A/B of decode attention over a shared prefix on CPU: the per-row kernel
(`paged_decode`, every row walks its whole context) against cascade attention
(`cascade_decode_amx_`: the shared prefix once for all rows on the tile unit, each row's
own keys after it with vector code, merged by log-sum-exp), in one process, interleaved.

    python benchmarks/cpu_cascade_ab.py [--threads 2] [--reps 7] [OUT.json]

Shapes are SmolLM2-135M's attention (3 KV heads, 9 query heads, head_dim 64, bf16 pool,
block size 16): for each (rows, shared prefix, own keys per row), a pool with shuffled
pages where every row's table starts with the same prefix blocks, then `reps` rounds of
both variants (the order alternated each round), each the median of `calls` calls. One
call is one layer of one decode step. Reports medians and the ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from gpu.cpu.kernels.build import cpu_kernels

BLOCK, KV_HEADS, GROUP, HEAD_DIM = 16, 3, 3, 64
# (rows, shared prefix tokens, own tokens per row): the chat load first
SHAPES = [(16, 768, 96), (16, 768, 64), (16, 768, 128), (4, 768, 96), (8, 768, 96),
          (32, 768, 96), (16, 256, 96), (16, 2048, 96), (16, 128, 96),
          # where it stops paying (gpu/attention/shared_prefix.py's MIN_ROWS, MIN_TOKENS)
          (2, 768, 96), (3, 768, 96), (4, 256, 96), (8, 256, 96), (4, 128, 96),
          (2, 256, 96)]


def step(rows: int, prefix: int, own: int):
    shared = prefix // BLOCK
    own_blocks = -(-own // BLOCK)
    num_blocks = shared + rows * own_blocks + 8
    order = torch.randperm(num_blocks).to(torch.int32)
    tables = torch.empty(rows, shared + own_blocks, dtype=torch.int32)
    tables[:, :shared] = order[:shared]
    tables[:, shared:] = order[shared:shared + rows * own_blocks].view(rows, own_blocks)
    shape = (KV_HEADS, num_blocks * BLOCK, HEAD_DIM)
    k = torch.randn(shape, dtype=torch.bfloat16)
    v = torch.randn(shape, dtype=torch.bfloat16)
    q = torch.randn(rows, KV_HEADS * GROUP, HEAD_DIM, dtype=torch.bfloat16)
    lens = torch.full((rows,), prefix + own, dtype=torch.int32)
    return q, k, v, tables, lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ops = cpu_kernels()
    assert ops is not None and hasattr(ops.namespace, "cascade_decode_amx_"), "needs AMX"
    scale = HEAD_DIM ** -0.5
    results = []
    for rows, prefix, own in SHAPES:
        q, k, v, tables, lens = step(rows, prefix, own)
        every = torch.arange(rows, dtype=torch.int32)
        out = torch.empty_like(q)

        variants = {
            "paged_decode": (ops.paged_decode, (q, k, v, tables, lens, BLOCK, scale, 0)),
            "cascade": (ops.cascade_decode_amx_,
                        (out, q, k, v, tables, lens, every, prefix, BLOCK, scale)),
        }
        times: dict[str, list[float]] = {name: [] for name in variants}
        for rep in range(args.reps):
            for name in (list(variants) if rep % 2 == 0 else list(variants)[::-1]):
                fn, fn_args = variants[name]
                fn(*fn_args)
                laps = []
                for _ in range(args.calls):
                    t0 = time.perf_counter()
                    fn(*fn_args)
                    laps.append(time.perf_counter() - t0)
                times[name].append(statistics.median(laps) * 1e6)
        med = {name: statistics.median(t) for name, t in times.items()}
        row = {"rows": rows, "prefix": prefix, "own": own,
               **{f"{name}_us": round(t, 1) for name, t in med.items()},
               "ratio": round(med["cascade"] / med["paged_decode"], 3)}
        results.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps({"threads": args.threads, "results": results}, indent=1))


if __name__ == "__main__":
    main()
