"""Paged decode attention: one new query token per sequence over its cached pages.

Decode is memory-bound: every cached K/V byte is read once per step and used
for a handful of FLOPs. Three choices follow from that:

- **GQA grouping.** A program owns one (sequence, KV head) pair and all the
  query heads that share that KV head, so each K/V tile is loaded once per
  group rather than once per query head (8x less traffic at a GQA ratio of 8).
  The group's query heads form the M side of a small `tl.dot`, padded to 16.
- **Split-K (flash-decoding)** when the batch alone cannot fill the GPU: see
  `decode_splits.py` (how many partitions, chosen per row on the device; the merge).
- **Loads in flight.** Small key tiles (`DECODE_BLOCK_N` = 32) and a 5-stage software
  pipeline keep the next two tiles' K and V (and their block ids) loading while this
  one is used. The indirection through the block table costs the pipeliner stages: at 3
  or 4 it keeps a single K/V buffer, one tile in flight (TTGIR checked offline for
  sm_90 with `scripts/kernel_ir.py`). At 96 registers and 37 KiB of shared memory, four
  CTAs fit an SM, so `choose_num_splits` aims for four programs per SM.

Keys are gathered token by token through the block table (page = position //
block_size), so any block size works, including ones smaller than a tile. With a
sliding window W only the tiles holding the last W keys are walked (and split).
Softmax runs online in fp32 using exp2 with the scale folded into log2 units.

In a mixed batch (prefill and decode rows together) the same kernel serves the
one-token rows: given `query_start_loc`, a program finds its row's query there and
leaves rows with longer queries to the prefill kernel.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from gpu.triton.decode_splits import (  # noqa: F401  (re-exported: the split API)
    HOPPER_NUM_SMS,
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    SplitWorkspace,
    choose_num_splits,
    reduce_splits,
    row_split_range,
)

LOG2E = math.log2(math.e)
DECODE_BLOCK_N = 32  # keys per inner-loop tile (16 in fp32: 32 spills registers)
DECODE_STAGES = 5  # software pipeline depth on CUDA: two K/V tiles in flight


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    scale_log2,
    num_splits,
    window,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_vd,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    MIXED: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    row = seq  # of q and out
    if MIXED:  # one-token rows only; the prefill kernel takes the rest
        row = tl.load(query_start_loc_ptr + seq)
        if tl.load(query_start_loc_ptr + seq + 1) - row != 1:
            return
    # This program's share of the context, in whole tiles. Computed here from the
    # device-side length so the launch grid never depends on it (CUDA graphs).
    context_len = tl.load(context_lens_ptr + seq)
    first_key, tile_start, tile_end, row_splits = row_split_range(
        context_len, window, split, num_splits, BLOCK_N, SLIDING)
    if split >= row_splits:
        return
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    dim_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h

    q = tl.load(
        q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    for tile in range(tile_start, tile_end):
        pos = tile * BLOCK_N + offs_n
        pos_mask = (pos < context_len) & (pos >= first_key)
        block = tl.load(
            block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_mask, other=0
        ).to(tl.int64)
        offset = pos % BLOCK_SIZE
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
        k = tl.load(
            k_cache_ptr
            + block[:, None] * stride_kb
            + offset[:, None] * stride_ks
            + kv_head * stride_kh
            + offs_d[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        )
        qk = (
            tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
            * scale_log2
        )
        # Every tile walked holds at least one key in the window, so m_new stays finite.
        qk = tl.where(pos_mask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(
            v_cache_ptr
            + block[:, None] * stride_vb
            + offset[:, None] * stride_vs
            + kv_head * stride_vh
            + offs_d[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        )
        # p is rounded to the cache dtype first, as the tensor cores will see it.
        acc = acc * alpha[:, None] + tl.dot(
            p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION
        )
        m = m_new

    out_mask = head_mask[:, None] & dim_mask[None, :]
    if SPLIT:
        if row_splits > 1:
            # Partials are [B, H, S] (+ [D]); an empty split writes m=-inf, l=0, acc=0.
            num_heads = tl.num_programs(1) * GROUP
            part = (seq * num_heads + heads) * num_splits + split
            tl.store(part_m_ptr + part, m, mask=head_mask)
            tl.store(part_l_ptr + part, l, mask=head_mask)
            tl.store(part_out_ptr + part[:, None] * HEAD_DIM + offs_d[None, :], acc,
                     mask=out_mask)
            return
    # A row left whole writes its output here. An empty context (a padding row) yields
    # zeros instead of 0/0.
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(
        out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=out_mask,
    )


def dot_config(dtype: torch.dtype, device: torch.device) -> tuple[tl.dtype, str]:
    """The dtype `tl.dot` operands are cast to, and its input precision.

    fp32 asks for "ieee": Hopper would otherwise round the operands to tf32.
    The Triton 3.9 interpreter multiplies bf16 operands' raw uint16 bit patterns
    in `tl.dot`, so when interpreting (always the case off-GPU) bf16 operands
    are widened to fp32 first. That is exact, as a bf16 x bf16 product fits in
    fp32, which is what the tensor cores accumulate in.
    """
    interpreting = device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
    if dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting):
        return tl.float32, "ieee"
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype], "tf32"


@functools.cache
def num_sms(device: torch.device) -> int:
    """SM count of a CUDA device; the H100/H200 figure elsewhere (CPU, interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return HOPPER_NUM_SMS


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim] (mixed: [T, ...], the batch's every token)
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, including the new token
    scale: float,
    num_splits: int | None = None,
    *,
    max_context_len: int | None = None,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    workspace: SplitWorkspace | None = None,
    query_start_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each sequence's single new token over its whole paged cache (or
    over its last `sliding_window` keys).

    `num_splits=None` asks `choose_num_splits`; pass `max_context_len` (known on
    the host) to spare a device sync. A CUDA-graph runner should fix num_splits
    per captured bucket so the grid stays constant.

    With `query_start_loc` ([B+1], a mixed batch), only sequences with one new token
    are computed, each reading and writing row `query_start_loc[i]` of q and `out`;
    the other rows of `out` are left for the prefill kernel.
    """
    num_heads, head_dim = q.shape[1:]
    batch = context_lens.shape[0]
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and v_cache.shape == k_cache.shape
    assert query_start_loc is not None or q.shape[0] == batch
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out
    if num_splits is None:
        if max_context_len is None:
            max_context_len = int(context_lens.max())
        num_splits = choose_num_splits(batch, num_kv_heads, max_context_len, num_sms(q.device))
    split = num_splits > 1
    if split and workspace is None:
        workspace = SplitWorkspace.allocate(batch, num_heads, head_dim, num_splits, q.device)
    if split:
        assert workspace.m.shape == (batch, num_heads, num_splits), "workspace of another step"
    # The kernel needs some tensor for the unused pointers.
    parts = (workspace.out, workspace.m, workspace.l) if split else (out, out, out)
    dot_dtype, dot_precision = dot_config(q.dtype, q.device)
    block_n = DECODE_BLOCK_N if q.element_size() < 4 else DECODE_BLOCK_N // 2

    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        context_lens if query_start_loc is None else query_start_loc,
        out,
        *parts,
        scale * LOG2E,
        num_splits,
        sliding_window or 0,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)),  # tl.dot wants M >= 16
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_N=block_n,
        SPLIT=split,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        SLIDING=sliding_window is not None,
        MIXED=query_start_loc is not None,
        num_warps=4,
        num_stages=DECODE_STAGES,
    )
    if split:
        reduce_splits(workspace, out, context_lens, query_start_loc, sliding_window, block_n)
    return out
