"""Which decode rows of a step share a prefix of KV blocks: the plan for cascade attention.

With prefix caching, requests that begin with the same prompt (a chat's system prompt)
hold the same pool blocks at the start of their block tables. Decode attention over
such rows can then read the shared blocks once for all of them (the C++ kernel
`cascade_decode_amx_`) instead of once per row. This runs once per step, on the host, over
the decode group's block table: an equality against one reference row and a cumulative
product, then a loop over at most one candidate length per row.

A row's blocks count as shared only while they are wholly before its newest token: that
token's block is written this step, so it is never a cached (shared) block, and the
kernel needs at least one key of the row's own after the prefix.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

# Below these the per-row kernel is as fast (benchmarks/cpu_cascade_ab.py): the tile
# unit's fixed costs (packing the prefix, the merge) need the prefix read by several rows.
# MIN_SAVED: keys (per KV head) that the rows after the first no longer read.
MIN_ROWS = 3
MIN_TOKENS = 256
MIN_SAVED = 1024


@dataclass(frozen=True)
class SharedPrefix:
    rows: torch.Tensor  # [R] int32: rows of the group that share the prefix
    others: torch.Tensor | None  # [B - R] int64: the group's other rows, None if none
    tokens: int  # the prefix's length, whole blocks
    # The other rows' block tables and context lengths, gathered once for every layer's
    # per-row kernel call (None with `others`).
    other_tables: torch.Tensor | None = None
    other_lens: torch.Tensor | None = None


def find_shared_prefix(tables: torch.Tensor, context_lens: list[int], block_size: int,
                       min_rows: int = MIN_ROWS, min_tokens: int = MIN_TOKENS,
                       min_saved: int = MIN_SAVED) -> SharedPrefix | None:
    """The prefix of blocks shared by at least `min_rows` rows of `tables` ([B, blocks]
    int32, one decode row each) that saves the most reads, (rows sharing it - 1) x its
    length, if that is at least `min_saved` tokens and it at least `min_tokens`; else
    None."""
    if len(context_lens) < min_rows:
        return None
    first = tables[:, 0].tolist()
    block, count = Counter(first).most_common(1)[0]
    if count < min_rows:
        return None
    ref = first.index(block)
    matched = (tables == tables[ref]).int().cumprod(1).sum(1).tolist()
    shared = [min(m, (n - 1) // block_size) for m, n in zip(matched, context_lens, strict=True)]
    best, best_gain = 0, min_saved - 1
    for length in set(shared):
        rows = sum(s >= length for s in shared)
        gain = (rows - 1) * length * block_size
        if length * block_size >= min_tokens and rows >= min_rows and gain > best_gain:
            best, best_gain = length, gain
    if best == 0:
        return None
    rows = [i for i, s in enumerate(shared) if s >= best]
    others = [i for i, s in enumerate(shared) if s < best]
    if not others:
        return SharedPrefix(torch.tensor(rows, dtype=torch.int32), None, best * block_size)
    rest = torch.tensor(others, dtype=torch.long)
    return SharedPrefix(torch.tensor(rows, dtype=torch.int32), rest, best * block_size,
                        tables[rest].contiguous(),
                        torch.tensor([context_lens[i] for i in others], dtype=torch.int32))
