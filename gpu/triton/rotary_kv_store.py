"""RoPE fused with the KV store: rotate q and k, write k and v into their slots, once.

Unfused, RoPE is five elementwise kernels per layer (multiply, negate, concatenate,
multiply, add) and the store a sixth, each a round trip of q/k through memory. Here
one program per token reads its q, k and v heads once, rotates q in place (the
attention kernels read it next) and writes rotated k and v straight into the pool.

The rotation is HF's rotate-half over the first `rotary_dim` dims of each head (the
rest pass through: partial rotary), exactly `models.rope.apply_rotary`, computed in
fp32 and rounded once. Slot -1 (CUDA-graph padding) rotates q and stores nothing.
The reference is `rotary_store_kv_ref` in `reference.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(x_ptr, heads, offs, head_mask, half_mask, cos_lo, cos_hi, sin_lo, sin_hi,
            stride_h, stride_d, HALF: tl.constexpr):
    """The two rotated halves of the heads at `x_ptr` (fp32, [heads, HALF-ish])."""
    lo_ptr = x_ptr + heads[:, None] * stride_h + offs[None, :] * stride_d
    mask = head_mask[:, None] & half_mask[None, :]
    x1 = tl.load(lo_ptr, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(lo_ptr + HALF * stride_d, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos_lo - x2 * sin_lo, x2 * cos_hi + x1 * sin_hi


@triton.jit
def _rotary_store_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_qt, stride_qh, stride_qd,
    stride_kt, stride_kh, stride_kd,
    stride_vt, stride_vh, stride_vd,
    stride_ct, stride_st,
    stride_cb, stride_cs, stride_ch, stride_cd,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,  # rotary_dim // 2
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_KV: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PARTIAL: tl.constexpr,  # rotary_dim < head_dim
):
    token = tl.program_id(0)
    offs = tl.arange(0, BLOCK_HALF)
    half_mask = offs < HALF
    cos_lo = tl.load(cos_ptr + token * stride_ct + offs, mask=half_mask, other=0.0).to(tl.float32)
    cos_hi = tl.load(cos_ptr + token * stride_ct + HALF + offs, mask=half_mask,
                     other=0.0).to(tl.float32)
    sin_lo = tl.load(sin_ptr + token * stride_st + offs, mask=half_mask, other=0.0).to(tl.float32)
    sin_hi = tl.load(sin_ptr + token * stride_st + HALF + offs, mask=half_mask,
                     other=0.0).to(tl.float32)

    # q: rotated in place.
    q_heads = tl.arange(0, BLOCK_H)
    q_mask = (q_heads < NUM_HEADS)[:, None] & half_mask[None, :]
    q_base = q_ptr + token * stride_qt
    q1, q2 = _rotate(q_base, q_heads, offs, q_heads < NUM_HEADS, half_mask, cos_lo, cos_hi,
                     sin_lo, sin_hi, stride_qh, stride_qd, HALF)
    q_lo = q_base + q_heads[:, None] * stride_qh + offs[None, :] * stride_qd
    tl.store(q_lo, q1.to(q_ptr.dtype.element_ty), mask=q_mask)
    tl.store(q_lo + HALF * stride_qd, q2.to(q_ptr.dtype.element_ty), mask=q_mask)

    # int64: block * stride can pass 2**31 elements in a large pool.
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    kv_heads = tl.arange(0, BLOCK_KV)
    kv_head_mask = kv_heads < NUM_KV_HEADS
    k_mask = kv_head_mask[:, None] & half_mask[None, :]
    k1, k2 = _rotate(k_ptr + token * stride_kt, kv_heads, offs, kv_head_mask, half_mask,
                     cos_lo, cos_hi, sin_lo, sin_hi, stride_kh, stride_kd, HALF)
    cache_row = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
    k_dst = k_cache_ptr + cache_row + kv_heads[:, None] * stride_ch + offs[None, :] * stride_cd
    tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    tl.store(k_dst + HALF * stride_cd, k2.to(k_cache_ptr.dtype.element_ty), mask=k_mask)
    dims = tl.arange(0, BLOCK_D)
    if PARTIAL:  # dims past the rotary ones pass through
        rest = (dims >= 2 * HALF) & (dims < HEAD_DIM)
        rest_mask = kv_head_mask[:, None] & rest[None, :]
        k_rest = tl.load(k_ptr + token * stride_kt + kv_heads[:, None] * stride_kh
                         + dims[None, :] * stride_kd, mask=rest_mask)
        tl.store(k_cache_ptr + cache_row + kv_heads[:, None] * stride_ch
                 + dims[None, :] * stride_cd, k_rest.to(k_cache_ptr.dtype.element_ty),
                 mask=rest_mask)
    v_mask = kv_head_mask[:, None] & (dims < HEAD_DIM)[None, :]
    v = tl.load(v_ptr + token * stride_vt + kv_heads[:, None] * stride_vh
                + dims[None, :] * stride_vd, mask=v_mask)
    tl.store(v_cache_ptr + cache_row + kv_heads[:, None] * stride_ch + dims[None, :] * stride_cd,
             v.to(v_cache_ptr.dtype.element_ty), mask=v_mask)


def rotary_store_kv(
    q: torch.Tensor,  # [T, num_heads, head_dim]; rotated in place
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]; strided views of a qkv output are fine
    v: torch.Tensor,
    cos: torch.Tensor,  # [T, 1, rotary_dim] (models.rope.Rotary), rotary_dim <= head_dim
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] flat slots, -1 = skip
) -> None:
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    rotary_dim = cos.shape[-1]
    assert k.shape == v.shape == (num_tokens, num_kv_heads, head_dim)
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim and sin.shape == cos.shape
    assert k_cache.shape[2:] == (num_kv_heads, head_dim) and v_cache.stride() == k_cache.stride()
    assert cos.stride(-1) == 1 and sin.stride(-1) == 1
    if num_tokens == 0:
        return
    _rotary_store_kv_kernel[(num_tokens,)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping,
        *q.stride(), *k.stride(), *v.stride(),
        cos.stride(0), sin.stride(0),
        *k_cache.stride(),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=rotary_dim // 2,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads),
        BLOCK_KV=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
        BLOCK_D=triton.next_power_of_2(head_dim),
        PARTIAL=rotary_dim < head_dim,
    )
