"""The C++ CPU kernels for the steps between matmuls against `models.ops.DecoderOps`.

Rows of SmolLM2's width (576, 1536) and odd ones, single rows (decode) and many (the
kernels split rows across threads), strided inputs (a slice of a wider tensor, as a
fused projection hands them over), float32 and bfloat16. `add_rms_norm` must leave the
same residual behind as the reference returns; SiLU-and-mul covers both tails of the
sigmoid and vector tails. RoPE with the KV store must give the torch path's bits.
"""

from __future__ import annotations

import pytest
import torch

from gpu.cpu.decoder_ops import CpuDecoderOps
from gpu.cpu.kernels.build import cpu_kernels
from models.ops import DecoderOps

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(KERNELS is None or not hasattr(KERNELS, "add_rms_norm_"),
                                reason="C++ CPU kernels not built here")
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
SHAPES = [(1, 576), (7, 576), (64, 1536), (3, 100)]


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", SHAPES)
def test_norms_match_the_reference(rows, dim, dtype):
    ref, ops = DecoderOps(), CpuDecoderOps(KERNELS)
    wide = torch.randn(rows, dim + 8).to(dtype)
    x = wide[:, 4 : 4 + dim]  # strided rows, as a slice of a fused projection
    residual = torch.randn(rows, dim).to(dtype)
    weight = (torch.rand(dim) + 0.5).to(dtype)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-5), ref.rms_norm(x, weight, 1e-5),
                               **TOL[dtype])
    want_out, want_res = ref.add_rms_norm(x, residual.clone(), weight, 1e-5)
    got_out, got_res = ops.add_rms_norm(x, residual, weight, 1e-5)
    assert got_res is residual  # updated in place, as the contract allows
    torch.testing.assert_close(got_res, want_res, atol=0, rtol=0)  # the same rounded sum
    torch.testing.assert_close(got_out, want_out, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inter", [(1, 1536), (33, 1536), (5, 50)])
def test_silu_and_mul_matches_the_reference(rows, inter, dtype):
    gate_up = (torch.randn(rows, 2 * inter) * 6).to(dtype)  # both tails of the sigmoid
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    got = CpuDecoderOps(KERNELS).silu_and_mul(gate_up)
    torch.testing.assert_close(got, DecoderOps().silu_and_mul(gate_up), **TOL[dtype])


@pytest.mark.parametrize("rows,dim", [(3, 576), (2, 100)])
def test_bfloat16_rows_are_the_float32_results_rounded(rows, dim):
    """The bf16 vector loops widen exactly, compute as the float32 ones do, and round as
    `.to(torch.bfloat16)` does (to nearest even, infinities kept), tails too. NaN stays
    NaN (c10's scalar rounding writes 0x7FC0, torch's vector cast 0xFFFF)."""
    ops = CpuDecoderOps(KERNELS)
    gate_up = (torch.randn(rows, 2 * dim) * 6).to(torch.bfloat16)
    gate_up[0, :3] = torch.tensor([float("nan"), float("inf"), -float("inf")])
    want = ops.silu_and_mul(gate_up.float()).to(torch.bfloat16)
    got = ops.silu_and_mul(gate_up)
    assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
    bits = [t.nan_to_num(0.0).view(torch.int16) for t in (got, want)]
    assert torch.equal(*bits)
    x = torch.randn(rows, dim).to(torch.bfloat16)
    weight = (torch.rand(dim) + 0.5).to(torch.bfloat16)
    want = ops.rms_norm(x.float(), weight.float(), 1e-5).to(torch.bfloat16)
    assert torch.equal(ops.rms_norm(x, weight, 1e-5), want)


def test_other_shapes_fall_back_to_the_reference():
    x = torch.randn(2, 3, 8)  # 3-D rows: not the kernels' shape
    weight = torch.ones(8)
    ops = CpuDecoderOps(KERNELS)
    want = DecoderOps().rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(ops.rms_norm(x, weight, 1e-6), want)
    torch.testing.assert_close(ops.silu_and_mul(x), DecoderOps().silu_and_mul(x))
    h = torch.randn(2, 16, dtype=torch.float64)
    torch.testing.assert_close(ops.rms_norm(h, torch.ones(16, dtype=torch.float64), 1e-6),
                               DecoderOps().rms_norm(h, torch.ones(16, dtype=torch.float64), 1e-6))


@pytest.mark.parametrize(("dtype", "pool_dtype"), [(torch.float32, None), (torch.bfloat16, None),
                                                   (torch.float32, torch.bfloat16)],
                         ids=["fp32", "bf16", "fp32-bf16-pool"])
@pytest.mark.parametrize("rot", [64, 32, 48])  # full, partial (Phi-3 style), a scalar tail
@pytest.mark.parametrize("tokens", [5, 300])  # one task, and a prefill split across threads
def test_rotary_kv_store_matches_rotate_then_store(dtype, pool_dtype, rot, tokens):
    """q rotated in place inside the fused qkv rows, k rotated into the pool, v stored,
    bit for bit what models/rope.py and two index_copy_ calls give; into a bfloat16 pool
    under float32 (`--kv-cache-dtype bfloat16`) each value rounded as `.to` rounds it."""
    from models.rope import apply_rotary

    heads, kv_heads, dim, slots = 9, 3, 64, 8 * tokens
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim).to(dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    angles = torch.rand(tokens, rot // 2) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)[:, None, :]
    slot_mapping = torch.randperm(slots)[:tokens]
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    want_kc = torch.zeros(kv_heads, slots, dim, dtype=pool_dtype or dtype)
    want_vc = torch.zeros_like(want_kc)
    want_kc.index_copy_(1, slot_mapping, want_k.transpose(0, 1).to(want_kc.dtype))
    want_vc.index_copy_(1, slot_mapping, v.transpose(0, 1).to(want_vc.dtype))
    kc, vc = torch.zeros_like(want_kc), torch.zeros_like(want_vc)
    v_before = v.clone()
    KERNELS.rotary_kv_store_(q, k, v, cos, sin, kc, vc, slot_mapping)
    assert torch.equal(qkv[:, :heads], want_q)  # in place, in the fused rows
    assert torch.equal(kc, want_kc) and torch.equal(vc, want_vc)
    assert torch.equal(v, v_before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_kv_store_nan_and_subnormal_bits(dtype):
    """Subnormal lanes (which a hardware bfloat16 conversion would flush to zero) still give
    torch's bits, and NaN lanes stay NaN beside them."""
    from models.rope import apply_rotary

    tokens, heads, kv_heads, dim = 40, 9, 3, 64
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim)
    qkv[::3, :, ::7] = float("nan")
    qkv[1::3, :, 1::5] = 3e-39  # subnormal in float32; a subnormal product under bf16
    qkv[2::3, :, 2::9] = 1e-38
    qkv = qkv.to(dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    angles = torch.rand(tokens, dim // 2) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)[:, None, :]
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)[:, None, :]
    slot_mapping = torch.randperm(2 * tokens)[:tokens]
    want_q, want_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    want_kc = torch.zeros(kv_heads, 2 * tokens, dim, dtype=torch.bfloat16)
    want_vc = torch.zeros_like(want_kc)
    want_kc.index_copy_(1, slot_mapping, want_k.transpose(0, 1).to(torch.bfloat16))
    want_vc.index_copy_(1, slot_mapping, v.transpose(0, 1).to(torch.bfloat16))
    kc, vc = torch.zeros_like(want_kc), torch.zeros_like(want_vc)
    KERNELS.rotary_kv_store_(q, k, v, cos, sin, kc, vc, slot_mapping)
    for got, want in [(qkv[:, :heads], want_q), (kc, want_kc), (vc, want_vc)]:
        # NaN bits differ between torch's own paths; NaNs must land where torch's do
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan)
        assert torch.equal(got[~nan], want[~nan])
