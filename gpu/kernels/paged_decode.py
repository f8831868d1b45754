"""Paged decode attention: one new query token per sequence over its cached pages.

Decode is memory-bound: every cached K/V byte is read once per step and used
for a handful of FLOPs. Two choices follow from that:

- **GQA grouping.** A program owns one (sequence, KV head) pair and all the
  query heads that share that KV head, so each K/V tile is loaded once per
  group rather than once per query head (8x less traffic at a GQA ratio of 8).
  The group's query heads form the M side of a small `tl.dot`, padded to 16.
- **Split-K (flash-decoding).** With few sequences, B * kv_heads programs cannot
  fill the GPU's SMs and a long context is walked serially by one program. Then
  the context is cut into `num_splits` partitions processed by separate
  programs, each writing a partial (max, sum, unnormalised out); a second kernel
  merges them. `choose_num_splits` decides.

Keys are gathered token by token through the block table (page = position //
block_size), so any block size works, including ones smaller than a tile. With a
sliding window W only the tiles holding the last W keys are walked (and split).
Softmax runs online in fp32 using exp2 with the scale folded into log2 units.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = math.log2(math.e)
HOPPER_NUM_SMS = 132
MIN_TOKENS_PER_SPLIT = 256  # below this a split's fixed cost outweighs its parallelism
MAX_SPLITS = 16
DECODE_BLOCK_N = 64  # keys per inner-loop tile


@triton.jit
def _paged_decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
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
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    head_mask = offs_h < GROUP
    dim_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h

    q = tl.load(
        q_ptr + seq * stride_qt + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    # This program's share of the context, in whole tiles. Computed here from the
    # device-side length so the launch grid never depends on it (CUDA graphs).
    context_len = tl.load(context_lens_ptr + seq)
    first_key = 0  # the oldest key the new token sees
    if SLIDING:
        first_key = tl.maximum(context_len - window, 0)
    first_tile = first_key // BLOCK_N
    num_tiles = tl.cdiv(context_len, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles - first_tile, num_splits)
    tile_start = first_tile + split * tiles_per_split
    tile_end = tl.minimum(tile_start + tiles_per_split, num_tiles)

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
        # Partials are [B, H, S] (+ [D]); an empty split writes m=-inf, l=0, acc=0.
        num_heads = tl.num_programs(1) * GROUP
        row = (seq * num_heads + heads) * num_splits + split
        tl.store(part_m_ptr + row, m, mask=head_mask)
        tl.store(part_l_ptr + row, l, mask=head_mask)
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
    else:
        # An empty context (a padding row) yields zeros instead of 0/0.
        out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
        tl.store(
            out_ptr + seq * stride_ot + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit
def _reduce_splits_kernel(
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    split_mask = offs_s < num_splits
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
        out_ptr + seq * stride_ot + head * stride_oh + offs_d * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=dim_mask,
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


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_context_len: int, sm_count: int = HOPPER_NUM_SMS
) -> int:
    """How many partitions to cut each context into.

    Split only when the unsplit grid (num_seqs * num_kv_heads programs) leaves
    SMs idle, and never so finely that a partition holds fewer than
    MIN_TOKENS_PER_SPLIT keys. E.g. 1 sequence x 8 KV heads at 4k context: 16
    splits (128 programs); 32 sequences x 8 KV heads: 1.
    """
    programs = num_seqs * num_kv_heads
    if programs >= sm_count:
        return 1
    by_occupancy = sm_count // programs
    by_length = max_context_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


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


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
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
) -> torch.Tensor:
    """Attention of each sequence's single new token over its whole paged cache (or
    over its last `sliding_window` keys).

    `num_splits=None` asks `choose_num_splits`; pass `max_context_len` (known on
    the host) to spare a device sync. A CUDA-graph runner should fix num_splits
    per captured bucket so the grid stays constant.
    """
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and v_cache.shape == k_cache.shape
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
    # The kernel needs some tensor for the unused partial pointers.
    parts = (workspace.out, workspace.m, workspace.l) if split else (out, out, out)
    block_d = max(16, triton.next_power_of_2(head_dim))
    dot_dtype, dot_precision = dot_config(q.dtype, q.device)

    _paged_decode_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
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
        BLOCK_D=block_d,
        BLOCK_N=DECODE_BLOCK_N,
        SPLIT=split,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        SLIDING=sliding_window is not None,
        num_warps=4,
    )
    if split:
        _reduce_splits_kernel[(batch, num_heads)](
            workspace.out,
            workspace.m,
            workspace.l,
            out,
            num_splits,
            *out.stride(),
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            num_warps=1,
        )
    return out
