"""The LoRA delta of one linear for a decode batch, four ways, interleaved (gpu/lora.py).

`kernel` (what `LoRALinear` does for decode rows with the C++ kernels built): one
`lora_delta_` call over the rows sorted by slot. `grouped` (its torch fallback, and what
prefill chunks take): per adapter present, gather its rows, two small matmuls,
scatter-add. `gathered`: every row's own A and B gathered, then two batched
matmuls (bgmv's shape). `masked`: one matmul against every slot's A stacked, the columns
of other slots zeroed per row, one matmul against every slot's B. Also the base linear
alone, for the delta's relative cost.

    python benchmarks/lora_delta_ab.py [--rows 32] [--adapters 4] [--rank 48] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from gpu.cpu.kernels.build import cpu_kernels
from gpu.lora_linear import MAX_PARTS, expand_parts, plan_segments


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=48, help="a fused qkv: 3 x --max-lora-rank")
    p.add_argument("--in-features", type=int, default=576)  # SmolLM2-135M's qkv_proj
    p.add_argument("--out-features", type=int, default=960)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = p.parse_args()
    torch.manual_seed(0)
    torch.set_default_dtype(getattr(torch, a.dtype))
    n, r, k, o = a.adapters, a.rank, a.in_features, a.out_features
    w = torch.randn(o, k)
    A, Bt = torch.randn(n, r, k) * 0.01, torch.randn(n, r, o) * 0.01
    x = torch.randn(a.rows, k)
    slot = torch.arange(a.rows) % n  # interleaved: the worst case for slices
    index = [torch.nonzero(slot == s).flatten() for s in range(n)]
    A_all, Bt_all = A.reshape(n * r, k), Bt.reshape(n * r, o)
    mask = (slot[:, None] == torch.arange(n).repeat_interleave(r)[None, :]).to(x.dtype)

    def base():
        return F.linear(x, w)

    def grouped():
        y = F.linear(x, w)
        for s, idx in enumerate(index):
            y.index_add_(0, idx, (x.index_select(0, idx) @ A[s].T) @ Bt[s])
        return y

    def gathered():
        y = F.linear(x, w)
        h = torch.bmm(A[slot], x[:, :, None])  # [rows, r, 1]
        return y + torch.bmm(h.transpose(1, 2), Bt[slot])[:, 0]

    def masked():
        return F.linear(x, w) + ((x @ A_all.T) * mask) @ Bt_all

    ways = {"base": base, "grouped": grouped, "gathered": gathered, "masked": masked}
    ops = cpu_kernels()
    if ops is not None:
        seg = plan_segments({s: idx.tolist() for s, idx in enumerate(index)})
        ranks = torch.full((n,), r, dtype=torch.long)
        parts = torch.zeros(n, MAX_PARTS, 4, dtype=torch.long)
        for s in range(n):
            for i, part in enumerate(expand_parts(Bt[s])):
                parts[s, i] = torch.tensor(part)

        def kernel():
            y = F.linear(x, w)
            ops.lora_delta_(y, x, A, Bt, seg.order, seg.starts, seg.slots, ranks, parts)
            return y

        ways["kernel"] = kernel
    ref = grouped()
    tol = 1e-4 if a.dtype == "float32" else 0.5  # bf16 rounds outputs of size ~20
    for name, fn in ways.items():
        if name != "base":
            assert torch.allclose(fn().float(), ref.float(), atol=tol), name
    times = {name: [] for name in ways}
    for _ in range(a.iters):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    print(f"{a.dtype}: rows {a.rows}, adapters {n}, rank {r}, {k} -> {o}, torch threads "
          f"{torch.get_num_threads()}")
    for name, ts in times.items():
        ts.sort()
        print(f"{name:9s} median {ts[len(ts) // 2] * 1e6:8.1f} us")


if __name__ == "__main__":
    main()
