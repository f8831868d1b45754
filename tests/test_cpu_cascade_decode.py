"""Cascade decode attention (`cascade_decode_amx_`): decode rows sharing a prefix of KV
blocks attend to it together on the tile unit, then to their own keys, and the two
partials are merged by their log-sum-exp. Checked against a plain torch reference (fp32
softmax attention over each row's whole context, from the same bf16 values) and against
the per-row kernel (`paged_decode`), and the backend's detection of the shared prefix.

Steps mix what a scheduler hands the kernel: rows sharing the prefix and rows that do
not (untouched by the call), own keys from one to several blocks past the prefix,
prefixes of an odd number of blocks (not a multiple of the tile's 32 keys), GQA groups of
1, 3 and 8, head_dim 64 and 128, block sizes 16 and 32, shuffled pages and NaN in every
slot no row may read. The kernel rounds p to bf16 before p·v on the prefix, as the AMX
prefill kernel does, so the tolerance is that of tests/test_cpu_prefill_bf16.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpu.attention.base import AttentionInputs
from gpu.attention.shared_prefix import find_shared_prefix
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.cpu.capabilities import CpuCapabilities
from gpu.cpu.kernels.build import cpu_kernels

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
CAPS = CpuCapabilities.of(KERNELS)
needs_amx = pytest.mark.skipif(
    not (CAPS.amx and CAPS.has("cascade_decode_amx_")),
    reason="needs the C++ kernels built with AMX-BF16 and Linux's grant of the tile state")
ATOL = RTOL = 2e-2


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def make_step(prefix_blocks, own_lens, others, block_size, num_kv_heads, group, head_dim):
    """One decode step: rows 0..len(own_lens)-1 share `prefix_blocks` blocks then hold
    own_lens[i] keys of their own; `others` more rows (context lengths) share nothing.
    Every slot no row reads is NaN; q is a strided view of a fused projection."""
    shared_len = prefix_blocks * block_size
    lens = [shared_len + n for n in own_lens] + list(others)
    own_blocks = [-(-n // block_size) for n in own_lens] + [-(-n // block_size) for n in others]
    num_blocks = prefix_blocks + sum(own_blocks) + 3
    order = torch.randperm(num_blocks).to(torch.int32)
    width = max(-(-n // block_size) for n in lens) + 1
    tables = order[-1].repeat(len(lens), width).contiguous()  # padding: a valid block id
    at = prefix_blocks
    for r, nb in enumerate(own_blocks):
        start = prefix_blocks if r < len(own_lens) else 0
        if start:
            tables[r, :start] = order[:prefix_blocks]
        tables[r, start:start + nb] = order[at:at + nb]
        at += nb
    shape = (num_kv_heads, num_blocks * block_size, head_dim)
    k_pool = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    v_pool = torch.full(shape, float("nan"), dtype=torch.bfloat16)
    for r, n in enumerate(lens):
        slots = slots_of(tables[r], n, block_size)
        k_pool[:, slots] = torch.randn(num_kv_heads, n, head_dim, dtype=torch.bfloat16)
        v_pool[:, slots] = torch.randn(num_kv_heads, n, head_dim, dtype=torch.bfloat16)
    heads = num_kv_heads * group
    fused = torch.randn(len(lens), heads + 2 * num_kv_heads, head_dim, dtype=torch.bfloat16)
    return fused[:, :heads], k_pool, v_pool, tables, torch.tensor(lens, dtype=torch.int32)


def slots_of(table, n, block_size):
    return torch.tensor([int(table[t // block_size]) * block_size + t % block_size
                         for t in range(n)])


def reference(q, k_pool, v_pool, tables, lens, block_size):
    group = q.shape[1] // k_pool.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float32)
    for r, n in enumerate(lens.tolist()):
        slots = slots_of(tables[r], n, block_size)
        k = k_pool[:, slots].float().repeat_interleave(group, 0)  # [H, n, D]
        v = v_pool[:, slots].float().repeat_interleave(group, 0)
        scores = (q[r].float()[:, None] @ k.transpose(1, 2))[:, 0] * q.shape[2] ** -0.5
        out[r] = (scores.softmax(-1)[:, None] @ v)[:, 0]
    return out


def cascade(q, k_pool, v_pool, tables, lens, rows, prefix, block_size):
    out = torch.full(q.shape, 7.0, dtype=q.dtype)  # rows not in `rows` must keep it
    KERNELS.cascade_decode_amx_(out, q, k_pool, v_pool, tables, lens,
                                torch.tensor(rows, dtype=torch.int32), prefix, block_size,
                                q.shape[2] ** -0.5)
    return out


STEPS = [  # prefix blocks, own lens, other rows' lens, block size, kv heads, group, head_dim
    (48, [70 + 4 * i for i in range(16)], [], 16, 3, 3, 64),  # the chat shape
    (5, [1, 16, 17, 40], [90, 3], 16, 3, 3, 64),
    (9, [33, 2, 64], [300], 32, 2, 8, 128),
    (17, [5, 100], [], 16, 4, 1, 64),
    (3, [1], [20], 16, 1, 8, 64),
    (130, [9, 200, 31], [], 16, 2, 3, 128),
]


@needs_amx
@pytest.mark.parametrize("step", STEPS, ids=lambda s: f"p{s[0]}-r{len(s[1])}+{len(s[2])}"
                         f"-bs{s[3]}-g{s[5]}-d{s[6]}")
def test_cascade_matches_the_reference_and_the_per_row_kernel(step) -> None:
    prefix_blocks, own, others, block_size, kv_heads, group, head_dim = step
    q, k_pool, v_pool, tables, lens = make_step(prefix_blocks, own, others, block_size,
                                                kv_heads, group, head_dim)
    rows = list(range(len(own)))
    out = cascade(q, k_pool, v_pool, tables, lens, rows, prefix_blocks * block_size, block_size)
    ref = reference(q, k_pool, v_pool, tables, lens, block_size)
    per_row = KERNELS.paged_decode(q, k_pool, v_pool, tables, lens, block_size,
                                   head_dim ** -0.5, 0)
    n = len(own)
    assert not out[:n].isnan().any()
    torch.testing.assert_close(out[:n].float(), ref[:n], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(out[:n], per_row[:n], atol=ATOL, rtol=RTOL)
    assert (out[n:] == 7.0).all()


@needs_amx
def test_cascade_does_not_depend_on_the_thread_count() -> None:
    """The prefix is cut into chunks per thread count; the merge must make that invisible
    (up to the summation order)."""
    q, k_pool, v_pool, tables, lens = make_step(40, [30, 50, 7, 64], [], 16, 3, 3, 64)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 7):
            torch.set_num_threads(n)
            outs.append(cascade(q, k_pool, v_pool, tables, lens, [0, 1, 2, 3], 640, 16))
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-2, rtol=1e-2)


@needs_amx
@pytest.mark.parametrize("rows,prefix,match", [
    ([0, 2], 64, "does not share"),  # row 2 has its own blocks
    ([0], 40, "whole blocks"),
    ([0], 96, "not past the prefix"),  # row 0's context is 64 + 10
])
def test_cascade_rejects_rows_that_do_not_share_the_prefix(rows, prefix, match) -> None:
    q, k_pool, v_pool, tables, lens = make_step(4, [10, 12], [80], 16, 3, 3, 64)
    with pytest.raises(RuntimeError, match=match):
        cascade(q, k_pool, v_pool, tables, lens, rows, prefix, 16)


def table(rows):
    return torch.tensor(rows, dtype=torch.int32)


def test_shared_prefix_is_found_where_it_pays() -> None:
    """Rows matching the most common first block share up to where they diverge, never
    the block of their newest token; the length chosen saves the most reads."""
    chat = [list(range(20)) + [100 + i, 200 + i] for i in range(5)]
    found = find_shared_prefix(table(chat), [340] * 5, 16, min_rows=4, min_tokens=256)
    assert found.tokens == 320 and found.rows.tolist() == [0, 1, 2, 3, 4] and found.others is None
    # A row's newest token in the last shared block: only the blocks before it count, and
    # 19 blocks for 5 rows save more than 20 for 4.
    found = find_shared_prefix(table(chat), [320, 340, 340, 340, 340], 16, min_rows=4,
                               min_tokens=256)
    assert found.tokens == 304 and found.others is None
    # One row diverging early (another conversation with the same first blocks) and one
    # not sharing at all are left to the per-row kernel; the rest keep the long prefix.
    mixed = chat + [list(range(3)) + [300 + j for j in range(19)], [400 + j for j in range(22)]]
    found = find_shared_prefix(table(mixed), [340] * 7, 16, min_rows=4, min_tokens=256)
    assert found.tokens == 320 and found.rows.tolist() == [0, 1, 2, 3, 4]
    assert found.others.tolist() == [5, 6]
    assert found.other_tables.tolist() == mixed[5:] and found.other_lens.tolist() == [340] * 2
    # Too few rows, too short a prefix, or too few reads saved: none.
    assert find_shared_prefix(table(chat[:3]), [340] * 3, 16, min_rows=4) is None
    assert find_shared_prefix(table(chat), [340] * 5, 16, min_tokens=400) is None
    assert find_shared_prefix(table(chat[:3]), [340] * 3, 16, min_rows=3,
                              min_saved=641) is None
    assert find_shared_prefix(table(mixed[4:]), [340] * 3, 16, min_rows=2, min_tokens=0,
                              min_saved=0).tokens == 3 * 16


def decode_inputs(tables: torch.Tensor, lens: torch.Tensor) -> AttentionInputs:
    """A decode step's attention inputs: one new token per row, no keys to store."""
    rows = len(lens)
    return AttentionInputs(
        slot_mapping=torch.zeros(0, dtype=torch.long),
        query_start_loc=torch.arange(rows + 1, dtype=torch.int32), context_lens=lens,
        block_tables=tables, max_query_len=1, max_context_len=int(lens.max()),
        query_lens_list=[1] * rows, context_lens_list=lens.tolist())


@needs_amx
@pytest.mark.parametrize("window", [None, 40])
def test_backend_decodes_shared_prefix_rows_by_cascade(window) -> None:
    """A decode group with rows sharing a prefix and rows not: the backend finds the
    prefix, and its result matches the per-row kernel's for every row (a sliding window
    keeps the per-row kernel)."""
    block_size, prefix_blocks = 16, 20
    q, k_pool, v_pool, tables, lens = make_step(prefix_blocks, [5, 30, 17, 64, 1], [200, 33],
                                                block_size, 3, 3, 64)
    inputs = decode_inputs(tables, lens)
    nothing = torch.zeros(0, 3, 64, dtype=torch.bfloat16)  # no new keys to store
    outs = {}
    for cascades in (True, False):
        backend = TorchAttentionBackend(9, 3, 64, block_size, kernels=CAPS)
        backend.cascades = cascades
        meta = backend.prepare(inputs)
        shared = meta.groups[0].shared
        assert (shared is not None) == cascades
        if cascades:
            assert shared.tokens == prefix_blocks * block_size
            assert shared.others.tolist() == [5, 6]
        outs[cascades] = backend.forward(q, nothing, nothing, k_pool, v_pool, meta, window)
    ref = reference(q, k_pool, v_pool, tables, lens, block_size)
    if window is None:
        torch.testing.assert_close(outs[True].float(), ref, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(outs[True], outs[False], atol=ATOL, rtol=RTOL)
    else:
        assert torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("amx,dtype,head_dim,window,expected", [
    (True, torch.bfloat16, 64, None, ["cascade_decode_amx_", "paged_decode"]),
    (True, torch.bfloat16, 64, 32, ["paged_decode"]),
    (True, torch.float32, 64, None, ["paged_decode"]),
    (True, torch.bfloat16, 48, None, ["paged_decode"]),
    (False, torch.bfloat16, 64, None, ["paged_decode"]),
])
def test_backend_takes_cascade_only_where_it_applies(amx, dtype, head_dim, window,
                                                     expected) -> None:
    """Which decode kernels run is decided from the capabilities, the dtype and the
    window alone (a recording stand-in for the library, so this runs on any host): rows
    sharing the prefix by cascade, the row that does not by the per-row kernel."""
    calls = []
    ops = ("paged_decode", "paged_prefill_", "paged_prefill_amx_", "cascade_decode_amx_")

    def recorder(name):
        def op(*args):
            calls.append(name)
            return torch.zeros(args[0].shape, dtype=args[0].dtype)
        return op

    kernels = SimpleNamespace(**{name: recorder(name) for name in ops})
    caps = CpuCapabilities(isa="avx512", amx=amx, ops=frozenset(ops), kernels=kernels)
    backend = TorchAttentionBackend(9, 3, head_dim, 16, kernels=caps)
    q, k_pool, v_pool, tables, lens = make_step(20, [5, 30, 17, 64, 1], [100], 16, 3, 3, 64)
    q = torch.zeros(q.shape[0], 9, head_dim, dtype=dtype)
    inputs = decode_inputs(tables, lens)
    nothing = torch.zeros(0, 3, head_dim, dtype=dtype)
    pool = torch.zeros(3, k_pool.shape[1], head_dim, dtype=dtype)
    backend.forward(q, nothing, nothing, pool, pool, backend.prepare(inputs), window)
    assert calls == expected
