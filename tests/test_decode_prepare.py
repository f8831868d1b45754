"""The torch backend's decode-only `prepare` (`_decode_all`) gives the very metadata the
general grouping gives: every field of the one group, for batches of one and many rows,
tables wider than the step needs (hand-made batches), shared prefixes (cascade), and a
batch size seen before (the kept index constants are not written by any step)."""

from __future__ import annotations

import pytest
import torch

from gpu.attention.base import AttentionInputs
from gpu.attention.torch_backend import TorchAttentionBackend

FIELDS = ("query_rows", "key_blocks", "allowed", "query_pos", "out_rows", "valid",
          "block_tables", "context_lens", "query_starts", "query_lens")


def decode_inputs(lens: list[int], block_size: int, extra_width: int = 0,
                  shared_blocks: int = 0) -> AttentionInputs:
    width = max(-(-n // block_size) for n in lens) + extra_width
    tables = torch.randint(0, 64, (len(lens), width), dtype=torch.int32)
    if shared_blocks:
        tables[:, :shared_blocks] = tables[0, :shared_blocks]
    b = len(lens)
    return AttentionInputs(
        slot_mapping=torch.randint(0, 64 * block_size, (b,)),
        query_start_loc=torch.arange(b + 1, dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables, max_query_len=1, max_context_len=max(lens),
        query_lens_list=[1] * b, context_lens_list=lens)


def assert_same(backend: TorchAttentionBackend, inputs: AttentionInputs) -> None:
    (fast,) = backend.prepare(inputs).groups
    slow = backend._group(inputs, list(range(len(inputs.query_lens_list))))
    for name in FIELDS:
        a, b = getattr(fast, name), getattr(slow, name)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    for name in ("num_seqs", "max_query_len", "max_context_len", "identity"):
        assert getattr(fast, name) == getattr(slow, name), name
    assert (fast.shared is None) == (slow.shared is None)
    if fast.shared is not None:
        assert fast.shared.tokens == slow.shared.tokens
        assert torch.equal(fast.shared.rows, slow.shared.rows)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("extra_width", [0, 3])
def test_decode_only_metadata_equals_the_general_grouping(block_size, extra_width):
    torch.manual_seed(0)
    backend = TorchAttentionBackend(8, 2, 64, block_size)
    for lens in ([1], [147], [block_size], [block_size + 1], [5, 300, 17, 64, 1],
                 [33] * 7, [1], [147]):
        assert_same(backend, decode_inputs(lens, block_size, extra_width))


def test_cascade_rows_are_found_as_before():
    torch.manual_seed(1)
    backend = TorchAttentionBackend(8, 2, 64, 16)
    backend.cascades = True  # find_shared_prefix runs whether or not the kernel is built
    assert_same(backend, decode_inputs([80, 90, 100, 70], 16, shared_blocks=4))
    assert_same(backend, decode_inputs([80, 90, 20], 16, shared_blocks=1))


def test_mixed_batches_keep_the_general_path():
    backend = TorchAttentionBackend(8, 2, 64, 16)
    lens = [40, 9, 70]
    inputs = decode_inputs(lens, 16)
    inputs.query_start_loc = torch.tensor([0, 1, 9, 10], dtype=torch.int32)
    inputs.query_lens_list = [1, 8, 1]
    inputs.max_query_len = 8
    meta = backend.prepare(inputs)
    assert [g.num_seqs for g in meta.groups] == [2, 1]
    assert meta.num_tokens == 10
    assert meta.groups[0].query_rows[:, 0].tolist() == [0, 9]
