"""A decode step's decoder layers in one C++ call (`kernels/decode_layers.cpp`), where
it applies; the module path otherwise.

At one user a decode step's layers are a few hundred kernel calls of a few
microseconds each, and in the module path each sits behind Python: nn.Module calls,
`PackedLinear`'s routing, the attention backend's per-layer work, the views and
splits between the ops. The fused call runs the same kernels in the same order from
C++, so its hidden states are the module path's bit for bit.

It applies to a step where all of these hold, and the module path runs the rest:
- the model (checked once, at its first forward, after its linears are packed): bf16,
  every layer's qkv, o, gate_up and down a bare `PackedLinear` with the bf16
  dot-product kernel (no LoRA wrapper, no bias), no q/k norm, no sliding window, one
  norm epsilon;
- the step: decode only (one new token per sequence, every row of the batch), no more
  rows than the linears send to the dot-product kernel, through the C++ paths of
  `TorchAttentionBackend` (RoPE fused with the KV store, `paged_decode`; no cascade
  prefix this step), with a bf16 KV pool.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu.attention.base import StepContext
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.cpu.linear import PackedLinear


class LayerCall:
    """A model's arguments of `decode_layers_bf16`, bound once: each layer's two norm
    weights then the final norm's, each linear's kernel arguments as `PackedLinear`
    binds them (`_dot_args`: its tensors, then N)."""

    def __init__(self, op, model: nn.Module, norms: list[torch.Tensor],
                 linears: list[PackedLinear]):
        self.op = op
        self.norms = norms
        self.eps = model.norm.eps
        self.num_heads = model.config.num_heads
        self.linears = [t for layer in linears for t in layer._dot_args[:-1]]
        self.out_features = [layer._dot_args[-1] for layer in linears]
        # Rows every linear sends to the dot-product kernel.
        self.max_rows = min(layer._dot_max_rows for layer in linears)

    @classmethod
    def of(cls, model: nn.Module, op) -> LayerCall | None:
        """The call for `model`, or None where some layer is not one it takes."""
        if op is None or model.embed_tokens.weight.dtype != torch.bfloat16:
            return None
        norms, linears = [], []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            parts = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if attn.q_norm is not None or attn.sliding_window is not None \
                    or not all(type(p) is PackedLinear and p._dot_max_rows > 0 for p in parts):
                return None
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            linears += parts
        norms.append(model.norm)
        if len({n.eps for n in norms}) != 1:
            return None
        return cls(op, model, [n.weight for n in norms], linears)

    def applies(self, x: torch.Tensor, ctx) -> bool:
        """Whether this step, `x` its embeddings, is one the fused call takes."""
        if x.shape[0] > self.max_rows or type(ctx) is not StepContext:
            return False
        backend = ctx.backend
        if type(backend) is not TorchAttentionBackend or backend.kernels is None \
                or not backend.fuses_rotary:
            return False
        groups = ctx.meta.groups
        return (len(groups) == 1 and groups[0].identity and groups[0].shared is None
                and ctx.k_caches[0].dtype == torch.bfloat16)

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                 ctx: StepContext) -> torch.Tensor:
        """The final hidden states [T, hidden] (the module path's `forward` result); `x`,
        the embeddings, becomes the residual stream, updated in place as there."""
        backend, meta = ctx.backend, ctx.meta
        group = meta.groups[0]
        return self.op(x, *rope, self.norms, self.eps, self.linears, self.out_features,
                       ctx.k_caches, ctx.v_caches, meta.slot_mapping, group.block_tables,
                       group.context_lens, backend.block_size, backend.scale, self.num_heads)
