"""The decoder's steps between matmuls in C++ on CPU (`decoder_ops.cpp`).

Same contract as `models.ops.DecoderOps`, the reference; dtypes the C++ does not take
(float16) and unusual shapes keep the reference. `add_rms_norm` updates `residual` in
place, as the contract allows.
"""

from __future__ import annotations

import torch

from models.ops import DecoderOps

KERNEL_DTYPES = (torch.float32, torch.bfloat16)


class CppDecoderOps(DecoderOps):
    def __init__(self, kernels):
        self.kernels = kernels  # torch.ops.ridgeline_cpu

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if x.dtype not in KERNEL_DTYPES or x.dim() != 2:
            return super().add_rms_norm(x, residual, weight, eps)
        return self.kernels.add_rms_norm(x, residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype not in KERNEL_DTYPES or gate_up.dim() != 2:
            return super().silu_and_mul(gate_up)
        return self.kernels.silu_and_mul(gate_up)
