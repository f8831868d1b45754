"""The decoder's steps between matmuls as fused Triton kernels (CUDA), behind the
interface of `models.ops.DecoderOps` (plain torch, the CPU path and the reference).

The runner hands this to the model when attention runs on the Triton backend, which
also fuses RoPE into its KV store (`rotary_kv_store.py`). Per layer that takes the
steps between matmuls from about a dozen kernels to four.
"""

from __future__ import annotations

import torch

from gpu.triton.rms_norm import add_rms_norm, rms_norm
from gpu.triton.silu_and_mul import silu_and_mul
from models.ops import DecoderOps


class TritonDecoderOps(DecoderOps):
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)
