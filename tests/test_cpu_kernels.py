"""The C++ CPU paged decode kernel against the torch backend's own decode path.

Both run through `TorchAttentionBackend` on the same step, pools and q/k/v: one built
with the kernels, one without (the gather and two batched matmuls, itself checked
against the references in test_sliding_window.py). Steps are scheduler-like: ragged
contexts, shuffled non-contiguous pages, GQA (3 query heads per KV head, as SmolLM2),
q a strided view of a fused projection, windows shorter than a block and longer than
several. head_dim 64 takes the AVX-512 loops where the host has them; 20 takes the
portable ones.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from gpu.attention.base import StepContext
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.kernels.cpu import build
from gpu.kernels.cpu.build import cpu_kernels
from gpu.kernels.cpu.decoder_ops import CppDecoderOps
from gpu.runner import decoder_ops, make_backend
from models.ops import DecoderOps
from models.rope import Rotary, apply_rotary
from tests.test_kernels import build_step

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="C++ CPU kernels not built here")
NUM_KV_HEADS, GROUP = 3, 3
TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5),
              torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def attend_both_ways(prefix_lens, query_lens, block_size, head_dim, dtype, window):
    """One layer of one step through the backend with and without the kernel."""
    context = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    num_blocks = sum(-(-n // block_size) for n in context) + 3
    inputs = build_step(prefix_lens, query_lens, block_size, num_blocks)
    num_heads = NUM_KV_HEADS * GROUP
    results = []
    shape = (NUM_KV_HEADS, num_blocks * block_size, head_dim)
    k_pool, v_pool = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    qkv = torch.randn(len(inputs.slot_mapping), num_heads + 2 * NUM_KV_HEADS, head_dim,
                      dtype=dtype)
    q, k, v = qkv.split([num_heads, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    assert not q.is_contiguous()
    for kernels in (KERNELS, None):
        backend = TorchAttentionBackend(num_heads, NUM_KV_HEADS, head_dim, block_size,
                                        kernels=kernels)
        ctx = StepContext(backend, backend.prepare(inputs), [k_pool.clone()], [v_pool.clone()])
        results.append(ctx.attend(0, q, k, v, window))
    return results


@needs_kernels
@pytest.mark.parametrize("window", [None, 5, 40], ids=["full", "w5", "w40"])
@pytest.mark.parametrize("head_dim", [64, 20])
@pytest.mark.parametrize(("block_size", "dtype"), [(16, torch.float32), (4, torch.float32),
                                                   (16, torch.bfloat16)],
                         ids=["bs16-fp32", "bs4-fp32", "bs16-bf16"])
def test_decode_rows_match_the_torch_path(window, head_dim, block_size, dtype) -> None:
    prefix_lens = [0, 37, 130, 16, 5, 300]
    fast, ref = attend_both_ways(prefix_lens, [1] * len(prefix_lens), block_size, head_dim,
                                 dtype, window)
    assert fast.dtype == dtype and fast.shape == ref.shape
    torch.testing.assert_close(fast.float(), ref.float(), **TOLERANCES[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_rows_between_prefill_rows(dtype) -> None:
    """The kernel takes the decode group's own q rows and table rows; prefill rows keep
    SDPA and the outputs land in their rows of the step."""
    fast, ref = attend_both_ways([0, 40, 16, 70], [9, 1, 12, 1], 16, 64, dtype, None)
    torch.testing.assert_close(fast.float(), ref.float(), **TOLERANCES[dtype])


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
    # RoPE fused into the CPU store must not hand the model Triton's decoder ops
    assert type(decoder_ops(auto)) is DecoderOps


def test_a_failed_build_falls_back_and_says_why(monkeypatch, caplog) -> None:
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: g++: not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    with caplog.at_level(logging.WARNING, logger=build.log.name):
        assert cpu_kernels.__wrapped__() is None
    assert "g++: not found" in caplog.text and "torch path" in caplog.text


@needs_kernels
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rotary_fused_with_the_store_matches_rotating_first(rotary_dim, dtype) -> None:
    """A mixed step with RoPE handed to the backend: the pools and the outputs equal
    those of rotating q and k in torch first (`apply_rotary`), then storing."""
    block_size, head_dim, num_heads = 16, 64, NUM_KV_HEADS * GROUP
    inputs = build_step([0, 40, 16, 70], [9, 1, 12, 1], block_size, num_blocks=16)
    rope = Rotary(None, theta=10000.0, rotary_dim=rotary_dim, max_position_embeddings=128,
                  max_positions=128)
    positions = torch.cat([torch.arange(c - n, c) for c, n in
                           zip(inputs.context_lens_list, inputs.query_lens_list)])
    cos, sin = rope(positions, dtype)
    shape = (NUM_KV_HEADS, 16 * block_size, head_dim)
    k_pool, v_pool = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
    qkv = torch.randn(len(positions), num_heads + 2 * NUM_KV_HEADS, head_dim, dtype=dtype)
    fused = TorchAttentionBackend(num_heads, NUM_KV_HEADS, head_dim, block_size, KERNELS)
    plain = TorchAttentionBackend(num_heads, NUM_KV_HEADS, head_dim, block_size)
    assert fused.fuses_rotary and not plain.fuses_rotary
    results = []
    for backend in (fused, plain):
        pools = [k_pool.clone()], [v_pool.clone()]
        ctx = StepContext(backend, backend.prepare(inputs), *pools)
        q, k, v = qkv.clone().split([num_heads, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
        if not ctx.rotates:
            q, k = apply_rotary(torch.cat([q, k], dim=1), cos, sin).split(
                [num_heads, NUM_KV_HEADS], dim=1)
        out = ctx.attend(0, q, k, v, None, (cos, sin) if ctx.rotates else None)
        results.append((out, pools[0][0], pools[1][0]))
    (out, k_fused, v_fused), (ref, k_ref, v_ref) = results
    assert torch.equal(v_fused, v_ref)
    # fp32: rounding order only; bf16: one rounding against torch's three
    torch.testing.assert_close(k_fused.float(), k_ref.float(), **TOLERANCES[dtype])
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[dtype])


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cpp_decoder_ops_match_the_reference(dtype) -> None:
    fused, ref = CppDecoderOps(KERNELS), DecoderOps()
    x = torch.randn(37, 576, dtype=dtype)
    residual = torch.randn(37, 576, dtype=dtype)
    weight = torch.rand(576, dtype=dtype) + 0.5
    expected, expected_residual = ref.add_rms_norm(x, residual.clone(), weight, 1e-5)
    out, new_residual = fused.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, expected_residual)  # the same one rounding of the sum
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCES[dtype])
    # gate/up as a strided view of a wider projection, with large gates both ways
    gate_up = (torch.randn(37, 2 * 1536 + 64) * 30).to(dtype)[:, 64:]
    torch.testing.assert_close(fused.silu_and_mul(gate_up).float(),
                               ref.silu_and_mul(gate_up).float(), **TOLERANCES[dtype])
