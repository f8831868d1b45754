"""The C++ LoRA delta (`lora_delta_`) against the torch groups it stands in for: every
row's own adapter, ranks below the slot's size and zero, rows of a slot apart, widths
that leave vector tails, a strided x, float32 and bfloat16. (The engine's greedy ids
with the kernel, and without, against PEFT: tests/test_lora_offline.py.)"""

from __future__ import annotations

import pytest
import torch

from gpu.lora_linear import MAX_PARTS, expand_parts, plan_segments

kernels = pytest.importorskip("gpu.cpu.kernels.build").cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels.namespace, "lora_delta_"),
                                reason="the C++ CPU kernels are not built here")


def parts_of(Bt: torch.Tensor, ranks: torch.Tensor) -> torch.Tensor:
    """Each slot's expand parts, as `LoRALinear.write` tables them."""
    parts = torch.zeros(Bt.shape[0], MAX_PARTS, 4, dtype=torch.long)
    for slot, r in enumerate(ranks.tolist()):
        for i, part in enumerate(expand_parts(Bt[slot, :r])):
            parts[slot, i] = torch.tensor(part)
    return parts


def reference(y, x, A, Bt, rows_of_slot, ranks):
    """The torch groups' arithmetic, in float32."""
    out = y.float().clone()
    for slot, rows in rows_of_slot.items():
        r = int(ranks[slot])
        idx = torch.tensor(rows)
        out[idx] += (x.float()[idx] @ A[slot, :r].float().T) @ Bt[slot, :r].float()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("shape", [(72, 40, 24), (576, 960, 48), (5, 3, 2)])
def test_the_kernel_matches_the_torch_groups(dtype, shape, fused):
    k, o, R = shape
    g = torch.Generator().manual_seed(0)
    S, T = 5, 23
    A = (torch.randn(S, R, k, generator=g) * 0.1).to(dtype)
    Bt = (torch.randn(S, R, o, generator=g) * 0.1).to(dtype)
    if fused:  # block-diagonal, as a fused q/k/v's: each third of the ranks, its columns
        mask = torch.zeros(R, o, dtype=torch.bool)
        for i in range(3):
            mask[i * R // 3:(i + 1) * R // 3, i * o // 3:(i + 1) * o // 3] = True
        Bt = Bt * mask
    ranks = torch.tensor([R, R // 2, 0, 1, R], dtype=torch.long)
    wide = torch.randn(T, k + 7, generator=g).to(dtype)
    x = wide[:, 3:3 + k]  # rows apart in memory, as a view of a wider tensor gives them
    y = torch.randn(T, o, generator=g).to(dtype)
    rows_of_slot = {3: [0, 5, 6], 0: [1, 2, 3, 4, 7, 8, 22], 2: [9], 4: [10, 21], 1: [12]}
    want = reference(y, x, A, Bt, rows_of_slot, ranks)
    seg = plan_segments(rows_of_slot)
    got = y.clone()
    kernels.lora_delta_(got, x, A, Bt, seg.order, seg.starts, seg.slots, ranks,
                        parts_of(Bt, ranks))
    untouched = [r for r in range(T) if all(r not in v for v in rows_of_slot.values())]
    assert torch.equal(got[untouched], y[untouched])
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: y's one rounding
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_expand_parts_are_the_runs_of_rows_that_write_the_same_columns():
    bt = torch.zeros(6, 10)
    bt[0:2, 0:4] = 1
    bt[3:5, 4:10] = 1  # row 2 is all zero: left out
    bt[5, 6:8] = 1
    assert expand_parts(bt) == [(0, 2, 0, 4), (3, 5, 4, 10), (5, 6, 6, 8)]
    bt[2, 9] = 1  # four runs: more than MAX_PARTS, so the whole
    assert expand_parts(bt) == [(0, 6, 0, 10)]


def test_the_kernel_refuses_what_it_cannot_read():
    A, Bt = torch.zeros(2, 4, 8), torch.zeros(2, 4, 6)
    y, x = torch.zeros(3, 6), torch.zeros(3, 8)
    seg = plan_segments({1: [0, 2]})
    ranks = torch.tensor([4, 4])
    parts = torch.zeros(2, MAX_PARTS, 4, dtype=torch.long)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.lora_delta_(y, x, A, Bt, torch.tensor([0, 3]), seg.starts, seg.slots, ranks,
                            parts)
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.lora_delta_(y, x.bfloat16(), A, Bt, seg.order, seg.starts, seg.slots, ranks,
                            parts)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.lora_delta_(y, x, A, Bt, seg.order, seg.starts, seg.slots,
                            torch.tensor([4, 5]), parts)
    parts[1, 0] = torch.tensor([0, 4, 0, 7])  # columns beyond y's
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.lora_delta_(y, x, A, Bt, seg.order, seg.starts, seg.slots, ranks, parts)

