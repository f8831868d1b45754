"""Both AMX block kernels (`quant_linear_amx_table.cpp`: Q4_1 layers;
`quant_linear_amx.cpp`: the Q8_0 LM head) against torch on the dequantized weights
rounded to bf16 (the bf16 checkpoint's), over every row count a call can bring (1..70:
one tile, two, a second pass past 32 rows), an N that leaves the last panel partial,
and x read in place from a wider tensor.

The kernel's products are those of the bf16 weights with fp32 sums, so its result is the
fp32 product rounded to bf16 up to the summation order. Runs only where the kernels were
built with AMX and Linux grants the process its state.
"""

from __future__ import annotations

import pytest
import torch

from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.linear import AMX_ROWS, PackedLinear
from gpu.cpu.panel_blocks import PanelBlocks
from models.gguf_blocks import QuantizedWeight

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(
    KERNELS is None or not hasattr(KERNELS, "q8_0_linear_amx") or not KERNELS.amx_usable(),
    reason="the C++ kernels were not built with AMX here (or Linux refused its state)")


def blocks(fmt: str, n: int, k: int, seed: int) -> QuantizedWeight:
    """Random blocks with f16 scales (and mins), as in a GGUF."""
    g = torch.Generator().manual_seed(seed)
    scales = (torch.randn(n, k // 32, generator=g) * 0.02).half().float()
    if fmt == "q4_1":
        qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
        mins = (torch.randn(n, k // 32, generator=g) * 0.1).half().float()
        return QuantizedWeight("q4_1", qweight, scales, mins)
    qweight = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    return QuantizedWeight("q8_0", qweight, scales, None)


def amx(x: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    blocks = PanelBlocks.of(q)
    if q.format == "q4_1":
        return KERNELS.q4_1_linear_amx(x, blocks.dot_pairs(), *blocks.tensors[1:],
                                       q.out_features)
    return KERNELS.q8_0_linear_amx(x, *blocks.tensors, q.out_features)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("n,k", [(100, 576), (49, 1536)])
def test_every_row_count_is_the_bf16_product(fmt, n, k):
    q = blocks(fmt, n, k, seed=n + k)
    weight = q.dequantize().bfloat16().double()
    g = torch.Generator().manual_seed(k)
    for rows in range(1, 71):
        wide = torch.randn(rows, k + 24, generator=g).bfloat16()
        x = wide[:, 8:8 + k]  # a strided view, read in place
        got = amx(x, q)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, n), rows
        assert not got.isnan().any(), rows
        want = x.double() @ weight.T
        # fp32 sums in another order, then one rounding to bf16: within a bf16 ulp or two
        # of the exact product, and mostly equal to it rounded.
        torch.testing.assert_close(got.double(), want, rtol=8e-3, atol=1e-2 * want.abs().max(),
                                   msg=f"rows {rows}")
        assert (got == want.bfloat16()).float().mean() > 0.9, rows
        assert torch.equal(amx(x.contiguous(), q), got), rows


def test_q8_0_identity_rows_give_every_weight_rounded_to_bf16():
    q = blocks("q8_0", 40, 128, seed=1)
    eye = torch.eye(128, dtype=torch.bfloat16)
    for first in range(0, 128, 64):  # two passes of 64 rows
        assert torch.equal(amx(eye[first:first + 64], q),
                           q.dequantize()[:, first:first + 64].T.bfloat16()), first


def test_q8_0_bad_inputs_are_refused():
    q = blocks("q8_0", 64, 64, seed=0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx(torch.randn(2, 64), q)
    with pytest.raises(RuntimeError, match="K = 32"):
        amx(torch.randn(2, 32).bfloat16(), q)
    with pytest.raises(RuntimeError, match="int8"):
        KERNELS.q8_0_linear_amx(torch.randn(2, 64).bfloat16(),
                                PanelBlocks.of(blocks("q4_1", 64, 64, 0)).tensors[0],
                                PanelBlocks.of(q).tensors[1], 64)


def test_the_q8_0_head_routes_rows_by_count():
    """A bf16 head with Q8_0 blocks: one row widened, AMX_ROWS on the tile unit, oneDNN's
    packed bf16 above."""
    q = blocks("q8_0", 200, 576, seed=5)
    exact = q.dequantize()
    head = PackedLinear(exact.bfloat16(), quantized=q, kernels=KERNELS, amx=True)
    fp32 = PackedLinear(exact, quantized=q, kernels=KERNELS)
    amx_rows = AMX_ROWS["q8_0"]
    assert head.amx_rows == amx_rows and head.quantized_max_rows == amx_rows.start - 1
    g = torch.Generator().manual_seed(0)
    for rows in (1, amx_rows.start, 32, amx_rows.stop - 1, amx_rows.stop):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        got = head(x)
        if rows < amx_rows.start:
            assert torch.equal(got, fp32(x.float()).bfloat16()), rows
        elif rows in amx_rows:
            assert torch.equal(got, amx(x, q)), rows
        else:
            packed = torch.ops.mkldnn._linear_pointwise(x, head.packed, None, "none", [None],
                                                        "")
            assert torch.equal(got, packed), rows
