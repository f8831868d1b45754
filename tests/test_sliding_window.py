"""Sliding-window attention in both backends, against the torch reference.

The token at position p sees keys p - W + 1 .. p (HF's mask: key > p - W). Windows are
chosen shorter than a KV block and longer than several blocks and a 64-key tile.

The Triton kernels must never read a key outside the window: the tests point every
block table entry that lies wholly outside the window at a block full of NaN, as if
the block had been freed and its entry left dangling, and expect the clean result.
The torch backend gathers whole tables and masks (it is the CPU path); there the
entries point at another request's finite keys, which is what a freed, reused block
holds.
"""

from __future__ import annotations

import pytest
import torch

from gpu.attention.base import StepContext
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.attention.triton_backend import TritonAttentionBackend
from gpu.memory import window_kv_tokens
from gpu.triton.paged_decode import SplitWorkspace, paged_decode_attention
from gpu.triton.prefill import prefill_attention
from gpu.triton.reference import (
    paged_decode_attention_ref,
    prefill_attention_ref,
    store_kv_ref,
)
from tests.test_kernels import (
    DEVICE,
    HEAD_DIM,
    NUM_KV_HEADS,
    assert_attention_close,
    build_step,
    random_pool,
    shuffled_block_tables,
)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def forget_old_blocks(tables: torch.Tensor, first_needed: list[int], block_size: int,
                      stand_in: int) -> torch.Tensor:
    """A copy of `tables` whose entries wholly before each row's first needed key name
    `stand_in` instead, the way a freed block's entry would be left."""
    tables = tables.clone()
    for i, first in enumerate(first_needed):
        tables[i, : max(first, 0) // block_size] = stand_in
    return tables


def nan_block(k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """Fill the pool's last block with NaN and return its id (no sequence owns it)."""
    k_cache[-1] = float("nan")
    v_cache[-1] = float("nan")
    return k_cache.shape[0] - 1


@pytest.mark.parametrize("window", [5, 40])
@pytest.mark.parametrize("cached_prefix", [False, True], ids=["fresh", "chunked"])
@pytest.mark.parametrize(("block_size", "dtype"),
                         [(16, torch.float32), (4, torch.bfloat16)], ids=["bs16-fp32", "bs4-bf16"])
def test_prefill_window_matches_reference(window: int, cached_prefix: bool, block_size: int,
                                          dtype: torch.dtype) -> None:
    query_lens = [5, 1, 70, 16]
    prefix_lens = [7, 33, 21, 0] if cached_prefix else [0, 0, 0, 0]
    context_lens = [p + n for p, n in zip(prefix_lens, query_lens, strict=True)]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 5
    k_cache, v_cache = random_pool(num_blocks, block_size, dtype)
    tables = shuffled_block_tables(context_lens, block_size, num_blocks - 1)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    starts = starts.to(DEVICE)
    q = torch.randn(sum(query_lens), NUM_KV_HEADS * 2, HEAD_DIM, dtype=dtype, device=DEVICE)
    scale = HEAD_DIM**-0.5
    ref = prefill_attention_ref(q, k_cache, v_cache, tables, starts, lens, scale, window)
    unwindowed = prefill_attention_ref(q, k_cache, v_cache, tables, starts, lens, scale)
    assert not torch.allclose(ref.float(), unwindowed.float())  # the window bites

    forgotten = forget_old_blocks(tables, [p - window + 1 for p in prefix_lens], block_size,
                                  nan_block(k_cache, v_cache))
    out = torch.full_like(q, float("nan"))
    prefill_attention(q, k_cache, v_cache, forgotten, starts, lens, max(query_lens), scale,
                      sliding_window=window, out=out)
    assert_attention_close(out, ref)


@pytest.mark.parametrize("window", [5, 40, 100])
@pytest.mark.parametrize("num_splits", [1, 4])
def test_paged_decode_window_matches_reference(window: int, num_splits: int) -> None:
    # 150 keys = 3 tiles of 64: a window of 100 starts mid-tile and leaves splits empty.
    block_size, dtype = 16, torch.float32
    context_lens = [1, 17, 64, 150]
    num_blocks = sum(-(-n // block_size) for n in context_lens) + 5
    k_cache, v_cache = random_pool(num_blocks, block_size, dtype)
    tables = shuffled_block_tables(context_lens, block_size, num_blocks - 1)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=DEVICE)
    q = torch.randn(len(context_lens), NUM_KV_HEADS * 4, HEAD_DIM, dtype=dtype, device=DEVICE)
    scale = HEAD_DIM**-0.5
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale, window)

    forgotten = forget_old_blocks(tables, [n - window for n in context_lens], block_size,
                                  nan_block(k_cache, v_cache))
    out = torch.full_like(q, float("nan"))
    workspace = SplitWorkspace.allocate(*q.shape[:2], HEAD_DIM, num_splits, DEVICE)
    paged_decode_attention(q, k_cache, v_cache, forgotten, lens, scale, num_splits,
                           sliding_window=window, out=out, workspace=workspace)
    assert_attention_close(out, ref)


def block_major(pool: torch.Tensor, block_size: int) -> torch.Tensor:
    """The torch backend's head-major pool [KVH, slots, D] as the references' layout."""
    kvh, slots, d = pool.shape
    return pool.view(kvh, slots // block_size, block_size, d).permute(1, 2, 0, 3)


@pytest.mark.parametrize("backend_cls", [TorchAttentionBackend, TritonAttentionBackend],
                         ids=["torch", "triton"])
@pytest.mark.parametrize("prefix_lens,query_lens", [([0, 40, 16], [9, 12, 1]),
                                                    ([20, 36, 3], [1, 1, 1])],
                         ids=["mixed", "decode"])
def test_backend_windows_per_layer(backend_cls, prefix_lens, query_lens) -> None:
    """Two layers of one step, one windowed and one not, as Qwen2's max_window_layers
    mixes them; the step's metadata serves both."""
    block_size, num_blocks, group = 16, 12, 3
    inputs = build_step(prefix_lens, query_lens, block_size, num_blocks)
    backend = backend_cls(NUM_KV_HEADS * group, NUM_KV_HEADS, HEAD_DIM, block_size)
    shape = backend.kv_cache_shape(num_blocks)
    pools = [(torch.randn(shape, device=DEVICE), torch.randn(shape, device=DEVICE))
             for _ in range(2)]
    ctx = StepContext(backend, backend.prepare(inputs), [k for k, _ in pools],
                      [v for _, v in pools])
    num_tokens = inputs.slot_mapping.shape[0]
    for layer, window in enumerate([7, None]):
        q = torch.randn(num_tokens, NUM_KV_HEADS * group, HEAD_DIM, device=DEVICE)
        k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
        v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, device=DEVICE)
        k_pool, v_pool = pools[layer]
        if backend_cls is TorchAttentionBackend:
            k_ref, v_ref = block_major(k_pool, block_size), block_major(v_pool, block_size)
        else:
            k_ref, v_ref = k_pool, v_pool
        k_ref, v_ref = k_ref.clone(), v_ref.clone()
        store_kv_ref(k, v, k_ref, v_ref, inputs.slot_mapping)
        out = ctx.attend(layer, q, k, v, window)
        ref = prefill_attention_ref(q, k_ref, v_ref, inputs.block_tables,
                                    inputs.query_start_loc, inputs.context_lens,
                                    backend.scale, window)
        assert_attention_close(out, ref)


def test_window_kv_tokens_counts_the_blocks_a_window_overlaps() -> None:
    # Keys p-W+1..p: W=16 at block size 16 spans two blocks unless p ends a block.
    assert window_kv_tokens(16, 16) == 32
    assert window_kv_tokens(1, 16) == 16
    assert window_kv_tokens(4096, 16) == 4096 + 16
    assert window_kv_tokens(17, 16) == 32
