"""LoRA's low-rank delta for a mixed batch: each row carries its adapter's slot.

Punica's BGMV for a batch whose rows belong to different adapters: every row (token)
reads its slot from `row_slots` (-1: the base model, no delta), so one launch of each
kernel serves the whole batch, with no grouping of rows on the host and no tensor
whose size depends on the batch's adapters. That is what lets a decode CUDA graph
capture it: the slots' weights live in static stacked tensors, written in place when
an adapter takes a slot, and a replay only changes the values of `row_slots`.

- shrink: `inter[t, :rank[s]] = x[t] @ A[s, :rank[s]]^T`, in float32. The ranks past
  a slot's own (the zero padding up to the linear's budget) are never read. The input
  features are split in `K_SPLIT` chunks, each program summing one into its own
  partial (the expand adds the partials in a fixed order): a decode row's shrink
  reads its slot's A on many SMs at once, not on the one or three its rank blocks
  would give, and the sum is the same from run to run (no atomics).
- expand: for each output slice p of the linear (q, k and v of a fused qkv; gate and
  up of gate_up; the whole output otherwise), `y[t, slice p] += inter[t, c0:c1] @
  B^T[s, c0:c1, slice p]`, `(c0, c1) = spans[s, p]`: the rank columns that are not
  zero in that slice's rows (`rank_spans`). A fused adapter's B is block-diagonal
  (`models/lora.py`), so each slice reads only its own part's ranks, and a part the
  adapter leaves alone reads nothing. y is added to in float32, rounded once.

Both sum with `tl.sum` over broadcast products rather than `tl.dot`: a row's delta is
a matrix-vector product, bound by reading the slot's weights, and it runs the same
under the interpreter in every dtype. Rows of one slot re-read its weights (from L2 on
a GPU); a prefill chunk of one adapter is where a segmented (SGMV) tiling would pay.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_R = 16  # rank columns per shrink program and per expand step
BLOCK_K = 128  # input features per shrink step
K_SPLIT = 512  # input features per shrink program (a multiple of BLOCK_K)
BLOCK_N = 128  # output features per expand program


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, ranks_ptr, inter_ptr, stride_xt, stride_as,
                   stride_ar, stride_it, stride_ik, in_features, BLOCK_R: tl.constexpr,
                   BLOCK_K: tl.constexpr, K_SPLIT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    rank = tl.load(ranks_ptr + slot)
    first = tl.program_id(1) * BLOCK_R
    if first >= rank:
        return
    r = first + tl.arange(0, BLOCK_R)
    a_rows = a_ptr + slot * stride_as + r[:, None] * stride_ar
    split = tl.program_id(2)
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(split * K_SPLIT, tl.minimum(in_features, (split + 1) * K_SPLIT), BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + row * stride_xt + k, mask=k < in_features, other=0.0)
        a = tl.load(a_rows + k[None, :], mask=(r[:, None] < rank) & (k[None, :] < in_features),
                    other=0.0)
        acc += tl.sum(a.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
    tl.store(inter_ptr + row * stride_it + split * stride_ik + r, acc, mask=r < rank)


@triton.jit
def _expand_kernel(inter_ptr, bt_ptr, slots_ptr, spans_ptr, slices_ptr, y_ptr, stride_it,
                   stride_ik, stride_bs, stride_br, stride_yt, stride_ss, splits,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot < 0:
        return
    c0 = tl.load(spans_ptr + slot * stride_ss + part * 2)
    c1 = tl.load(spans_ptr + slot * stride_ss + part * 2 + 1)
    offset = tl.load(slices_ptr + part * 2)
    size = tl.load(slices_ptr + part * 2 + 1)
    first = tl.program_id(2) * BLOCK_N
    if (c1 <= c0) | (first >= size):
        return
    n = first + tl.arange(0, BLOCK_N)
    cols = offset + n
    b_slot = bt_ptr + slot * stride_bs
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for c in range(c0, c1, BLOCK_R):
        r = c + tl.arange(0, BLOCK_R)
        v = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k in range(0, splits):  # the shrink's partials, always in the same order
            v += tl.load(inter_ptr + row * stride_it + k * stride_ik + r, mask=r < c1, other=0.0)
        b = tl.load(b_slot + r[:, None] * stride_br + cols[None, :],
                    mask=(r[:, None] < c1) & (n[None, :] < size), other=0.0)
        acc += tl.sum(v[:, None] * b.to(tl.float32), axis=0)
    out = y_ptr + row * stride_yt + cols
    y = tl.load(out, mask=n < size, other=0.0)
    tl.store(out, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=n < size)


def add_lora(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
             row_slots: torch.Tensor, ranks: torch.Tensor, spans: torch.Tensor,
             slices: torch.Tensor, max_slice: int) -> torch.Tensor:
    """`y[t] += x[t] A[s]^T B^T[s]` for every row t whose slot s = row_slots[t] is not -1,
    in place; returns y.

    y [T, out], x [T, in] (row-major rows); a [slots, R, in]; bt [slots, R, out];
    row_slots [>= T] int32; ranks [slots] int32; spans [slots, P, 2] int32 (`rank_spans`);
    slices [P, 2] int32, each output slice's (offset, size); max_slice: the largest size.
    Nothing here reads a tensor's values on the host, so a CUDA graph can capture it.
    """
    rows = x.shape[0]
    if rows == 0:
        return y
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and a.stride(-1) == 1 and bt.stride(-1) == 1
    assert spans.is_contiguous() and slices.is_contiguous()
    splits = triton.cdiv(x.shape[1], K_SPLIT)
    inter = torch.empty(rows, splits, a.shape[1], dtype=torch.float32, device=x.device)
    _shrink_kernel[(rows, triton.cdiv(a.shape[1], BLOCK_R), splits)](
        x, a, row_slots, ranks, inter, x.stride(0), a.stride(0), a.stride(1), inter.stride(0),
        inter.stride(1), x.shape[1], BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, K_SPLIT=K_SPLIT,
        num_warps=4)
    _expand_kernel[(rows, slices.shape[0], triton.cdiv(max_slice, BLOCK_N))](
        inter, bt, row_slots, spans, slices, y, inter.stride(0), inter.stride(1), bt.stride(0),
        bt.stride(1), y.stride(0), spans.stride(0), splits, BLOCK_R=BLOCK_R,
        BLOCK_N=BLOCK_N, num_warps=4)
    return y


def rank_spans(bt: torch.Tensor, slices: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Per output slice, the rank columns `[c0, c1)` of one slot's B^T [R, out] that are
    not zero in that slice's columns ((0, 0): none).

    Exact by construction: for a slice's outputs every rank column outside its span is
    zero, so it adds nothing. A fused adapter's parts sit in contiguous column ranges
    (`models/lora.py`), so each span covers one part's ranks and no other's."""
    spans = []
    for offset, size in slices:
        used = (bt[:, offset:offset + size] != 0).any(dim=1).nonzero().flatten().tolist()
        spans.append((used[0], used[-1] + 1) if used else (0, 0))
    return spans
