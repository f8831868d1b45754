"""CPU linear layers: weights pre-packed for oneDNN, and a GGUF's blocks for few rows.

Unpacked, the matmul library re-blocks the weight on every call; packed at load time
it does not. `PackedLinear` holds what its routes need (the packed weight, the GGUF's
blocks in the kernels' panel layout, the plain weight for calls of one to three rows);
which route a call takes is the policy of `gpu/cpu/routing.py` (`choose_route`), on the
`CpuCapabilities` the runner resolved at load.

Quantized checkpoints (a GGUF's Q4_1 / Q8_0 blocks, `models/gguf_blocks.py`): the blocks'
values are the float32 checkpoint's bit for bit, and a decode step streams every weight
once, so for few rows reading ~0.6 bytes a weight instead of 4 is most of the step's
cost; only the summation order differs from oneDNN's. Where every call takes the blocks
(int8 activations) no packed copy is kept; where the blocks serve few rows, fp32 layers
keep no plain weight either.

bf16 on a CPU without bf16 arithmetic (AVX2: oneDNN cannot pack bf16 there, and torch's
bf16 matmul runs at a fraction of fp32's rate): the layer is widened, multiplying in
float32 with bf16 in and out. bf16 on a CPU with it: oneDNN's packed bf16, the blocks
(multiplied in float32, the sum rounded to bf16 once) for the fewest rows, and on AMX the
tile unit for a middle range. Those calls multiply the GGUF's exact values where oneDNN
multiplies them rounded to bf16, so a request's tokens can differ between a step of few
rows and a larger one, as they can between batch sizes in any engine whose kernels
change with the shape.

Results match `F.linear` to rounding. Without oneDNN or the C++ kernels the layers stay
plain `nn.Linear` or take only the routes that exist, so correctness never depends on
them.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Iterator, Mapping
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from gpu.cpu import routing
from gpu.cpu.capabilities import CpuCapabilities, onednn
from gpu.cpu.panel_blocks import PANEL, PanelBlocks, amx_levels, dequantized
from gpu.cpu.routing import AMX_ROWS, PACKED_MIN_ROWS, LinearLayer, Route, RoutePlan, plan_routes
from gpu.roofline import QuantizedReads
from models.gguf_blocks import QuantizedWeight

__all__ = ["AMX_ROWS", "PACKED_MIN_ROWS", "PackedLinear", "SplitLinear", "multiply_dtype",
           "pack_linears",
           "params_not_needed", "quantized_max_rows", "quantized_reads", "int8_unavailable"]

T = TypeVar("T")

log = logging.getLogger("ridgeline.cpu_linear")


# Weights widened per slice of a `Route.UNPACKED` call: a scratch buffer of 8 MB in bf16,
# reused by every layer (the model thread runs one call at a time).
_UNPACK_ELEMENTS = 1 << 22
_SCRATCH: dict[torch.dtype, torch.Tensor] = {}


def _scratch(dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
    """A [rows, cols] view of the thread's scratch buffer for `dtype`, grown as needed."""
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
                 quantized: QuantizedWeight | None = None, kernels=None,
                 int8_activations: bool = False, widen: bool = False, amx: bool = False,
                 float32: torch.Tensor | None = None, blocks_only: bool = False):
        """`kernels`: `CpuCapabilities`, or the library's ops (None: no C++ kernels).
        `float32`: a widened layer's float32 weight where the caller has it (the
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
        # bf16 calls of the fewest rows: the AVX512-BF16 dot-product kernel, same blocks.
        self._dot_max_rows = plan.dot_max_rows
        self._dot_op = (capabilities.op(f"{quantized.format}_linear_bf16")
                        if plan.dot_max_rows else None)
        # Its levels regrouped for it (the panels' bytes once more: the float32 kernel
        # reads the panels, the Q4_1 AMX kernel its own copy below).
        self._dot_args = ((self.quantized.dot_pairs(capabilities), *self.quantized.tensors[1:],
                           self.out_features) if plan.dot_max_rows else ())
        self.amx_rows = plan.amx_rows
        self._amx_op = (capabilities.op(f"{quantized.format}_linear_amx")
                        if plan.amx_rows is not None else None)
        # The op's block arguments, bound once rather than per call.
        self._quantized_args = (() if self.quantized is None
                                else (*self.quantized.tensors, self.out_features))
        # The Q4_1 AMX kernel reads each output's levels in a row (`amx_levels`), a copy
        # beside the panels the widened blocks read; Q8_0's reads the panels.
        self.amx_levels = (amx_levels(self.quantized)
                           if plan.amx_rows is not None and quantized.format == "q4_1" else None)
        self._amx_args = (self._quantized_args if self.amx_levels is None
                          else (self.amx_levels, *self.quantized.tensors[1:], self.out_features))
        # Few rows without blocks: the plain weight, in the calls' dtype (a bf16 one
        # streams half the bytes, and torch's one-row bf16 product is as fast as fp32's).
        self.plain = (None if not plan.plain_below else narrow if self.widen else weight)
        self._plain_below = plan.plain_below
        self.plan = plan

    @property
    def block_max_rows(self) -> int:
        """Calls of up to this many rows read the blocks (widened, or on AMX)."""
        return self.amx_rows.stop - 1 if self.amx_rows is not None else self.quantized_max_rows

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds: packed copy, blocks (with their dot-product pairs and
        their AMX copy), plain weight."""
        packed = 0 if self.packed is None else self.packed.numel() * self.packed.element_size()
        blocks = 0 if self.quantized is None else self.quantized.nbytes
        blocks += self._dot_args[0].nbytes if self._dot_args else 0
        blocks += self.amx_levels.nbytes if self.amx_levels is not None else 0
        plain = 0 if self.plain is None else self.plain.numel() * self.plain.element_size()
        return packed + blocks + plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # `self.plan.route(rows)`, inlined: a decode step makes ~100 of these calls.
        if x.dim() == 2 and x.shape[0] <= self.quantized_max_rows:  # a decode step's call
            return self._blocks(x)
        rows = x.numel() // x.shape[-1]
        if rows <= self.quantized_max_rows:
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


class SplitLinear(nn.Module):
    """A fused weight (q, k and v in one qkv) whose parts' blocks came in different formats:
    a GGUF quantizes each tensor alone, and llama-quantize's K-quant mixes give some
    layers' v another type than q and k (Q6_K beside Q4_K). Blocks of two formats cannot
    stack into one panel set, so each part is a `PackedLinear` of its own rows, and a call
    concatenates their outputs: the same values as one layer, a few more calls."""

    def __init__(self, parts: list[PackedLinear]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def _by_parameter(model: nn.Module, by_hf: Mapping[str, T]) -> dict[str, list[T]]:
    """Our parameter name -> the values `by_hf` holds for its HF parts, in row order
    (a fused parameter only where every part is there)."""
    by_hf = {name.removeprefix("model."): v for name, v in by_hf.items()}
    layout = model.checkpoint_layout() if hasattr(model, "checkpoint_layout") else {}
    parts: dict[str, list[tuple[int, str]]] = {}
    for hf, (ours, offset, _rows) in layout.items():
        parts.setdefault(ours, []).append((offset, hf))
    out = {name: [v] for name, v in by_hf.items() if name not in layout}
    for ours, sources in parts.items():
        if all(hf in by_hf for _, hf in sources):
            out[ours] = [by_hf[hf] for _, hf in sorted(sources)]
    return out


def _quantized_sources(model: nn.Module, quantized: dict[str, QuantizedWeight]
                       ) -> dict[str, QuantizedWeight | list[QuantizedWeight]]:
    """Our parameter name -> its quantized blocks, fused parameters stacked from their
    HF parts in row order where every part was kept in one format, else a list of the
    runs of parts that share one, each stacked, in row order (a `SplitLinear`)."""
    def stacked(parts: list[QuantizedWeight]) -> QuantizedWeight:
        return parts[0] if len(parts) == 1 else QuantizedWeight.stack(parts)

    out: dict[str, QuantizedWeight | list[QuantizedWeight]] = {}
    for name, parts in _by_parameter(model, quantized).items():
        runs = [stacked(list(run)) for _, run in itertools.groupby(parts, lambda p: p.format)]
        out[name] = runs[0] if len(runs) == 1 else runs
    return out


def _stored_float32(parts: list[torch.Tensor] | None) -> torch.Tensor | None:
    """A weight's float32 values from its checkpoint parts, where they are stored so
    (a bf16 checkpoint's are rounded: the blocks hold the exact values then)."""
    if not parts or any(p.dtype != torch.float32 or p.is_meta for p in parts):
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _fits(q: QuantizedWeight | None, weight: torch.Tensor) -> bool:
    return q is not None and _parts_fit([q], weight)


def _split_fits(parts: list[QuantizedWeight], weight: torch.Tensor) -> bool:
    """Whether `parts` (any formats), one under the other, hold `weight`'s shape."""
    return all(_fits(p, weight[:p.out_features]) for p in parts) \
        and sum(p.out_features for p in parts) == weight.shape[0]


def _parts_fit(parts: list[QuantizedWeight] | None, weight: torch.Tensor) -> bool:
    """Whether blocks stacked from `parts` (one format) would hold `weight`'s shape."""
    if not parts or len({p.format for p in parts}) != 1:
        return False
    return all(p.in_features == parts[0].in_features for p in parts) \
        and (sum(p.out_features for p in parts), parts[0].in_features) == tuple(weight.shape)


def int8_unavailable(dtype: torch.dtype, quantized: dict[str, QuantizedWeight] | None,
                     kernels) -> str | None:
    """Why `int8_activations` cannot run here (None: it can)."""
    if dtype != torch.float32:
        return f"it needs --dtype float32 (got {str(dtype).removeprefix('torch.')})"
    if not quantized:
        return "it needs a GGUF model with Q4_1 or Q8_0 weights"
    capabilities = CpuCapabilities.of(kernels)
    if not capabilities.onednn_packing or not capabilities.has("q4_1_linear_int8"):
        return "the C++ CPU kernels are not available (see the log above)"
    if not capabilities.int8:
        return "this CPU has neither AVX512-VNNI with AVX512-VBMI nor AVX2"
    return None


def _usable(kernels) -> CpuCapabilities | None:
    """The kernels' capabilities, or None where they have no blocks' paths (oneDNN for
    every call)."""
    capabilities = CpuCapabilities.of(kernels)
    if not capabilities.has("q4_1_linear") or quantized_max_rows(capabilities) is None:
        return None
    return capabilities


def _packable_linears(model: nn.Module) -> Iterator[tuple[nn.Module, str, nn.Linear, str]]:
    """(parent, attribute, layer, its weight's parameter name) of every linear that
    `pack_linears` replaces: bias-free, bf16 or fp32, on CPU."""
    for prefix, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.bias is None and _packable(child.weight):
                yield parent, name, child, f"{prefix}.{name}.weight" if prefix else f"{name}.weight"


def _packable(w: torch.Tensor) -> bool:
    return w.dtype in (torch.bfloat16, torch.float32) and w.device.type == "cpu"


def params_not_needed(model: nn.Module, quantized: dict[str, QuantizedWeight] | None,
                      kernels, int8_activations: bool = False) -> set[str]:
    """The linear weights a load need not fill, as `pack_linears` will build their layers:
    those served from their blocks alone (every call through the blocks' kernels or
    unpacked from them: no dense copy), and widened bf16 layers with blocks, which take
    their float32 weight from the checkpoint or the blocks. Their parameters would only
    be copied and dropped; left unfilled, the checkpoint's pages are never read.
    `load_weights(skip=...)` takes this."""
    kernels = _usable(kernels)
    if kernels is None or not quantized:
        return set()
    widen = multiply_dtype(torch.bfloat16) == torch.float32
    parts_of = _by_parameter(model, quantized)  # not stacked: `pack_linears` stacks them
    skip = set()
    for _, _, layer, name in _packable_linears(model):
        parts, dtype = parts_of.get(name), layer.weight.dtype
        if not parts or not _split_fits(parts, layer.weight):
            continue
        alone = all(not (plan := _plan(dtype, fmt, kernels, int8_activations, widen and dtype
                                       == torch.bfloat16, kernels.amx, True)).packed
                    and not plan.plain_below for fmt in {p.format for p in parts})
        if alone or (widen and dtype == torch.bfloat16):
            skip.add(name)
    return skip


def pack_linears(model: nn.Module, quantized: dict[str, QuantizedWeight] | None = None,
                 kernels=None, int8_activations: bool = False,
                 checkpoint: Mapping[str, torch.Tensor] | None = None,
                 blocks_only: bool = True) -> int:
    """Replace every bias-free bf16 or fp32 nn.Linear on CPU with a PackedLinear, and give
    a tied LM head (no `lm_head` module) a packed copy of the embedding. `quantized`:
    a GGUF's blocks by HF name, used with the C++ kernels where they fit (`kernels`:
    the runner's `CpuCapabilities`, or the library's ops), with int8
    activations when asked (the caller checks `int8_unavailable` first). `checkpoint`:
    the HF-named tensors as stored; a widened layer with blocks packs its float32 weight
    from them where they are float32 (the blocks' exact values, read from the mapped
    file: cheaper than dequantizing the blocks), and then needs no parameter of its own
    (`params_not_needed`).

    Returns the bytes the packed copies add to the weights (negative where blocks alone
    replace fp32 weights, with int8 activations)."""
    if not _packing_available():
        return 0
    kernels = _usable(kernels)
    sources = _quantized_sources(model, quantized or {}) if kernels is not None else {}
    stored = _by_parameter(model, checkpoint) if checkpoint is not None else {}
    count, extra, used, on_amx, alone = 0, 0, 0, 0, 0

    widen = multiply_dtype(torch.bfloat16) == torch.float32
    amx = kernels is not None and kernels.amx

    def packed(weight: torch.Tensor, q: QuantizedWeight | None,
               float32: torch.Tensor | None) -> PackedLinear:
        nonlocal count, used, on_amx, alone
        layer = PackedLinear(weight, quantized=q, kernels=kernels,
                             int8_activations=int8_activations, widen=widen, amx=amx,
                             float32=float32, blocks_only=blocks_only)
        count += 1
        used += layer.quantized is not None
        alone += layer.quantized is not None and not layer.plan.packed
        on_amx += layer.amx_rows is not None
        return layer

    def pack(weight: torch.Tensor, name: str) -> PackedLinear | SplitLinear:
        nonlocal extra
        q = sources.get(name)
        float32 = _stored_float32(stored.get(name)) if widen and q is not None else None
        if float32 is not None and float32.shape != weight.shape:
            raise ValueError(f"{name}: the checkpoint's float32 weight has shape "
                             f"{tuple(float32.shape)}, expected {tuple(weight.shape)}")
        if isinstance(q, list) and _split_fits(q, weight):
            starts = [0, *itertools.accumulate(p.out_features for p in q)]
            layer = SplitLinear([packed(
                weight[a:b], part, None if float32 is None else float32[a:b])
                for part, a, b in zip(q, starts, starts[1:])])
        else:
            layer = packed(weight, q if isinstance(q, QuantizedWeight) and _fits(q, weight)
                           else None, float32)
        # The layer's copies replace the weight, but for the embedding, still needed for
        # the lookup.
        weight_bytes = weight.numel() * weight.element_size()
        extra += layer.nbytes - (0 if name == "embed_tokens.weight" else weight_bytes)
        return layer

    for parent, attr, layer, name in _packable_linears(model):
        setattr(parent, attr, pack(layer.weight, name))
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", "absent") is None and embed is not None \
            and _packable(embed.weight):
        model.lm_head = pack(embed.weight, "embed_tokens.weight")
    if count:
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        if int8_activations:
            rest = f", the other {count - used} packed for oneDNN" if used < count else ""
            log.info("%d of %d %s linear weights read from their quantized blocks with int8 "
                     "activations for every call%s (%+.2f GiB)", used, count, dtype, rest,
                     extra / 2**30)
        else:
            how = (" (multiplied in float32: this CPU has no bfloat16 arithmetic)"
                   if widen and dtype == "bfloat16" else "")
            spans = ", ".join(f"{fmt} {r.start}-{r.stop - 1}" for fmt, r in AMX_ROWS.items())
            tiles = (f", {on_amx} of those on AMX for calls of these rows: {spans}"
                     if on_amx else "")
            if alone:
                log.info("%d %s linear weights: %d served from their quantized blocks alone "
                         "(no dense copy: calls of many rows unpack them), %d of them on AMX "
                         "for calls of these rows: %s; %d packed for oneDNN%s (%+.2f GiB)",
                         count, dtype, alone, on_amx, spans, count - alone, how,
                         extra / 2**30)
            else:
                log.info("packed %d %s linear weights for oneDNN%s, %d of them also read "
                         "from their quantized blocks for calls of few rows%s (%+.2f GiB)",
                         count, dtype, how, used, tiles, extra / 2**30)
    return extra


def quantized_reads(model: nn.Module) -> QuantizedReads | None:
    """What a few-row step reads from blocks, for the roofline (None: nothing does)."""
    layers = [m for n, m in model.named_modules()
              if isinstance(m, PackedLinear) and m.quantized is not None and n != "lm_head"]
    head = getattr(model, "lm_head", None)
    head_blocks = head.quantized if isinstance(head, PackedLinear) else None
    if not layers and head_blocks is None:
        return None
    return QuantizedReads(
        layer_bytes=sum(m.quantized.nbytes for m in layers),
        head_bytes=head_blocks.nbytes if head_blocks is not None else 0,
        layer_max_rows=min((m.block_max_rows for m in layers), default=0),
        head_max_rows=head.block_max_rows if head_blocks is not None else 0,
        layer_params=sum(m.in_features * m.out_features for m in layers))
