"""The AMX kernel for a bf16 model's Q4_1 layers (`gpu/cpu/kernels/quant_linear_amx.cpp`)
and the rows `PackedLinear` hands it.

It multiplies the GGUF's blocks rounded to bf16, the bf16 checkpoint's weights, so with x
the identity its output is every weight rounded, bit for bit, and otherwise it is the
product of the bf16 values with fp32 sums, as oneDNN's bf16 matmul. Runs only where the
kernels were built with AMX and Linux grants the process its state.
"""

from __future__ import annotations

import sys

import pytest
import torch

from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.linear import AMX_ROWS, PackedLinear
from gpu.cpu.packing import pack_linears
from gpu.cpu.panel_blocks import PanelBlocks
from models import gguf_blocks
from models.gguf_blocks import QuantizedWeight

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(
    KERNELS is None or not hasattr(KERNELS, "q4_1_linear_amx") or not KERNELS.amx_usable(),
    reason="the C++ kernels were not built with AMX here (or Linux refused its state)")


def q4_1(n: int, k: int, seed: int) -> tuple[QuantizedWeight, torch.Tensor]:
    """Random Q4_1 blocks (f16 scales and mins, as in a GGUF) and their exact values."""
    g = torch.Generator().manual_seed(seed)
    blocks = k // 32
    qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.randn(n, blocks, generator=g) * 0.02).half().float()
    mins = (torch.randn(n, blocks, generator=g) * 0.1).half().float()
    q = QuantizedWeight("q4_1", qweight, scales, mins)
    return q, q.dequantize()


def amx(x: torch.Tensor, q: QuantizedWeight) -> torch.Tensor:
    blocks = PanelBlocks.of(q)
    return KERNELS.q4_1_linear_amx(x, blocks.dot_pairs(), *blocks.tensors[1:],
                                   q.out_features)


@pytest.mark.parametrize("n,k", [(96, 576), (100, 576), (40, 1536)])
def test_identity_rows_give_every_weight_rounded_to_bf16(n, k):
    q, exact = q4_1(n, k, seed=n + k)
    for first in range(0, k, 40):  # every k, 40 rows at a time (three x tiles)
        rows = min(40, k - first)
        eye = torch.zeros(rows, k, dtype=torch.bfloat16)
        eye[torch.arange(rows), first + torch.arange(rows)] = 1
        got = amx(eye, q)
        assert torch.equal(got, exact[:, first:first + rows].T.bfloat16()), first


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 32, 33, 64, 100])
def test_random_rows_are_the_bf16_product(rows):
    q, exact = q4_1(100, 576, seed=rows)  # a partial last panel (100 = 3 x 32 + 4)
    weight = exact.bfloat16()
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
    got = amx(x, q)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 100)
    want = (x.float() @ weight.float().T).bfloat16()  # fp32 sums in another order
    assert (got == want).float().mean() > 0.98
    torch.testing.assert_close(got.double(), x.double() @ weight.double().T, rtol=8e-3,
                               atol=1e-2)
    # Rows with a stride (a view of a wider tensor) are read in place.
    wide = torch.randn(rows, 600).bfloat16()
    wide[:, :576] = x
    assert torch.equal(amx(wide[:, :576], q), got)


def test_rows_in_chunks_are_each_rows_own_product():
    """A prompt's many rows go in chunks, so that x's transposed rows stay in L2 while
    every panel reads them (K = 2048: chunks of 256 rows): each row's result is the one
    it gets alone, across the chunks' seams and the last, short chunk."""
    q, _ = q4_1(40, 2048, seed=7)
    x = torch.randn(600, 2048, generator=torch.Generator().manual_seed(7)).bfloat16()
    got = amx(x, q)
    alone = torch.cat([amx(x[i:i + 30], q) for i in range(0, 600, 30)])
    assert torch.equal(got, alone)


def test_bad_inputs_are_refused():
    q, _ = q4_1(64, 64, seed=0)
    with pytest.raises(RuntimeError, match="bfloat16"):
        amx(torch.randn(2, 64), q)
    with pytest.raises(RuntimeError, match="K = 32"):
        amx(torch.randn(2, 32).bfloat16(), q)


def test_packed_linear_routes_rows_by_count():
    """bf16 with AMX: the widened blocks below AMX_ROWS (the float32 layer's output
    rounded), the AMX kernel inside it, oneDNN's packed bf16 above it."""
    q, exact = q4_1(96, 576, seed=3)
    layer = PackedLinear(exact.bfloat16(), quantized=q, kernels=KERNELS, amx=True)
    fp32 = PackedLinear(exact, quantized=q, kernels=KERNELS)
    amx_rows = AMX_ROWS["q4_1"]
    assert layer.amx_rows == amx_rows and layer.quantized_max_rows == amx_rows.start - 1
    g = torch.Generator().manual_seed(0)
    for rows in (1, amx_rows.start - 1, amx_rows.start, 40, amx_rows.stop - 1, amx_rows.stop):
        x = torch.randn(rows, 576, generator=g).bfloat16()
        got = layer(x)
        if rows < amx_rows.start:
            assert torch.equal(got, fp32(x.float()).bfloat16()), rows
        elif rows in amx_rows:
            assert torch.equal(got, amx(x, q)), rows
        else:
            packed = torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [None],
                                                        "")
            assert torch.equal(got, packed), rows
    x = torch.randn(2, 7, 576, generator=g).bfloat16()  # a prefill's [batch, tokens, K]
    assert torch.equal(layer(x), amx(x.reshape(14, 576), q).view(2, 7, 96))
    # Not asked for (a float32 layer, or amx off): no AMX.
    assert fp32.amx_rows is None
    assert PackedLinear(exact.bfloat16(), quantized=q, kernels=KERNELS).amx_rows is None


def test_the_embedded_models_bf16_layers_use_it(smollm2_dir):
    """Wired, not only built: pack_linears gives every Q4_1 layer of the bf16 model the
    AMX rows, and the Q8_0 LM head its own past its one widened row; holding their blocks
    alone, the layers take every call from there on to the tile unit."""
    from models.config import ModelConfig
    from models.decoder import DecoderForCausalLM
    from models.weights import iter_safetensors

    cfg = ModelConfig.from_dir(smollm2_dir)
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, max_positions=64)
    model = model.to_empty(device="cpu").bfloat16()
    model.load_weights(iter_safetensors(smollm2_dir, torch.bfloat16))
    pack_linears(model, gguf_blocks.load(smollm2_dir), KERNELS)
    layers = [m for name, m in model.named_modules()
              if isinstance(m, PackedLinear) and name != "lm_head"]
    assert len(layers) == 4 * cfg.num_layers
    def from_first(fmt: str) -> range:
        return range(AMX_ROWS[fmt].start, sys.maxsize)

    assert all(m.amx_rows == from_first("q4_1") for m in layers)
    # The Q4_1 kernel reads the dot kernel's pairs, the levels' one copy (half a byte a
    # weight): the panels keep only their scales and mins beside it.
    assert all(m.dot_pairs is not None and m._amx_args[0] is m.dot_pairs
               and m._dot_args[0] is m.dot_pairs
               and m.dot_pairs.numel() * 8 == m.in_features * m.out_features
               and m.quantized.tensors[0].numel() == 0
               for m in layers)
    assert model.lm_head.dot_pairs is None
    assert model.lm_head.amx_rows == from_first("q8_0")
    assert model.lm_head.quantized_max_rows == AMX_ROWS["q8_0"].start - 1
