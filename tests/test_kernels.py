"""Triton kernels against their torch references.

On CPU the kernels run under TRITON_INTERPRET=1 (set by conftest.py before
triton is imported), which is ~1000x slower than torch: shapes stay tiny, but
are chosen to cross every boundary that matters (KV blocks, 64-key tiles,
64-row query tiles, split partitions, GQA groups, non-power-of-two head dims).
Inputs are random (never zeros) and outputs are pre-filled with NaN, so a row
a kernel forgets to write fails loudly. On CUDA the same tests run natively.
"""

from __future__ import annotations

import pytest
import torch

from gpu.attention.base import AttentionInputs, StepContext
from gpu.attention.triton_backend import TritonAttentionBackend
from gpu.triton.kv_store import store_kv
from gpu.triton.paged_decode import SplitWorkspace, choose_num_splits, paged_decode_attention
from gpu.triton.prefill import prefill_attention
from gpu.triton.reference import (
    paged_decode_attention_ref,
    prefill_attention_ref,
    store_kv_ref,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# bf16 runs under the interpreter too (see dot_config for the workaround it needs);
# the interpreter truncates fp32 -> bf16 instead of rounding to nearest, hence the slack.
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = list(TOLERANCES)
DTYPE_IDS = ["fp32", "fp16", "bf16"]
# Block size only changes address arithmetic, so not every dtype needs both sizes:
# this keeps the attention tests' matrix to a third less interpreter time.
LAYOUTS = pytest.mark.parametrize(
    ("block_size", "dtype"),
    [(4, torch.float32), (16, torch.float32), (16, torch.float16), (4, torch.bfloat16)],
    ids=["bs4-fp32", "bs16-fp32", "bs16-fp16", "bs4-bf16"],
)
NUM_KV_HEADS = 2
HEAD_DIM = 32


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def random_pool(num_blocks: int, block_size: int, dtype: torch.dtype, head_dim: int = HEAD_DIM):
    shape = (num_blocks, block_size, NUM_KV_HEADS, head_dim)
    return (
        torch.randn(shape, dtype=dtype, device=DEVICE),
        torch.randn(shape, dtype=dtype, device=DEVICE),
    )


def shuffled_block_tables(context_lens: list[int], block_size: int, num_blocks: int):
    """Disjoint, shuffled pages per sequence; padding columns point at valid blocks."""
    needed = [-(-n // block_size) for n in context_lens]
    width = max(needed) + 2
    order = torch.randperm(num_blocks).tolist()
    assert sum(needed) <= num_blocks
    tables = torch.randint(0, num_blocks, (len(context_lens), width), dtype=torch.int32)
    for i, n in enumerate(needed):
        tables[i, :n] = torch.tensor(order[:n], dtype=torch.int32)
        order = order[n:]
    return tables.to(DEVICE)


def assert_attention_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCES[ref.dtype])


# --- KV store -----------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("block_size", [4, 16])
def test_store_kv_writes_slots_and_skips_padding(block_size: int, dtype: torch.dtype) -> None:
    num_tokens, num_kv_heads, head_dim, num_blocks = 11, 3, 20, 7
    # k and v as strided views of a fused qkv projection, as a model produces them.
    qkv = torch.randn(num_tokens, (4 + 2 * num_kv_heads) * head_dim, dtype=dtype, device=DEVICE)
    k = qkv[:, 4 * head_dim : (4 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, -1)
    v = qkv[:, (4 + num_kv_heads) * head_dim :].view(num_tokens, num_kv_heads, head_dim)
    assert not k.is_contiguous()
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:num_tokens]
    slots[[1, 5, 10]] = -1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    v_cache = torch.randn(shape, dtype=dtype, device=DEVICE)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    store_kv(k, v, k_cache, v_cache, slots)

    k_expected, v_expected = k_before.clone(), v_before.clone()
    store_kv_ref(k, v, k_expected, v_expected, slots)
    assert torch.equal(k_cache, k_expected) and torch.equal(v_cache, v_expected)
    flat_k = k_cache.view(-1, num_kv_heads, head_dim)
    flat_v = v_cache.view(-1, num_kv_heads, head_dim)
    written = slots[slots >= 0]
    assert torch.equal(flat_k[written], k[slots >= 0])
    assert torch.equal(flat_v[written], v[slots >= 0])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.equal(flat_k[untouched], k_before.view_as(flat_k)[untouched])
    assert torch.equal(flat_v[untouched], v_before.view_as(flat_v)[untouched])


def test_store_kv_with_no_tokens_is_a_no_op() -> None:
    k_cache, v_cache = random_pool(2, 4, torch.float32)
    before = k_cache.clone()
    empty = torch.empty(0, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
    store_kv(empty, empty, k_cache, v_cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(k_cache, before)


# --- paged decode ---------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("group", [1, 3, 8])
@LAYOUTS
def test_paged_decode_matches_reference(
    block_size: int, group: int, dtype: torch.dtype, num_splits: int
) -> None:
    # A row uses at most one split per 256 keys: 600 keys take 3 of the 4 splits, 300
    # take 2, the short rows 1 (written without the merge).
    context_lens = [1, 17, 64, 300, 600]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 5
    k_cache, v_cache = random_pool(num_blocks, block_size, dtype)
    block_tables = shuffled_block_tables(context_lens, block_size, num_blocks)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(context_lens), NUM_KV_HEADS * group, HEAD_DIM, dtype=dtype, device=DEVICE)
    scale = HEAD_DIM**-0.5
    out = torch.full_like(q, float("nan"))
    workspace = SplitWorkspace.allocate(*q.shape[:2], HEAD_DIM, num_splits, DEVICE)
    for partial in (workspace.out, workspace.m, workspace.l):
        partial.fill_(float("nan"))

    result = paged_decode_attention(
        q, k_cache, v_cache, block_tables, lens, scale, num_splits, out=out, workspace=workspace
    )

    assert result is out
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens, scale)
    assert_attention_close(out, ref)


def test_paged_decode_non_power_of_two_head_dim_and_auto_splits() -> None:
    head_dim, block_size = 40, 16
    context_lens = [600, 3]  # long enough for the heuristic to split (600 // 256 = 2)
    num_blocks = 45
    k_cache, v_cache = random_pool(num_blocks, block_size, torch.float32, head_dim)
    block_tables = shuffled_block_tables(context_lens, block_size, num_blocks)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(2, NUM_KV_HEADS * 4, head_dim, device=DEVICE)
    assert choose_num_splits(2, NUM_KV_HEADS, max(context_lens)) == 2
    ref = paged_decode_attention_ref(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5)
    out = paged_decode_attention(q, k_cache, v_cache, block_tables, lens, head_dim**-0.5)
    assert_attention_close(out, ref)


@pytest.mark.parametrize(
    ("num_seqs", "max_context_len", "expected"),
    [
        (1, 4096, 16),  # 8 programs: split as far as 256-key partitions allow
        (1, 32768, 64),  # up to the cap: 512 programs, about 4 per SM
        (8, 16384, 8),  # 64 programs x 8 = 512
        (32, 4096, 2),  # 256 programs: twice that reaches ~4 per SM
        (66, 4096, 1),  # 528 programs: 4 per SM already
        (1, 300, 1),  # too short: a partition would hold < 256 keys
        (2, 600, 2),
    ],
)
def test_choose_num_splits(num_seqs: int, max_context_len: int, expected: int) -> None:
    assert choose_num_splits(num_seqs, 8, max_context_len) == expected


# --- prefill --------------------------------------------------------------------


def test_prefill_128_row_tiles_and_unmasked_tiles_before_the_diagonal() -> None:
    """A query long enough for 128-row tiles (16-bit dtypes), over a cached prefix several
    key tiles long: the tiles before the diagonal run without a mask."""
    from gpu.triton.prefill import tile_sizes

    dtype = torch.bfloat16
    assert tile_sizes(130, HEAD_DIM, dtype.itemsize)[0] == 128
    query_lens, prefix_lens = [130, 3], [70, 200]
    context_lens = [p + n for p, n in zip(prefix_lens, query_lens)]
    num_blocks = sum(-(-n // 16) for n in context_lens) + 2
    k_cache, v_cache = random_pool(num_blocks, 16, dtype)
    block_tables = shuffled_block_tables(context_lens, 16, num_blocks)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, 130, 133], dtype=torch.int32, device=DEVICE)
    q = torch.randn(133, NUM_KV_HEADS * 2, HEAD_DIM, device=DEVICE, dtype=dtype)
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k_cache, v_cache, block_tables, starts, lens, 130, HEAD_DIM**-0.5,
                      out=out)
    ref = prefill_attention_ref(q, k_cache, v_cache, block_tables, starts, lens, HEAD_DIM**-0.5)
    assert_attention_close(out, ref)


@pytest.mark.parametrize("cached_prefix", [False, True], ids=["fresh", "chunked"])
@pytest.mark.parametrize("group", [1, 3, 8])
@LAYOUTS
def test_prefill_matches_reference(
    block_size: int, group: int, dtype: torch.dtype, cached_prefix: bool
) -> None:
    # 70 new tokens span two 64-row query tiles; a 1-token row is a decode in a mixed batch.
    query_lens = [5, 1, 70, 16]
    prefix_lens = [7, 33, 21, 0] if cached_prefix else [0, 0, 0, 0]
    context_lens = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 5
    k_cache, v_cache = random_pool(num_blocks, block_size, dtype)
    block_tables = shuffled_block_tables(context_lens, block_size, num_blocks)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    starts = starts.to(DEVICE)
    q = torch.randn(sum(query_lens), NUM_KV_HEADS * group, HEAD_DIM, dtype=dtype, device=DEVICE)
    scale = HEAD_DIM**-0.5
    out = torch.full_like(q, float("nan"))

    prefill_attention(
        q, k_cache, v_cache, block_tables, starts, lens, max(query_lens), scale, out=out
    )

    ref = prefill_attention_ref(q, k_cache, v_cache, block_tables, starts, lens, scale)
    assert_attention_close(out, ref)


# --- backend end to end -----------------------------------------------------------


def build_step(
    prefix_lens: list[int],
    query_lens: list[int],
    block_size: int,
    num_blocks: int,
    num_padding: int = 0,
) -> AttentionInputs:
    """A scheduler-like step: shuffled pages, new tokens at the end of each context.

    `num_padding` rows are appended the way a CUDA-graph bucket pads a decode
    batch: one token each, slot -1, empty context.
    """
    context_lens = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    tables = shuffled_block_tables(context_lens + [0] * num_padding, block_size, num_blocks)
    slots = []
    for i, (prefix, n) in enumerate(zip(prefix_lens, query_lens, strict=True)):
        for pos in range(prefix, prefix + n):
            slots.append(int(tables[i, pos // block_size]) * block_size + pos % block_size)
    slots += [-1] * num_padding
    query_lens = query_lens + [1] * num_padding
    context_lens = context_lens + [0] * num_padding
    starts = [0, *torch.tensor(query_lens).cumsum(0).tolist()]
    return AttentionInputs(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables,
        max_query_len=max(query_lens),
        max_context_len=max(context_lens),
        query_lens_list=query_lens,
        context_lens_list=context_lens,
    )


def run_two_layers(inputs: AttentionInputs, dtype: torch.dtype, group: int, num_blocks: int):
    """Run the backend over two layers and check each against the references."""
    block_size = 16
    num_heads = NUM_KV_HEADS * group
    backend = TritonAttentionBackend(num_heads, NUM_KV_HEADS, HEAD_DIM, block_size)
    meta = backend.prepare(inputs)
    pools = [random_pool(num_blocks, block_size, dtype) for _ in range(2)]
    expected_pools = [(k.clone(), v.clone()) for k, v in pools]
    ctx = StepContext(backend, meta, [k for k, _ in pools], [v for _, v in pools])
    num_tokens = inputs.slot_mapping.shape[0]
    for layer in range(2):
        qkv = torch.randn(num_tokens, num_heads + 2 * NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
        qkv = qkv.to(DEVICE)
        q, k, v = qkv.split([num_heads, NUM_KV_HEADS, NUM_KV_HEADS], dim=1)
        out = ctx.attend(layer, q, k, v)

        k_ref, v_ref = expected_pools[layer]
        store_kv_ref(k, v, k_ref, v_ref, inputs.slot_mapping)
        starts, lens = inputs.query_start_loc, inputs.context_lens
        ref = prefill_attention_ref(
            q, k_ref, v_ref, inputs.block_tables, starts, lens, backend.scale
        )
        assert torch.equal(pools[layer][0], k_ref) and torch.equal(pools[layer][1], v_ref)
        assert_attention_close(out, ref)
    return meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_backend_mixed_batch(dtype: torch.dtype) -> None:
    # fresh prefill, chunked prefill over a cached prefix, and a decode row.
    inputs = build_step([0, 40, 16], [9, 12, 1], block_size=16, num_blocks=12)
    meta = run_two_layers(inputs, dtype, group=3, num_blocks=12)
    assert not meta.decode_only and meta.has_decode_rows


def test_backend_mixed_batch_decode_rows_take_the_split_decode_kernel(monkeypatch) -> None:
    """Decode rows between prefill rows, long enough to split: the prefill kernel skips
    them and the decode kernel finds their queries through query_start_loc."""
    import gpu.attention.triton_backend as backend_module

    calls = []
    real = backend_module.paged_decode_attention
    monkeypatch.setattr(backend_module, "paged_decode_attention",
                        lambda *a, **kw: calls.append(kw["query_start_loc"]) or real(*a, **kw))
    inputs = build_step([0, 520, 16, 300], [9, 1, 12, 1], block_size=16, num_blocks=64)
    meta = run_two_layers(inputs, torch.float32, group=4, num_blocks=64)
    assert meta.num_splits > 1 and len(calls) == 2 and calls[0] is inputs.query_start_loc


@pytest.mark.parametrize("long_context", [False, True], ids=["unsplit", "split"])
def test_backend_decode_only_batch(long_context: bool) -> None:
    # The last row is CUDA-graph padding: slot -1 and an empty context (output zeros).
    prefix_lens = [512, 36, 0] if long_context else [20, 36, 0]
    inputs = build_step(prefix_lens, [1, 1, 1], block_size=16, num_blocks=40, num_padding=1)
    meta = run_two_layers(inputs, torch.float32, group=8, num_blocks=40)
    assert meta.decode_only
    assert (meta.num_splits > 1) == long_context
