"""The bf16 paged decode kernel (paged_decode.cpp with paged_decode_bf16.h: vdpbf16ps
scores, deinterleaved value sums) against a float64 reference of the same bf16 inputs.

The path runs for a bf16 q over bf16 pools with head_dim a multiple of 32, on AVX-512 BF16
hosts; elsewhere the same calls take the portable loops, and these tests check those.
Shapes cover the tiles the path splits work into: GQA groups of 1, 3, 4 and 8 query heads
(the value pass takes heads four at a time), head_dim 32 (a half tile), 64, 96 (a tile and a
half) and 128, blocks of 4, 16 and 32 keys, windows, and contexts that end mid-block.
"""

from __future__ import annotations

import pytest
import torch

from gpu.cpu.kernels.build import cpu_kernels

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(KERNELS is None, reason="C++ CPU kernels not built here")
LENS = [1, 17, 40, 160, 77, 5]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def make_step(num_heads, kv_heads, head_dim, block_size, lens=LENS):
    """Pools with shuffled pages (room for every context plus spare blocks), q a strided
    view of a wider projection, as the backend passes it."""
    per_row = -(-max(lens) // block_size)
    num_blocks = len(lens) * per_row + 3
    shape = (kv_heads, num_blocks * block_size, head_dim)
    k, v = torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()
    tables = torch.randperm(num_blocks)[: len(lens) * per_row].view(len(lens), per_row)
    qkv = torch.randn(len(lens), num_heads + 2 * kv_heads, head_dim).bfloat16()
    q = qkv[:, :num_heads]
    assert not q.is_contiguous()
    return q, k, v, tables.to(torch.int32), torch.tensor(lens, dtype=torch.int32)


def reference(q, k, v, tables, lens, block_size, scale, window):
    """Softmax attention of each row over its visible keys, in float64."""
    num_heads, kv_heads = q.shape[1], k.shape[0]
    out = []
    for b, n in enumerate(lens.tolist()):
        slots = (tables[b].long()[:, None] * block_size + torch.arange(block_size)).flatten()
        slots = slots[max(0, n - window) if window else 0 : n]
        keys = k[:, slots].double().repeat_interleave(num_heads // kv_heads, 0)
        values = v[:, slots].double().repeat_interleave(num_heads // kv_heads, 0)
        scores = (q[b].double()[:, None, :] @ keys.transpose(1, 2))[:, 0] * scale
        out.append((scores.softmax(-1)[:, None, :] @ values)[:, 0])
    return torch.stack(out)


@pytest.mark.parametrize("window", [0, 6, 40], ids=["full", "w6", "w40"])
@pytest.mark.parametrize("block_size", [4, 16, 32])
@pytest.mark.parametrize(("num_heads", "kv_heads"), [(9, 3), (4, 4), (8, 2), (16, 2)],
                         ids=["gqa3", "mha", "gqa4", "gqa8"])
@pytest.mark.parametrize("head_dim", [32, 64, 96, 128])
def test_matches_the_float64_reference(head_dim, num_heads, kv_heads, block_size,
                                       window) -> None:
    q, k, v, tables, lens = make_step(num_heads, kv_heads, head_dim, block_size)
    scale = head_dim**-0.5  # not a power of two for 32 and 96
    out = KERNELS.paged_decode(q, k, v, tables, lens, block_size, scale, window)
    ref = reference(q, k, v, tables, lens, block_size, scale, window)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    # The fp32 result is within a few fp32 ulps of the exact one; bf16 rounding of that
    # may land one bf16 step away where the exact value sits near a rounding boundary.
    torch.testing.assert_close(out.double(), ref, atol=1e-2, rtol=8e-3)
    close = (out.double() - ref.bfloat16().double()).abs() <= 1e-6
    assert close.float().mean() > 0.97


@pytest.mark.parametrize("block_size", [4, 16])
def test_no_key_outside_a_context_or_window_is_read(block_size) -> None:
    """NaN in every pool slot no row may see (the rest of each last block, spare blocks,
    keys before a window) must not reach the result."""
    lens = [15, 9, 33]
    q, k, v, tables, lens_t = make_step(9, 3, 64, block_size, lens)
    for window in (0, 6):
        clean = KERNELS.paged_decode(q, k, v, tables, lens_t, block_size, 0.125, window)
        visible = torch.zeros(k.shape[1], dtype=torch.bool)
        for b, n in enumerate(lens):
            slots = (tables[b].long()[:, None] * block_size + torch.arange(block_size))
            visible[slots.flatten()[max(0, n - window) if window else 0 : n]] = True
        k2, v2 = k.clone(), v.clone()
        k2[:, ~visible] = float("nan")
        v2[:, ~visible] = float("nan")
        poisoned = KERNELS.paged_decode(q, k2, v2, tables, lens_t, block_size, 0.125, window)
        assert not clean.isnan().any() and torch.equal(poisoned, clean)


def test_the_result_does_not_depend_on_the_thread_count() -> None:
    """Each (row, KV head) is one task's, summed in one order: the bits are the same on
    one thread as on several."""
    q, k, v, tables, lens = make_step(9, 3, 64, 16, [170] * 32)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = KERNELS.paged_decode(q, k, v, tables, lens, 16, 0.125, 0)
        torch.set_num_threads(max(2, threads))
        many = KERNELS.paged_decode(q, k, v, tables, lens, 16, 0.125, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)


def test_a_power_of_two_scale_agrees_with_the_float32_path() -> None:
    """With scale 1/8 (head_dim 64) the scores are the same exact products summed in fp32
    as the float32-q path over the same bf16 pools computes: the outputs agree to within
    fp32 summation order, before their rounding to bf16."""
    q, k, v, tables, lens = make_step(9, 3, 64, 16)
    fast = KERNELS.paged_decode(q, k, v, tables, lens, 16, 0.125, 0)
    wide = KERNELS.paged_decode(q.float(), k, v, tables, lens, 16, 0.125, 0)
    torch.testing.assert_close(fast.float(), wide, atol=8e-3, rtol=8e-3)
    assert torch.equal(fast, wide.bfloat16()) or (
        (fast.float() != wide.bfloat16().float()).float().mean() < 0.02)
