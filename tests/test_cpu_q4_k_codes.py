"""A Q4_K's own scale codes in place of float32 scales and mins (`q4_1_scales.h`): the
load's rewrite writes them beside the float32 ones, the bf16 dot kernel and the AMX tile
kernel give from them bit for bit what they give from the float32 layout, and a layer
whose every call takes those kernels keeps the codes alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu.cpu.capabilities import CpuCapabilities
from gpu.cpu.linear import PackedLinear
from gpu.cpu.panel_blocks import PanelBlocks
from tests.test_gguf_types import KERNELS, random_blocks, rewritten

CAPS = CpuCapabilities.of(KERNELS) if KERNELS is not None else None
needs_dot = pytest.mark.skipif(CAPS is None or not CAPS.has("q4_1_linear_bf16"),
                               reason="needs the AVX512-BF16 dot kernel")


def read_q4_k(n: int, k: int, seed: int) -> tuple[PanelBlocks, np.ndarray]:
    """Random Q4_K rows read into panels by the load's op, with the pairs and the codes."""
    raw = random_blocks("Q4_K", n, k, seed=seed)
    panels = -(-n // 32)
    levels = torch.empty(panels, k // 32, 16, 32, dtype=torch.uint8)
    scales, mins = torch.empty(panels, k // 32, 32), torch.empty(panels, k // 32, 32)
    pairs = torch.empty(panels, k // 32, 4, 32, dtype=torch.int32)
    codes = (torch.empty(panels, k // 32, 2, 32, dtype=torch.uint8),
             torch.empty(panels, k // 256, 2, 32))
    KERNELS.gguf_repack_panels_("Q4_K", torch.from_numpy(raw), None,
                                levels.view(panels, -1, 32), scales, mins, pairs, *codes, 0)
    return PanelBlocks("q4_1", n, (levels, scales, mins), pairs, codes), raw


@pytest.mark.skipif(KERNELS is None, reason="C++ CPU kernels not built here")
def test_codes_times_their_super_blocks_are_the_float32_scales():
    blocks, raw = read_q4_k(40, 512, seed=1)
    codes, supers = blocks.codes
    levels, scales, mins = blocks.tensors
    # Each block of 32 takes its super-block's (of 256) d and -dmin.
    d = supers[:, :, 0].repeat_interleave(8, dim=1)
    dmin = supers[:, :, 1].repeat_interleave(8, dim=1)
    assert torch.equal(d * codes[:, :, 0].float(), scales)
    assert torch.equal(dmin * codes[:, :, 1].float(), mins)
    assert codes.max() < 64 and not codes[1, :, :, 8:].any()  # 6 bits; the padding rows
    # And they are the row-order rewrite's values, laid out.
    reference = PanelBlocks.of(rewritten("Q4_K", raw, 40))
    assert all(torch.equal(a, b) for a, b in zip(blocks.tensors, reference.tensors, strict=True))


@pytest.mark.skipif(KERNELS is None, reason="C++ CPU kernels not built here")
def test_pairs_written_without_panel_levels_are_those_written_beside_them():
    """A layer that keeps no panel levels gets its pairs straight from the file's bytes
    (`q4_k_pairs`, super-block by super-block), in two parts as q and k stack: the
    second from row 32, its rows reordered as llama's q and k are, its last panel
    partial and filled with zeros."""
    n, k = 72, 512
    with_levels, raw = read_q4_k(n, k, seed=7)
    order = np.random.default_rng(8).permutation(n - 32)  # the second part's source rows
    pairs = torch.full_like(with_levels.dot, 7)
    codes = tuple(torch.full_like(t, 7) for t in with_levels.codes)
    for part, rows, row0 in ((raw[:32], None, 0), (raw[32:][np.argsort(order)], order, 32)):
        KERNELS.gguf_repack_panels_("Q4_K", torch.from_numpy(np.ascontiguousarray(part)),
                                    None if rows is None else torch.from_numpy(rows), None,
                                    None, None, pairs, *codes, row0)
    assert torch.equal(pairs, with_levels.dot)
    assert all(torch.equal(a, b) for a, b in zip(codes, with_levels.codes, strict=True))


@pytest.mark.parametrize("op,rows", [*(("q4_1_linear_bf16", r) for r in (1, 2, 3, 4)),
                                     *(("q4_1_linear_amx", r) for r in (4, 17, 40))])
def test_the_paired_kernels_read_codes_as_they_read_float32(op, rows):
    """The bf16 dot kernel (few rows) and the AMX tile kernel (more)."""
    if CAPS is None or not CAPS.has(op) or (op.endswith("amx") and not CAPS.amx):
        pytest.skip(f"needs {op}")
    blocks, _ = read_q4_k(72, 768, seed=rows)
    x = torch.randn(rows, 768).bfloat16()
    kernel = getattr(KERNELS, op)
    f32 = kernel(x, blocks.dot, *blocks.tensors[1:], 72)
    coded = kernel(x, blocks.dot, *blocks.codes, 72)
    assert torch.equal(f32, coded)


@pytest.mark.skipif(CAPS is None or CAPS.isa != "avx512", reason="the pairs are AVX-512's")
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 24, 25, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_exact_kernel_reads_the_pairs_as_it_reads_the_panels(rows, dtype):
    """`q4_1_linear` on the dot kernel's pairs (`q4_1_pairs.h`), with float32 scales or
    the codes: bit for bit its result on the panels, on each of its paths (per block up
    to 4 rows, widened in registers to 24, through its L1 buffer above)."""
    blocks, _ = read_q4_k(72, 768, seed=rows)
    x = torch.randn(rows, 768).to(dtype)
    want = KERNELS.q4_1_linear(x, *blocks.tensors, 72)
    assert torch.equal(KERNELS.q4_1_linear(x, blocks.dot, *blocks.tensors[1:], 72), want)
    assert torch.equal(KERNELS.q4_1_linear(x, blocks.dot, *blocks.codes, 72), want)


@needs_dot
def test_codes_that_do_not_fit_are_refused():
    blocks, _ = read_q4_k(32, 512, seed=3)
    x = torch.randn(1, 512).bfloat16()
    codes, supers = blocks.codes
    with pytest.raises(RuntimeError, match="supers must be contiguous float32"):
        KERNELS.q4_1_linear_bf16(x, blocks.dot, codes, supers[:, :1].contiguous(), 32)


@needs_dot
def test_a_layer_on_the_paired_kernels_alone_keeps_the_codes_alone():
    """bf16, blocks alone, with AMX or without: every call reads the pairs and the codes
    (the dot kernel, the AMX tile kernel, the exact kernel), so the layer holds 0.5 +
    0.094 bytes a weight (no panel levels, no float32 scales)."""
    n, k = 64, 512
    blocks, raw = read_q4_k(n, k, seed=4)
    x = torch.randn(300, k).bfloat16()
    want = x.float() @ rewritten("Q4_K", raw, n).dequantize().T
    for amx in (True, False):
        layer = PackedLinear(torch.empty(n, k, dtype=torch.bfloat16), quantized=blocks,
                             kernels=CAPS, amx=amx, blocks_only=True)
        assert layer._dot_args[1] is blocks.codes[0] and layer._dot_args[2] is blocks.codes[1]
        assert layer._quantized_args[:3] == layer._dot_args[:3]
        if layer.amx_rows is not None:
            assert layer._amx_args[1:3] == layer._dot_args[1:3]
        assert all(t.numel() == 0 for t in layer.quantized.tensors)
        assert layer.nbytes == layer.read_bytes == n * k * (0.5 + 3 / 32)
        for rows in (1, 6, 300):
            torch.testing.assert_close(layer(x[:rows]).float(), want[:rows],
                                       atol=1e-2 * want.abs().max().item(), rtol=1e-2)
