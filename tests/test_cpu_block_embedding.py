"""A model's embedding looked up from a GGUF's blocks (`BlockEmbedding`): the rows a
dense embedding would hold (the blocks' values, rounded to the served dtype), for any
ids (repeats, a panel's last rows, a partial last panel); a tied GGUF loads with no
dense embedding filled (the untied case: `tests/test_gguf_types.py`)."""

from __future__ import annotations

import pytest
import torch

from gpu.cpu.block_embedding import BlockEmbedding
from gpu.cpu.kernels.build import cpu_kernels
from gpu.cpu.linear import PackedLinear
from tests.test_gguf_types import random_blocks, rewritten

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
needs_kernels = pytest.mark.skipif(KERNELS is None or not hasattr(KERNELS.namespace,
                                                                   "q4_1_unpack"),
                                   reason="C++ CPU kernels not built here")


@needs_kernels
@pytest.mark.parametrize("type_name", ["Q8_0", "Q6_K", "Q4_K"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lookup_is_the_dense_embeddings_rows(type_name, dtype):
    vocab, hidden = 100, 256  # four panels, the last one partial
    q = rewritten(type_name, random_blocks(type_name, vocab, hidden, seed=7), vocab)
    # An AVX2 build has no bf16 arithmetic: there `pack_linears` widens a bf16 layer.
    widen = dtype == torch.bfloat16 and int(KERNELS.vector_width()) < 16
    head = PackedLinear(torch.empty(vocab, hidden, dtype=dtype), quantized=q,
                        kernels=KERNELS, widen=widen, blocks_only=True)
    lookup = BlockEmbedding.of(head.quantized, KERNELS, dtype)
    if head.dot_pairs is not None:  # bf16 Q4_K where the dot kernel is: the pairs serve
        assert lookup is None and not head.quantized.tensors[0].numel()  # every call
        return
    assert lookup is not None and lookup.weight.is_meta and lookup.weight.dtype == dtype
    dense = q.dequantize().to(dtype)
    ids = torch.tensor([[5, 5, 31, 32, 99], [0, 63, 64, 98, 7]])
    assert torch.equal(lookup(ids), dense[ids])


@needs_kernels
def test_a_tied_gguf_fills_no_dense_embedding(smollm2_dir):
    """The embedded SmolLM2 ties its embedding: the load skips the dense weight and the
    model looks tokens up from the head's blocks (the parity tests check the tokens)."""
    from gpu.cpu.packing import pack_linears, params_not_needed
    from models import gguf_blocks
    from tests.test_quantized_weights import load_model

    model = load_model(smollm2_dir)
    blocks = gguf_blocks.load(smollm2_dir)
    assert "embed_tokens.weight" in params_not_needed(model, blocks, KERNELS)
    dense = model.embed_tokens.weight.detach().clone()
    pack_linears(model, blocks, KERNELS)
    assert isinstance(model.embed_tokens, BlockEmbedding)
    ids = torch.arange(0, dense.shape[0], 997)
    assert torch.equal(model.embed_tokens(ids), dense[ids])
