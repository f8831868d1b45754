"""SiLU-and-multiply: the gated MLP's activation, one kernel instead of two.

`gate_up` is the fused gate/up projection's output, [T, 2I]: the first I columns are
the gate, the rest the up projection. Unfused, SiLU writes [T, I] and the multiply
reads it back. Rounding follows `models.ops.DecoderOps`: SiLU is rounded to the
dtype, then the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_g, stride_o, inter,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(gate_up_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * stride_g + inter + offs, mask=mask, other=0.0)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs,
             (silu * up.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter)
    assert rows.stride(-1) == 1
    out = torch.empty(rows.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, BLOCK))](
            rows, out, rows.stride(0), out.stride(0), inter, BLOCK=BLOCK, num_warps=4)
    return out.view(*gate_up.shape[:-1], inter)
