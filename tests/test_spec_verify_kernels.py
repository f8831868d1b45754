"""Speculative decoding's verify steps on the Triton attention backend, against the
torch reference (`gpu/triton/reference.py`), under TRITON_INTERPRET=1 off the GPU.

A verify row is a sequence's last token and its drafts: 1 + d query tokens at the end
of its context, causal among themselves. Eagerly the backend sends such rows to the
prefill kernel (a short prefill over a paged prefix) and one-token rows to the decode
kernel; a CUDA graph of a verify step (`gpu/verify_graphs.py`) pads every row to
1 + k tokens with dummies in front and sends all of them to the prefill kernel. Both
are checked here with rows that cross block boundaries, after a rollback: the slots
past each context (rejected drafts of an earlier step, a freed block handed to the
table's padding) hold NaN, which any read past a context would spread.
"""

from __future__ import annotations

import pytest
import torch

from gpu.attention.base import AttentionInputs, StepContext
from gpu.attention.triton_backend import TritonAttentionBackend
from gpu.batch import Batch, SamplingRow
from gpu.triton.reference import prefill_attention_ref, store_kv_ref
from gpu.verify_graphs import pad_verify_batch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {torch.float32: dict(atol=2e-5, rtol=2e-5),
              torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
NUM_KV_HEADS, HEAD_DIM, GROUP, BLOCK = 2, 32, 3, 4
NUM_HEADS = NUM_KV_HEADS * GROUP


class Step:
    """Sequences with their pages, and one step's new tokens at the end of each context.

    Block 0 is the stale block: every table's columns past its pages name it, as a
    freed and reused block would be named, and it holds NaN; so do the slots of each
    sequence's last page past its context (drafts a rollback discarded)."""

    def __init__(self, prefix_lens: list[int], query_lens: list[int], width: int):
        self.prefix_lens, self.query_lens = prefix_lens, query_lens
        self.context_lens = [p + q for p, q in zip(prefix_lens, query_lens, strict=True)]
        needed = [-(-c // BLOCK) for c in self.context_lens]
        self.num_blocks = 1 + sum(needed)
        order = (torch.randperm(self.num_blocks - 1) + 1).tolist()
        self.tables = torch.zeros(len(prefix_lens), width, dtype=torch.int32)
        for i, n in enumerate(needed):
            self.tables[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
            order = order[n:]
        self.slots = [int(self.tables[i, pos // BLOCK]) * BLOCK + pos % BLOCK
                      for i, (p, c) in enumerate(zip(prefix_lens, self.context_lens))
                      for pos in range(p, c)]

    def pools(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.num_blocks, BLOCK, NUM_KV_HEADS, HEAD_DIM)
        k, v = torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)
        for cache in (k, v):
            cache[0] = float("nan")
            for i, c in enumerate(self.context_lens):
                if c % BLOCK:
                    cache[int(self.tables[i, (c - 1) // BLOCK]), c % BLOCK:] = float("nan")
        return k.to(DEVICE), v.to(DEVICE)

    def batch(self) -> Batch:
        """As the engine sends it (token ids unused here), every row sampled."""
        n = sum(self.query_lens)
        positions = [pos for p, c in zip(self.prefix_lens, self.context_lens)
                     for pos in range(p, c)]
        spec_lens = [q - 1 for q in self.query_lens]
        return Batch(list(range(n)), positions, self.slots, self.query_lens, self.context_lens,
                     self.tables.tolist(), list(range(len(self.query_lens))),
                     [SamplingRow()] * (len(self.query_lens) + sum(spec_lens)),
                     spec_lens=spec_lens)


def inputs(slots: list[int], query_lens: list[int], context_lens: list[int],
           tables: torch.Tensor) -> AttentionInputs:
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    return AttentionInputs(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE), max_query_len=max(query_lens),
        max_context_len=max(context_lens), query_lens_list=query_lens,
        context_lens_list=context_lens)


def attend(attn: AttentionInputs, qkv: torch.Tensor, pools) -> torch.Tensor:
    backend = TritonAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK)
    q, k, v = qkv.split([NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    ctx = StepContext(backend, backend.prepare(attn), [pools[0]], [pools[1]])
    return ctx.attend(0, q.clone(), k, v)


def reference(step: Step, qkv: torch.Tensor, pools) -> torch.Tensor:
    q, k, v = qkv.split([NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
    k_ref, v_ref = pools[0].clone(), pools[1].clone()
    attn = inputs(step.slots, step.query_lens, step.context_lens, step.tables)
    store_kv_ref(k, v, k_ref, v_ref, attn.slot_mapping)
    return prefill_attention_ref(q, k_ref, v_ref, attn.block_tables, attn.query_start_loc,
                                 attn.context_lens, HEAD_DIM**-0.5), (k_ref, v_ref)


# Verify rows of 3, 5 and 2 tokens beside decode rows; drafts that cross a page boundary
# (prefix 2 + 3 tokens, 14 + 5, 7 + 2 with pages of 4), a row whose context is shorter
# than the padded row (prefix 1 + 2), a decode row at a page's first slot.
PREFIX = [2, 14, 9, 7, 1, 12]
QUERY = [3, 5, 1, 2, 2, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_eager_verify_step_matches_reference(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    step = Step(PREFIX, QUERY, width=8)
    pools = step.pools(dtype)
    qkv = torch.randn(sum(QUERY), NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    qkv = qkv.to(DEVICE)
    out = attend(inputs(step.slots, QUERY, step.context_lens, step.tables), qkv, pools)
    ref, (k_ref, v_ref) = reference(step, qkv, pools)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[dtype])
    # The store wrote the new tokens' slots and nothing else (NaN != NaN: compare masks).
    for pool, want in zip(pools, (k_ref, v_ref)):
        assert torch.equal(pool.isnan(), want.isnan())
        assert torch.equal(pool.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("row_len", [5, 33])  # 33: k = 32, the most drafts a row has
def test_padded_verify_rows_match_unpadded(row_len: int) -> None:
    """The verify graphs' layout: every row `row_len` tokens, dummies in front (slot -1,
    position 0), then dummy rows of context 0. The real tokens' outputs are the
    unpadded step's; the dummies store nothing and come out finite."""
    torch.manual_seed(1)
    step = Step(PREFIX, QUERY, width=8)
    pools = step.pools(torch.float32)
    qkv = torch.randn(sum(QUERY), NUM_HEADS + 2 * NUM_KV_HEADS, HEAD_DIM).to(DEVICE)
    ref, (k_ref, v_ref) = reference(step, qkv, pools)

    bucket = 8
    padded = pad_verify_batch(step.batch(), bucket, row_len, padding_row=0)
    real = [t for t, slot in enumerate(padded.slot_mapping) if slot >= 0]
    assert len(real) == sum(QUERY) and len(padded.slot_mapping) == bucket * row_len
    assert [padded.slot_mapping[t] for t in real] == step.slots
    assert padded.logit_rows == real  # every position of every row is sampled here
    padded_qkv = torch.zeros(bucket * row_len, *qkv.shape[1:], device=DEVICE)
    padded_qkv[real] = qkv
    tables = torch.zeros(bucket, 8, dtype=torch.int32)
    tables[: len(QUERY)] = step.tables
    attn = inputs(padded.slot_mapping, [row_len] * bucket, padded.context_lens, tables)
    backend = TritonAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK)
    meta = backend.prepare(attn, num_splits=1)
    assert not meta.decode_only and not meta.has_decode_rows  # the prefill kernel alone
    out = attend(attn, padded_qkv, pools)

    torch.testing.assert_close(out[real], ref, **TOLERANCES[torch.float32])
    assert torch.isfinite(out).all()
    dummy_rows = out[len(QUERY) * row_len:]
    assert torch.equal(dummy_rows, torch.zeros_like(dummy_rows))  # context 0: output 0
    for pool, want in zip(pools, (k_ref, v_ref)):
        assert torch.equal(pool.isnan(), want.isnan())
        assert torch.equal(pool.nan_to_num(), want.nan_to_num())
