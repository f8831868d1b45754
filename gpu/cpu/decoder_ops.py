"""The decoder's steps between matmuls through the C++ CPU kernels (`decoder_ops.cpp`),
behind the interface of `models.ops.DecoderOps` (plain torch, the reference).

The runner hands this to the model on CPU when the kernels are built: each norm, each
residual add with its norm becomes one call instead of six or seven torch ops, which at
decode batch sizes is where a step's time between matmuls goes (RoPE joins the KV
store in the attention backend); SiLU-and-mul is one pass instead of two (at one
thread, where a one-row call is mostly the cost of calling). Shapes or dtypes the
kernels do not take fall back to the reference.
"""

from __future__ import annotations

import torch

from gpu.cpu.capabilities import CpuCapabilities
from gpu.cpu.layer_call import LayerCall
from models.ops import DecoderOps

DTYPES = (torch.float32, torch.bfloat16)


class CpuDecoderOps(DecoderOps):
    def __init__(self, kernels):
        """`kernels`: `CpuCapabilities` with the library loaded, or the library's ops."""
        capabilities = CpuCapabilities.of(kernels)
        self.kernels = capabilities.kernels  # torch.ops.ridgeline_cpu
        self._layers_op = capabilities.op("decode_layers_bf16")
        self.layer_call_built = self._layers_op is not None
        self.fuses_layers = self.layer_call_built
        self.layer_calls = 0
        self._calls: dict[int, LayerCall | None] = {}  # by id(model), at its first forward

    @staticmethod
    def _takes(x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.dtype in DTYPES and x.stride(-1) == 1

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not self._takes(x):
            return super().rms_norm(x, weight, eps)
        return self.kernels.rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self._takes(x) and self._takes(residual)):
            return super().add_rms_norm(x, residual, weight, eps)
        return self.kernels.add_rms_norm_(x, residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if not self._takes(gate_up):
            return super().silu_and_mul(gate_up)
        return self.kernels.silu_and_mul(gate_up)

    def decode_layers(self, model, x, rope, ctx) -> torch.Tensor | None:
        if not self.fuses_layers:
            return None
        key = id(model)
        if key not in self._calls:
            self._calls[key] = LayerCall.of(model, self._layers_op)
        call = self._calls[key]
        args = call.decode_args(x, ctx) if call is not None else None
        if args is None:
            return None
        self.layer_calls += 1
        return call(x, rope, ctx, args)
