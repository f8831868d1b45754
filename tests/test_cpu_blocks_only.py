"""A GGUF's layers hold their blocks alone (`gpu/cpu/linear.py`, `Route.UNPACKED`): no
dense copy in memory, calls of many rows widen slices of panels into scratch
(`quant_unpack.cpp`) and multiply them with oneDNN.

The unpacked weights must be the blocks' own values (bit for bit in float32, rounded to
nearest even in bf16), a layer must agree with F.linear on its dequantized weight at
every row count, and the load must not fill the dense parameters it will not keep."""

from __future__ import annotations

import pytest
import torch

from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.linear import PackedLinear, reads_panel_levels
from gpu.cpu.packing import SplitLinear, pack_linears, params_not_needed
from gpu.cpu.panel_blocks import PANEL, PanelBlocks
from gpu.cpu.routing import Route
from models import gguf_blocks
from tests.test_gguf_types import random_blocks, rewritten
from tests.test_quantized_weights import load_model

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
needs_kernels = pytest.mark.skipif(KERNELS is None or not hasattr(KERNELS.namespace,
                                                                   "q4_1_unpack"),
                                   reason="C++ CPU kernels not built here")
TYPES = ("Q4_K", "Q6_K", "IQ4_XS")  # one of each format: q4_1, q8_16, q8_0


@needs_kernels
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpacked_panels_are_the_blocks_values(type_name, dtype):
    rows, k = 70, 256  # three panels, the last one partial
    q = rewritten(type_name, random_blocks(type_name, rows, k, seed=3), rows)
    panels = PanelBlocks.of(q)
    op = getattr(KERNELS, f"{q.format}_unpack")
    want = q.dequantize().to(dtype)  # float32 values; bf16: rounded to nearest even
    for p0, p1 in ((0, 3), (1, 3), (0, 1)):
        out = torch.full((k, (p1 - p0) * PANEL), float("nan"), dtype=dtype)
        op(*panels.tensors, p0, p1, out)
        n1 = min(rows, p1 * PANEL)
        assert torch.equal(out[:, :n1 - p0 * PANEL], want[p0 * PANEL:n1].T)
        assert not out[:, n1 - p0 * PANEL:].any()  # the last panel's padding is zeros


@needs_kernels
@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_layer_of_blocks_alone_agrees_at_every_row_count(type_name, dtype):
    n, k = 200, 512
    q = rewritten(type_name, random_blocks(type_name, n, k, seed=4), n)
    weight = torch.empty(n, k, dtype=dtype)  # never read: its values were never loaded
    # An AVX2 build has no bf16 arithmetic: there `pack_linears` widens a bf16 layer.
    widen = dtype == torch.bfloat16 and int(KERNELS.vector_width()) < 16
    layer = PackedLinear(weight, quantized=q, kernels=KERNELS, widen=widen,
                         amx=KERNELS is not None, blocks_only=True)
    assert layer.packed is None and layer.plain is None and layer.plan.unpacked
    # The same without AMX: its calls of many rows may take the unpacked route.
    no_amx = PackedLinear(weight, quantized=q, kernels=KERNELS, widen=widen, blocks_only=True)
    dense = q.dequantize()
    for rows in (1, 3, 5, 40, 200, 300):
        x = torch.randn(rows, k).to(dtype)
        want = x.float() @ dense.T
        # fp32: summation order over 512 products; bf16: the sums' rounding, and the
        # weights' where many rows unpack them to bf16 (a bf16 checkpoint's values).
        scale = want.abs().max().item()
        tol = dict(atol=1e-2 * scale, rtol=1e-2) if dtype == torch.bfloat16 else \
            dict(atol=1e-5 * scale, rtol=1e-4)
        torch.testing.assert_close(layer(x).float(), want, **tol)
        torch.testing.assert_close(no_amx(x).float(), want, **tol)
        # The unpacked route itself, whichever rows the routing hands it on this host,
        # where some call can take it (not where the dot kernel's pairs serve every one).
        if reads_panel_levels(no_amx.plan, q.format):
            torch.testing.assert_close(no_amx._unpacked(x).float(), want, **tol)
    assert layer.plan.route(10**6) in (Route.UNPACKED, Route.AMX, Route.BLOCKS)


@needs_kernels
def test_the_load_skips_the_dense_weights_of_layers_served_from_blocks(smollm2_dir):
    """SmolLM2's GGUF: every linear Q4_1, the tied head Q8_0. Every linear's parameter
    is left unfilled and every packed layer holds no dense copy; nor is the embedding
    (looked up from the head's blocks, `BlockEmbedding`); the model's logits agree with
    the float32 path's."""
    blocks = gguf_blocks.load(smollm2_dir)
    reference = load_model(smollm2_dir)
    model = load_model(smollm2_dir)
    skip = params_not_needed(model, blocks, KERNELS)
    assert len(skip) == 30 * 4 + 1 and "embed_tokens.weight" in skip
    extra = pack_linears(model, blocks, KERNELS)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 30 * 4 + 1 and not any(isinstance(m, SplitLinear)
                                                 for m in model.modules())
    assert all(m.packed is None and m.plain is None for m in layers)
    dense = sum(m.in_features * m.out_features * 4 for m in layers[:-1])
    assert extra < -0.7 * dense  # the blocks replace the float32 weights: ~0.2 of them
    from tests.test_quantized_weights import _Context

    for rows in (1, 250):  # 250: past every blocks' kernel (AMX's 128 rows)
        ids, pos = torch.randint(0, 49152, (rows,)), torch.arange(rows)
        with torch.inference_mode():
            want = reference.compute_logits(reference(ids, pos, _Context()))
            got = model.compute_logits(model(ids, pos, _Context()))
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-3)


@needs_kernels
def test_where_dot_and_amx_take_every_call_the_panels_levels_go():
    """bf16 on AMX: the dot kernel (1-3 rows) and the tile unit (4 rows on) read one copy
    of a Q4_1 layer's levels, regrouped (`dot_pairs`), so the panels keep only their
    scales and minimums: the layer holds 0.75 bytes a weight, what a call reads."""
    from gpu.cpu.capabilities import CpuCapabilities

    caps = CpuCapabilities.of(KERNELS)
    if not (caps.amx and caps.has("q4_1_linear_bf16")):
        pytest.skip("needs AMX and the AVX512-BF16 dot kernel")
    n, k = 256, 512
    q = rewritten("Q4_K", random_blocks("Q4_K", n, k, seed=5), n)
    layer = PackedLinear(torch.empty(n, k, dtype=torch.bfloat16), quantized=q, kernels=caps,
                         amx=True, blocks_only=True)
    assert layer.quantized.tensors[0].numel() == 0
    assert layer.nbytes == n * k * 0.75 and layer.read_bytes == n * k * 0.75
    assert layer._amx_args[0] is layer._dot_args[0]
    x = torch.randn(5, k).bfloat16()
    want = x.float() @ q.dequantize().T
    for rows in (1, 5):
        torch.testing.assert_close(layer(x[:rows]).float(), want[:rows],
                                   atol=1e-2 * want.abs().max().item(), rtol=1e-2)
