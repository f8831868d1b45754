"""The adapted linear of the CUDA path: Punica's BGMV, every row carrying its slot.

`RowLoRALinear` keeps the same stacked pairs as `LoRALinear` and, beside them, static
device tables the Triton kernels read (`gpu/triton/lora.py`), so a CUDA graph captured
once sees every adapter later written into a slot.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gpu.lora_linear import LoRALinear, StepLoRA
from models.lora import Target

# `gpu.triton.lora.add_lora`'s signature: (y, x, A, Bt, row_slots, ranks, spans, slices,
# max_slice), adding into y in place.
RowKernel = Callable[..., torch.Tensor]


def row_kernel(device: torch.device) -> RowKernel | None:
    """The per-row delta for this device: the Triton kernels on CUDA; None on CPU, where
    the rows are grouped per adapter and multiplied by torch ops."""
    if device.type != "cuda":
        return None
    from gpu.triton.lora import add_lora

    return add_lora


class RowLoRALinear(LoRALinear):
    """The same stacked pairs, the delta by a per-row kernel: every row reads its slot
    from the step's row-slot tensor. Beside the pairs, static device tables the kernel
    reads (so a CUDA graph sees a new adapter without a new capture): each slot's rank,
    and per slot and output slice the span of rank columns that slice reads."""

    def __init__(self, base: nn.Module, current: StepLoRA, max_loras: int, rank: int,
                 dtype: torch.dtype, device: torch.device, slices: list[tuple[int, int]],
                 kernel: RowKernel):
        super().__init__(base, current, max_loras, rank, dtype, device)
        self.kernel, self.slices = kernel, slices
        self.slice_table = torch.tensor(slices, dtype=torch.int32, device=device)
        self.max_slice = max(size for _, size in slices)
        self.rank_table = torch.zeros(max_loras, dtype=torch.int32, device=device)
        self.parts = None  # the C++ kernel's table: not read here
        self.spans = torch.zeros(max_loras, len(slices), 2, dtype=torch.int32, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        rows = self.current.rows
        if rows is None:
            return y
        self.kernel(y.view(-1, self.out_features), x.reshape(-1, self.in_features), self.A,
                    self.Bt, rows, self.rank_table, self.spans, self.slice_table,
                    self.max_slice)
        return y

    def write_tables(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The Triton kernels' view of the slot (in place: graphs keep the addresses)."""
        from gpu.triton.lora import rank_spans

        spans = rank_spans(pair[1].T, self.slices) if pair else [(0, 0)] * len(self.slices)
        self.rank_table[slot] = self.ranks[slot]
        self.spans[slot] = torch.tensor(spans, dtype=torch.int32)


def output_slices(targets: dict[str, Target], module: str, out: int) -> list[tuple[int, int]]:
    """(offset, size) of each part a fused linear's output holds (q, k, v; gate, up), in
    order; the whole output for a linear of one part."""
    parts = sorted({(t.offset, t.rows) for t in targets.values()
                    if t.module == module and t.rows < out})
    ends = [0] + [o + n for o, n in parts]
    if parts and all(o == e for (o, _), e in zip(parts, ends)) and ends[-1] == out:
        return parts
    return [(0, out)]
