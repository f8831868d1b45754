"""Paged attention in plain torch: the CPU path and the reference for the kernels.

Sequences are split into two groups: decode rows (one new token each) and
prefill rows (several new tokens). Within a group, each sequence's keys are
gathered from its pages into a padded [B, L] tensor once per layer, and one
batched scaled-dot-product attention runs with a mask that is causal within
the new tokens and hides the padding. Index tensors are built once per step in
`prepare()` and shared by all layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gpu.attention.base import AttentionBackend, AttentionInputs


@dataclass
class _Group:
    query_rows: torch.Tensor  # [B, Q] rows of the flat token batch (padding repeats a row)
    key_slots: torch.Tensor  # [B, L] flat pool slots (padding points at a valid slot)
    mask: torch.Tensor  # [B, 1, Q, L] True where attention is allowed
    out_rows: torch.Tensor  # [N] rows of the flat output these results fill
    valid: torch.Tensor  # [B, Q] which query entries are real
    identity: bool  # the group is every row of the batch, in order, one token each


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    groups: list[_Group]
    num_tokens: int


class TorchAttentionBackend(AttentionBackend):
    def prepare(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        qlens = inputs.query_lens_list
        decode = [i for i, q in enumerate(qlens) if q == 1]
        prefill = [i for i, q in enumerate(qlens) if q != 1]
        groups = [self._group(inputs, idx) for idx in (decode, prefill) if idx]
        return TorchAttentionMetadata(inputs.slot_mapping, groups, sum(qlens))

    def _group(self, inputs: AttentionInputs, seqs: list[int]) -> _Group:
        device = inputs.slot_mapping.device
        idx = torch.tensor(seqs, dtype=torch.long, device=device)
        starts = inputs.query_start_loc[idx].long()
        qlens = (inputs.query_start_loc[idx + 1] - inputs.query_start_loc[idx]).long()
        ctx = inputs.context_lens[idx].long()
        q_max = max(inputs.query_lens_list[i] for i in seqs)
        l_max = max(inputs.context_lens_list[i] for i in seqs)

        j = torch.arange(q_max, device=device)
        valid = j[None, :] < qlens[:, None]  # [B, Q]
        query_rows = starts[:, None] + torch.minimum(j[None, :], qlens[:, None] - 1)
        query_pos = (ctx - qlens)[:, None] + j[None, :]  # position of each new token

        pos = torch.arange(l_max, device=device)
        tables = inputs.block_tables[idx].long()
        blocks = tables.gather(1, (pos // self.block_size).expand(len(seqs), -1))
        key_slots = blocks * self.block_size + pos % self.block_size
        key_slots = torch.where(pos[None, :] < ctx[:, None], key_slots, key_slots[:, :1])

        # Causal: new token at position p sees keys 0..p (all inside the context).
        mask = pos[None, None, :] <= query_pos[:, :, None]  # [B, Q, L]
        identity = q_max == 1 and len(seqs) == len(inputs.query_lens_list)
        return _Group(query_rows, key_slots, mask[:, None], query_rows[valid], valid, identity)

    def forward(self, q, k, v, k_cache, v_cache, meta: TorchAttentionMetadata):
        k_flat = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_flat = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        k_flat.index_copy_(0, meta.slot_mapping, k)
        v_flat.index_copy_(0, meta.slot_mapping, v)

        out = None if len(meta.groups) == 1 and meta.groups[0].identity else torch.empty_like(q)
        for g in meta.groups:
            qg = q[g.query_rows].transpose(1, 2)  # [B, H, Q, D]
            kg = k_flat[g.key_slots].transpose(1, 2)  # [B, KVH, L, D]
            vg = v_flat[g.key_slots].transpose(1, 2)
            o = F.scaled_dot_product_attention(
                qg, kg, vg, attn_mask=g.mask, scale=self.scale,
                enable_gqa=self.num_heads != self.num_kv_heads,
            ).transpose(1, 2)  # [B, Q, H, D]
            if out is None:
                return o.reshape(meta.num_tokens, self.num_heads, self.head_dim)
            out[g.out_rows] = o[g.valid]
        return out
