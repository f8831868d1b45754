"""Split-K for paged decode (flash-decoding): how many partitions, and merging them.

With few sequences, `batch × kv_heads` programs cannot fill the GPU and a long
context is walked serially by one program. Then each context is cut into partitions
walked by separate programs, each writing a partial (max, sum, unnormalised output);
`_reduce_splits_kernel` merges them.

Two levels decide the cut:
- on the host, `choose_num_splits` sets the grid's split dimension for the batch: enough
  programs for about `PROGRAMS_PER_SM` per SM (registers and shared memory allow four
  of the decode kernel's CTAs per Hopper SM; one per SM leaves the memory system idle
  while each program waits on its loads). A CUDA graph pins it per bucket.
- on the device, each row uses only as many of those splits as its own context
  deserves (`row_split_range`: at least `MIN_TOKENS_PER_SPLIT` keys each, as SGLang's
  per-row `num_kv_splits`), so short rows in a long-context bucket are not cut into
  slivers. A row left with one split writes its output directly and the merge skips it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

HOPPER_NUM_SMS = 132
PROGRAMS_PER_SM = 4
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs its parallelism
MAX_SPLITS = 64
_MIN_TOKENS = tl.constexpr(MIN_TOKENS_PER_SPLIT)  # what a jitted function may read


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, sm_count: int = HOPPER_NUM_SMS
) -> int:
    """How many partitions the grid allows each context (rows may use fewer).

    Split only when the unsplit grid (num_seqs * num_kv_heads programs) holds fewer
    than PROGRAMS_PER_SM programs per SM, and never so finely that a partition of the
    longest context holds fewer than MIN_TOKENS_PER_SPLIT keys. E.g. 1 sequence x 8 KV
    heads at 32k: 64 splits (512 programs); 8 x 8 at 16k: 8 (512); 64 x 8: 1.
    """
    programs = num_seqs * num_kv_heads
    target = PROGRAMS_PER_SM * sm_count
    if programs >= target:
        return 1
    by_occupancy = target // programs
    by_length = max_context_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


@triton.jit
def row_split_range(context_len, window, split, num_splits,
                    BLOCK_N: tl.constexpr, SLIDING: tl.constexpr):
    """(first key, first tile, end tile, splits this row uses) for program `split`.

    Tiles before the sliding window are never walked; the rest are shared out over
    `min(num_splits, tiles / MIN_TILES)` splits. Both kernels compute it alike."""
    first_key = 0
    if SLIDING:
        first_key = tl.maximum(context_len - window, 0)
    first_tile = first_key // BLOCK_N
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    min_tiles = _MIN_TOKENS // BLOCK_N
    row_splits = tl.minimum(tl.maximum(tl.cdiv(num_tiles - first_tile, min_tiles), 1),
                            num_splits)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, row_splits)
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)
    return first_key, tile_start, tile_end, row_splits


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    context_lens_ptr,
    query_start_loc_ptr,
    num_splits,
    window,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING: tl.constexpr,
    MIXED: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    out_row = seq
    if MIXED:  # only the batch's one-token rows were decoded; their outputs sit at q rows
        out_row = tl.load(query_start_loc_ptr + seq)
        if tl.load(query_start_loc_ptr + seq + 1) - out_row != 1:
            return
    context_len = tl.load(context_lens_ptr + seq)
    _, _, _, row_splits = row_split_range(context_len, window, 0, num_splits, BLOCK_N, SLIDING)
    if row_splits == 1:
        return  # the decode kernel wrote this row's output itself
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    split_mask = offs_s < row_splits
    dim_mask = offs_d < HEAD_DIM
    row = (seq * tl.num_programs(1) + head) * num_splits + offs_s

    m = tl.load(part_m_ptr + row, mask=split_mask, other=float("-inf"))
    l = tl.load(part_l_ptr + row, mask=split_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    # Rescale every split to the global max; empty splits (m=-inf) weigh 0.
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_ref))
    l_total = tl.sum(weight * l, axis=0)
    acc = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=split_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * weight[:, None], axis=0) / tl.where(l_total == 0.0, 1.0, l_total)
    tl.store(
        out_ptr + out_row * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
    )


@dataclass
class SplitWorkspace:
    """fp32 partials of a split decode; allocate once per step, reuse in every layer."""

    out: torch.Tensor  # [B, H, S, D]
    m: torch.Tensor  # [B, H, S] running max, log2 units
    l: torch.Tensor  # [B, H, S] running sum of exp2

    @classmethod
    def allocate(
        cls, batch: int, num_heads: int, head_dim: int, num_splits: int, device: torch.device
    ) -> SplitWorkspace:
        shape = (batch, num_heads, num_splits)
        return cls(
            out=torch.empty(*shape, head_dim, dtype=torch.float32, device=device),
            m=torch.empty(shape, dtype=torch.float32, device=device),
            l=torch.empty(shape, dtype=torch.float32, device=device),
        )


def reduce_splits(workspace: SplitWorkspace, out: torch.Tensor, context_lens: torch.Tensor,
                  query_start_loc: torch.Tensor | None, sliding_window: int | None,
                  block_n: int) -> None:
    batch, num_heads, num_splits, head_dim = workspace.out.shape
    _reduce_splits_kernel[(batch, num_heads)](
        workspace.out,
        workspace.m,
        workspace.l,
        out,
        context_lens,
        context_lens if query_start_loc is None else query_start_loc,
        num_splits,
        sliding_window or 0,
        *out.stride(),
        HEAD_DIM=head_dim,
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        SLIDING=sliding_window is not None,
        MIXED=query_start_loc is not None,
        num_warps=4,
    )
