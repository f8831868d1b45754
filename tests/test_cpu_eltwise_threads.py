"""The elementwise CPU kernels give the same bits on one thread as on several.

Decode batches of a few dozen rows split over the threads (decoder_ops.cpp's grain,
rotary_kv_store.cpp's): each row is still one task's, computed in one order, so the
split must not show in the results. Shapes are SmolLM2's at a batch of 32.
"""

from __future__ import annotations

import pytest
import torch

from gpu.cpu.kernels.build import cpu_kernels

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(KERNELS is None, reason="C++ CPU kernels not built here")
ROWS, HIDDEN, INTER, HEADS, KV_HEADS, DIM = 32, 576, 1536, 9, 3, 64


def on_threads(n: int, fn):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_silu_do_not_depend_on_the_thread_count(dtype) -> None:
    torch.manual_seed(0)
    x = torch.randn(ROWS, HIDDEN).to(dtype)
    weight = (torch.rand(HIDDEN) + 0.5).to(dtype)
    residual = torch.randn(ROWS, HIDDEN).to(dtype)
    gate_up = (torch.randn(ROWS, 2 * INTER) * 6).to(dtype)

    def run():
        res = residual.clone()
        return (KERNELS.rms_norm(x, weight, 1e-5), KERNELS.add_rms_norm_(x, res, weight, 1e-5),
                res, KERNELS.silu_and_mul(gate_up))

    for one, many in zip(on_threads(1, run), on_threads(2, run), strict=True):
        assert torch.equal(one, many)


def test_rotary_kv_store_does_not_depend_on_the_thread_count() -> None:
    torch.manual_seed(0)
    qkv = torch.randn(ROWS, (HEADS + 2 * KV_HEADS) * DIM).to(torch.bfloat16)
    angle = torch.rand(ROWS, DIM) * 6.28
    cos, sin = angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)
    slots = torch.randperm(4 * ROWS)[:ROWS]

    def run():
        rows = qkv.clone()
        q = rows[:, : HEADS * DIM].view(ROWS, HEADS, DIM)
        k = rows[:, HEADS * DIM : (HEADS + KV_HEADS) * DIM].view(ROWS, KV_HEADS, DIM)
        v = rows[:, (HEADS + KV_HEADS) * DIM :].view(ROWS, KV_HEADS, DIM)
        pools = [torch.zeros(KV_HEADS, 4 * ROWS, DIM, dtype=torch.bfloat16) for _ in "kv"]
        KERNELS.rotary_kv_store_(q, k, v, cos, sin, *pools, slots)
        return rows, *pools

    one, many = on_threads(1, run), on_threads(2, run)
    assert not torch.equal(one[0], qkv)  # q was rotated in place
    for a, b in zip(one, many, strict=True):
        assert torch.equal(a, b)
