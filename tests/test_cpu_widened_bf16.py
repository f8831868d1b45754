"""bfloat16 linears on a CPU without bf16 arithmetic (`PackedLinear.widen`,
`gpu/cpu/linear.py`).

There (AVX2) oneDNN cannot pack bf16 and torch's bf16 matmul runs at a fifth of fp32's
rate, so a bf16 layer multiplies in float32: bf16 in, bf16 out, the products summed in
float32 and rounded once, as a bf16 matmul does. Its float32 weight is the
checkpoint's: a GGUF's blocks' exact values, so a widened layer's output is the float32
layer's (same kernels, same weights) rounded to bf16, bit for bit, at every row count.
`widen` is passed explicitly here, so these run on any host; `pack_linears` turns it on
only where the CPU lacks bf16 arithmetic (the last test stands in for such a CPU). Where
the CPU has it, a bf16 layer's calls of few rows read the blocks the same way, and more
rows go to oneDNN's bf16 matmul.
"""

from __future__ import annotations

import pytest
import torch

from gpu.cpu import linear as cpu_linear
from gpu.cpu import packing
from gpu.cpu.block_embedding import BlockEmbedding
from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.linear import PackedLinear, multiply_dtype, quantized_max_rows
from gpu.cpu.packing import pack_linears, params_not_needed
from models import gguf_blocks
from models.weights import iter_safetensors

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
needs_kernels = pytest.mark.skipif(
    KERNELS is None or quantized_max_rows(KERNELS) is None,
    reason="C++ CPU kernels not built here, or without vector paths (no blocks then)")
needs_packing = pytest.mark.skipif(not cpu_linear._packing_available(),
                                   reason="torch without oneDNN's packed linears")
needs_bf16_arithmetic = pytest.mark.skipif(
    not cpu_linear._packing_available() or multiply_dtype(torch.bfloat16) != torch.bfloat16,
    reason="this CPU has no bf16 arithmetic: oneDNN cannot pack bf16 (AVX2), every bf16 "
           "layer is widened, which the tests above cover")


@needs_kernels
@needs_packing
def test_widened_layer_is_the_float32_layer_rounded(smollm2_dir):
    blocks = gguf_blocks.load(smollm2_dir)
    dense = dict(iter_safetensors(smollm2_dir, torch.float32))
    name = "model.layers.3.mlp.down_proj.weight"
    q, exact = blocks[name], dense[name]
    # The bf16 model holds the weight rounded; the widened layer multiplies the blocks'
    # exact values instead, the float32 checkpoint's.
    assert torch.equal(q.dequantize(), exact)
    fp32 = PackedLinear(exact, quantized=q, kernels=KERNELS)
    widened = PackedLinear(exact.bfloat16(), quantized=q, kernels=KERNELS, widen=True)
    assert widened.widen and widened.quantized is not None and widened.plain is None
    assert widened.packed.dtype == torch.float32
    most = quantized_max_rows(KERNELS)["q4_1"]
    for rows in (1, 3, 5, most, most + 1, 300):  # the blocks, then the packed weight
        x = torch.randn(rows, exact.shape[1]).bfloat16()
        got = widened(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, exact.shape[0])
        assert torch.equal(got, fp32(x.float()).bfloat16()), rows
    x = torch.randn(2, 7, exact.shape[1]).bfloat16()  # a prefill's [batch, tokens, K]
    assert torch.equal(widened(x), fp32(x.float()).bfloat16())


@needs_kernels
@needs_bf16_arithmetic
def test_bf16_layer_reads_the_blocks_for_few_rows_where_the_cpu_multiplies_bf16(smollm2_dir):
    """On a CPU with bf16 arithmetic a bf16 layer keeps oneDNN's packed bf16 weight, and
    its calls of up to `BF16_QUANTIZED_MAX_ROWS` rows read the blocks instead (a third of
    the bytes), multiplied in float32 as a widened layer does: those outputs are the
    float32 layer's rounded, bit for bit; more rows run oneDNN's bf16 matmul."""
    blocks = gguf_blocks.load(smollm2_dir)
    name = "model.layers.3.self_attn.o_proj.weight"
    q = blocks[name]
    exact = q.dequantize()
    layer = PackedLinear(exact.bfloat16(), quantized=q, kernels=KERNELS)
    assert not layer.widen
    most = (quantized_max_rows(KERNELS, torch.bfloat16) or {}).get("q4_1")
    if most is None:  # no bf16 table for this vector width: the blocks stay unused
        assert layer.quantized is None and layer.quantized_max_rows == 0
        return
    assert layer.quantized is not None and layer.quantized_max_rows == most
    assert layer.packed.dtype == torch.bfloat16 and layer.plain is None
    fp32 = PackedLinear(exact, quantized=q, kernels=KERNELS)
    torch.manual_seed(0)
    for rows in range(1, most + 1):
        x = torch.randn(rows, exact.shape[1]).bfloat16()
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, exact.shape[0])
        assert torch.equal(got, fp32(x.float()).bfloat16()), rows
    x = torch.randn(most + 1, exact.shape[1]).bfloat16()
    packed = torch.ops.mkldnn._linear_pointwise(x, layer.packed, None, "none", [None], "")
    assert torch.equal(layer(x), packed)  # past the threshold: oneDNN's bf16 product
    torch.testing.assert_close(layer(x).double(), x.double() @ exact.bfloat16().double().T,
                               atol=3e-2, rtol=1e-2)


@needs_packing
def test_widened_layer_without_blocks():
    """No blocks (a bf16 checkpoint): fp32 packed from the bf16 weight, exact there; and
    fewer rows than the packed weight pays for run on the bf16 weight itself."""
    torch.manual_seed(0)
    w = torch.randn(96, 64).bfloat16()
    layer = PackedLinear(w, widen=True)
    assert layer.quantized is None and layer.plain.data_ptr() == w.data_ptr()
    for rows in (1, cpu_linear.PACKED_MIN_ROWS, 50):
        x = torch.randn(rows, 64).bfloat16()
        want = (x.double() @ w.double().T)
        got = layer(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, atol=3e-2, rtol=1e-2)
    # Not bf16: nothing to widen.
    assert not PackedLinear(w.float(), widen=True).widen


@needs_kernels
@needs_packing
def test_pack_linears_widens_bf16_where_the_cpu_cannot_multiply_it(smollm2_dir, monkeypatch):
    from models.config import ModelConfig
    from models.decoder import DecoderForCausalLM

    # Stand in for a CPU without bf16 arithmetic (on one that has it, this is the AVX2
    # host's decision).
    for module in (cpu_linear, packing):
        monkeypatch.setattr(module, "multiply_dtype",
                            lambda d: torch.float32 if d == torch.bfloat16 else d)
    cfg = ModelConfig.from_dir(smollm2_dir)
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, max_positions=64)
    model = model.to_empty(device="cpu").bfloat16()
    model.load_weights(iter_safetensors(smollm2_dir, torch.bfloat16))
    bf16_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                     if n.endswith("proj.weight") or n == "embed_tokens.weight")
    blocks = gguf_blocks.load(smollm2_dir)
    extra = pack_linears(model, blocks, KERNELS)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 30 * 4 + 1
    assert all(m.widen and m.quantized is not None and m.packed is None for m in layers)
    # Each layer's bf16 weight gives way to its blocks alone (calls of many rows unpack
    # them in float32), and the embedding to the lookup from the head's blocks.
    assert extra == sum(m.quantized.nbytes for m in layers) - bf16_bytes
    assert isinstance(model.embed_tokens, BlockEmbedding)


@needs_kernels
@needs_packing
def test_widened_load_from_the_checkpoint_packs_what_the_blocks_give(smollm2_dir, monkeypatch):
    """The runner's widened load (`params_not_needed`, `load_weights(skip=...)`,
    `pack_linears(checkpoint=...)`) never fills a linear's bf16 parameter: every layer
    computes from its blocks alone what the layer of a model loaded dense does, bit for
    bit, within the blocks' rows and past them (unpacked in float32), and the rest of
    the model (embedding, norms) is loaded as before."""
    from models.config import ModelConfig
    from models.decoder import DecoderForCausalLM

    for module in (cpu_linear, packing):
        monkeypatch.setattr(module, "multiply_dtype",
                            lambda d: torch.float32 if d == torch.bfloat16 else d)
    cfg = ModelConfig.from_dir(smollm2_dir)
    blocks = gguf_blocks.load(smollm2_dir)

    def empty_model() -> DecoderForCausalLM:
        with torch.device("meta"):
            model = DecoderForCausalLM(cfg, max_positions=64)
        return model.to_empty(device="cpu").bfloat16()

    old = empty_model()
    old.load_weights(iter_safetensors(smollm2_dir, torch.bfloat16))
    old_extra = pack_linears(old, blocks, KERNELS)

    new = empty_model()
    skip = params_not_needed(new, blocks, KERNELS)
    assert len(skip) == 30 * 4 and "embed_tokens.weight" not in skip  # the lookup needs it
    checkpoint = dict(iter_safetensors(smollm2_dir))
    assert {t.dtype for t in checkpoint.values()} == {torch.float32}
    new.load_weights(checkpoint.items(), skip=skip)
    new_extra = pack_linears(new, blocks, KERNELS, checkpoint=checkpoint)

    assert new_extra == old_extra
    old_layers = dict(old.named_modules())
    layers = [(n, m) for n, m in new.named_modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 30 * 4 + 1
    torch.manual_seed(0)
    for name, layer in layers:
        assert layer.widen and layer.plain is None and layer.packed is None
        for rows in (2, 300):
            x = torch.randn(rows, layer.in_features).bfloat16()
            assert torch.equal(layer(x), old_layers[name](x)), (name, rows)
    new_params, old_params = dict(new.named_parameters()), dict(old.named_parameters())
    assert new_params.keys() == old_params.keys()
    for name in new_params:
        assert torch.equal(new_params[name], old_params[name]), name


def test_a_bf16_conversion_keeps_the_blocks(smollm2_dir):
    """The embedded model converted for `--dtype bfloat16` keeps the blocks too: the
    widened layers read them, and they hold the float32 entry's values exactly (the bf16
    checkpoint holds them rounded)."""
    from models.resolve import resolve_model

    bf16_dir = resolve_model(None, dtype="bfloat16")
    blocks = gguf_blocks.load(bf16_dir)
    assert len(blocks) == 30 * 7 + 1
    name = "model.layers.7.self_attn.k_proj.weight"  # Q/K rows un-permuted like the dense
    exact = dict(iter_safetensors(smollm2_dir, torch.float32))[name]
    rounded = dict(iter_safetensors(bf16_dir, torch.bfloat16))[name]
    assert torch.equal(blocks[name].dequantize(), exact)
    assert torch.equal(rounded, exact.bfloat16())
