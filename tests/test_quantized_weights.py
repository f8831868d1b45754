"""The GGUF's quantized blocks kept beside its float32 checkpoint, and the model reading
them for few-row matmuls on CPU (`models/gguf_blocks.py`, `gpu/cpu/linear.py`).

The blocks must decode to the checkpoint's float32 weights bit for bit (Q/K rows
un-permuted like the dense ones), fused layers (qkv, gate_up) must stack their HF parts
in the right order, and a real SmolLM2 forward through the blocks must agree with the
float32 path (summation order aside) and pick the same greedy tokens. The end-to-end
greedy parity with transformers (test_smollm2.py) runs through this path too.
"""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.linear import PackedLinear, quantized_max_rows
from gpu.cpu.packing import SplitLinear, pack_linears
from models import gguf_blocks
from models.config import ModelConfig
from models.decoder import DecoderForCausalLM
from models.weights import iter_safetensors

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
needs_kernels = pytest.mark.skipif(
    KERNELS is None or quantized_max_rows(KERNELS) is None,
    reason="C++ CPU kernels not built here, or without vector paths (no blocks then)")


def dequantize(q: gguf_blocks.QuantizedWeight) -> torch.Tensor:
    """gguf-py's arithmetic in torch float32: d * q (+ m), two separate roundings."""
    rows = q.out_features
    if q.format == "q4_1":
        nibbles = q.qweight.view(rows, -1, 16)
        values = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).float()  # GGML order
        return (q.scales[..., None] * values + q.mins[..., None]).reshape(rows, -1)
    return (q.qweight.view(rows, -1, 32).float() * q.scales[..., None]).reshape(rows, -1)


def test_blocks_decode_to_the_checkpoint_exactly(smollm2_dir):
    blocks = gguf_blocks.load(smollm2_dir)
    dense = dict(iter_safetensors(smollm2_dir, torch.float32))
    # SmolLM2's GGUF: every linear weight Q4_1, the tied embedding Q8_0.
    assert len(blocks) == 30 * 7 + 1
    assert blocks["model.embed_tokens.weight"].format == "q8_0"
    assert {q.format for n, q in blocks.items() if "layers" in n} == {"q4_1"}
    for name, q in blocks.items():
        assert torch.equal(dequantize(q), dense[name]), name


def load_model(model_dir):
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, max_positions=256)
    model = model.to_empty(device="cpu")
    model.rotary = model.make_rotary(256)
    model.load_weights(iter_safetensors(model_dir, torch.float32))
    return model.eval()


class _Context:
    """Attention over the new tokens only (causal), enough to compare two models' linears."""
    rotates = False

    def attend(self, layer_idx, q, k, v, window, rotary):
        t, heads, dim = q.shape
        group = heads // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return o.transpose(0, 1)


@needs_kernels
def test_model_reads_blocks_for_few_rows_and_agrees(smollm2_dir):
    reference = load_model(smollm2_dir)
    model = load_model(smollm2_dir)
    extra = pack_linears(model, gguf_blocks.load(smollm2_dir), KERNELS)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert len(layers) == 30 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
    assert all(m.quantized is not None and m.plain is None for m in layers)
    assert model.layers[0].self_attn.qkv_proj.quantized.out_features == 576 + 2 * 192
    assert extra < 0  # the blocks alone replace the float32 weights (no packed copy)
    ctx = _Context()
    most = quantized_max_rows(KERNELS)  # by the vector width the kernels were built for
    for rows in (1, 5, most["q8_0"] + 1, most["q4_1"], most["q4_1"] + 1):  # blocks, the
        # head packed from its threshold on, then everything packed
        ids = torch.randint(0, 49152, (rows,))
        pos = torch.arange(rows)
        with torch.inference_mode():
            want = reference.compute_logits(reference(ids, pos, ctx))
            got = model.compute_logits(model(ids, pos, ctx))
        # Summation order only, grown over 30 layers: per matmul the kernel's error
        # against float64 is 1e-6 of the largest output, like oneDNN's (0.8e-6).
        torch.testing.assert_close(got, want, atol=2e-2, rtol=1e-3)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


@needs_kernels
def test_fused_parts_stack_in_row_order(smollm2_dir):
    """qkv_proj's blocks are q, k, v's in that order: the layer's output through the
    blocks matches F.linear on the fused float32 weight, rows of every part."""
    model = load_model(smollm2_dir)
    weight = model.layers[3].self_attn.qkv_proj.weight.detach().clone()
    gate_up = model.layers[3].mlp.gate_up_proj.weight.detach().clone()
    pack_linears(model, gguf_blocks.load(smollm2_dir), KERNELS)
    x = torch.randn(3, 576)
    for layer, w in ((model.layers[3].self_attn.qkv_proj, weight),
                     (model.layers[3].mlp.gate_up_proj, gate_up)):
        torch.testing.assert_close(layer(x), x @ w.T, atol=1e-4, rtol=1e-4)


def test_without_kernels_or_blocks_nothing_changes(smollm2_dir):
    model = load_model(smollm2_dir)
    pack_linears(model, gguf_blocks.load(smollm2_dir), kernels=None)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    assert layers and all(m.quantized is None and m.plain is not None for m in layers)
    assert not any(isinstance(m, nn.Linear) for m in model.modules())


@needs_kernels
def test_roofline_counts_the_blocks_for_few_rows(smollm2_dir):
    """MBU must not be computed against fp32 weights a step never read."""
    from gpu.cpu.packing import quantized_reads
    from gpu.roofline import ModelCost

    model = load_model(smollm2_dir)
    pack_linears(model, gguf_blocks.load(smollm2_dir), KERNELS)
    reads = quantized_reads(model)  # the layers hold their blocks alone: every call reads them
    assert reads.layer_max_rows == reads.head_max_rows == sys.maxsize
    # With packed copies beside the blocks, calls past the blocks' rows read the copies.
    model = load_model(smollm2_dir)
    pack_linears(model, gguf_blocks.load(smollm2_dir), KERNELS, blocks_only=False)
    reads = quantized_reads(model)
    most = quantized_max_rows(KERNELS)
    assert (reads.layer_max_rows, reads.head_max_rows) == (most["q4_1"], most["q8_0"])
    cfg = ModelConfig.from_dir(smollm2_dir)
    dense, blocks = ModelCost.from_config(cfg, 4), ModelCost.from_config(cfg, 4, blocks=reads)
    above = reads.layer_max_rows + 1  # past both thresholds: every weight read in fp32
    one, many = blocks.decode(1, 100), blocks.decode(above, 100)
    # ~0.75 bytes a layer weight and ~1.06 a head weight instead of 4.
    assert one.bytes_read < dense.decode(1, 100).bytes_read / 4
    assert one.flops == dense.decode(1, 100).flops
    assert many.bytes_read == dense.decode(above, 100).bytes_read
    layers_saved = reads.layer_bytes - reads.layer_params * 4
    head_saved = reads.head_bytes - cfg.vocab_size * cfg.hidden_size * 4
    saved = [blocks.decode(rows, 100).bytes_read - dense.decode(rows, 100).bytes_read
             for rows in (most["q8_0"], most["q8_0"] + 1)]
    assert saved == [layers_saved + head_saved, layers_saved]  # the head dense past its rows


def q8_0_of(w: torch.Tensor) -> gguf_blocks.QuantizedWeight:
    """`w` as Q8_0 blocks (one scale per 32 weights), for a GGUF that mixes formats."""
    blocks = w.view(w.shape[0], -1, gguf_blocks.BLOCK)
    scales = blocks.abs().amax(-1).clamp_min(1e-8) / 127
    levels = torch.round(blocks / scales[..., None]).to(torch.int8)
    return gguf_blocks.QuantizedWeight("q8_0", levels.view(w.shape), scales, None)


@needs_kernels
def test_fused_parts_in_mixed_formats_split_by_format(smollm2_dir):
    """A GGUF that quantizes v_proj in Q8_0 beside Q4_1 q and k (llama-quantize's K-quant
    mixes give some layers' v Q6_K beside Q4_K): blocks of two formats cannot stack into
    one panel set, so qkv_proj becomes a `SplitLinear` of q and k stacked and v alone,
    each reading its own blocks, with the fused weight's outputs; the layers whose parts
    agree keep one `PackedLinear`."""
    model = load_model(smollm2_dir)
    blocks = dict(gguf_blocks.load(smollm2_dir))  # read once, one weight replaced
    v = "model.layers.3.self_attn.v_proj.weight"
    assert blocks[v].format == "q4_1"
    blocks[v] = q8_0_of(blocks[v].dequantize())
    fused = model.layers[3].self_attn.qkv_proj.weight
    with torch.no_grad():
        fused[576 + 192:] = blocks[v].dequantize()  # v's rows follow q's 576 and k's 192
    weight = fused.detach().clone()
    pack_linears(model, blocks, KERNELS)
    qkv = model.layers[3].self_attn.qkv_proj
    assert isinstance(qkv, SplitLinear)
    assert [(p.quantized.format, p.out_features) for p in qkv.parts] == [
        ("q4_1", 576 + 192), ("q8_0", 192)]
    assert isinstance(model.layers[3].mlp.gate_up_proj, PackedLinear)
    assert isinstance(model.layers[4].self_attn.qkv_proj, PackedLinear)
    for rows in (1, 2, 40):
        x = torch.randn(rows, 576)
        torch.testing.assert_close(qkv(x), x @ weight.T, atol=1e-4, rtol=1e-4)
