"""The C++ quantized linear kernels (Q4_1, Q8_0) against a float32 reference dequantizer
and against gguf-py's own.

Weights are made in the GGUF's row order and repacked into the kernels' panels as the
server does it (`PanelBlocks.of`). Exactness is checked with x = identity: then every
output is one weight times 1.0 plus zeros, so `out.T` is the kernel's dequantized
weight itself and must equal the reference bit for bit. (Scales are f16 values, as in
a GGUF file and as `PanelBlocks` demands, so `d * q` is exact in fp32 and the kernel's
fused multiply-add rounds like numpy's multiply then add.) Random x then checks the
matmul, with row counts around the kernel's switches (scales per block up to 4 rows;
tiles of up to 12 rows, widened in registers up to 24 rows, into a buffer above), K
within and across the 128-k chunks, and output counts that leave the last 32-row panel
partly empty.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.panel_blocks import PanelBlocks
from models.gguf_blocks import QuantizedWeight

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="C++ CPU kernels not built here")
BLOCK = 32


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def random_q4_1(n: int, k: int, fp16_scales: bool = True):
    """Random Q4_1 tensors in the kernel's layout; scales and mins fp16-representable as
    in a GGUF file, unless `fp16_scales` is False."""
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
    scales = torch.randn(n, k // BLOCK) * 0.05
    mins = torch.randn(n, k // BLOCK) * 0.5
    if fp16_scales:
        scales, mins = scales.half().float(), mins.half().float()
    return qweight, scales, mins


def random_q8_0(n: int, k: int):
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scales = (torch.randn(n, k // BLOCK) * 0.01).half().float()
    return qweight, scales


def q4_1(x, qweight, scales, mins) -> torch.Tensor:
    """The kernel on GGUF-order tensors, repacked as at load."""
    panels = PanelBlocks.of(QuantizedWeight("q4_1", qweight, scales, mins))
    return KERNELS.q4_1_linear(x, *panels.tensors, qweight.shape[0])


def q8_0(x, qweight, scales) -> torch.Tensor:
    panels = PanelBlocks.of(QuantizedWeight("q8_0", qweight, scales, None))
    return KERNELS.q8_0_linear(x, *panels.tensors, qweight.shape[0])


def dequant_q4_1(qweight, scales, mins) -> torch.Tensor:
    """Float32, as gguf-py's numpy: `(d * q) + m`, two ops, two roundings (torch's CPU
    elementwise ops do not fuse)."""
    n = qweight.shape[0]
    blocks = qweight.view(n, -1, 16)
    q = torch.cat([blocks & 0x0F, blocks >> 4], dim=2).float()  # GGML order: lows, highs
    return (scales[:, :, None] * q + mins[:, :, None]).reshape(n, -1)


def dequant_q8_0(qweight, scales) -> torch.Tensor:
    n = qweight.shape[0]
    return (qweight.view(n, -1, BLOCK).float() * scales[:, :, None]).reshape(n, -1)


@needs_kernels
@pytest.mark.parametrize("k", [64, 576])
def test_dequantization_is_bit_exact(k) -> None:
    """Through every path: up to 4 rows (scales applied per block), up to 24 (weights
    dequantized in registers, one tile or two) and more (into a buffer)."""
    eye = torch.eye(k)
    q4, q8 = random_q4_1(70, k), random_q8_0(70, k)
    w4, w8 = dequant_q4_1(*q4), dequant_q8_0(*q8)
    for rows in (slice(0, 3), slice(0, 5), slice(0, 20), slice(None)):
        assert torch.equal(q4_1(eye[rows], *q4).T, w4[:, rows])
        assert torch.equal(q8_0(eye[rows], *q8).T, w8[:, rows])


def test_panels_refuse_q4_1_scales_whose_products_would_round() -> None:
    """The kernel's Q4_1 widening is one fused multiply-add, exact only when `d * q` is
    (q < 16): scales of more than 20 significant bits would round differently from
    numpy, so they are refused. Minimums and Q8_0 scales round once either way; a
    K-quant's scale (an f16 times a 6-bit integer) passes."""
    qweight, scales, mins = random_q4_1(40, 64)
    qweight8, scales8 = random_q8_0(40, 64)
    for bad in (QuantizedWeight("q4_1", *random_q4_1(40, 64, fp16_scales=False)),
                QuantizedWeight("q4_1", qweight, scales * (1 + 2**-22), mins)):
        with pytest.raises(ValueError, match="at most 20 significant bits"):
            PanelBlocks.of(bad)
    PanelBlocks.of(QuantizedWeight("q4_1", qweight, scales, mins))  # f16 values pass
    PanelBlocks.of(QuantizedWeight("q4_1", qweight, scales * 63, mins + 1e-6))
    PanelBlocks.of(QuantizedWeight("q8_0", qweight8, scales8 + 1e-6, None))


@needs_kernels
@pytest.mark.parametrize("k", [64, 576])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 8, 9, 12, 13, 24, 25, 64])
def test_matmul_matches_fp32(m, k) -> None:
    x = torch.randn(m, k)
    # The last of three panels partly empty: 6 of its 32 outputs (inside the first 8-lane
    # group), 26 (two whole groups of AVX2's four, then 2 of the fourth).
    for n in (70, 90):
        q4 = random_q4_1(n, k)
        out = q4_1(x, *q4)
        assert out.shape == (m, n) and out.dtype == torch.float32
        torch.testing.assert_close(out, x @ dequant_q4_1(*q4).T, rtol=1e-5, atol=1e-4)
        q8 = random_q8_0(n, k)
        torch.testing.assert_close(q8_0(x, *q8), x @ dequant_q8_0(*q8).T,
                                   rtol=1e-5, atol=1e-4)


@needs_kernels
@pytest.mark.parametrize("m", [3, 5, 20, 30])  # scales per block; direct: one tile, two; buffered
def test_x_with_a_row_stride(m) -> None:
    """x may be a view into a wider buffer (e.g. one part of a fused projection)."""
    wide = torch.randn(m, 2 * 64)
    x = wide[:, 32:96]
    assert not x.is_contiguous()
    q4, q8 = random_q4_1(9, 64), random_q8_0(9, 64)
    torch.testing.assert_close(q4_1(x, *q4), x @ dequant_q4_1(*q4).T,
                               rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(q8_0(x, *q8), x @ dequant_q8_0(*q8).T,
                               rtol=1e-5, atol=1e-4)


@needs_kernels
def test_bad_shapes_are_refused() -> None:
    qw, scales, mins = PanelBlocks.of(QuantizedWeight("q4_1", *random_q4_1(40, 64))).tensors
    with pytest.raises(RuntimeError, match="x has K"):
        KERNELS.q4_1_linear(torch.randn(2, 32), qw, scales, mins, 40)
    with pytest.raises(RuntimeError, match="float32"):
        KERNELS.q4_1_linear(torch.randn(2, 64).double(), qw, scales, mins, 40)
    with pytest.raises(RuntimeError, match="mins"):
        KERNELS.q4_1_linear(torch.randn(2, 64), qw, scales, mins[:, :1], 40)
    with pytest.raises(RuntimeError, match="does not fill"):  # 40 outputs take 2 panels
        KERNELS.q4_1_linear(torch.randn(2, 64), qw, scales, mins, 65)
    with pytest.raises(RuntimeError, match="does not fill"):
        KERNELS.q4_1_linear(torch.randn(2, 64), qw, scales, mins, 32)
    with pytest.raises(RuntimeError, match="qweight must be contiguous Char"):  # not int8
        KERNELS.q8_0_linear(torch.randn(2, 64), torch.zeros(1, 2, 32, 32, dtype=torch.uint8),
                            torch.zeros(1, 2, 32), 32)


def gguf_blocks_q4_1(qweight, scales, mins) -> np.ndarray:
    """Raw GGML Q4_1 bytes: per block f16 d, f16 m, 16 qs bytes."""
    n, nb = scales.shape
    d = scales.half().numpy().reshape(n, nb, 1).view(np.uint8)
    m = mins.half().numpy().reshape(n, nb, 1).view(np.uint8)
    qs = qweight.numpy().reshape(n, nb, 16)
    return np.concatenate([d, m, qs], axis=2).reshape(n, -1)


def gguf_blocks_q8_0(qweight, scales) -> np.ndarray:
    n, nb = scales.shape
    d = scales.half().numpy().reshape(n, nb, 1).view(np.uint8)
    qs = qweight.numpy().view(np.uint8).reshape(n, nb, BLOCK)
    return np.concatenate([d, qs], axis=2).reshape(n, -1)


@needs_kernels
def test_matches_gguf_dequantizer_bit_for_bit() -> None:
    """The served fp32 weights come from gguf-py; the kernel must reproduce them."""
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    k = 576
    eye = torch.eye(k)
    q4 = random_q4_1(37, k)
    ref = dequantize(gguf_blocks_q4_1(*q4), gguf.GGMLQuantizationType.Q4_1)
    assert ref.shape == (37, k) and ref.dtype == np.float32
    assert torch.equal(q4_1(eye, *q4).T, torch.from_numpy(ref))
    q8 = random_q8_0(37, k)
    ref = dequantize(gguf_blocks_q8_0(*q8), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(q8_0(eye, *q8).T, torch.from_numpy(ref))


@needs_kernels
@pytest.mark.parametrize("fp16_scales", [True, False])
def test_one_pass_dequantize_matches_gguf_dequantizer(fp16_scales) -> None:
    """The load's dequantize (`quant_dequantize.cpp`, behind `panel_blocks.dequantized`) gives
    the float32 checkpoint's values bit for bit, from GGUF row order; with full fp32 scales
    too (it rounds the multiply and the add apart, as numpy does)."""
    from gpu.cpu.panel_blocks import dequantized

    for n, k in ((37, 576), (1, 32), (300, 64)):  # rows across the parallel grain
        q4 = QuantizedWeight("q4_1", *random_q4_1(n, k, fp16_scales=fp16_scales))
        assert torch.equal(dequantized(q4, KERNELS), dequant_q4_1(q4.qweight, q4.scales, q4.mins))
        q8 = QuantizedWeight("q8_0", *random_q8_0(n, k), None)
        assert torch.equal(dequantized(q8, KERNELS), dequant_q8_0(q8.qweight, q8.scales))
    gguf = pytest.importorskip("gguf")
    from gguf.quants import dequantize

    q4 = QuantizedWeight("q4_1", *random_q4_1(37, 576))
    ref = dequantize(gguf_blocks_q4_1(q4.qweight, q4.scales, q4.mins),
                     gguf.GGMLQuantizationType.Q4_1)
    assert torch.equal(dequantized(q4, KERNELS), torch.from_numpy(ref))
    assert torch.equal(dequantized(q4, None), torch.from_numpy(ref))  # eager torch's path


@needs_kernels
def test_one_pass_dequantize_refuses_bad_shapes() -> None:
    qweight, scales, mins = random_q4_1(4, 64)
    with pytest.raises(RuntimeError, match="out must be"):
        KERNELS.q4_1_dequantize(qweight, scales, mins, torch.empty(4, 32))
    with pytest.raises(RuntimeError, match="mins must be"):
        KERNELS.q4_1_dequantize(qweight, scales, mins[:, :1], torch.empty(4, 64))
    with pytest.raises(RuntimeError, match="qweight must be contiguous Char"):
        KERNELS.q8_0_dequantize(qweight, scales, torch.empty(4, 64))


@needs_kernels
@pytest.mark.parametrize("m", [0, 1, 3, 5, 20, 30])
def test_bf16_x_is_widened_and_the_sums_rounded_once(m) -> None:
    """bf16 x (a bf16 layer's calls of few rows): bit for bit what widening x in torch,
    multiplying in float32 and rounding the sums to bf16 give; x with a row stride too."""
    wide = torch.randn(m, 2 * 576).bfloat16()
    q4, q8 = random_q4_1(70, 576), random_q8_0(70, 576)
    for x in (wide[:, :576].contiguous(), wide[:, 288:864]):
        out = q4_1(x, *q4)
        assert out.dtype == torch.bfloat16 and out.shape == (m, 70)
        assert torch.equal(out.view(torch.int16), q4_1(x.float(), *q4).bfloat16().view(torch.int16))
        out = q8_0(x, *q8)
        assert torch.equal(out.view(torch.int16), q8_0(x.float(), *q8).bfloat16().view(torch.int16))
