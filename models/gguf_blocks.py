"""A GGUF's quantized weight blocks: a converted GGUF's weights, kept as blocks only.

Why: dequantized, a GGUF's weights take 2-7x the bytes (SmolLM2 in float32: 540 MB, a
1.7B Q4_K_M in bf16: 3.4 GB), and a decode step of a few sequences is bound by how fast
the weights stream from memory. So the CPU serves each layer from its blocks alone and
dequantizes in registers (`gpu/cpu/kernels/quant_linear.cpp` and its siblings), as
llama.cpp does; a loader that needs a weight dense (a GPU, the torch backend) gets
`QuantizedWeight.dequantize`'s values (`models.weights.iter_safetensors`). Those are
bit-identical to gguf-py's (it computes `d * q + m` in float32, and so do the kernels),
so outputs differ from a dense float32 path only by summation order, like any two
matmul libraries.

Kept formats, the three the kernels read: Q4_1 (32 weights in 16 bytes of nibbles, a
scale `d` and minimum `m`: w = d*q + m), Q8_0 (32 int8, one scale: w = d*q) and Q8_16
(int8 with a scale per 16). The other GGUF types the kernels serve (Q4_0, Q4_K, Q5_0,
Q3_K, Q6_K, IQ4_NL, IQ4_XS) are rewritten into one of them at conversion, exactly
(`models/gguf_repack.py`); types with no rewrite are not kept: those layers use the
dense weights.

On disk: `quantized/weights.safetensors` in the converted directory (a subdirectory,
so the checkpoint loader never mistakes it for weights), per HF weight name `W`:
`W.qweight` (uint8 [N, K/2] nibbles, or int8 [N, K]), `W.scales` ([N, K/32], or
[N, K/16] for Q8_16) and for Q4_1
`W.mins` (float32 [N, K/32]: the file's f16 values widened, or their products with
the K-quants' 6-bit scales). Rows are in HF order (the Q/K
row permutation undone like the dense tensors').
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from models import gguf_repack

if TYPE_CHECKING:
    from gguf import ReaderTensor

BLOCK = 32  # weights per block (a scale per 16 in Q8_16's)
SUBDIR, FILE = "quantized", "weights.safetensors"
FORMATS = ("q4_1", "q8_0", "q8_16")


@dataclass(frozen=True)
class QuantizedWeight:
    """One [N, K] weight as blocks: `mins` is None for Q8_0."""

    format: str
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.format == "q4_1" else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.scales, self.mins) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """The [N, K] float32 weight the blocks encode, as gguf-py computes it (`d * q`,
        then `+ m`, each rounded): the float32 checkpoint's values bit for bit."""
        rows = self.out_features
        if self.format == "q4_1":
            nibbles = self.qweight.view(rows, -1, BLOCK // 2)
            levels = torch.cat([nibbles & 0xF, nibbles >> 4], dim=-1).float()  # GGML order
            return (self.scales[..., None] * levels + self.mins[..., None]).reshape(rows, -1)
        per_scale = self.qweight.shape[1] // self.scales.shape[1]  # 32, or 16 for q8_16
        levels = self.qweight.view(rows, -1, per_scale).float()
        return (levels * self.scales[..., None]).reshape(rows, -1)

    @staticmethod
    def stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row-wise concatenation (q, k, v into qkv): rows are independent."""
        if len({p.format for p in parts}) != 1:
            raise ValueError("cannot fuse weights quantized in different formats")
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        return QuantizedWeight(parts[0].format, torch.cat([p.qweight for p in parts]),
                               torch.cat([p.scales for p in parts]), mins)


def blocks_of(t: ReaderTensor, rows: int,
              permute: Callable[[np.ndarray], np.ndarray] | None
              ) -> tuple[str, dict[str, np.ndarray]] | None:
    """One GGUF tensor of `rows` rows in a kernels' format (`models/gguf_repack.py`):
    (format, arrays), or None for a type with no rewrite. `permute` reorders rows
    (llama.cpp's Q/K interleave undone)."""
    kept = gguf_repack.repack(t.tensor_type.name, t.data, rows)
    if kept is None:
        return None
    fmt, out = kept
    if permute is not None:
        out = {k: np.ascontiguousarray(permute(v)) for k, v in out.items()}
    return fmt, out


def save(tensors: dict[str, dict[str, np.ndarray]], formats: dict[str, str],
         model_dir: Path) -> None:
    """Write the kept blocks of every HF weight name into `model_dir/quantized/`."""
    from safetensors.torch import save_file

    if not tensors:
        return
    flat = {f"{name}.{part}": torch.from_numpy(arr)
            for name, parts in tensors.items() for part, arr in parts.items()}
    (model_dir / SUBDIR).mkdir()
    save_file(flat, str(model_dir / SUBDIR / FILE),
              metadata={"format": "pt", "formats": json.dumps(formats)})
    (model_dir / SUBDIR / FILE).chmod(0o644)  # a shared cache: readable by other users


def load(model_dir: str | Path, only: Collection[str] | None = None
         ) -> dict[str, QuantizedWeight]:
    """HF weight name -> its blocks (those named in `only`, where given); empty when the
    directory has none."""
    from safetensors import safe_open

    path = Path(model_dir) / SUBDIR / FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as f:
        formats = json.loads(f.metadata()["formats"])
        return {name: QuantizedWeight(
            fmt, f.get_tensor(f"{name}.qweight"), f.get_tensor(f"{name}.scales"),
            f.get_tensor(f"{name}.mins") if fmt == "q4_1" else None)
            for name, fmt in formats.items() if only is None or name in only}


def shapes(model_dir: str | Path) -> dict[str, tuple[int, int]]:
    """HF weight name -> the [N, K] weight its blocks hold, read from the file's header
    (no block is read)."""
    from safetensors import safe_open

    path = Path(model_dir) / SUBDIR / FILE
    if not path.is_file():
        return {}
    with safe_open(str(path), framework="pt") as f:
        formats = json.loads(f.metadata()["formats"])
        out = {}
        for name, fmt in formats.items():
            rows, cols = f.get_slice(f"{name}.qweight").get_shape()
            out[name] = (rows, cols * (2 if fmt == "q4_1" else 1))
        return out
