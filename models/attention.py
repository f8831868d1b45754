"""What a model layer needs from attention, and nothing more.

Models are written against this protocol; the model thread's per-step
`gpu.attention.base.StepContext` satisfies it. `models/` imports nothing of
`gpu/` or `app/`: the lowest floor depends on no floor above it.
"""

from __future__ import annotations

from typing import Protocol

import torch


class PagedAttention(Protocol):
    # True when `attend` applies RoPE itself (fused with the KV store, on CUDA): the
    # layer then hands over q and k unrotated, with the step's cos/sin as `rotary`.
    rotates: bool

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor, sliding_window: int | None = None,
               rotary: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Store this step's k/v [T, kv_heads, D] in the paged KV pool, then return the
        attention output [T, heads, D] of the step's T new tokens over their contexts.

        With a `sliding_window` W, the token at position p sees keys p - W + 1 .. p
        (HF's mask: key > p - W); without, every key up to p. With `rotary`, q (in
        place) and k are rotated first, exactly as `models.rope.apply_rotary` would."""
        ...
