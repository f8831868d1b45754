"""The CUDA attention backend: Triton kernels over the paged KV pool.

Per layer: the KV store writes the new tokens' K/V into their slots, then
attention reads everything (prefix and new tokens alike) back from the pool.
A decode-only step (every sequence has one new token) takes the GQA-grouped
paged decode kernel, split-K when the batch is too small to fill the GPU; any
step with a longer query (prefill, chunked prefill, mixed batches) takes the
ragged prefill kernel, which handles decode rows as query_len 1.

Importing this module needs Triton but no GPU: kernels compile on first launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.attention.base import AttentionBackend, AttentionInputs
from gpu.kernels.kv_store import store_kv
from gpu.kernels.paged_decode import (
    SplitWorkspace,
    choose_num_splits,
    num_sms,
    paged_decode_attention,
)
from gpu.kernels.prefill import prefill_attention


@dataclass
class TritonAttentionMetadata:
    """One step's metadata, built once in `prepare` and read by every layer."""

    inputs: AttentionInputs
    decode_only: bool
    num_splits: int  # decode only; 1 means the unsplit kernel
    # Split partials, allocated once per step (layers run one after another).
    workspace: SplitWorkspace | None


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels (natively on CUDA, interpreted elsewhere)."""

    def prepare(
        self, inputs: AttentionInputs, num_splits: int | None = None
    ) -> TritonAttentionMetadata:
        """`num_splits` pins the decode split count instead of choosing it from this
        step's max_context_len: a CUDA graph bakes in the grid and the workspace."""
        if inputs.max_query_len != 1:
            return TritonAttentionMetadata(inputs, False, 1, None)
        num_seqs = len(inputs.query_lens_list)
        device = inputs.context_lens.device
        if num_splits is None:
            num_splits = choose_num_splits(
                num_seqs, self.num_kv_heads, inputs.max_context_len, num_sms(device)
            )
        workspace = None
        if num_splits > 1:
            workspace = SplitWorkspace.allocate(
                num_seqs, self.num_heads, self.head_dim, num_splits, device
            )
        return TritonAttentionMetadata(inputs, True, num_splits, workspace)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        inputs = meta.inputs
        store_kv(k, v, k_cache, v_cache, inputs.slot_mapping)
        if meta.decode_only:
            return paged_decode_attention(
                q,
                k_cache,
                v_cache,
                inputs.block_tables,
                inputs.context_lens,
                self.scale,
                meta.num_splits,
                sliding_window=sliding_window,
                workspace=meta.workspace,
            )
        return prefill_attention(
            q,
            k_cache,
            v_cache,
            inputs.block_tables,
            inputs.query_start_loc,
            inputs.context_lens,
            inputs.max_query_len,
            self.scale,
            sliding_window=sliding_window,
        )
