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
  bias) with blocks of a format the call knows (`FORMATS`: Q4_1, and Q8_16, a Q6_K's)
  or a `SplitLinear` of such parts (a K-quant mix's q and k beside a v of another
  type), one route plan per format, no q/k norm, no sliding window, one norm epsilon;
- the step: decode only (one new token per sequence, every row of the batch), a row
  count each format's linears send to their blocks (`ROUTES`: the bf16 dot-product
  kernel, the blocks' exact kernel, AMX, the int8 kernel; not oneDNN's packed weight
  nor the unpacked route), where the attention backend says its `forward` would take
  only its C++ paths (`one_call_decode`: RoPE fused with the KV store, `paged_decode`,
  or cascade attention where the rows share a prefix of blocks), with a bf16 KV pool.
"""

from __future__ import annotations

import torch
from torch import nn

from gpu.cpu.linear import PackedLinear
from gpu.cpu.packing import SplitLinear
from gpu.cpu.routing import Route

# The routes the fused call takes, by the code `decode_layers.cpp` reads, and where
# `PackedLinear` binds each route's kernel arguments (its tensors, then N).
ROUTES = {Route.BLOCKS_BF16: (0, "_dot_args"), Route.BLOCKS: (1, "_quantized_args"),
          Route.AMX: (2, "_amx_args"), Route.BLOCKS_INT8: (3, "_int8_args")}
# The blocks' formats it takes, by the code `decode_layers.cpp` reads.
FORMATS = {"q4_1": 0, "q8_16": 1}
ARGS = 3  # a part's tensors for a route's kernel (N apart)


class LayerCall:
    """A model's `DecodeWeights` for `decode_layers_bf16`, bound once: each layer's two
    norm weights then the final norm's; per linear (qkv, o, gate_up, down, in layer
    order) its parts' count, and per part its format and N; per route each part's kernel
    arguments as `PackedLinear` binds them (empty tensors where it has none)."""

    def __init__(self, op, model: nn.Module, norms: list[torch.Tensor],
                 linears: list[list[PackedLinear]]):
        self.op = op
        parts = [part for linear in linears for part in linear]
        # Each format's plan (`of` checks that its parts share one).
        self.plans = {FORMATS[p.quantized.format]: p.plan for p in parts}
        none = (torch.empty(0),) * ARGS
        by_code = {code: [t for p in parts for t in (getattr(p, attr)[:-1] or none)]
                   for code, attr in ROUTES.values()}
        # The routes every part of a format has arguments for, by format.
        self.codes = {f: {route: code for route, (code, attr) in ROUTES.items()
                          if all(getattr(p, attr) for p in parts
                                 if FORMATS[p.quantized.format] == f)}
                      for f in self.plans}
        self.weights = torch.classes.ridgeline_cpu.DecodeWeights(
            norms, model.norm.eps, [len(linear) for linear in linears],
            [FORMATS[p.quantized.format] for p in parts], [p.out_features for p in parts],
            model.config.num_heads, *(by_code[code] for code in range(len(ROUTES))))
        self._by_rows: dict[int, list[int] | None] = {}

    def route(self, rows: int) -> list[int] | None:
        """Each format's route code for a step of `rows` rows (by `FORMATS`' code; 0 for
        a format the model has none of), or None: a route some format does not take."""
        if rows not in self._by_rows:
            codes = {f: self.codes[f].get(plan.route(rows)) for f, plan in self.plans.items()}
            self._by_rows[rows] = (None if None in codes.values()
                                   else [codes.get(f, 0) for f in range(len(FORMATS))])
        return self._by_rows[rows]

    @classmethod
    def of(cls, model: nn.Module, op) -> LayerCall | None:
        """The call for `model`, or None where some layer is not one it takes."""
        if op is None or model.embed_tokens.weight.dtype != torch.bfloat16:
            return None
        norms, linears = [], []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if attn.q_norm is not None or attn.sliding_window is not None:
                return None
            for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                parts = list(linear.parts) if type(linear) is SplitLinear else [linear]
                if not all(type(p) is PackedLinear and p.quantized is not None
                           and p.quantized.format in FORMATS for p in parts):
                    return None
                linears.append(parts)
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
        norms.append(model.norm)
        parts = [p for linear in linears for p in linear]
        if len({n.eps for n in norms}) != 1 \
                or len({(p.quantized.format, p.plan) for p in parts}) \
                != len({p.quantized.format for p in parts}):
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
