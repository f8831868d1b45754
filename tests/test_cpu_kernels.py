"""The C++ CPU paged attention kernels (decode and prefill) against the torch backend's
own paths.

Both run through `TorchAttentionBackend` on the same step, pools and q/k/v: one built
with the kernels, one without (the gather and two batched matmuls for decode rows, the
gather and masked SDPA for prefill rows, themselves checked against the references in
test_sliding_window.py). Steps are scheduler-like: ragged contexts, shuffled
non-contiguous pages, GQA (3 query heads per KV head, as SmolLM2), q a strided view of
a fused projection, windows shorter than a block and longer than several. head_dim 64
takes the AVX-512 loops where the host has them; 20 takes the portable ones (but for
the prefill kernel's scores, whose AVX-512 loop takes any head_dim).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from gpu.attention.base import StepContext
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.cpu.kernels import build
from gpu.cpu.kernels.build import cpu_kernels
from gpu.runner import make_backend
from tests.test_kernels import build_step

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="C++ CPU kernels not built here")
NUM_KV_HEADS, GROUP = 3, 3
TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5),
              torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def attend_both_ways(prefix_lens, query_lens, block_size, head_dim, dtype, window,
                     pool_dtype=None, pools_out=None):
    """One layer of one step through the backend with and without the kernel (pools in
    `pool_dtype`, default `dtype`; `pools_out` collects each way's pools after)."""
    context = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    num_blocks = sum(-(-n // block_size) for n in context) + 3
    inputs = build_step(prefix_lens, query_lens, block_size, num_blocks)
    num_heads = NUM_KV_HEADS * GROUP
    results = []
    shape = (NUM_KV_HEADS, num_blocks * block_size, head_dim)
    k_pool = torch.randn(shape, dtype=pool_dtype or dtype)
    v_pool = torch.randn(shape, dtype=pool_dtype or dtype)
    qkv = torch.randn(len(inputs.slot_mapping), num_heads + 2 * NUM_KV_HEADS, head_dim,
                      dtype=dtype)
    q, k, v = qkv.split([num_heads, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    assert not q.is_contiguous()
    for kernels in (KERNELS, None):
        backend = TorchAttentionBackend(num_heads, NUM_KV_HEADS, head_dim, block_size,
                                        kernels=kernels)
        pools = [k_pool.clone()], [v_pool.clone()]
        ctx = StepContext(backend, backend.prepare(inputs), *pools)
        results.append(ctx.attend(0, q, k, v, window))
        if pools_out is not None:
            pools_out.append(pools)
    return results


# (prefix lengths, new tokens) of each kernel's rows in one step.
ROWS = {
    # One token each, after ragged contexts.
    "decode": ([0, 37, 130, 16, 5, 300], [1] * 6),
    # After no prefix and after cached ones (a block's worth, ragged, long), in tiles of
    # 16 tokens and their ragged ends (2, 16, 17, 33, 70 new tokens).
    "prefill": ([0, 16, 37, 0, 300, 5], [17, 2, 33, 70, 16, 9]),
}


@needs_kernels
@pytest.mark.parametrize("window", [None, 5, 40], ids=["full", "w5", "w40"])
@pytest.mark.parametrize("head_dim", [64, 20])
@pytest.mark.parametrize(("block_size", "dtype"), [(16, torch.float32), (4, torch.float32),
                                                   (16, torch.bfloat16)],
                         ids=["bs16-fp32", "bs4-fp32", "bs16-bf16"])
@pytest.mark.parametrize("rows", ROWS)
def test_rows_match_the_torch_path(rows, window, head_dim, block_size, dtype) -> None:
    prefix_lens, query_lens = ROWS[rows]
    fast, ref = attend_both_ways(prefix_lens, query_lens, block_size, head_dim, dtype,
                                 window)
    assert fast.dtype == dtype and fast.shape == ref.shape
    torch.testing.assert_close(fast.float(), ref.float(), **TOLERANCES[dtype])


@needs_kernels
@pytest.mark.parametrize("window", [None, 5], ids=["full", "w5"])
@pytest.mark.parametrize("rows", ROWS)
def test_bfloat16_pools_under_float32(rows, window) -> None:
    """`--kv-cache-dtype bfloat16`: float32 q and output, bfloat16 pools. The kernels widen
    the pool as they read it and must agree with the torch path, which stores each new
    key and value rounded to bfloat16 and gathers the pools back to float32; both store
    the same rounded values, bit for bit."""
    prefix_lens, query_lens = ROWS[rows]
    pools: list = []
    fast, ref = attend_both_ways(prefix_lens, query_lens, 16, 64, torch.float32, window,
                                 pool_dtype=torch.bfloat16, pools_out=pools)
    assert fast.dtype == torch.float32
    torch.testing.assert_close(fast, ref, **TOLERANCES[torch.float32])
    (k_fast, v_fast), (k_ref, v_ref) = pools
    assert k_fast[0].dtype == torch.bfloat16
    assert torch.equal(k_fast[0], k_ref[0]) and torch.equal(v_fast[0], v_ref[0])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_and_prefill_rows_interleaved(dtype) -> None:
    """Each kernel takes its own group's q rows and table rows (decode rows between
    prefill rows), and the outputs land in their rows of the step."""
    fast, ref = attend_both_ways([0, 40, 16, 70], [9, 1, 12, 1], 16, 64, dtype, None)
    torch.testing.assert_close(fast.float(), ref.float(), **TOLERANCES[dtype])


@needs_kernels
def test_prefill_reads_no_key_outside_its_context() -> None:
    """Pool slots past a sequence's context (the rest of its last block, other requests'
    blocks) may hold anything: NaN there must not reach the kernel's result."""
    block_size, head_dim = 4, 64
    tables = torch.tensor([[3, 0, 5, 1], [2, 4, 6, 7]], dtype=torch.int32)
    lens = torch.tensor([14, 6], dtype=torch.int32)  # 8 cached + 6 new; 0 cached + 6 new
    qlens = torch.tensor([6, 6], dtype=torch.int32)
    starts = torch.tensor([0, 6], dtype=torch.int32)
    shape = (NUM_KV_HEADS, 8 * block_size, head_dim)
    k_pool, v_pool = torch.randn(shape), torch.randn(shape)
    q = torch.randn(12, NUM_KV_HEADS * GROUP, head_dim)
    args = (tables, starts, qlens, lens, block_size, head_dim**-0.5, 0)
    clean = torch.empty_like(q)
    KERNELS.paged_prefill_(clean, q, k_pool, v_pool, *args)
    # Row 0's keys 0..13 end in block 1 at offset 1; row 1's keys 0..5 end in block 4.
    for pool in (k_pool, v_pool):
        pool[:, 1 * block_size + 2:2 * block_size] = float("nan")
        pool[:, 4 * block_size + 2:5 * block_size] = float("nan")
        pool[:, 6 * block_size:] = float("nan")
    poisoned = torch.empty_like(q)
    KERNELS.paged_prefill_(poisoned, q, k_pool, v_pool, *args)
    assert torch.equal(poisoned, clean) and not clean.isnan().any()


@needs_kernels
def test_prefill_rejects_a_context_its_block_table_cannot_hold() -> None:
    q = torch.randn(4, NUM_KV_HEADS * GROUP, 64)
    pool = torch.randn(NUM_KV_HEADS, 32, 64)
    one = torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="out of range"):
        KERNELS.paged_prefill_(torch.empty_like(q), q, pool, pool,
                               torch.zeros(1, 1, dtype=torch.int32), one,
                               torch.tensor([4], dtype=torch.int32),
                               torch.tensor([20], dtype=torch.int32), 16, 0.125, 0)


@needs_kernels
def test_kernel_reads_no_key_outside_the_window() -> None:
    """Blocks wholly before a row's window may be freed and reused: poisoning them with
    NaN must not change the kernel's result."""
    block_size, window, head_dim = 4, 6, 64
    tables = torch.tensor([[3, 0, 5, 1], [2, 4, 6, 7]], dtype=torch.int32)
    lens = torch.tensor([15, 9], dtype=torch.int32)
    shape = (NUM_KV_HEADS, 8 * block_size, head_dim)
    k_pool, v_pool = torch.randn(shape), torch.randn(shape)
    q = torch.randn(2, NUM_KV_HEADS * GROUP, head_dim)
    args = (tables, lens, block_size, head_dim**-0.5, window)
    clean = KERNELS.paged_decode(q, k_pool, v_pool, *args)
    for block in (3, 0, 2):  # row 0 sees keys 9..14 (blocks 5, 1); row 1 keys 3..8
        if block == 2:
            k_pool[:, block * block_size:block * block_size + 3] = float("nan")  # keys 0..2
            v_pool[:, block * block_size:block * block_size + 3] = float("nan")
        else:
            k_pool[:, block * block_size:(block + 1) * block_size] = float("nan")
            v_pool[:, block * block_size:(block + 1) * block_size] = float("nan")
    assert torch.equal(KERNELS.paged_decode(q, k_pool, v_pool, *args), clean)


def test_auto_on_cpu_takes_the_kernels_and_torch_stays_plain() -> None:
    cfg = SimpleNamespace(num_heads=9, num_kv_heads=3, head_dim=64)
    auto = make_backend("auto", torch.device("cpu"), cfg, 16)
    plain = make_backend("torch", torch.device("cpu"), cfg, 16)
    assert auto.kernels is KERNELS and plain.kernels is None


def _no_compiler(*args, **kwargs):
    raise RuntimeError("Error building extension: g++: not found")


def test_a_failed_build_falls_back_and_says_why(monkeypatch, caplog, tmp_path) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(build, "cache_dir", lambda: tmp_path)  # nothing built there yet
    monkeypatch.setattr(cpp_extension, "load", _no_compiler)
    with caplog.at_level(logging.WARNING, logger=build.log.name):
        assert cpu_kernels.__wrapped__() is None
    assert "g++: not found" in caplog.text and "torch path" in caplog.text


@pytest.mark.skipif(KERNELS is None, reason="the C++ CPU kernels could not be built here")
def test_a_built_library_is_loaded_without_building(monkeypatch) -> None:
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "load", _no_compiler)  # a build would fail
    assert cpu_kernels.__wrapped__().namespace is KERNELS.namespace

