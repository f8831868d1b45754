"""Prefill attention over a ragged batch, reading keys and values from the paged pool.

Sequence i contributes rows `query_start_loc[i]:query_start_loc[i+1]` of q;
they are the LAST query_len of its `context_lens[i]` cached tokens, whose K/V
the KV store has already written. Attending over the pool rather than over the
fresh k/v tensors is what makes one kernel serve a plain prefill (no prefix) and a
chunked prefill (a cached prefix from earlier chunks or the prefix cache). In a mixed
batch the one-token rows go to the decode kernel instead (`skip_single_token_rows`).

Grid: (query head, sequence, query tile), the tile index reversed so that the
heaviest tiles (the last ones, which see the most keys) start first and the light
ones fill in behind them. Tiles past a sequence's query_len exit at once, so the
grid is sized by max_query_len, known on the host. Prefill is compute-bound, so each
program handles one query head and lets L2 absorb the repeated K/V reads of a GQA
group. Long queries take 128-row tiles with 8 warps (two warpgroups), short ones 64.

The key loop has two parts: tiles wholly before the query tile's first position,
which every row sees whole (no mask to compute), then the tiles on the diagonal,
masked; a tile stops at the key position of its last row. A sliding window W starts
the loop at the first key its first row sees (position - W + 1) and masks every tile,
so keys older than the window are never read. A query row whose position is negative
(a dummy token in front of a padded verify row whose context is shorter than the row,
`gpu/verify_graphs.py`) sees no key and writes zeros.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from gpu.triton.paged_decode import dot_config

LOG2E = math.log2(math.e)


@triton.jit
def _attend_tile(q, m, l, acc, kv_start, offs_n, offs_d, dim_mask, q_pos, kv_end, window,
                 block_table_row, k_base, v_base, stride_ks, stride_kb, stride_kd,
                 stride_vs, stride_vb, stride_vd, scale_log2,
                 BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, SLIDING: tl.constexpr,
                 DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One key tile of online softmax: the updated (m, l, acc)."""
    pos = kv_start + offs_n
    if MASKED:
        pos_mask = pos < kv_end
        block = tl.load(block_table_row + pos // BLOCK_SIZE, mask=pos_mask, other=0).to(tl.int64)
        kv_mask = pos_mask[:, None] & dim_mask[None, :]
    else:  # every key of the tile is before every query row: all valid, all visible
        block = tl.load(block_table_row + pos // BLOCK_SIZE).to(tl.int64)
        kv_mask = dim_mask[None, :]
    offset = pos % BLOCK_SIZE
    k = tl.load(k_base + block[:, None] * stride_kb + offset[:, None] * stride_ks
                + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)
    qk = tl.dot(q.to(DOT_DTYPE), tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION)
    qk = qk * scale_log2
    if MASKED:
        visible = (pos[None, :] <= q_pos[:, None]) & pos_mask[None, :]
        if SLIDING:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m, tl.max(qk, axis=1))
    # A row that has seen no key yet (its window starts in a later tile) keeps
    # m = -inf: subtract 0 instead, so exp2 gives 0 rather than NaN.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v = tl.load(v_base + block[:, None] * stride_vb + offset[:, None] * stride_vs
                + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(DOT_DTYPE), v.to(DOT_DTYPE),
                                        input_precision=DOT_PRECISION)
    return m_new, l, acc


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    context_lens_ptr,
    out_ptr,
    scale_log2,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr,
    SKIP_SINGLE: tl.constexpr,
):
    head = tl.program_id(0)
    seq = tl.program_id(1)
    q_tile = tl.num_programs(2) - 1 - tl.program_id(2)  # heaviest first
    q_start = tl.load(query_start_loc_ptr + seq)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_tile * BLOCK_M >= query_len:
        return
    if SKIP_SINGLE:
        if query_len == 1:
            return  # a decode row: the decode kernel takes it
    context_len = tl.load(context_lens_ptr + seq)
    prefix_len = context_len - query_len
    kv_head = head // GROUP

    offs_m = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    row_mask = offs_m < query_len
    dim_mask = offs_d < HEAD_DIM
    q_pos = prefix_len + offs_m
    rows = (q_start + offs_m)[:, None]
    q = tl.load(
        q_ptr + rows * stride_qt + head * stride_qh + offs_d[None, :] * stride_qd,
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    first_pos = prefix_len + q_tile * BLOCK_M  # of the tile's first row
    kv_end = tl.minimum(context_len, first_pos + BLOCK_M)
    table = block_tables_ptr + seq * stride_bt
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    if SLIDING:
        kv_begin = tl.maximum(first_pos - window + 1, 0)
        full_end = kv_begin  # the window's edge moves row by row: mask every tile
    else:
        kv_begin = 0
        # A padded verify row (gpu/verify_graphs.py) may start before position 0.
        full_end = (tl.maximum(first_pos, 0) // BLOCK_N) * BLOCK_N
    for kv_start in range(kv_begin, full_end, BLOCK_N):
        m, l, acc = _attend_tile(q, m, l, acc, kv_start, offs_n, offs_d, dim_mask, q_pos,
                                 kv_end, window, table, k_base, v_base, stride_ks, stride_kb,
                                 stride_kd, stride_vs, stride_vb, stride_vd, scale_log2,
                                 BLOCK_SIZE, False, SLIDING, DOT_DTYPE, DOT_PRECISION)
    for kv_start in range(full_end, kv_end, BLOCK_N):
        m, l, acc = _attend_tile(q, m, l, acc, kv_start, offs_n, offs_d, dim_mask, q_pos,
                                 kv_end, window, table, k_base, v_base, stride_ks, stride_kb,
                                 stride_kd, stride_vs, stride_vb, stride_vd, scale_log2,
                                 BLOCK_SIZE, True, SLIDING, DOT_DTYPE, DOT_PRECISION)

    # Rows past query_len may see no key in a window (l = 0); they are never stored.
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(
        out_ptr + rows * stride_ot + head * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def tile_sizes(max_query_len: int, block_d: int, dtype_bytes: int = 2) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): 128 query rows and two warpgroups once queries are
    long enough to fill them, else 64 and one; halve the key tile past head_dim 128 to
    fit shared memory. fp32 (exact `ieee` dots, no tensor cores) spills registers at any
    size; 64 x 32 with 8 warps spills least (`scripts/kernel_ir.py`)."""
    if dtype_bytes >= 4:
        return 64, 32, 8
    block_n = 64 if block_d <= 128 else 32
    if max_query_len >= 128:
        return 128, block_n, 8
    return 64, block_n, 4


def prefill_attention(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32, cached prefix + new tokens
    max_query_len: int,
    scale: float,
    *,
    sliding_window: int | None = None,
    out: torch.Tensor | None = None,
    skip_single_token_rows: bool = False,
) -> torch.Tensor:
    """Causal attention of every new token over its sequence's paged cache (or over its
    last `sliding_window` keys). `skip_single_token_rows` leaves one-token rows of `out`
    unwritten, for the decode kernel."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    assert num_heads % num_kv_heads == 0 and v_cache.shape == k_cache.shape
    batch = context_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or batch == 0:
        return out
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_m, block_n, num_warps = tile_sizes(max_query_len, block_d, q.element_size())
    dot_dtype, dot_precision = dot_config(q.dtype, q.device)
    grid = (num_heads, batch, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale * LOG2E,
        sliding_window or 0,
        *q.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        block_tables.stride(0),
        *out.stride(),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_DTYPE=dot_dtype,
        DOT_PRECISION=dot_precision,
        SLIDING=sliding_window is not None,
        SKIP_SINGLE=skip_single_token_rows,
        num_warps=num_warps,
        num_stages=2,
    )
    return out
