"""A Batch's host lists turned into the device tensors of an eager step, in one copy.

Everything the forward and the logits need — token ids, positions, slots, query
offsets, context lengths, block tables (or the deltas to the persistent ones), and the
rows of the hidden states that get logits — goes through one `Staging.stage` call: one
asynchronous host-to-device copy, no sync (`gpu/staging.py`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from gpu.attention.base import AttentionInputs
from gpu.batch import Batch
from gpu.block_table import DeviceBlockTable, flatten_updates
from gpu.staging import Staging

LONG, INT = torch.long, torch.int32


@dataclass
class StepInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attention: AttentionInputs
    # Rows of the hidden states that get logits, in sampling order; None: all, in order.
    logit_rows: torch.Tensor | None


def logit_rows(batch: Batch, query_start_loc: list[int]) -> list[int] | None:
    """The last new token of each sampled sequence (its last `1 + spec_lens[e]` under
    speculative decoding); None when that is every row in order."""
    if batch.samples_every_row:
        return None
    if not batch.spec_lens:
        return [query_start_loc[i + 1] - 1 for i in batch.sample_indices]
    return [row for i, k in zip(batch.sample_indices, batch.spec_lens)
            for row in range(query_start_loc[i + 1] - 1 - k, query_start_loc[i + 1])]


def whole_tables(batch: Batch) -> tuple[list[int], int]:
    """A hand-made batch's tables padded to its widest one, flat (row-major), and the width."""
    assert batch.block_tables is not None
    width = max(len(t) for t in batch.block_tables)
    return [b for t in batch.block_tables for b in (*t, *[0] * (width - len(t)))], width


def apply_table_updates(batch: Batch, staging: Staging, tables: DeviceBlockTable) -> None:
    """Write the batch's block-table deltas into the persistent rows (one copy, one scatter)."""
    if batch.table_updates:
        rows, cols, blocks = flatten_updates(batch.table_updates)
        tables.update(*staging.stage((rows, LONG), (cols, LONG), (blocks, INT)))


def stage_eager_step(batch: Batch, staging: Staging, tables: DeviceBlockTable,
                     block_size: int) -> StepInputs:
    qsl = list(itertools.accumulate(batch.query_lens, initial=0))
    fields = [(batch.token_ids, LONG), (batch.positions, LONG), (batch.slot_mapping, LONG),
              (qsl, INT), (batch.context_lens, INT)]
    if batch.table_rows is None:
        flat, width = whole_tables(batch)
        fields.append((flat, INT))
    else:
        width = min(-(-max(batch.context_lens) // block_size), tables.width)
        fields.append((batch.table_rows, LONG))
        if batch.table_updates:  # most decode steps add no block
            rows, cols, blocks = flatten_updates(batch.table_updates)
            fields += [(rows, LONG), (cols, LONG), (blocks, INT)]
    sampled = logit_rows(batch, qsl)
    if sampled is not None:
        fields.append((sampled, LONG))
    staged = staging.stage(*fields)
    ids, positions, slots, starts, context_lens, *rest = staged
    if batch.table_rows is None:
        block_tables = rest.pop(0).view(batch.num_seqs, width)
    else:
        table_rows, *rest = rest
        if batch.table_updates:
            tables.update(*rest[:3])
            rest = rest[3:]
        block_tables = tables.gather(table_rows, width)
    attention = AttentionInputs(
        slot_mapping=slots, query_start_loc=starts, context_lens=context_lens,
        block_tables=block_tables, max_query_len=max(batch.query_lens),
        max_context_len=max(batch.context_lens), query_lens_list=batch.query_lens,
        context_lens_list=batch.context_lens,
    )
    return StepInputs(ids, positions, attention, rest[0] if rest else None)
