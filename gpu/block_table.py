"""Block tables that live on the device and change by deltas, not rebuilt every step.

A running request's block table only grows, by one block every `block_size` tokens;
rebuilding a `[batch, width]` table from Python lists every step costs milliseconds
at a batch of hundreds. So the engine gives each scheduled request a row of one
persistent device table and sends only the entries that row has not received yet
(`Batch.table_rows`, `Batch.table_updates`; the event-loop side is
`app/engine/table_rows.py`). vLLM's `BlockTable` keeps per-request rows for the same
reason. A row's entries may name blocks other rows name too (a shared, cached prefix):
entries are plain block ids.

This side applies the deltas (`update`, one scatter) and gathers a step's rows in
batch order (`gather`, one index_select). Row `padding_row` stays all zeros: CUDA-graph
padding rows point at it. Entries past a request's length keep whatever an earlier
owner of the row wrote: always valid block ids, and never read, since the kernels stop
at each sequence's context length.
"""

from __future__ import annotations

import torch

TableUpdate = tuple[int, int, list[int]]  # (row, first column, block ids from there)


def flatten_updates(updates: list[TableUpdate]) -> tuple[list[int], list[int], list[int]]:
    """(rows, columns, blocks), one entry per updated cell, ready to stage."""
    rows: list[int] = []
    cols: list[int] = []
    blocks: list[int] = []
    for row, first, ids in updates:
        rows += [row] * len(ids)
        cols += range(first, first + len(ids))
        blocks += ids
    return rows, cols, blocks


class DeviceBlockTable:
    def __init__(self, num_rows: int, max_blocks_per_seq: int, device: torch.device):
        self.table = torch.zeros(num_rows + 1, max_blocks_per_seq, dtype=torch.int32,
                                 device=device)
        self.padding_row = num_rows
        self.num_rows = num_rows

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def update(self, rows: torch.Tensor, cols: torch.Tensor, blocks: torch.Tensor) -> None:
        """Write `blocks[i]` at `(rows[i], cols[i])` (device tensors, e.g. staged)."""
        if rows.numel():
            self.table.index_put_((rows.long(), cols.long()), blocks.to(torch.int32))

    def gather(self, rows: torch.Tensor, width: int | None = None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The tables of `rows`, in that order: `[len(rows), width]` (all columns by
        default; `out` must then be a contiguous `[len(rows), self.width]`)."""
        table = self.table if width is None else self.table[:, :width]
        if out is not None:
            return torch.index_select(table, 0, rows, out=out)
        return table.index_select(0, rows)
