"""The attention interface every model layer talks to.

A model never knows how attention is computed or where K/V live: each layer
calls `ctx.attend(layer_idx, q, k, v)` on the `StepContext` it was handed for
this step. The context carries the backend, the backend's per-step metadata and
the KV pool; it is created per step and dropped afterwards, so no global state
outlives a step (not even when the forward raises).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class AttentionInputs:
    """Tensors describing one step's sequences (already on the model's device).

    For sequence i: new tokens are rows `query_start_loc[i]:query_start_loc[i+1]`
    of q/k/v; after this step its cache holds `context_lens[i]` tokens, so the
    new tokens sit at positions `context_lens[i] - query_len .. context_lens[i]-1`.
    `block_tables[i, j]` is the pool block holding positions
    `j*block_size .. (j+1)*block_size-1`; entries past the sequence are padding
    (any valid block id, never read). `slot_mapping[t]` is the flat slot
    (`block * block_size + offset`) where token t's K/V goes; -1 means padding:
    the store skips it.
    """

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_context_len: int
    # Plain-list copies for backends that group sequences on the host.
    query_lens_list: list[int]
    context_lens_list: list[int]


class AttentionBackend(ABC):
    """Writes new K/V into the paged pool and attends over each sequence's pages."""

    # True when `forward` can apply RoPE to q and k itself, fused with the KV store.
    fuses_rotary = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int):
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scale = head_dim**-0.5

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's K (and V) pool; the backend owns the layout.

        The default is block-major, `[num_blocks, block_size, num_kv_heads, head_dim]`,
        what the Triton kernels walk. Flat slot s is `(s // block_size, s % block_size)`.
        """
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def one_call_decode(self, meta: Any) -> tuple | None:
        """(slot_mapping, block_tables, context_lens, then the shared prefix's pieces) of
        a step where a fused decode call over every layer can stand in for `forward`
        (None: it cannot; `gpu/cpu/layer_call.py`)."""
        return None

    @abstractmethod
    def prepare(self, inputs: AttentionInputs) -> Any:
        """Build per-step metadata once; reused by every layer of the step."""

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # kv_cache_shape(num_blocks)
        v_cache: torch.Tensor,
        meta: Any,
        sliding_window: int | None = None,
        rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Store k/v at their slots, then return attention output for the T new tokens.

        A `sliding_window` W hides keys at positions <= p - W from the query at p. Those
        keys' values are never used, so their blocks may be freed and reused as long as
        the block table still names some valid block there. `rotary` (cos, sin), given
        only to a backend that `fuses_rotary`, means q and k still need RoPE."""


@dataclass
class StepContext:
    """Everything a layer needs for attention in one step; scoped to that step."""

    backend: AttentionBackend
    meta: Any
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]

    @property
    def rotates(self) -> bool:
        return self.backend.fuses_rotary

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sliding_window: int | None = None,
               rotary: tuple[torch.Tensor, torch.Tensor] | None = None):
        return self.backend.forward(
            q, k, v, self.k_caches[layer_idx], self.v_caches[layer_idx], self.meta,
            sliding_window, rotary,
        )
