"""A model's linear layers replaced at load by the CPU's (`gpu/cpu/linear.py`): which
blocks each gets, which parameters the load need not fill, what a decode step reads.

`pack_linears` walks the model's bias-free linears and gives each a `PackedLinear` over
its GGUF blocks where they fit (fused q/k/v and gate/up stacked from their parts, or a
`SplitLinear` where the parts come in different formats), holding the blocks alone
where the kernels serve every call from them; `params_not_needed` tells the loader
which dense parameters those layers will never read, so they are never filled.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Iterator, Mapping
from typing import TypeVar

import torch
from torch import nn

from gpu.cpu.block_embedding import BlockEmbedding
from gpu.cpu.capabilities import CpuCapabilities
from gpu.cpu.linear import (
    AMX_ROWS,
    PackedLinear,
    _packing_available,
    _plan,
    holds_pairs,
    multiply_dtype,
    quantized_max_rows,
    reads_panel_levels,
)
from gpu.cpu.panel_blocks import PanelBlocks
from gpu.cpu.weight_arena import ENV, WeightArena, huge_page_bytes
from gpu.roofline import QuantizedReads
from models.gguf_blocks import GGUFBlocks, QuantizedWeight

__all__ = ["SplitLinear", "int8_unavailable", "pack_linears", "params_not_needed",
           "quantized_reads"]

T = TypeVar("T")

log = logging.getLogger("ridgeline.cpu_linear")


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


# A weight's blocks as a layer takes them: in row order, or laid out as panels already.
Blocks = QuantizedWeight | PanelBlocks


def _stacked_runs(parts: list[QuantizedWeight]) -> QuantizedWeight | list[QuantizedWeight]:
    """A parameter's blocks from its HF parts in row order: stacked where every part was
    kept in one format, else a list of the runs of parts that share one, each stacked
    (a `SplitLinear`)."""
    def stacked(run: list[QuantizedWeight]) -> QuantizedWeight:
        return run[0] if len(run) == 1 else QuantizedWeight.stack(run)

    runs = [stacked(list(run)) for _, run in itertools.groupby(parts, lambda p: p.format)]
    return runs[0] if len(runs) == 1 else runs


def _read_panels(weight: torch.Tensor, quantized: GGUFBlocks, names: list[str],
                 kernels: CpuCapabilities, int8_activations: bool, widen: bool,
                 blocks_only: bool, arena: WeightArena) -> PanelBlocks | None:
    """GGUF parts in one format read straight into the kernels' panels
    (`PanelBlocks.read`) where their layer needs nothing else from them: not a widened
    layer packed for oneDNN (which dequantizes the blocks in row order). None: read them
    in row order."""
    fmt = quantized.sources[names[0]].format
    plan = _plan(weight.dtype, fmt, kernels, int8_activations,
                 widen and weight.dtype == torch.bfloat16, kernels.amx, blocks_only)
    if (widen and weight.dtype == torch.bfloat16 and plan.packed) \
            or not (plan.blocks or plan.amx_rows is not None):
        return None
    return PanelBlocks.read(quantized, names, kernels, levels=reads_panel_levels(plan, fmt),
                            dot=holds_pairs(plan, fmt), arena=arena)


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


def int8_unavailable(dtype: torch.dtype, quantized: Mapping[str, QuantizedWeight] | None,
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


def params_not_needed(model: nn.Module, quantized: Mapping[str, QuantizedWeight] | None,
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
    # What each weight's blocks hold, read from a `GGUFBlocks`' index without reading the
    # blocks; not stacked: `pack_linears` stacks them.
    parts_of = _by_parameter(model, getattr(quantized, "sources", quantized))
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
    if _lookup_from_head(model, parts_of.get("embed_tokens.weight"), kernels,
                         int8_activations, widen) or _lookup_from_own_blocks(
                             model, quantized, kernels):
        skip.add("embed_tokens.weight")
    return skip


def _lookup_from_own_blocks(model: nn.Module, quantized: Mapping[str, QuantizedWeight],
                            kernels: CpuCapabilities) -> bool:
    """Whether an untied model's embedding will be looked up from its own blocks, read
    from the GGUF into panels (`BlockEmbedding`), so its dense weight need not be filled."""
    embed = getattr(model, "embed_tokens", None)
    src = getattr(quantized, "sources", {}).get("model.embed_tokens.weight")
    return getattr(model, "lm_head", None) is not None and embed is not None \
        and src is not None and (src.out_features, src.in_features) == tuple(embed.weight.shape) \
        and kernels.has("gguf_repack_panels_") and kernels.has(f"{src.format}_unpack")


def _lookup_from_head(model: nn.Module, parts: list | None, kernels: CpuCapabilities,
                      int8_activations: bool, widen: bool) -> bool:
    """Whether a tied model's embedding will be looked up from its LM head's blocks
    (`BlockEmbedding`), so its dense weight need not be filled: the head holds them alone
    (no oneDNN or plain copy, which would be packed from that weight) with the panels'
    levels, and the kernels can unpack them."""
    embed = getattr(model, "embed_tokens", None)
    if getattr(model, "lm_head", "absent") is not None or embed is None or not parts \
            or len(parts) != 1 or not _fits(parts[0], embed.weight):
        return False
    dtype, fmt = embed.weight.dtype, parts[0].format
    if widen and dtype == torch.bfloat16:
        return False
    plan = _plan(dtype, fmt, kernels, int8_activations, False, kernels.amx, True)
    return (plan.blocks or plan.amx_rows is not None) and not plan.packed \
        and not plan.plain_below and reads_panel_levels(plan, fmt) \
        and kernels.has(f"{fmt}_unpack")


def pack_linears(model: nn.Module, quantized: Mapping[str, QuantizedWeight] | None = None,
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

    Each weight's blocks are taken from `quantized` as its layer is built: from a
    `GGUFBlocks` that is when they are read from the file, so a load holds one GGUF
    tensor at a time beside the layers built so far.

    Returns the bytes the packed copies add to the weights (negative where blocks alone
    replace the weights)."""
    if not _packing_available():
        return 0
    kernels = _usable(kernels)
    quantized = quantized if quantized is not None else {}
    # Our parameter -> its parts' HF names; their blocks are stacked as each layer is built.
    names = _by_parameter(model, {n: n for n in quantized}) if kernels is not None else {}
    stored = _by_parameter(model, checkpoint) if checkpoint is not None else {}
    count, extra, used, on_amx, alone = 0, 0, 0, 0, 0
    arena = WeightArena()  # the blocks read from the file, on huge pages

    widen = multiply_dtype(torch.bfloat16) == torch.float32
    amx = kernels is not None and kernels.amx

    def packed(weight: torch.Tensor, q: Blocks | None,
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

    def blocks_of(weight: torch.Tensor, hf: list[str]) -> Blocks | list[Blocks]:
        """The blocks of `weight`'s HF parts: from a GGUF, each run of parts in one
        format read straight into panels where its layer allows, else stacked in row
        order (`_stacked_runs`); a list where the formats differ (a `SplitLinear`)."""
        if not isinstance(quantized, GGUFBlocks):
            return _stacked_runs([quantized[h] for h in hf])
        runs, row = [], 0
        for _, group in itertools.groupby(hf, lambda h: quantized.sources[h].format):
            run = list(group)
            rows = sum(quantized.sources[h].out_features for h in run)
            runs.append(_read_panels(weight[row:row + rows], quantized, run, kernels,
                                     int8_activations, widen, blocks_only, arena)
                        or _stacked_runs([quantized[h] for h in run]))
            row += rows
        return runs[0] if len(runs) == 1 else runs

    def pack(weight: torch.Tensor, name: str) -> PackedLinear | SplitLinear:
        nonlocal extra
        hf = names.pop(name, None)
        q = None if hf is None else blocks_of(weight, hf)
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
            layer = packed(weight, q if not isinstance(q, list) and _fits(q, weight)
                           else None, float32)
        # The layer's copies replace the weight (a tied head's embedding: where the lookup
        # below replaces it too).
        weight_bytes = weight.numel() * weight.element_size()
        extra += layer.nbytes - (0 if name == "embed_tokens.weight" else weight_bytes)
        return layer

    for parent, attr, layer, name in _packable_linears(model):
        setattr(parent, attr, pack(layer.weight, name))
    embed, lookup = getattr(model, "embed_tokens", None), None
    if getattr(model, "lm_head", "absent") is None and embed is not None \
            and _packable(embed.weight):
        model.lm_head = pack(embed.weight, "embed_tokens.weight")
        # The lookup from the head's blocks where they allow it: no second copy of them.
        lookup = BlockEmbedding.of(getattr(model.lm_head, "quantized", None), kernels,
                                   embed.weight.dtype)
    elif kernels is not None and _lookup_from_own_blocks(model, quantized, kernels):
        own = PanelBlocks.read(quantized, ["model.embed_tokens.weight"], kernels,
                               levels=True, dot=False, arena=arena)
        lookup = BlockEmbedding.of(own, kernels, embed.weight.dtype)
        extra += own.nbytes
    if lookup is not None:
        extra -= embed.weight.numel() * embed.weight.element_size()
        model.embed_tokens = lookup
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
    if arena.allocated:
        huge = huge_page_bytes()
        log.info("%.2f GiB of blocks read from the file into memory %s%s",
                 arena.allocated / 2**30,
                 "advised onto huge pages" if arena.advise else f"without huge pages ({ENV}=0)",
                 "" if huge is None else f" (this process: {huge / 2**30:.2f} GiB on huge pages)")
    return extra


def _read_rows(layer: PackedLinear) -> int:
    """Calls of up to this many rows read `layer`'s blocks: all of them where it holds no
    dense copy (the unpacked route reads the blocks too)."""
    return layer.block_max_rows if layer.plan.packed else sys.maxsize


def quantized_reads(model: nn.Module) -> QuantizedReads | None:
    """What a few-row step reads from blocks, for the roofline (None: nothing does)."""
    layers = [m for n, m in model.named_modules()
              if isinstance(m, PackedLinear) and m.quantized is not None and n != "lm_head"]
    head = getattr(model, "lm_head", None)
    head_blocks = head.quantized if isinstance(head, PackedLinear) else None
    if not layers and head_blocks is None:
        return None
    return QuantizedReads(
        layer_bytes=sum(m.read_bytes for m in layers),
        head_bytes=head.read_bytes if head_blocks is not None else 0,
        layer_max_rows=min((_read_rows(m) for m in layers), default=0),
        head_max_rows=_read_rows(head) if head_blocks is not None else 0,
        layer_params=sum(m.in_features * m.out_features for m in layers))
