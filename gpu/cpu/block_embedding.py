"""A model's token embedding looked up from a GGUF's blocks: no dense copy.

Why: the embedding is a model's largest tensor (Llama-3.1-8B's 128k-token one: 1 GB in
bf16). Held dense beside its blocks it is a second copy where the embeddings are tied
(SmolLM2, the small Qwen and Llama 3.2 models: the LM head serves the same tensor from
its blocks), and 2.7x its blocks' bytes where they are not, dequantized at each load.
A lookup needs one row per token, so each token's panel of 32 rows is
widened by the op the LM head's large calls use (`quant_unpack.cpp`) and the token's row
taken: the blocks' values, rounded to the served dtype exactly as the dense table held
them (`QuantizedWeight.dequantize`, then cast).
"""

from __future__ import annotations

import torch
from torch import nn

from gpu.cpu.capabilities import CpuCapabilities
from gpu.cpu.panel_blocks import PANEL, PanelBlocks


class BlockEmbedding(nn.Module):
    """`nn.Embedding`'s lookup from `blocks` (panels with their levels). `weight` is a
    meta tensor of the embedding's shape and dtype, for code that asks what it is."""

    def __init__(self, blocks: PanelBlocks, unpack, dtype: torch.dtype) -> None:
        super().__init__()
        self.blocks, self._unpack = blocks, unpack
        self.weight = torch.empty(blocks.out_features, blocks.in_features, dtype=dtype,
                                  device="meta")

    @staticmethod
    def of(blocks: PanelBlocks | None, kernels, dtype: torch.dtype) -> BlockEmbedding | None:
        """The lookup from `blocks` (a tied LM head's, or the embedding's own), or None
        where they hold no levels (a head whose dot and AMX kernels read them regrouped,
        `dot_pairs`) or the kernels have no unpack op for them."""
        if blocks is None or not blocks.tensors[0].numel() or kernels is None:
            return None
        unpack = CpuCapabilities.of(kernels).op(f"{blocks.format}_unpack")
        return None if unpack is None else BlockEmbedding(blocks, unpack, dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        hidden = self.weight.shape[1]
        out = torch.empty(flat.numel(), hidden, dtype=self.weight.dtype)
        panels, which = torch.unique(flat // PANEL, return_inverse=True)
        scratch = torch.empty(hidden, PANEL, dtype=self.weight.dtype)  # [K, 32]: W.T
        for i, panel in enumerate(panels.tolist()):
            self._unpack(*self.blocks.tensors, panel, panel + 1, scratch)
            at = (which == i).nonzero().squeeze(1)
            out[at] = scratch.t()[flat[at] % PANEL]
        return out.view(*ids.shape, hidden)
