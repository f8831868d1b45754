"""A tied model's token embedding read from its LM head's blocks: no dense copy.

Why: a GGUF with tied embeddings (SmolLM2, Qwen's and Llama 3.2's small models) stores
one tensor for both; the LM head serves it from its blocks, and a dense embedding
beside it for the lookup would be a second copy of the model's largest tensor (0.2 GB
in bf16 at 1.7B, and its dequantization a tenth of the load). A lookup needs one row
per token, so each token's panel of 32 rows is widened by the op the head's large calls
use (`quant_unpack.cpp`) and the token's row taken: the blocks' values, rounded to the
served dtype exactly as the dense copy was (`QuantizedWeight.dequantize`, then cast).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu.cpu.capabilities import CpuCapabilities
from gpu.cpu.linear import PackedLinear
from gpu.cpu.panel_blocks import PANEL


class BlockEmbedding(nn.Module):
    """`nn.Embedding`'s lookup from `head`'s panels. `weight` is a meta tensor of the
    embedding's shape and dtype, for code that asks what the embedding is."""

    def __init__(self, head: PackedLinear, unpack) -> None:
        super().__init__()
        self._head = (head,)  # not a submodule: it is the model's `lm_head`
        self._unpack = unpack
        self.weight = torch.empty(head.out_features, head.in_features, dtype=head.io_dtype,
                                  device="meta")

    @staticmethod
    def of(head: nn.Module, kernels) -> BlockEmbedding | None:
        """The lookup from `head`'s blocks, or None where it keeps no panel levels (the
        dot and AMX kernels' own copies) or the kernels have no unpack op for them."""
        blocks = getattr(head, "quantized", None)  # a `SplitLinear` has none of its own
        if blocks is None or not blocks.tensors[0].numel():
            return None
        unpack = CpuCapabilities.of(kernels).op(f"{blocks.format}_unpack")
        return None if unpack is None else BlockEmbedding(head, unpack)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        hidden = self.weight.shape[1]
        out = torch.empty(flat.numel(), hidden, dtype=self.weight.dtype)
        panels, which = torch.unique(flat // PANEL, return_inverse=True)
        scratch = torch.empty(hidden, PANEL, dtype=self.weight.dtype)  # [K, 32]: W.T
        tensors = self._head[0].quantized.tensors
        for i, panel in enumerate(panels.tolist()):
            self._unpack(*tensors, panel, panel + 1, scratch)
            at = (which == i).nonzero().squeeze(1)
            out[at] = scratch.t()[flat[at] % PANEL]
        return out.view(*ids.shape, hidden)
