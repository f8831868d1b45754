"""A GGUF's blocks in the layout the C++ CPU kernels read, and the float32 weight they encode.

`gpu/cpu/linear.py` keeps these per packed layer: the panels for calls of few rows, the
dequantized weight to pack for oneDNN where nothing else holds it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu.cpu.capabilities import CpuCapabilities
from gpu.cpu.weight_arena import WeightArena
from models.gguf_blocks import BLOCK, GGUFBlocks, QuantizedWeight
from models.gguf_repack import QK_K

PANEL = 32  # output rows per panel of the kernels' layout
Q8_16_PACKED = 24  # bytes of a Q8_16 block's 32 levels packed to 6 bits


@dataclass(frozen=True)
class PanelBlocks:
    """One weight's blocks in the C++ kernels' layout (`quant_linear.cpp`): panels of 32
    output rows, each block's bytes transposed so one load holds a k's weights for the
    panel's 32 outputs. Rows past `out_features` (to fill the last panel) are zeros."""

    format: str
    out_features: int
    # qweight, scales[, mins]; Q8_16's: levels packed to 6 bits, codes, supers
    # (`gpu/cpu/kernels/q8_16_blocks.h`).
    tensors: tuple[torch.Tensor, ...]
    # Q4_1's levels as the dot and AMX kernels read them, where `read` wrote them.
    dot: torch.Tensor | None = None
    # A Q4_K's own scale codes, for those kernels in place of the float32 scales and mins
    # (`q4_1_scales.h`: 0.09 byte a weight where those take 0.25), where `read` wrote them.
    codes: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def in_features(self) -> int:
        if self.dot is not None:
            return self.dot.shape[1] * BLOCK
        return self.tensors[1].shape[1] * (16 if self.format == "q8_16" else BLOCK)

    @property
    def paired_scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The scales and mins the dot and AMX kernels take beside `dot_pairs`: the codes
        where the blocks have them, else the float32 ones."""
        return self.codes if self.codes is not None else self.tensors[1:]

    @staticmethod
    def read(blocks: GGUFBlocks, names: list[str], kernels, levels: bool,
             dot: bool, arena: WeightArena | None = None) -> PanelBlocks | None:
        """The weights `names` (their rows stacked in order, as q, k, v in one qkv) read
        from the GGUF straight into panels by the kernels' `gguf_repack_panels_`: the
        scales (and minimums), the levels where `levels` (else an empty tensor, as
        `without_levels` leaves), and Q4_1's `dot_pairs` where `dot` (with a Q4_K's
        scale codes for them, and then no float32 scales unless with the levels). One
        pass from the mapped file where `of` takes a row-order copy, a stack and a
        transpose, and the pairs another. None where it cannot: no such op, parts in
        different formats, or a part before the last that ends inside a panel. The
        tensors come from `arena` where given (huge pages: `weight_arena.py`)."""
        empty = torch.empty if arena is None else arena.empty
        op = CpuCapabilities.of(kernels).op("gguf_repack_panels_") if kernels else None
        sources = [blocks.sources[n] for n in names]
        fmt = sources[0].format
        if op is None or any(s.format != fmt or s.in_features != sources[0].in_features
                             for s in sources) \
                or any(s.out_features % PANEL for s in sources[:-1]):
            return None
        n, k = sum(s.out_features for s in sources), sources[0].in_features
        panels, per_scale = -(-n // PANEL), 16 if fmt == "q8_16" else BLOCK
        level_bytes = {"q4_1": BLOCK // 2, "q8_0": BLOCK, "q8_16": Q8_16_PACKED}[fmt]
        panel_levels = empty(
            (panels, k // BLOCK, level_bytes, PANEL) if levels or fmt == "q8_16" else 0,
            dtype=torch.int8 if fmt == "q8_0" else torch.uint8)
        pairs = empty(panels, k // BLOCK, 4, PANEL, dtype=torch.int32) \
            if dot and fmt == "q4_1" else None
        coded = pairs is not None and all(s.type_name == "Q4_K" for s in sources)
        codes = (empty(panels, k // BLOCK, 2, PANEL, dtype=torch.uint8),
                 empty(panels, k // QK_K, 2, PANEL)) if coded else (None, None)
        if fmt == "q8_16":  # its scales are codes and supers, always
            codes = (empty(panels, k // 16, PANEL, dtype=torch.int8),
                     empty(panels, k // QK_K, PANEL))
        # Float32 scales for the panels' kernels, or for the pairs' where no codes are.
        floats = (levels or not coded) and fmt != "q8_16"
        scales = empty(panels, k // per_scale, PANEL) if floats else empty(0)
        mins = empty(scales.shape) if fmt == "q4_1" else None
        row0 = 0
        for name, src in zip(names, sources, strict=True):
            with blocks.mapped(name) as (raw, rows):
                op(src.type_name, torch.from_numpy(raw), None if rows is None
                   else torch.from_numpy(rows), panel_levels.view(panels, -1, PANEL)
                   if panel_levels.numel() else None, scales if floats else None,
                   mins if floats else None, pairs, *codes, row0)
            row0 += src.out_features
        if fmt == "q8_16":
            return PanelBlocks(fmt, n, (panel_levels, *codes))
        kept = (panel_levels, scales) if mins is None else (panel_levels, scales, mins)
        return PanelBlocks(fmt, n, kept, pairs, codes if coded else None)

    @staticmethod
    def of(q: QuantizedWeight | PanelBlocks) -> PanelBlocks:
        """Repack GGUF row order ([N, K/2] nibbles or [N, K] int8; [N, K/32] scales)
        into panels: a permutation of the same bytes, done once at load. Q4_1 scales
        must have at most 20 significant bits, as a GGUF's f16 values and the K-quants'
        products of one with a 6-bit scale have: the kernel's Q4_1 widening fuses
        `d * q + m`, exact only when `d * q` (q < 16) is. Panels (`read`) are returned
        as they are."""
        if isinstance(q, PanelBlocks):
            return q
        if q.format == "q4_1" and bool((q.scales.view(torch.int32) & 0xF).any()):
            raise ValueError("q4_1 scales must have at most 20 significant bits (f16 values "
                             "or K-quant products), so that d * q is exact")
        n = q.out_features
        blocks = q.qweight.shape[1] * (2 if q.format == "q4_1" else 1) // BLOCK
        panels = -(-n // PANEL)

        def padded(t: torch.Tensor) -> torch.Tensor:
            pad = panels * PANEL - n
            return torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) if pad else t

        # Q8_16's filling rows are level 0 packed, as the load's pass writes them.
        levels = packed6(padded(q.qweight)) if q.format == "q8_16" else padded(q.qweight)
        per_block = levels.shape[1] // blocks  # bytes: 16 (Q4_1), 32 (Q8_0) or 24 (Q8_16)
        qweight = levels.view(panels, PANEL, blocks, per_block).permute(0, 2, 3, 1)
        rest = [padded(t).view(panels, PANEL, t.shape[1]).permute(0, 2, 1)
                for t in (q.scales, q.mins, q.supers) if t is not None]
        return PanelBlocks(q.format, n, tuple(t.contiguous() for t in (qweight, *rest)))

    def dot_pairs(self, kernels=None) -> torch.Tensor:
        """Q4_1's levels as the AVX512-BF16 dot kernel and the AMX tile kernel read them
        (`quant_linear_bf16.cpp`, `quant_linear_amx_table.cpp`):
        int32 [panels, K/32, 4, 32], per chunk c and output n one dword whose low half
        holds k = 4c + i + 16 and high half k = 4c + i in nibble i. The same bytes as
        the panels' levels, regrouped so that a shift and a table lookup give a vector of
        bf16 pairs of one output each. As `read` wrote it where it did, else through
        the kernels' one pass where `kernels` (`CpuCapabilities` or the library's ops)
        has it, else in tensor arithmetic."""
        if self.format != "q4_1":
            raise ValueError(f"dot_pairs: Q4_1 only, not {self.format}")
        if self.dot is not None:
            return self.dot
        op = CpuCapabilities.of(kernels).op("q4_1_dot_pairs") if kernels is not None else None
        if op is not None:
            return op(self.tensors[0])
        q = self.tensors[0]  # [panels, K/32, 16 (j), 32]: k = j low nibble, j + 16 high
        panels, blocks = q.shape[:2]
        q = q.view(panels, blocks, 4, 4, PANEL).to(torch.int64)  # [.., c, i, n], j = 4c + i
        shifts = (4 * torch.arange(4)).view(1, 1, 1, 4, 1)
        low = ((q >> 4) << shifts).sum(3)  # k = j + 16
        high = ((q & 0x0F) << shifts).sum(3)  # k = j
        dwords = low | (high << 16)
        return torch.where(dwords >= 2**31, dwords - 2**32, dwords).to(torch.int32).contiguous()

    def without_levels(self) -> PanelBlocks:
        """These blocks as a layer keeps them whose every call reads `dot_pairs`: no
        panel levels, and no float32 scales and mins where the codes stand for them."""
        kept = (self.tensors[1:] if self.codes is None
                else tuple(t.new_empty(0) for t in self.tensors[1:]))
        return PanelBlocks(self.format, self.out_features,
                           (self.tensors[0].new_empty(0), *kept), self.dot, self.codes)

    @property
    def nbytes(self) -> int:
        """Bytes the panels hold (not counting `dot`), with the codes."""
        codes = 0 if self.codes is None else sum(t.nbytes for t in self.codes)
        return sum(t.numel() * t.element_size() for t in self.tensors) + codes


def packed6(levels: torch.Tensor) -> torch.Tensor:
    """Q8_16's int8 levels [N, K] (in [-32, 31]) packed to 6 bits, [N, K/32 * 24] uint8, as
    the kernels read them (`q8_16_blocks.h`; the C++ load writes the same, `pack6`): per
    block of 32, with u = level + 32, bytes j < 16 hold u[j] & 15 | (u[j + 16] & 15) << 4,
    bytes 16 + i the top two bits of u[i + 8f] at bits 2f."""
    if levels.numel() and (int(levels.min()) < -32 or int(levels.max()) > 31):
        raise ValueError("q8_16 levels must lie in [-32, 31] to pack to 6 bits")
    u = (levels.to(torch.int16) + 32).view(levels.shape[0], -1, BLOCK)
    low = (u[..., :16] & 0x0F) | ((u[..., 16:] & 0x0F) << 4)
    shifts = (2 * torch.arange(4, dtype=torch.int16)).view(4, 1)
    top = ((u >> 4).view(*u.shape[:2], 4, 8) << shifts).sum(2)
    return torch.cat([low, top], dim=-1).to(torch.uint8).view(levels.shape[0], -1)


def dequantized(q: QuantizedWeight, kernels) -> torch.Tensor:
    """The float32 weight `q`'s blocks encode, bit for bit as `QuantizedWeight.dequantize`
    gives it: through the C++ kernels' one parallel pass where they are built
    (`quant_dequantize.cpp`), else eager torch. A widened bf16 layer uses it where its
    checkpoint holds no float32 values (a bf16 conversion). `kernels`: `CpuCapabilities`,
    the library's ops, or None."""
    op = CpuCapabilities.of(kernels).op(f"{q.format}_dequantize")
    if op is None:
        return q.dequantize()
    out = torch.empty(q.out_features, q.scales.shape[1] * BLOCK)
    op(q.qweight, q.scales, *(() if q.mins is None else (q.mins,)), out)
    return out
