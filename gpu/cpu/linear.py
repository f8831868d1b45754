"""CPU linear layers: a GGUF's blocks read in place, or weights pre-packed for oneDNN.

`PackedLinear` holds what its routes need; which route a call takes is the policy of
`gpu/cpu/routing.py` (`choose_route`), on the `CpuCapabilities` the runner resolved at
load; which layers get what is `gpu/cpu/packing.py`'s.

Quantized checkpoints (a GGUF's blocks, `models/gguf_blocks.py`): the blocks' values are
the float32 checkpoint's bit for bit, and a decode step streams every weight once, so
for few rows reading ~0.6-1.3 bytes a weight instead of 2 or 4 is most of the step's
cost. Such a layer holds its blocks alone where the kernels can unpack them (`blocks_only`):
calls of few rows read the blocks in place (the exact kernel, the bf16 dot product, the
AMX tile unit), calls of more rows widen slices of them into scratch for oneDNN
(`Route.UNPACKED`), and no dense copy exists. Where every call takes the blocks (int8
activations) none is needed either.

Layers without blocks (an HF checkpoint): oneDNN's packed weight (unpacked, the matmul
library re-blocks the weight on every call; packed at load time it does not), and for
fp32 the plain weight for calls of one to three rows. bf16 on a CPU without bf16
arithmetic (AVX2: oneDNN cannot pack bf16 there, and torch's bf16 matmul runs at a
fraction of fp32's rate): the layer is widened, multiplying in float32 with bf16 in and
out. The blocks' calls multiply the GGUF's exact values where oneDNN multiplies them
rounded to bf16, so a request's tokens can differ between a step of few rows and a
larger one, as they can between batch sizes in any engine whose kernels change with the
shape.

Results match `F.linear` to rounding. Without oneDNN or the C++ kernels the layers stay
plain `nn.Linear` or take only the routes that exist, so correctness never depends on
them.
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F
from torch import nn

from gpu.cpu import routing
from gpu.cpu.capabilities import CpuCapabilities, onednn
from gpu.cpu.panel_blocks import PANEL, PanelBlocks, dequantized
from gpu.cpu.routing import AMX_ROWS, PACKED_MIN_ROWS, LinearLayer, Route, RoutePlan, plan_routes
from models.gguf_blocks import QuantizedWeight

__all__ = ["AMX_ROWS", "PACKED_MIN_ROWS", "PackedLinear", "multiply_dtype",
           "quantized_max_rows"]


# Weights widened per slice of a `Route.UNPACKED` call: a scratch buffer of 8 MB in bf16,
# reused by every layer (the model thread runs one call at a time).
_UNPACK_ELEMENTS = 1 << 22
_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    """A [rows, cols] view of the model thread's scratch buffer for `dtype`, grown as
    needed."""
    buffer = _SCRATCH.get(dtype)
    if buffer is None or buffer.numel() < rows * cols:
        buffer = _SCRATCH[dtype] = torch.empty(rows * cols, dtype=dtype)
    return buffer[:rows * cols].view(rows, cols)


def quantized_max_rows(kernels, dtype: torch.dtype = torch.float32) -> dict[str, int] | None:
    """Rows per format up to which the kernels' blocks beat oneDNN for layers that multiply
    in `dtype` (None: never). `kernels`: `CpuCapabilities`, or the library's ops."""
    return routing.quantized_max_rows(CpuCapabilities.of(kernels), dtype)


def _packing_available() -> bool:
    return onednn()[0]


def multiply_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the packed linears of a `dtype` model multiply in on this CPU: float32
    for bf16 where the CPU has no bf16 arithmetic."""
    return routing.multiply_dtype(dtype, CpuCapabilities.of(None))


def _plan(dtype: torch.dtype, blocks: str | None, capabilities: CpuCapabilities,
          int8_activations: bool, widen: bool, amx: bool, blocks_only: bool) -> RoutePlan:
    """A layer's routes, the policy seeing the CPU as the caller asked for it: widened or
    not, AMX or not."""
    asked = dataclasses.replace(capabilities, bf16_arithmetic=not widen,
                                onednn_packing=True, amx=amx and capabilities.amx)
    return plan_routes(LinearLayer(dtype, blocks, int8_activations, blocks_only), asked)


def holds_pairs(plan: RoutePlan, fmt: str) -> bool:
    """Whether a layer with `plan` over `fmt` blocks holds Q4_1's levels regrouped as
    `dot_pairs`: for the bf16 dot kernel or the Q4_1 AMX kernel, or where the int8 kernel
    takes every call (`--int8-activations`; it reads them on AVX512-VNNI and AVX2 alike,
    int8_pairs.h). Its other blocks' calls then read them too (`q4_1_linear` takes either
    layout, q4_1_pairs.h)."""
    every_call_int8 = plan.blocks_route == Route.BLOCKS_INT8 \
        and plan.blocks_max_rows == sys.maxsize
    return fmt == "q4_1" and (plan.dot_max_rows > 0 or plan.amx_rows is not None
                              or every_call_int8)


def reads_panel_levels(plan: RoutePlan, fmt: str) -> bool:
    """Whether some call of a layer with `plan` over `fmt` blocks reads the panels' levels:
    not where the pairs serve every call (int8 for every call; bf16 with AVX512-BF16 or
    AMX where the blocks are held alone and no call gets to the unpacked route)."""
    if not holds_pairs(plan, fmt):
        return True
    covered = plan.blocks_max_rows == sys.maxsize or (
        plan.amx_rows is not None and plan.amx_rows.stop == sys.maxsize)
    alone = plan.unpacked or plan.blocks_route == Route.BLOCKS_INT8
    return not (alone and covered)


class PackedLinear(nn.Module):
    """A bias-free linear layer holding the weights of the routes its calls can take
    (`routing.plan_routes`): oneDNN's packed weight, the GGUF's blocks in the kernels'
    panel layout, the plain weight.

    `widen` (a bf16 weight on a CPU without bf16 arithmetic, where oneDNN cannot pack
    bf16): the layer multiplies in float32, bf16 in and bf16 out, as a bf16 matmul does
    (products accumulated in float32, the sum rounded once). Its float32 weight is the
    checkpoint's: the GGUF blocks' exact values where it has them (the same values as the
    blocks' own calls), else the bf16 weight widened. `amx`: a bf16 layer's Q4_1 or
    Q8_0 blocks on the tile unit where the capabilities have it. `pack_linears` decides
    both from the `CpuCapabilities`; a layer built directly takes neither unless asked."""

    def __init__(self, weight: torch.Tensor, batch_hint: int = 64,
                 quantized: QuantizedWeight | PanelBlocks | None = None, kernels=None,
                 int8_activations: bool = False, widen: bool = False, amx: bool = False,
                 float32: torch.Tensor | None = None, blocks_only: bool = False):
        """`quantized`: the weight's blocks in row order, or laid out already
        (`PanelBlocks.read`, which `pack_linears` uses only where this layer needs no
        row order). `kernels`: `CpuCapabilities`, or the library's ops (None: no C++
        kernels). `float32`: a widened layer's float32 weight where the caller has it (the
        checkpoint's, which holds the blocks' values); else it is dequantized from the
        blocks or widened from `weight`. `blocks_only`: hold no dense copy where the
        kernels can unpack the blocks for the calls that would read one (`weight` is
        then read for its shape and dtype only: its values may never have been loaded)."""
        super().__init__()
        capabilities = CpuCapabilities.of(kernels)
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        self.widen = widen and weight.dtype == torch.bfloat16
        self.io_dtype = weight.dtype  # what calls pass in and get back
        plan = _plan(weight.dtype, quantized.format if quantized is not None else None,
                     capabilities, int8_activations, self.widen, amx,
                     blocks_only and quantized is not None)
        narrow = weight if self.widen else None
        # Calls past the blocks' kernels: the blocks unpacked per call, in this dtype.
        self._unpack_op = (capabilities.op(f"{quantized.format}_unpack")
                           if plan.unpacked else None)
        self._unpack_dtype = torch.float32 if self.widen else weight.dtype
        if self.widen and plan.packed:
            weight = (float32 if float32 is not None
                      else dequantized(quantized, capabilities) if quantized is not None
                      else weight.float())
        self.quantized = (PanelBlocks.of(quantized)
                          if plan.blocks or plan.amx_rows is not None else None)
        self.packed = (torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
                       if plan.packed else None)
        suffix = "_int8" if plan.blocks_route == Route.BLOCKS_INT8 else ""
        self._quantized_op = (capabilities.op(f"{quantized.format}_linear{suffix}")
                              if plan.blocks else None)
        self.quantized_max_rows = plan.blocks_max_rows
        # Calls of many rows on a CPU without AMX, or of the fewest rows where only those
        # gain (`INT8_ONLY_MAX_ROWS`): the int8 kernel, same arguments.
        self._int8_min_rows = plan.int8_min_rows or sys.maxsize
        self._int8_max_rows = plan.int8_max_rows
        self._int8_op = (capabilities.op(f"{quantized.format}_linear_int8")
                         if plan.int8_min_rows or plan.int8_max_rows else None)
        # bf16 calls of the fewest rows: the AVX512-BF16 dot-product kernel, same blocks.
        self._dot_max_rows = plan.dot_max_rows
        self._dot_op = (capabilities.op(f"{quantized.format}_linear_bf16")
                        if plan.dot_max_rows else None)
        self.amx_rows = plan.amx_rows
        self._amx_op = (capabilities.op(f"{quantized.format}_linear_amx")
                        if plan.amx_rows is not None else None)
        # Q4_1's levels regrouped (`dot_pairs`) for the dot kernel and the Q4_1 AMX
        # kernel, one copy for every kernel of the layer's calls (the exact and int8
        # ones read it too); the panels' bytes once more only where the unpacked route
        # can still be reached. Q8_0's AMX kernel reads the panels. Beside them a
        # Q4_K's scale codes where the blocks have them, else float32 scales.
        pairs = (self.quantized.dot_pairs(capabilities)
                 if quantized is not None and holds_pairs(plan, quantized.format) else None)
        # The ops' block arguments, bound once rather than per call: where the layer
        # holds the pairs, the exact kernel reads them too.
        paired = (() if pairs is None
                  else (pairs, *self.quantized.paired_scales, self.out_features))
        self._quantized_args = (() if self.quantized is None else paired
                                or (*self.quantized.tensors, self.out_features))
        self._dot_args = (paired or self._quantized_args) if plan.dot_max_rows else ()
        self._int8_args = self._quantized_args if self._int8_op is not None or suffix else ()
        self._amx_args = paired or self._quantized_args
        self.dot_pairs = pairs
        # Few rows without blocks: the plain weight, in the calls' dtype (a bf16 one
        # streams half the bytes, and torch's one-row bf16 product is as fast as fp32's).
        self.plain = (None if not plan.plain_below else narrow if self.widen else weight)
        self._plain_below = plan.plain_below
        self.plan = plan
        # Where the pairs serve every call (bf16 with the blocks held alone), nothing reads
        # the panels' levels, only their scales and minimums (or codes in their place):
        # the pairs hold the same bytes, so these go.
        if self.quantized is not None and not reads_panel_levels(plan, quantized.format):
            self.quantized = self.quantized.without_levels()

    @property
    def block_max_rows(self) -> int:
        """Calls of up to this many rows read the blocks (widened, or on AMX)."""
        return self.amx_rows.stop - 1 if self.amx_rows is not None else self.quantized_max_rows

    @property
    def read_bytes(self) -> int:
        """Bytes a call of few rows reads: the dot kernel's arguments where it takes them,
        else the panels."""
        if self._dot_args:
            return sum(t.nbytes for t in self._dot_args[:-1])
        return 0 if self.quantized is None else self.quantized.nbytes

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds: packed copy, blocks (with their dot-product pairs),
        plain weight."""
        packed = 0 if self.packed is None else self.packed.numel() * self.packed.element_size()
        blocks = 0 if self.quantized is None else self.quantized.nbytes
        blocks += self.dot_pairs.nbytes if self.dot_pairs is not None else 0
        plain = 0 if self.plain is None else self.plain.numel() * self.plain.element_size()
        return packed + blocks + plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # `self.plan.route(rows)`, inlined: a decode step makes ~100 of these calls.
        if x.dim() == 2 and x.shape[0] <= self.quantized_max_rows:  # a decode step's call
            return self._blocks(x)
        rows = x.numel() // x.shape[-1]
        if rows <= self.quantized_max_rows or rows >= self._int8_min_rows:
            out = self._blocks(x.reshape(rows, self.in_features))
            return out.view(*x.shape[:-1], self.out_features)
        if self.amx_rows is not None and rows in self.amx_rows:
            out = self._amx_op(x.reshape(rows, self.in_features), *self._amx_args)
            return out.view(*x.shape[:-1], self.out_features)
        if self._unpack_op is not None:
            out = self._unpacked(x.reshape(rows, self.in_features))
            return out.view(*x.shape[:-1], self.out_features)
        if rows < self._plain_below:
            return F.linear(x, self.plain)
        if self.widen:
            return self._packed(x.float()).to(self.io_dtype)
        return self._packed(x)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        # bf16 x too: the kernels widen it, multiply in float32 and round the sums once.
        if x.shape[0] <= self._dot_max_rows:
            return self._dot_op(x, *self._dot_args)
        if x.shape[0] <= self._int8_max_rows or x.shape[0] >= self._int8_min_rows:
            return self._int8_op(x, *self._quantized_args)
        return self._quantized_op(x, *self._quantized_args)

    def _unpacked(self, x: torch.Tensor) -> torch.Tensor:
        """x @ W.T from the blocks: slices of panels widened into scratch (`[K, width]`,
        W.T's columns) and multiplied by oneDNN, each into its columns of the output."""
        dtype, n, k = self._unpack_dtype, self.out_features, self.in_features
        xin = x if x.dtype == dtype else x.to(dtype)
        out = torch.empty(x.shape[0], n, dtype=dtype)
        panels = self.quantized.tensors[0].shape[0]
        step = max(1, _UNPACK_ELEMENTS // (k * PANEL))  # panels per slice
        for p0 in range(0, panels, step):
            p1 = min(panels, p0 + step)
            wt = _scratch(dtype, k, (p1 - p0) * PANEL)
            self._unpack_op(*self.quantized.tensors, p0, p1, wt)
            n0, n1 = p0 * PANEL, min(n, p1 * PANEL)
            if p0 == 0 and p1 == panels:
                torch.mm(xin, wt[:, :n1], out=out)
            else:
                out[:, n0:n1] = xin @ wt[:, :n1 - n0]
        return out if dtype == self.io_dtype else out.to(self.io_dtype)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")
