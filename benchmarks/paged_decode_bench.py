"""Times the C++ paged decode kernel alone at a decode step's shape: SmolLM2-135M's heads
(9 query, 3 KV, head_dim 64), bf16 q and pools, 32 rows of 140-180 keys, pages shuffled,
one pool per layer (30), so that the K/V come from memory as in a step, not from cache.

Why: the kernel streams every row's keys and values once per layer, and at batch 32 it is
a quarter of a decode step; this prints microseconds a call, and with `--repo` run
alternately against another checkout (each in its own process and extension dir) it
gives paired old/new ratios.

    python benchmarks/paged_decode_bench.py                      # this checkout
    python benchmarks/paged_decode_bench.py --repo /path/to/other --rounds 5
"""

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCH, HEADS, KV_HEADS, DIM, BLOCK, LAYERS = 32, 9, 3, 64, 16, 30


def time_kernel(iters: int, threads: int) -> float:
    """Median microseconds a call over `iters` passes through every layer's pools."""
    import torch

    from gpu.cpu.kernels.build import cpu_kernels

    ops = cpu_kernels()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    lens = torch.randint(140, 181, (BATCH,), dtype=torch.int32)
    per_row = -(-int(lens.max()) // BLOCK)
    num_blocks = BATCH * per_row + 8
    shape = (KV_HEADS, num_blocks * BLOCK, DIM)
    pools = [(torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16())
             for _ in range(LAYERS)]
    tables = torch.randperm(num_blocks)[: BATCH * per_row].view(BATCH, per_row).int()
    q = torch.randn(BATCH, HEADS, DIM).bfloat16()

    def step() -> None:
        for k, v in pools:
            ops.paged_decode(q, k, v, tables, lens, BLOCK, DIM**-0.5, 0)

    for _ in range(3):
        step()
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        step()
        samples.append((time.perf_counter() - t0) / LAYERS)
    return statistics.median(samples) * 1e6


def run_in(repo: Path, iters: int, threads: int) -> float:
    """time_kernel in a fresh process importing `repo`, with its own extension dir."""
    digest = hashlib.sha1(str(repo.resolve()).encode()).hexdigest()[:10]
    env = dict(os.environ, PYTHONPATH=str(repo),
               TORCH_EXTENSIONS_DIR=f"/tmp/paged-decode-bench-{digest}")
    proc = subprocess.run([sys.executable, __file__, "--iters", str(iters), "--threads",
                           str(threads), "--json"], cwd=repo, env=env, capture_output=True,
                          text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", type=Path, help="another checkout to compare against (old)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.json:
        print(json.dumps(time_kernel(args.iters, args.threads)))
        return
    if args.repo is None:
        print(f"paged_decode B={BATCH} bf16: {time_kernel(args.iters, args.threads):.1f} us")
        return
    here = Path(__file__).resolve().parents[1]
    old, new = [], []
    for _ in range(args.rounds):  # interleaved, so drift on a shared host hits both
        old.append(run_in(args.repo, args.iters, args.threads))
        new.append(run_in(here, args.iters, args.threads))
    o, n = statistics.median(old), statistics.median(new)
    print(f"paged_decode B={BATCH} bf16: old {o:.1f} us, new {n:.1f} us, new/old {n / o:.2f}")


if __name__ == "__main__":
    main()
