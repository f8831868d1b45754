"""RMSNorm, optionally fused with the residual add before it: one kernel, one pass.

A pre-norm decoder adds each block's output to the residual stream and normalises the
sum for the next block: unfused that is an add kernel and a norm kernel, the sum
written out and read back. Here one program per token row loads both, stores the new
residual (in place) and the normalised row.

Rounding follows `models.ops.DecoderOps` (torch and HF): the sum is rounded to the
input dtype, the norm is computed in fp32 and rounded, then multiplied by the weight
and rounded again; in fp32 only the order of the mean's summation differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    stride_x, stride_r, stride_o,
    n, eps,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(residual_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * stride_r + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * inv_rms).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty),
             mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> torch.Tensor:
    n = x.shape[-1]
    assert x.stride(-1) == 1 and weight.shape == (n,)
    rows = x.reshape(-1, n)
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, residual if residual is not None else rows, weight, out,
            rows.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
            n, eps,
            BLOCK=block, ADD_RESIDUAL=residual is not None,
            num_warps=min(16, max(1, block // 512)),
        )
    return out.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(residual + x), residual), `residual` updated in place to the sum."""
    assert residual.shape == x.shape and residual.stride(-1) == 1 and residual.dim() == 2
    return _launch(x, residual, weight, eps), residual
