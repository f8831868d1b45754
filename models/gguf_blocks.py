"""A GGUF's quantized weight blocks, served from the GGUF file itself.

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
(int8 levels in [-32, 31], a scale per 16 given as an int8 code times a float32 scale
per 256: w = (code * super) * q). The GGUF types the kernels serve (Q4_0, Q4_1, Q4_K, Q5_0,
Q8_0, Q3_K, Q6_K, IQ4_NL, IQ4_XS) are rewritten into one of them as they are read,
exactly (`models/gguf_repack.py`, and its C++ twin `gguf_repack` in the CPU kernels);
types with no rewrite are not kept: those layers use the dense weights.

Nothing of the blocks is copied to disk: a converted directory holds
`quantized/blocks.json`, the GGUF's path (relative to that folder, or absolute) and,
per HF weight name, where its tensor lies in the file, its GGUF type, shape and the
format it is served in (and for llama's q/k, the heads whose rotary rows are
un-interleaved as they are read). `load` returns a mapping that reads and rewrites a
weight when it is asked for, so a load holds one GGUF tensor at a time beside the
layers it has built, and each start costs one read of the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from models import gguf_file, gguf_repack

BLOCK = 32  # weights per block (a scale per 16 in Q8_16's)
SUBDIR, INDEX = "quantized", "blocks.json"
FORMATS = ("q4_1", "q8_0", "q8_16")


@dataclass(frozen=True)
class QuantizedWeight:
    """One [N, K] weight as blocks: `mins` is Q4_1's alone; Q8_16's `scales` are int8
    codes [N, K/16], each scaled by its 256 weights' `supers` [N, K/256]."""

    format: str
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    supers: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * (2 if self.format == "q4_1" else 1)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (self.qweight, self.scales, self.mins, self.supers)
                   if t is not None)

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
        return (levels * self.float_scales()[..., None]).reshape(rows, -1)

    def float_scales(self) -> torch.Tensor:
        """The float32 scale of each run of weights: Q8_16's code times its super-block
        scale (an f16 value times a small integer: exact)."""
        if self.supers is None:
            return self.scales
        return self.scales.float() * self.supers.repeat_interleave(
            self.scales.shape[1] // self.supers.shape[1], dim=1)

    @staticmethod
    def stack(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Row-wise concatenation (q, k, v into qkv): rows are independent."""
        if len({p.format for p in parts}) != 1:
            raise ValueError("cannot fuse weights quantized in different formats")
        def cat(field: str) -> torch.Tensor | None:
            first = getattr(parts[0], field)
            return None if first is None else torch.cat([getattr(p, field) for p in parts])

        return QuantizedWeight(parts[0].format, *map(cat, ("qweight", "scales", "mins",
                                                           "supers")))


@dataclass(frozen=True)
class BlockSource:
    """Where one HF weight's blocks lie in the GGUF, and how they are served: `heads` is
    set for llama's q/k, whose rotary rows are un-interleaved over that many heads."""

    tensor: str
    type_name: str
    offset: int
    nbytes: int
    out_features: int
    in_features: int
    format: str
    heads: int | None = None


# repack(type name, raw uint8 [rows, bytes], source rows int64 [rows] or None)
# -> [qweight, scales, mins (Q4_1) or supers (Q8_16), else empty]: the CPU kernels'
# `gguf_repack`.
Repack = Callable[[str, torch.Tensor, torch.Tensor | None], list[torch.Tensor]]


class GGUFBlocks(Mapping[str, QuantizedWeight]):
    """HF weight name -> its blocks, read from the GGUF and rewritten when asked for (not
    kept: a second ask reads again). `sources` says what each holds without reading.
    `repack`: the C++ rewrite where the CPU kernels are built, else the numpy one."""

    def __init__(self, gguf_path: Path, sources: dict[str, BlockSource],
                 repack: Repack | None = None) -> None:
        self.gguf_path, self.sources, self.repack = gguf_path, sources, repack

    @contextlib.contextmanager
    def mapped(self, name: str) -> Iterator[tuple[np.ndarray, np.ndarray | None]]:
        """`name`'s bytes as the GGUF stores them ([rows, bytes], a mapping valid inside
        the block: nothing made from it may keep it), and the source row of each HF row
        (None: the same order)."""
        src = self.sources[name]
        rows = (None if src.heads is None else np.ascontiguousarray(
            gguf_repack.undo_qk_permutation(np.arange(src.out_features), src.heads)))
        with gguf_file.mapped(self.gguf_path, src.offset, src.nbytes) as raw:
            yield raw.reshape(src.out_features, -1), rows

    def __getitem__(self, name: str) -> QuantizedWeight:
        src = self.sources[name]
        with self.mapped(name) as (raw, rows):
            if self.repack is not None:
                q, d, m = self.repack(src.type_name, torch.from_numpy(raw),
                                      None if rows is None else torch.from_numpy(rows))
                return QuantizedWeight(src.format, q, d, m if src.format == "q4_1" else None,
                                       m if src.format == "q8_16" else None)
            fmt, arrays = gguf_repack.repack(src.type_name, raw, src.out_features)
            # Copies (row-reordered or not): nothing may keep the mapping alive.
            arrays = {k: np.array(v if rows is None else v[rows]) for k, v in arrays.items()}
        optional = {k: torch.from_numpy(arrays[k]) if k in arrays else None
                    for k in ("mins", "supers")}
        return QuantizedWeight(fmt, torch.from_numpy(arrays["qweight"]),
                               torch.from_numpy(arrays["scales"]), **optional)

    def __iter__(self) -> Iterator[str]:
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def save(sources: dict[str, BlockSource], gguf_path: Path, model_dir: Path) -> None:
    """Record where each kept weight's blocks lie in `gguf_path` (and the file's size and
    modification time, which `load` checks) in `model_dir/quantized/`."""
    if not sources:
        return
    stat = gguf_path.stat()
    (model_dir / SUBDIR).mkdir()
    index = {"gguf": str(gguf_path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
             "weights": {name: asdict(src) for name, src in sources.items()}}
    path = model_dir / SUBDIR / INDEX
    path.write_text(json.dumps(index, indent=1) + "\n")
    path.chmod(0o644)  # a shared cache: readable by other users


def load(model_dir: str | Path, repack: Repack | None = None) -> GGUFBlocks | dict:
    """HF weight name -> its blocks; empty when the directory has none. Raises
    FileNotFoundError when the GGUF they are read from is gone or has changed."""
    path = Path(model_dir) / SUBDIR / INDEX
    if not path.is_file():
        return {}
    index = json.loads(path.read_text())
    gguf = path.parent / index["gguf"]  # an absolute path stays as it is
    try:
        stat = gguf.stat()
    except FileNotFoundError:
        raise FileNotFoundError(f"{model_dir} serves its weights from {gguf}, which no "
                                "longer exists: pass the GGUF itself again") from None
    if (stat.st_size, stat.st_mtime_ns) != (index["size"], index["mtime_ns"]):
        raise FileNotFoundError(f"{model_dir} serves its weights from {gguf}, which has "
                                "changed since: pass the GGUF itself again")
    return GGUFBlocks(gguf, {name: BlockSource(**src) for name, src
                             in index["weights"].items()}, repack)


def embed_gguf(model_dir: Path) -> None:
    """Make `model_dir` (a copy of a converted directory) carry its GGUF: the file is
    copied (or hard-linked) into `quantized/` and the index names it relatively."""
    path = model_dir / SUBDIR / INDEX
    if not path.is_file():
        return
    index = json.loads(path.read_text())
    source = path.parent / index["gguf"]
    target = path.parent / source.name
    if target != source:
        try:
            os.link(source, target)
        except OSError:  # another file system
            shutil.copy2(source, target)
    stat = target.stat()
    index |= {"gguf": target.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    path.write_text(json.dumps(index, indent=1) + "\n")
