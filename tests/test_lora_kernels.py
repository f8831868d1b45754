"""The per-row LoRA kernels (`gpu/triton/lora.py`) against their torch reference.

Under TRITON_INTERPRET=1 on CPU (conftest.py), natively on the GPU machine. The slots'
pairs are fused the way `models/lora.py` fuses an adapter's parts (A stacked, B
block-diagonal), so the per-slice spans the kernel reads are checked against the
reference's plain product with the whole B. The ranks past a slot's own are NaN here
(zeros in service): a kernel that read them would fail loudly. Batches mix several
slots, rows without an adapter (slot -1), a slot whose adapter leaves the linear alone
(rank 0), and ranks wider than one rank block.
"""

from __future__ import annotations

import pytest
import torch

from gpu.triton.lora import add_lora, rank_spans
from gpu.triton.reference import add_lora_ref
from models.lora import Target, _fuse

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}
DTYPES = pytest.mark.parametrize("dtype", list(TOLERANCES), ids=["fp32", "fp16", "bf16"])
IN = 600  # crosses the shrink's 128-feature blocks and its 512-feature split
QKV = [(0, 64), (64, 32), (96, 32)]  # a fused qkv's slices: q, k, v
MAX_RANK = 8


class Stack:
    """One linear's slots as `LoRALinear` holds them, and the kernel's tables."""

    def __init__(self, slots: int, rank_budget: int, out: int, slices, dtype):
        self.A = torch.full((slots, rank_budget, IN), float("nan"), dtype=dtype)
        self.Bt = torch.full((slots, rank_budget, out), float("nan"), dtype=dtype)
        self.ranks = [0] * slots
        self.spans = [[(0, 0)] * len(slices) for _ in range(slots)]
        self.slices, self.dtype = slices, dtype

    def write(self, slot: int, parts: dict[int, int], seed: int) -> None:
        """`parts`: slice index -> the rank of that part's adapter (absent: not adapted)."""
        g = torch.Generator().manual_seed(seed)
        fused = [(Target("m", *self.slices[p]), torch.randn(r, IN, generator=g) * 0.1,
                  torch.randn(self.slices[p][1], r, generator=g) * 0.1)
                 for p, r in parts.items()]
        a, b = _fuse(fused, self.Bt.shape[2], 0.5, self.dtype)
        r = a.shape[0]
        self.A[slot, :r], self.Bt[slot, :r] = a, b.T
        self.ranks[slot] = r
        self.spans[slot] = rank_spans(b.T, self.slices)

    def run(self, x, y, row_slots, kernel: bool):
        tensors = [t.to(DEVICE) for t in (y.clone(), x, self.A, self.Bt)]
        rows = torch.tensor(row_slots, dtype=torch.int32, device=DEVICE)
        ranks = torch.tensor(self.ranks, dtype=torch.int32, device=DEVICE)
        if not kernel:
            return add_lora_ref(*tensors, rows, ranks)
        spans = torch.tensor(self.spans, dtype=torch.int32, device=DEVICE)
        slices = torch.tensor(self.slices, dtype=torch.int32, device=DEVICE)
        return add_lora(*tensors, rows, ranks, spans, slices, max(s for _, s in self.slices))


def batch(rows: int, out: int, dtype, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, IN, generator=g).to(dtype),
            torch.randn(rows, out, generator=g).to(dtype))


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


def fused_qkv(dtype) -> Stack:
    stack = Stack(4, 3 * MAX_RANK, 128, QKV, dtype)
    stack.write(0, {0: 8, 1: 3, 2: 5}, seed=10)  # every part, ranks below the budget
    stack.write(1, {1: 2}, seed=11)  # k alone: q and v read nothing
    stack.write(3, {0: 4, 2: 8}, seed=13)  # slot 2 stays empty: rank 0
    return stack


@DTYPES
def test_mixed_batch_of_a_fused_linear_matches_the_reference(dtype):
    stack = fused_qkv(dtype)
    row_slots = [0, -1, 1, 2, 0, 3, -1, 3, 1]
    x, y = batch(len(row_slots), 128, dtype)
    got = stack.run(x, y, row_slots, kernel=True)
    want = stack.run(x, y, row_slots, kernel=False)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **TOLERANCES[dtype])
    untouched = [i for i, s in enumerate(row_slots) if s in (-1, 2)]
    assert torch.equal(got[untouched].cpu(), y[untouched])  # bit for bit: no delta added
    adapted = [i for i, s in enumerate(row_slots) if s in (0, 1, 3)]
    assert (got[adapted].cpu() != y[adapted]).any(dim=1).all()


def test_spans_cover_each_parts_ranks_and_nothing_else():
    stack = fused_qkv(torch.float32)
    assert stack.spans[0] == [(0, 8), (8, 11), (11, 16)]
    assert stack.spans[1] == [(0, 0), (0, 2), (0, 0)]
    assert stack.spans[2] == [(0, 0)] * 3
    assert stack.spans[3] == [(0, 4), (0, 0), (4, 12)]


@DTYPES
def test_one_slice_linear_with_a_rank_wider_than_a_rank_block(dtype):
    """Phi-3's fused checkpoint, or o/down: one slice; rank 20 spans two rank blocks."""
    stack = Stack(3, 24, 200, [(0, 200)], dtype)  # 200 outputs: two expand blocks
    stack.write(0, {0: 20}, seed=20)
    stack.write(2, {0: 1}, seed=22)
    row_slots = [2, 0, -1, 0, 0, 2]
    x, y = batch(len(row_slots), 200, dtype, seed=3)
    got = stack.run(x, y, row_slots, kernel=True)
    torch.testing.assert_close(got.float(), stack.run(x, y, row_slots, kernel=False).float(),
                               **TOLERANCES[dtype])


def test_an_empty_batch_and_a_batch_of_the_base_alone():
    stack = fused_qkv(torch.float32)
    x, y = batch(0, 128, torch.float32)
    assert stack.run(x, y, [], kernel=True).shape == (0, 128)
    x, y = batch(3, 128, torch.float32)
    assert torch.equal(stack.run(x, y, [-1, -1, -1], kernel=True).cpu(), y)


def test_row_slots_longer_than_the_batch_are_read_only_up_to_its_rows():
    """A graph's static buffer holds the largest bucket's rows; a step reads its own."""
    stack = fused_qkv(torch.float32)
    x, y = batch(2, 128, torch.float32)
    got = stack.run(x, y, [3, 0, 1, 1, 1], kernel=True)
    torch.testing.assert_close(got, stack.run(x, y, [3, 0], kernel=False))


@needs_cuda
def test_a_cuda_graph_replays_new_slots_and_new_weights():
    """Captured once; the row slots and a slot's weights change in place between replays."""
    dtype = torch.bfloat16
    stack = fused_qkv(dtype)
    x, y = batch(4, 128, dtype)
    dev = {name: getattr(stack, name).to(DEVICE) for name in ("A", "Bt")}
    rows = torch.tensor([0, 1, -1, 3], dtype=torch.int32, device=DEVICE)
    tables = [torch.tensor(t, dtype=torch.int32, device=DEVICE)
              for t in (stack.ranks, stack.spans, stack.slices)]
    xs, ys, out = x.to(DEVICE), y.to(DEVICE), y.to(DEVICE).clone()

    def step():
        out.copy_(ys)
        add_lora(out, xs, dev["A"], dev["Bt"], rows, *tables, 64)

    step()  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for slots in ([0, 1, -1, 3], [3, -1, 0, 0], [-1] * 4):
        rows.copy_(torch.tensor(slots, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        want = stack.run(x, y, slots, kernel=False)
        torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[dtype])
    stack.write(1, {0: 6, 2: 2}, seed=99)  # another adapter takes slot 1
    dev["A"].copy_(stack.A)
    dev["Bt"].copy_(stack.Bt)
    for t, values in zip(tables, (stack.ranks, stack.spans, stack.slices)):
        t.copy_(torch.tensor(values, dtype=torch.int32))
    rows.copy_(torch.tensor([1, 1, 0, -1], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    want = stack.run(x, y, [1, 1, 0, -1], kernel=False)
    torch.testing.assert_close(out.float(), want.float(), **TOLERANCES[dtype])
