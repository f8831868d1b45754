"""A decode step's decoder layers in one C++ call (`kernels/decode_layers.cpp`), where
it applies; the module path otherwise.

At one user a decode step's layers are a few hundred kernel calls of a few
microseconds each, and in the module path each sits behind Python: nn.Module calls,
`PackedLinear`'s routing, the attention backend's per-layer work, the views and
splits between the ops. The fused call runs the same kernels in the same order from
C++, so its hidden states are the module path's bit for bit.

It applies to a step where all of these hold, and the module path runs the rest:
- the model (checked once, at its first forward, after its linears are packed): bf16,
  every layer's qkv, o, gate_up and down a bare `PackedLinear` (no LoRA wrapper, no
  bias) with Q4_1 blocks and one route plan for all of them, no q/k norm, no sliding
  window, one norm epsilon;
- the step: decode only (one new token per sequence, every row of the batch), a row
  count the linears send to their blocks (`ROUTES`: the bf16 dot-product kernel, the
  widened blocks, AMX; not oneDNN's packed weight), where the attention backend says
  its `forward` would take only its C++ paths (`one_call_decode`: RoPE fused with the
  KV store, `paged_decode`, or cascade attention where the rows share a prefix of
  blocks), with a bf16 KV pool.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu.cpu.linear import PackedLinear
from gpu.cpu.routing import Route

# The routes the fused call takes, by the code `decode_layers.cpp` reads, and where
# `PackedLinear` binds each route's kernel arguments (its tensors, then N).
ROUTES = {Route.BLOCKS_BF16: (0, "_dot_args"), Route.BLOCKS: (1, "_quantized_args"),
          Route.AMX: (2, "_amx_args")}


class LayerCall:
    """A model's `DecodeWeights` for `decode_layers_bf16`, bound once: each layer's two
    norm weights then the final norm's, and per route the linears' kernel arguments as
    `PackedLinear` binds them, in layer order (qkv, o, gate_up, down)."""

    def __init__(self, op, model: nn.Module, norms: list[torch.Tensor],
                 linears: list[PackedLinear]):
        self.op = op
        self.plan = linears[0].plan  # every linear's (`of` checks)
        by_code = {code: [t for layer in linears for t in getattr(layer, attr)[:-1]]
                   if all(getattr(layer, attr) for layer in linears) else []
                   for code, attr in ROUTES.values()}
        self.codes = {route: code for route, (code, _) in ROUTES.items() if by_code[code]}
        self.weights = torch.classes.ridgeline_cpu.DecodeWeights(
            norms, model.norm.eps, [layer.out_features for layer in linears],
            model.config.num_heads, *(by_code[code] for code in range(len(ROUTES))))
        self._by_rows: dict[int, int | None] = {}

    def route(self, rows: int) -> int | None:
        """The route code of a step of `rows` rows, or None (a route it does not take)."""
        if rows not in self._by_rows:
            self._by_rows[rows] = self.codes.get(self.plan.route(rows))
        return self._by_rows[rows]

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
                    or not all(type(p) is PackedLinear and p.quantized is not None
                               and p.quantized.format == "q4_1" for p in parts):
                return None
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            linears += parts
        norms.append(model.norm)
        if len({n.eps for n in norms}) != 1 or len({p.plan for p in linears}) != 1:
            return None
        return cls(op, model, [n.weight for n in norms], linears)

    def decode_args(self, x: torch.Tensor, ctx) -> tuple | None:
        """The attention metadata the fused call reads (slot_mapping, block_tables,
        context_lens, then the shared prefix's pieces: `one_call_decode`) where it takes
        this step (`x` its embeddings, `ctx` its `StepContext`), else None."""
        backend = getattr(ctx, "backend", None)  # the model thread's StepContext on CPU
        if backend is None or self.route(x.shape[0]) is None \
                or ctx.k_caches[0].dtype != torch.bfloat16:
            return None
        return backend.one_call_decode(ctx.meta)

    def __call__(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx,
                 decode_args: tuple) -> torch.Tensor:
        """The final hidden states [T, hidden] (the module path's `forward` result); `x`,
        the embeddings, becomes the residual stream, updated in place as there."""
        backend = ctx.backend
        return self.op(self.weights, x, self.route(x.shape[0]), *rope, ctx.k_caches,
                       ctx.v_caches, *decode_args, backend.block_size, backend.scale)
