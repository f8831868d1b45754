"""Plain-torch references for the Triton kernels: slow, obvious, and the ground truth.

The kernels must match these (tests compare them under the Triton interpreter on
CPU and natively on CUDA). Each reference walks sequences one by one with
ordinary indexing, so a reader can check the semantics without knowing Triton:

- a flat slot is `block * block_size + offset`; slot -1 is padding and skipped;
- sequence i's new tokens are the LAST `query_len` of its `context_lens[i]`
  cached tokens, and each attends causally to every cached token up to and
  including its own position (so a cached prefix makes it a chunked prefill);
- with a sliding window W, the token at position p sees only keys p - W + 1 .. p.

The fused elementwise kernels (add + RMSNorm, SiLU-and-multiply) have theirs in
`models/ops.py` (`DecoderOps`: what the CPU path runs); RoPE is `models.rope`.
"""

from __future__ import annotations

import torch

from models.rope import apply_rotary


def store_kv_ref(
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64, -1 = padding
) -> None:
    """Write token t's K/V into `slot_mapping[t]` in place; padding slots write nothing."""
    block_size = k_cache.shape[1]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    # (block, offset) indexing works for any pool strides, unlike a reshape+scatter.
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k[keep].to(k_cache.dtype)
    v_cache[blocks, offsets] = v[keep].to(v_cache.dtype)


def rotary_store_kv_ref(q, k, v, cos, sin, k_cache, v_cache, slot_mapping) -> None:
    """RoPE on q (in place) and k, exactly as the model applies it unfused, then the store."""
    q.copy_(apply_rotary(q, cos, sin))
    store_kv_ref(apply_rotary(k, cos, sin), v, k_cache, v_cache, slot_mapping)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, context_len: int) -> torch.Tensor:
    """The first `context_len` cached tokens of one sequence: [context_len, kv_heads, dim]."""
    block_size = cache.shape[1]
    positions = torch.arange(context_len, device=cache.device)
    blocks = block_table.long()[positions // block_size]
    return cache[blocks, positions % block_size]


def prefill_attention_ref(
    q: torch.Tensor,  # [T, num_heads, head_dim]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    query_start_loc: torch.Tensor,  # [B+1] int32
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its paged cache, in fp32."""
    num_heads = q.shape[1]
    group = num_heads // k_cache.shape[2]
    out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    for i, context_len in enumerate(context_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if end == start:
            continue
        query_len = end - start
        keys = gather_kv(k_cache, block_tables[i], context_len).float()
        values = gather_kv(v_cache, block_tables[i], context_len).float()
        # GQA: query head h reads KV head h // group.
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [H, ctx, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        queries = q[start:end].float().transpose(0, 1)  # [H, qlen, D]
        scores = queries @ keys.transpose(1, 2) * scale  # [H, qlen, ctx]
        q_pos = torch.arange(context_len - query_len, context_len, device=q.device)
        k_pos = torch.arange(context_len, device=q.device)
        hidden = k_pos[None, :] > q_pos[:, None]
        if sliding_window is not None:
            hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        scores.masked_fill_(hidden, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[start:end] = (probs @ values).transpose(0, 1).to(q.dtype)
    return out


def paged_decode_attention_ref(
    q: torch.Tensor,  # [B, num_heads, head_dim]: one new token per sequence
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """Decode is prefill with one query per sequence: the last token sees the whole cache
    (or its last `sliding_window` tokens)."""
    batch = q.shape[0]
    query_start_loc = torch.arange(batch + 1, dtype=torch.int32, device=q.device)
    return prefill_attention_ref(
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, sliding_window
    )


def add_lora_ref(
    y: torch.Tensor,  # [T, out], added to in place
    x: torch.Tensor,  # [T, in]
    a: torch.Tensor,  # [slots, R, in]
    bt: torch.Tensor,  # [slots, R, out]
    row_slots: torch.Tensor,  # [>= T] int, -1 = no adapter
    ranks: torch.Tensor,  # [slots] int: the ranks of each slot that are read
) -> torch.Tensor:
    """Row t of slot s gets `(x[t] A[s, :r]^T) B^T[s, :r]` (r = ranks[s]) added, in fp32
    and rounded once; a row of slot -1 and a slot of rank 0 get nothing. The whole B^T of
    a fused linear: the kernel's per-slice spans must give the same sums."""
    slots, r_of = row_slots.tolist(), ranks.tolist()
    for t in range(x.shape[0]):
        s = slots[t]
        if s < 0 or not r_of[s]:
            continue
        r = r_of[s]
        delta = (x[t].float() @ a[s, :r].float().T) @ bt[s, :r].float()
        y[t] = (y[t].float() + delta).to(y.dtype)
    return y
