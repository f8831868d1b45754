"""The CUDA attention backend: Triton kernels over the paged KV pool.

Per layer: the KV store writes the new tokens' K/V into their slots (rotating q
and k on the way when the model hands over RoPE: one kernel instead of six), then
attention reads everything (prefix and new tokens alike) back from the pool.
Every one-token row takes the GQA-grouped paged decode kernel (split-K when the
batch is too small to fill the GPU); rows with longer queries (prefill, chunked
prefill) take the ragged prefill kernel. A mixed batch runs both, each on its own
rows of one output: its decode rows read each K/V tile once per KV group, with
splits, instead of sitting alone in a 64-row prefill tile once per query head.
Speculative decoding's verify rows (a request's last token and its drafts) are such
short prefills over a paged prefix; a verify CUDA graph pads every row to 1 + k tokens
and sends them all to the prefill kernel (`gpu/verify_graphs.py`).

Importing this module needs Triton but no GPU: kernels compile on first launch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.attention.base import AttentionBackend, AttentionInputs
from gpu.triton.kv_store import store_kv
from gpu.triton.paged_decode import (
    SplitWorkspace,
    choose_num_splits,
    num_sms,
    paged_decode_attention,
)
from gpu.triton.prefill import prefill_attention
from gpu.triton.rotary_kv_store import rotary_store_kv


@dataclass
class TritonAttentionMetadata:
    """One step's metadata, built once in `prepare` and read by every layer."""

    inputs: AttentionInputs
    decode_only: bool
    has_decode_rows: bool  # any one-token row (all of them when decode_only)
    num_splits: int  # for the decode kernel; 1 means unsplit
    # Split partials, allocated once per step (layers run one after another).
    workspace: SplitWorkspace | None


class TritonAttentionBackend(AttentionBackend):
    """Paged attention with Triton kernels (natively on CUDA, interpreted elsewhere)."""

    fuses_rotary = True

    def prepare(
        self, inputs: AttentionInputs, num_splits: int | None = None
    ) -> TritonAttentionMetadata:
        """`num_splits` pins the decode split count instead of choosing it from this
        step's one-token rows: a CUDA graph bakes in the grid and the workspace."""
        decode_only = inputs.max_query_len == 1
        decode_ctx = [c for q, c in zip(inputs.query_lens_list, inputs.context_lens_list)
                      if q == 1]
        num_seqs = len(inputs.query_lens_list)
        device = inputs.context_lens.device
        if num_splits is None:
            num_splits = 1 if not decode_ctx else choose_num_splits(
                len(decode_ctx), self.num_kv_heads, max(decode_ctx), num_sms(device))
        workspace = None
        if num_splits > 1:
            workspace = SplitWorkspace.allocate(
                num_seqs, self.num_heads, self.head_dim, num_splits, device
            )
        return TritonAttentionMetadata(inputs, decode_only, decode_only or bool(decode_ctx),
                                       num_splits, workspace)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: TritonAttentionMetadata,
        sliding_window: int | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        inputs = meta.inputs
        if rotary is None:
            store_kv(k, v, k_cache, v_cache, inputs.slot_mapping)
        else:  # q is rotated in place; k is rotated on its way into the pool
            rotary_store_kv(q, k, v, *rotary, k_cache, v_cache, inputs.slot_mapping)
        out = torch.empty_like(q)
        if not meta.decode_only:
            prefill_attention(
                q,
                k_cache,
                v_cache,
                inputs.block_tables,
                inputs.query_start_loc,
                inputs.context_lens,
                inputs.max_query_len,
                self.scale,
                sliding_window=sliding_window,
                out=out,
                skip_single_token_rows=meta.has_decode_rows,
            )
        if meta.has_decode_rows:
            paged_decode_attention(
                q,
                k_cache,
                v_cache,
                inputs.block_tables,
                inputs.context_lens,
                self.scale,
                meta.num_splits,
                sliding_window=sliding_window,
                out=out,
                workspace=meta.workspace,
                query_start_loc=None if meta.decode_only else inputs.query_start_loc,
            )
        return out
