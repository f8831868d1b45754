"""The AVX512-BF16 dot-product Q4_1 kernel (`q4_1_linear_bf16`) for a bf16 model's calls
of one to four rows, against the dequantized weights.

Exactness with x = one-hot rows: each output is one weight times 1.0 plus zeros, d * q
is exact and only `+ m` rounds (once, as the float32 dequantizer), so the kernel's
output must be the dequantized weight rounded to bf16, bit for bit. Random bf16 x then
checks the matmul against float32 on the exact weights (the kernel sums in float32 and
rounds once to bf16: at most one bf16 ulp apart, where the float32 sum is not exactly
on a rounding boundary), with N that leaves the last 32-output panel partly empty, K of
one block and of many, strided x; and bit for bit against the float32 kernel's bf16
path (`q4_1_linear` with bf16 x), whose sums it reproduces in the same order.
"""

from __future__ import annotations

import pytest
import torch

from gpu.cpu.panel_blocks import PanelBlocks
from models.gguf_blocks import QuantizedWeight
from tests.test_cpu_quant_kernels import KERNELS, dequant_q4_1, random_q4_1

HAS_OP = KERNELS is not None and hasattr(KERNELS.namespace, "q4_1_linear_bf16")
needs_op = pytest.mark.skipif(not HAS_OP, reason="no AVX512-BF16 kernel built on this CPU")


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def panels(qweight, scales, mins) -> tuple:
    """The float32 kernel's arguments."""
    return (*PanelBlocks.of(QuantizedWeight("q4_1", qweight, scales, mins)).tensors,
            qweight.shape[0])


def pairs(qweight, scales, mins) -> tuple:
    """The dot-product kernel's arguments."""
    blocks = PanelBlocks.of(QuantizedWeight("q4_1", qweight, scales, mins))
    return (blocks.dot_pairs(), *blocks.tensors[1:], qweight.shape[0])


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """float64 products of the exact values, the sum rounded to bf16 once."""
    return (x.double() @ w.double().T).to(torch.bfloat16)


@needs_op
@pytest.mark.parametrize("n,k", [(32, 32), (45, 64), (96, 576)])
def test_one_hot_rows_give_each_weight_bit_for_bit(n, k) -> None:
    q = random_q4_1(n, k)
    args = pairs(*q)
    w = dequant_q4_1(*q).to(torch.bfloat16)
    for rows in (1, 2, 3, 4):
        for k0 in range(0, k, rows):
            ks = [min(k0 + i, k - 1) for i in range(rows)]
            x = torch.zeros(rows, k, dtype=torch.bfloat16)
            x[torch.arange(rows), ks] = 1.0
            out = KERNELS.q4_1_linear_bf16(x, *args)
            assert torch.equal(out.view(torch.int16), w[:, ks].T.contiguous().view(torch.int16))


@needs_op
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(960, 576), (77, 1536), (33, 32)])
def test_matmul_matches_exact_weights(m, n, k) -> None:
    q = random_q4_1(n, k)
    x = torch.randn(m, k).to(torch.bfloat16)
    out = KERNELS.q4_1_linear_bf16(x, *pairs(*q))
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = reference(x, dequant_q4_1(*q))
    # One bf16 rounding of sums that differ from float64's in float32's last bits.
    torch.testing.assert_close(out.float(), ref.float(), rtol=2**-7, atol=1e-5)
    # Nearly all outputs round to the same bf16 as the float64 sum.
    assert (out != ref).float().mean() < 0.02


@needs_op
@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("n,k", [(960, 576), (77, 1536), (33, 32)])
def test_bit_for_bit_the_float32_kernels_bf16_path(m, n, k) -> None:
    """Same sums in the same order: the dot product of two bf16 values is exact, and
    vdpbf16ps adds its two products one at a time, as the float32 kernel's FMAs do."""
    q = random_q4_1(n, k)
    args, fp32 = pairs(*q), panels(*q)
    x = (torch.randn(m, k) * torch.logspace(-3, 3, k)).to(torch.bfloat16)
    ours, theirs = KERNELS.q4_1_linear_bf16(x, *args), KERNELS.q4_1_linear(x, *fp32)
    assert torch.equal(ours.view(torch.int16), theirs.view(torch.int16))


@needs_op
@pytest.mark.parametrize("m", [1, 3])
def test_x_with_a_row_stride(m) -> None:
    q = random_q4_1(64, 128)
    args = pairs(*q)
    wide = torch.randn(m, 300).to(torch.bfloat16)
    x = wide[:, 7:135]
    assert x.stride(0) == 300
    assert torch.equal(KERNELS.q4_1_linear_bf16(x, *args),
                       KERNELS.q4_1_linear_bf16(x.contiguous(), *args))


@needs_op
def test_no_rows_and_bad_inputs() -> None:
    q = random_q4_1(64, 64)
    args = pairs(*q)
    assert KERNELS.q4_1_linear_bf16(torch.zeros(0, 64, dtype=torch.bfloat16),
                                    *args).shape == (0, 64)
    with pytest.raises(RuntimeError, match="bfloat16"):
        KERNELS.q4_1_linear_bf16(torch.zeros(1, 64), *args)
    with pytest.raises(RuntimeError, match="at most 4"):
        KERNELS.q4_1_linear_bf16(torch.zeros(5, 64, dtype=torch.bfloat16), *args)
    with pytest.raises(RuntimeError, match="K = 32"):
        KERNELS.q4_1_linear_bf16(torch.zeros(1, 32, dtype=torch.bfloat16), *args)
    with pytest.raises(RuntimeError, match="does not fill"):
        KERNELS.q4_1_linear_bf16(torch.zeros(1, 64, dtype=torch.bfloat16), *args[:-1], 20)


@needs_op
def test_packed_linear_takes_it_for_one_row_of_a_bf16_layer() -> None:
    """Routing wired: a bf16 layer with Q4_1 blocks (no AMX) sends one to three rows to
    the dot-product kernel and four to the float32 blocks kernel; a float32 layer never
    takes it."""
    from gpu.cpu.linear import PackedLinear

    qweight, scales, mins = random_q4_1(96, 576)
    q = QuantizedWeight("q4_1", qweight, scales, mins)
    exact = dequant_q4_1(qweight, scales, mins)
    layer = PackedLinear(exact.bfloat16(), quantized=q, kernels=KERNELS)
    assert layer.plan.dot_max_rows == 3 and layer.quantized_max_rows >= 4
    args, fp32 = pairs(qweight, scales, mins), panels(qweight, scales, mins)
    x = torch.randn(4, 576).bfloat16()
    for rows in (1, 3):
        assert torch.equal(layer(x[:rows]), KERNELS.q4_1_linear_bf16(x[:rows], *args))
    assert torch.equal(layer(x), KERNELS.q4_1_linear(x, *fp32))
    assert PackedLinear(exact, quantized=q, kernels=KERNELS).plan.dot_max_rows == 0


@pytest.mark.skipif(KERNELS is None, reason="C++ CPU kernels not built here")
def test_float32_kernels_round_ties_infinities_and_nan_as_torch() -> None:
    """The float32 kernels' bf16 path rounds its sums in vectors: ties to even, overflow
    to infinity and NaN exactly as `Tensor.bfloat16()` does (Q8_0, one-hot x: each
    output is q * d * x, chosen to land on ties, past float32's range, and inf - inf)."""
    n, k = 40, 64
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    d = torch.tensor([1 + 2**-8, 1 + 3 * 2**-9, 2**-14, 1024.0] * 10)[:, None].expand(n, 2)
    panel_args = (*PanelBlocks.of(QuantizedWeight("q8_0", q, d.contiguous(), None)).tensors, n)
    for values in ([1.0, 0.0], [2.0**120, 0.0], [2.0**120, -(2.0**120)], [3.0, 5.0]):
        x = torch.zeros(1, k)
        x[0, 3], x[0, 7] = values
        x = x.bfloat16()
        out = KERNELS.q8_0_linear(x, *panel_args)
        ref = KERNELS.q8_0_linear(x.float(), *panel_args).bfloat16()
        assert torch.equal(out.view(torch.int16), ref.view(torch.int16)), values


@needs_op
def test_the_load_time_regrouping_op_equals_the_tensor_arithmetic():
    """`q4_1_dot_pairs` (one C++ pass at load) gives `dot_pairs`' tensor arithmetic's
    dwords, with partial panels and many blocks."""
    blocks = PanelBlocks.of(QuantizedWeight("q4_1", *random_q4_1(70, 512)))
    assert torch.equal(blocks.dot_pairs(KERNELS), blocks.dot_pairs())
