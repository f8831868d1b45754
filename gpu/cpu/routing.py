"""Which kernel multiplies a CPU linear layer's call: the policy, apart from the weights.

`choose_route(shape, capabilities)` is pure: the same layer, rows and capabilities
always give the same route. `PackedLinear` (`gpu/cpu/linear.py`) holds the weights each
route it can take needs, and resolves its `RoutePlan` once at construction, so a call
compares its rows with a few integers. `docs/cpu.md` has the table; the figures behind
each threshold come from `benchmarks/cpu_quant_linear_ab.py` (one layer shape's kernels
side by side, per row count) and `benchmarks/cpu_decode_ab.py` (whole steps).

The routes, in the order a call tries them:
- `blocks`: the GGUF's Q4_1/Q8_0 blocks through the exact C++ kernel
  (`quant_linear.cpp`). Decode streams every weight once a step, and the blocks are
  ~0.6 bytes a weight against 4 (fp32) or 2 (bf16), so for few rows they win. For more
  rows the kernel's FMAs, not memory, bound it, and oneDNN's packed matmul wins.
- `blocks_bf16`: a bf16 model's Q4_1 blocks through the AVX512-BF16 dot-product kernel
  (`quant_linear_bf16.cpp`), for the fewest rows: exact as `blocks` (bf16 levels times
  bf16 x, summed in float32), fewer instructions to widen the weights, and its blocks
  read ahead of use; to three rows it beats `blocks` and `amx`, from four the tile unit
  wins.
- `blocks_int8`: the same blocks with x quantized to int8 (`quant_linear_int8.cpp`): a
  bf16 model's calls of `INT8_MIN_ROWS` rows or more (a prompt's prefill, a decode
  step of that many sequences) on a CPU without AMX (`CpuCapabilities.int8_batches`);
  with `--int8-activations` (by default where `--dtype auto` serves float32: AVX2),
  every call. Not exact: x is rounded to 8 bits per block of 32, as llama.cpp does for
  every call. `--dtype float32` stays the exact path, as bf16 makes no such promise
  anyway.
- `amx`: a bf16 model's Q4_1 or Q8_0 blocks on the AMX tile unit
  (`quant_linear_amx_table.cpp`, `quant_linear_amx.cpp`), for a middle range of rows
  where the tile unit beats both the widened blocks (below) and oneDNN's packed bf16
  (above, where it runs at the same rate without the dequantizing).
- `plain`: `F.linear` on the weight as loaded, not packed. oneDNN's packing pays for
  itself from a few rows; for one to three rows the plain fp32 weight streams straight
  from memory.
- `packed`: oneDNN's packed weight, in the model's dtype.
- `widened`: oneDNN's packed float32 weight for a bf16 model on a CPU without bf16
  arithmetic (oneDNN cannot pack bf16 there, and torch's bf16 matmul runs at a fraction
  of fp32's rate): bf16 in, float32 products, the sum rounded to bf16 once.
- `unpacked`: a GGUF layer that holds only its blocks (`LinearLayer.blocks_only`: no
  dense weight in memory) takes this where the routes above would take a dense one:
  slices of its panels widened per call into a scratch buffer (`quant_unpack.cpp`,
  bf16 where the layer multiplies in bf16) and multiplied by oneDNN. The widening is a
  fixed cost per call, so this takes only the rows past `BLOCKS_ONLY_MAX_ROWS`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum

import torch

from gpu.cpu.capabilities import CpuCapabilities

# fp32: fewer rows than this run faster on the plain weight than on the packed one.
PACKED_MIN_ROWS = 4
# Calls multiplied in float32 (fp32 models, widened bf16 ones): up to this many rows per
# format the blocks beat oneDNN's packed fp32, by the kernels' vector width (float
# lanes). Portable builds never take the blocks: their plain loops lose to oneDNN at any
# row count. The Q8_0 LM head crosses over earlier than the Q4_1 layers: its levels
# take more bytes and more work to widen; Q8_16 (a Q6_K or Q3_K file's) reads as many.
QUANTIZED_MAX_ROWS = {16: {"q4_1": 192, "q8_0": 48, "q8_16": 48},
                      8: {"q4_1": 96, "q8_0": 32, "q8_16": 32}}
# bf16 on a CPU with bf16 arithmetic: up to this many rows the blocks, multiplied in
# float32 as a widened layer does, beat oneDNN's packed bf16, which streams the whole
# bf16 weight whatever the rows. Only AVX-512 builds: an AVX2 CPU has no bf16
# arithmetic, and there every bf16 layer is widened.
BF16_QUANTIZED_MAX_ROWS = {16: {"q4_1": 6, "q8_0": 1, "q8_16": 1}}
# bf16 with AMX: calls of these many rows run on the tile unit, and the widened blocks
# keep only the calls below; above, oneDNN's packed bf16 is as fast or faster. The Q8_0
# LM head sees as many rows as the step has sequences (a prefill's last tokens too).
AMX_ROWS = {"q4_1": range(4, 129), "q8_0": range(2, 97), "q8_16": range(5, 97)}
# A layer that holds its blocks alone (no dense copy: `LinearLayer.blocks_only`): up to
# this many rows the blocks' exact kernel beats widening slices of the blocks for oneDNN
# (`Route.UNPACKED`), by vector width and the dtype the layer multiplies in
# (`benchmarks/cpu_unpack_ab.py` on a 1.7B model's shapes). With bf16 arithmetic but no
# AMX, oneDNN's bf16 matmul on freshly widened weights did not catch up with the exact
# kernel by 256 rows, so the blocks take every call; with AMX the tile kernels take
# every call from `AMX_ROWS`' first row on (they beat the unpacked route at every row
# count measured).
BLOCKS_ONLY_MAX_ROWS = {
    (16, torch.float32): {"q4_1": 256, "q8_0": 128, "q8_16": 128},
    (16, torch.bfloat16): {"q4_1": sys.maxsize, "q8_0": sys.maxsize, "q8_16": sys.maxsize},
    (8, torch.float32): {"q4_1": 112, "q8_0": 80, "q8_16": 80},
}
# bf16 with the AVX512-BF16 dot-product kernels: calls of up to this many rows take them
# (within the blocks' rows above; `benchmarks/cpu_quant_bf16_ab.py`,
# `benchmarks/cpu_int8_rows_ab.py`). On a CPU with AMX (Intel's, from Sapphire Rapids on)
# vdpbf16ps issues only every other cycle, with a long latency: there a Q6_K layer's dot
# kernel (more dot products per byte than Q4_1's) reads its blocks slower than the exact
# kernel does, and its few rows stay on that one (`BF16_DOT_MAX_ROWS_AMX`;
# `benchmarks/decode_step_profile.py --batch 1` on an 8B model, whose layers come from
# memory), where on Zen 4 its dot kernel was the quicker.
BF16_DOT_MAX_ROWS = {"q4_1": 3, "q8_16": 3}
BF16_DOT_MAX_ROWS_AMX = {"q4_1": 3}
# Without AMX, a bf16 model's calls of at least this many rows quantize x to int8
# (`Route.BLOCKS_INT8`): where there is no tile unit, the exact kernel is bound by its
# float32 FMAs from a few rows up, and integer dot products (VNNI, or AVX2's
# vpmaddubsw) do about four times the work an instruction; a prompt is most of a CPU's
# time to first token, and a decode step of many sequences most of its time under load
# (`benchmarks/cpu_int8_rows_ab.py`: a model's layers per row count). Fewer rows (one
# user's decode steps) read the blocks from memory at the same rate either way, so
# they stay exact, on the bf16 dot-product kernel.
INT8_MIN_ROWS = 4
# With int8 activations (`--int8-activations`), formats whose int8 kernel on this vector
# width wins only up to some rows: AVX2's Q8_16 unpacks its 6-bit levels per call (a
# panel at a time for more than two rows), in 0.55-0.75x the exact kernel's time for a
# Q6_K layer's calls of one to 16 rows and 0.8-0.95x at 64-256, but from ~128 rows the
# unpacked route (oneDNN on float32 slices) is quicker still
# (`benchmarks/cpu_q8_16_int8_ab.py`); calls of more rows take the routes below.
INT8_ONLY_MAX_ROWS = {8: {"q8_16": 96}}


class Route(str, Enum):
    BLOCKS = "blocks"
    BLOCKS_BF16 = "blocks_bf16"
    BLOCKS_INT8 = "blocks_int8"
    AMX = "amx"
    PLAIN = "plain"
    PACKED = "packed"
    WIDENED = "widened"
    UNPACKED = "unpacked"


@dataclass(frozen=True)
class LinearLayer:
    """What routing needs of a layer: its weight's dtype, the format of the GGUF blocks
    it holds (None: none, or they do not fit its weight), and whether int8 activations
    were asked for."""

    dtype: torch.dtype
    blocks: str | None = None
    int8_activations: bool = False
    blocks_only: bool = False  # the layer holds no dense weight (`Route.UNPACKED`)


@dataclass(frozen=True)
class LinearShape:
    """One call: `rows` rows of x through `layer`."""

    rows: int
    layer: LinearLayer


def quantized_max_rows(capabilities: CpuCapabilities,
                       dtype: torch.dtype = torch.float32) -> dict[str, int] | None:
    """Rows per format up to which the blocks beat oneDNN for layers that multiply in
    `dtype` (None: never)."""
    table = BF16_QUANTIZED_MAX_ROWS if dtype == torch.bfloat16 else QUANTIZED_MAX_ROWS
    return table.get(capabilities.vector_width)


def multiply_dtype(dtype: torch.dtype, capabilities: CpuCapabilities) -> torch.dtype:
    """The dtype a `dtype` layer multiplies in: float32 for bf16 where oneDNN has no bf16
    arithmetic (the layer is widened)."""
    if dtype == torch.bfloat16 and capabilities.onednn_packing \
            and not capabilities.bf16_arithmetic:
        return torch.float32
    return dtype


@dataclass(frozen=True)
class RoutePlan:
    """A layer's routes by rows, resolved once: calls of up to `dot_max_rows` rows take
    the bf16 dot-product kernel, the rest up to `blocks_max_rows` rows `blocks_route`,
    rows in `amx_rows` take AMX, fewer than `plain_below` rows the plain
    weight, the rest oneDNN's packed weight (widened when `widen`)."""

    blocks_max_rows: int = 0  # 0: no blocks; sys.maxsize: every call (int8)
    blocks_route: Route = Route.BLOCKS
    amx_rows: range | None = None
    plain_below: int = 0
    widen: bool = False
    dot_max_rows: int = 0  # 0: no bf16 dot-product kernel; never above blocks_max_rows
    unpacked: bool = False  # the rest unpack the blocks per call, not oneDNN's packed copy
    int8_min_rows: int = 0  # 0: none; else calls of these rows or more take int8 x
    int8_max_rows: int = 0  # calls of up to these rows take int8 x (after the dot kernel)

    @property
    def blocks(self) -> bool:
        return self.blocks_max_rows > 0

    @property
    def packed(self) -> bool:
        """Whether some call needs oneDNN's packed weight."""
        return self.blocks_max_rows != sys.maxsize and not self.unpacked

    def route(self, rows: int) -> Route:
        if rows <= self.dot_max_rows:
            return Route.BLOCKS_BF16
        if rows <= self.int8_max_rows or (self.int8_min_rows and rows >= self.int8_min_rows):
            return Route.BLOCKS_INT8
        if rows <= self.blocks_max_rows:
            return self.blocks_route
        if self.amx_rows is not None and rows in self.amx_rows:
            return Route.AMX
        if self.unpacked:
            return Route.UNPACKED
        if rows < self.plain_below:
            return Route.PLAIN
        return Route.WIDENED if self.widen else Route.PACKED


def plan_routes(layer: LinearLayer, capabilities: CpuCapabilities) -> RoutePlan:
    """The routes of every call `layer` can get on a CPU with `capabilities`."""
    widen = layer.dtype == torch.bfloat16 \
        and multiply_dtype(layer.dtype, capabilities) == torch.float32
    compute = torch.float32 if widen else layer.dtype
    fmt = layer.blocks
    fmt_op = f"{fmt}_linear"
    table = (quantized_max_rows(capabilities, compute)
             if fmt is not None and capabilities.has(fmt_op) else None)
    if not table:  # no blocks: the plain weight for few rows where it is fp32 or widened
        plain = PACKED_MIN_ROWS if compute == torch.float32 else 0
        return RoutePlan(plain_below=plain, widen=widen)
    int8_activations = layer.int8_activations and compute == torch.float32 \
        and capabilities.has(f"{fmt_op}_int8")
    few = INT8_ONLY_MAX_ROWS.get(capabilities.vector_width, {}).get(fmt, 0)
    if int8_activations and not few:
        return RoutePlan(sys.maxsize, Route.BLOCKS_INT8, widen=widen)
    unpacked = layer.blocks_only and capabilities.has(f"{fmt}_unpack")
    most = (BLOCKS_ONLY_MAX_ROWS.get((capabilities.vector_width, compute), table)[fmt]
            if unpacked else table[fmt])
    amx_rows = (AMX_ROWS.get(fmt) if capabilities.amx and compute == torch.bfloat16
                and capabilities.has(f"{fmt_op}_amx") else None)
    if amx_rows is not None:
        most = min(most, amx_rows.start - 1)
        if unpacked:  # no dense copy to hand the calls above to
            amx_rows = range(amx_rows.start, sys.maxsize)
    dots = BF16_DOT_MAX_ROWS_AMX if capabilities.amx else BF16_DOT_MAX_ROWS
    dot = (min(most, dots.get(fmt, 0))
           if compute == torch.bfloat16 and capabilities.has(f"{fmt_op}_bf16") else 0)
    int8 = (INT8_MIN_ROWS if capabilities.int8_batches and amx_rows is None
            and layer.dtype == torch.bfloat16 and capabilities.int8 and not few
            and capabilities.has(f"{fmt_op}_int8") else 0)
    return RoutePlan(most, Route.BLOCKS, amx_rows, widen=widen, dot_max_rows=dot,
                     unpacked=unpacked, int8_min_rows=int8,
                     int8_max_rows=few if int8_activations else 0)


def choose_route(shape: LinearShape, capabilities: CpuCapabilities) -> Route:
    """The kernel that multiplies `shape.rows` rows through `shape.layer` on this CPU."""
    return plan_routes(shape.layer, capabilities).route(shape.rows)
