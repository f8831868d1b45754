"""The decoder's small steps between matmuls, in plain torch.

The residual add joined with the next RMSNorm, and SiLU-and-multiply. The CPU path
runs exactly these; they are also the references of the fused Triton kernels the model
thread installs on CUDA (`gpu/triton/decoder_ops.py`, same signatures), which do each
step in one kernel instead of two or three. The model holds one `DecoderOps` object,
chosen once when it is built, so no call site branches on the device.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class DecoderOps:
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # torch's fused kernel accumulates in fp32; one op instead of six per norm.
        return F.rms_norm(x, weight.shape, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(RMSNorm(residual + x), residual + x): a pre-norm block's join with the next
        block's norm. A fused version may update `residual` in place."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up for `gate_up` = [gate | up] along the last dim."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def decode_layers(self, model, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      ctx) -> torch.Tensor | None:
        """`model`'s decoder layers and final norm over `x` (its embeddings) in one fused
        call, where these ops have one for this step (the C++ CPU path's one-user decode:
        `gpu/cpu/layer_call.py`); None: the model runs its layers."""
        return None
