"""Times the CPU kernels' elementwise ops (`rotary_kv_store_`, `silu_and_mul`,
`add_rms_norm_`) on the chat load's prefill shape and on a decode shape, in bf16.

Why: these ops move a few megabytes per layer, so their time should follow their bytes;
this prints each op's median time beside the bytes it moves, and with `--repo` run
alternately against another checkout (each in its own process and extension dir) it
gives paired old/new ratios.

    python benchmarks/eltwise_ops_bench.py                      # this checkout
    python benchmarks/eltwise_ops_bench.py --repo /path/to/other --rounds 5
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

SHAPES = {  # name: (sequences, new tokens each, cached prefix)
    "chat": (15, 64, 768),
    "decode": (32, 1, 768),
}
HEADS, KV_HEADS, DIM, HIDDEN, INTER = 9, 3, 64, 576, 1536  # SmolLM2-135M


def time_ops(iters: int) -> dict:
    """Median microseconds of each op on each shape, in this process."""
    import torch

    from gpu.cpu.kernels.build import cpu_kernels

    ops = cpu_kernels()
    torch.manual_seed(0)
    out = {}
    for name, (seqs, new, prefix) in SHAPES.items():
        tokens = seqs * new
        qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * DIM, dtype=torch.bfloat16)
        q = qkv[:, : HEADS * DIM].view(tokens, HEADS, DIM)
        k = qkv[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(tokens, KV_HEADS, DIM)
        v = qkv[:, (HEADS + KV_HEADS) * DIM :].view(tokens, KV_HEADS, DIM)
        # A true rotation (cos^2 + sin^2 = 1): q is rotated in place on every call, and
        # random tables would grow or shrink it toward inf or denormals, whose assists
        # would then be what is timed.
        angle = torch.rand(tokens, DIM) * 6.28
        cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
        block = prefix + 256
        pools = [torch.zeros(KV_HEADS, seqs * block, DIM, dtype=torch.bfloat16) for _ in "kv"]
        slots = torch.tensor([s * block + prefix + i for s in range(seqs) for i in range(new)])
        gate_up = torch.randn(tokens, 2 * INTER, dtype=torch.bfloat16)
        x = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16)
        res = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16)
        w = torch.randn(HIDDEN, dtype=torch.bfloat16)
        calls = {
            "rotary_kv_store_": partial(ops.rotary_kv_store_, q, k, v, cos, sin, *pools, slots),
            "silu_and_mul": partial(ops.silu_and_mul, gate_up),
            "add_rms_norm_": partial(ops.add_rms_norm_, x, res, w, 1e-5),
        }
        for op, call in calls.items():
            for _ in range(max(3, iters // 10)):
                call()
            samples = []
            for _ in range(iters):
                t0 = time.perf_counter()
                call()
                samples.append(time.perf_counter() - t0)
            out[f"{name}/{op}"] = statistics.median(samples) * 1e6
    return out


def run_in(repo: Path, iters: int) -> dict:
    """time_ops in a fresh process importing `repo`, with its own extension dir."""
    env = dict(os.environ, PYTHONPATH=str(repo),
               TORCH_EXTENSIONS_DIR=f"/tmp/eltwise-bench-{abs(hash(str(repo.resolve())))}")
    proc = subprocess.run([sys.executable, __file__, "--iters", str(iters), "--json"],
                          cwd=repo, env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", type=Path, help="another checkout to compare against (old)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.json:
        print(json.dumps(time_ops(args.iters)))
        return
    if args.repo is None:
        for key, us in time_ops(args.iters).items():
            print(f"{key:32s} {us:9.1f} us")
        return
    here = Path(__file__).resolve().parents[1]
    old, new = {}, {}
    for _ in range(args.rounds):  # interleaved, so drift on a shared host hits both
        for key, us in run_in(args.repo, args.iters).items():
            old.setdefault(key, []).append(us)
        for key, us in run_in(here, args.iters).items():
            new.setdefault(key, []).append(us)
    print(f"{'op':32s} {'old us':>9s} {'new us':>9s} {'new/old':>8s}")
    for key in old:
        o, n = statistics.median(old[key]), statistics.median(new[key])
        print(f"{key:32s} {o:9.1f} {n:9.1f} {n / o:8.2f}")


if __name__ == "__main__":
    main()
