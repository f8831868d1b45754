"""The adapted linear of the CPU path, and the per-step plan it reads.

A `LoRALinear` wraps a base linear with one stacked pair per slot, `A [max_loras, R,
in]` and `B^T [max_loras, R, out]`, and adds, inside a step (`StepLoRA`, set by
`gpu/lora.py`'s `LoRASlots.step`), each row's adapter delta: the few-row sequences
(decodes) through the C++ kernel's segments, the others as torch matmuls per group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

# Runs of a slot's B^T rows that write the same output columns (a fused linear's parts:
# q, k, v) the kernel reads; an adapter whose B^T has more runs is read whole.
MAX_PARTS = 3


@dataclass(frozen=True)
class Group:
    """The rows of one slot in this step: a slice when contiguous, else an index."""

    slot: int
    rows: slice | torch.Tensor


@dataclass(frozen=True)
class Segments:
    """The kernel's rows of a step, built once and read by every linear: `order` the
    rows sorted by slot, `starts` where each slot's segment begins in it (and the end),
    `slots` each segment's slot (int64 tensors)."""

    order: torch.Tensor
    starts: torch.Tensor
    slots: torch.Tensor


class StepLoRA:
    """The groups and segments of the step running now, or (per-row kernels) each row's
    slot; set only inside `LoRASlots.step` or `LoRASlots.rows`. `kernel`: the C++ delta
    op (`lora_delta_`), or None."""

    def __init__(self, kernel=None) -> None:
        self.groups: list[Group] | None = None
        self.rows: torch.Tensor | None = None
        self.segments: Segments | None = None
        self.kernel = kernel


class LoRALinear(nn.Module):
    """A base linear plus, for the rows of the current step's groups, their adapter's
    low-rank delta."""

    def __init__(self, base: nn.Module, current: StepLoRA, max_loras: int, rank: int,
                 dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base = base
        self.current = current
        self.in_features, self.out_features = base.in_features, base.out_features
        self.A = torch.zeros(max_loras, rank, self.in_features, dtype=dtype, device=device)
        self.Bt = torch.zeros(max_loras, rank, self.out_features, dtype=dtype, device=device)
        self.ranks = [0] * max_loras  # per slot: 0 where its adapter leaves this linear alone
        self.rank_table = torch.zeros(max_loras, dtype=torch.long)  # the same, for the kernel
        self.parts = torch.zeros(max_loras, MAX_PARTS, 4, dtype=torch.long)  # `expand_parts`

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        groups = self.current.groups
        if groups is None:
            return y
        segments = self.current.segments
        if segments is not None:
            self.current.kernel(y, x, self.A, self.Bt, segments.order, segments.starts,
                                segments.slots, self.rank_table, self.parts)
        for g in groups:
            r = self.ranks[g.slot]
            if not r:
                continue
            a, bt = self.A[g.slot, :r], self.Bt[g.slot, :r]
            if isinstance(g.rows, slice):
                y[g.rows] += (x[g.rows] @ a.T) @ bt
            else:
                y.index_add_(0, g.rows, (x.index_select(0, g.rows) @ a.T) @ bt)
        return y

    def write(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        r = 0 if pair is None else pair[0].shape[0]
        if pair is not None:
            a, b = pair
            self.A[slot].zero_()
            self.Bt[slot].zero_()
            self.A[slot, :r] = a
            self.Bt[slot, :r] = b.T
        self.ranks[slot] = r
        self.write_tables(slot, pair)

    def write_tables(self, slot: int, pair: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """The C++ kernel's view of the slot: its rank and its B^T's parts."""
        r = self.ranks[slot]
        self.rank_table[slot] = r
        self.parts[slot] = 0
        for i, part in enumerate(expand_parts(self.Bt[slot, :r]) if r else ()):
            self.parts[slot, i] = torch.tensor(part)


def expand_parts(bt: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """(rank from, to, column from, to): the runs of `bt`'s rows that write the same
    columns (nonzero from the first to the last), all-zero rows left out; the whole
    of `bt` if that takes more than MAX_PARTS runs."""
    r, out = bt.shape
    nz = bt != 0
    first = nz.int().argmax(1).tolist()
    last = (out - nz.flip(1).int().argmax(1)).tolist()
    runs: list[tuple[int, int, int, int]] = []
    for j, any_ in enumerate(nz.any(1).tolist()):
        if not any_:
            continue
        if runs and runs[-1][1] == j and runs[-1][2:] == (first[j], last[j]):
            runs[-1] = (runs[-1][0], j + 1, first[j], last[j])
        else:
            runs.append((j, j + 1, first[j], last[j]))
    return runs if len(runs) <= MAX_PARTS else [(0, r, 0, out)]


def plan_segments(rows_of_slot: dict[int, list[int]]) -> Segments:
    order = [r for rows in rows_of_slot.values() for r in rows]
    starts = [0]
    for rows in rows_of_slot.values():
        starts.append(starts[-1] + len(rows))
    return Segments(torch.tensor(order, dtype=torch.long), torch.tensor(starts, dtype=torch.long),
                    torch.tensor(list(rows_of_slot), dtype=torch.long))
