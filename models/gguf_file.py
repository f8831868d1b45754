"""A GGUF file's header: its metadata, and where each tensor's bytes lie.

Why our own reader: gguf-py's `GGUFReader` builds a numpy view for every part of every
metadata field, and a tokenizer's 50-150 thousand strings made opening a file cost
seconds, twice per conversion (transformers opened it again for the tokenizer). This
reads the header with `struct` in one pass and touches no tensor data: the data is read
tensor by tensor where it is needed (`read`), so opening a file costs milliseconds and
nothing of its gigabytes lands in memory until then.

The format (ggml's docs/gguf.md, version 2 and 3): magic `GGUF`, a u32 version, u64
counts of tensors and metadata pairs, the pairs (key string, u32 value type, value),
then per tensor its name, u32 dimension count, u64 dimensions (fastest first), u32
ggml type and u64 offset into the data section, which starts at the next multiple of
`general.alignment` (32 by default). Strings are a u64 length and UTF-8 bytes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# ggml type id -> (name, weights per block, bytes per block): ggml.h's `ggml_type` and
# ggml.c's type traits. Names are gguf-py's `GGMLQuantizationType` member names.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50), 20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136), 24: ("I8", 1, 1), 25: ("I16", 1, 2),
    26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8), 29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
}

# Metadata value type -> struct format of a scalar (8: string, 9: array are read apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: `shape` in GGUF order (fastest-varying dimension first), `offset` from
    the start of the file."""

    name: str
    type_name: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def rows(self) -> int:
        """Rows of a 2-D weight ([rows, K] in torch order); 0 for a vector."""
        return self.shape[-1] if len(self.shape) == 2 else 0

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


class GGUFFile:
    """The header of the GGUF at `path`: `metadata` (key -> value: numbers, strings,
    lists) and `tensors` (in file order). Raises ValueError naming the file when it is
    not a GGUF or is cut short."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            try:
                self._parse(f, size)
            except (struct.error, UnicodeDecodeError, KeyError, EOFError) as e:
                raise ValueError(f"{self.path} is not a readable GGUF file "
                                 f"(truncated or corrupt?): {e!r}") from e

    def _parse(self, f, size: int) -> None:
        head = f.read(24)
        if head[:4] != MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise ValueError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        r = _Reader(f)
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            self.metadata[key] = r.value(r.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = r.string()
            dims = r.unpack(f"<{r.unpack('<I')}Q", tuple_=True)
            type_id, offset = r.unpack("<I"), r.unpack("<Q")
            infos.append((name, dims, type_id, offset))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        start = -(-r.pos // align) * align
        self.tensors: list[TensorInfo] = []
        for name, dims, type_id, offset in infos:
            type_name, per_block, block_bytes = GGML_TYPES[type_id]
            count = int(np.prod(dims, dtype=np.int64))
            nbytes = count // per_block * block_bytes
            if start + offset + nbytes > size:
                raise EOFError(f"tensor {name} ends past the end of the file")
            self.tensors.append(TensorInfo(name, type_name, tuple(int(d) for d in dims),
                                           start + offset, nbytes))

    def tensor(self, name: str) -> TensorInfo | None:
        return next((t for t in self.tensors if t.name == name), None)

    def read(self, t: TensorInfo) -> np.ndarray:
        """`t`'s bytes (uint8), read now: the caller holds one tensor at a time."""
        return read_bytes(self.path, t.offset, t.nbytes)


@contextlib.contextmanager
def mapped(path: str | os.PathLike[str], offset: int, nbytes: int) -> Iterator[np.ndarray]:
    """`nbytes` of the file at `offset` as a uint8 array over a private mapping of just
    that range, unmapped on exit: no copy (the page cache's pages are read in place, half
    the time of copying them out), and the range leaves the process's memory with the
    block, so a load maps one tensor at a time. The array must not outlive the block."""
    with open(path, "rb") as f:
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        # ACCESS_COPY: writable to numpy and torch (no read-only warnings), never written.
        mm = mmap.mmap(f.fileno(), offset + nbytes - start, access=mmap.ACCESS_COPY,
                       offset=start)
    view = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=offset - start)
    try:
        yield view
    finally:
        del view
        try:
            mm.close()
        except BufferError:  # a view outlived the block (a traceback's): the GC unmaps it
            pass


def read_bytes(path: str | os.PathLike[str], offset: int, nbytes: int) -> np.ndarray:
    """`nbytes` of the file at `offset`, as a fresh uint8 array (not a mapping: its pages
    are the array's, freed with it, and count once)."""
    out = np.empty(nbytes, dtype=np.uint8)
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        view, done = memoryview(out), 0
        while done < nbytes:
            n = f.readinto(view[done:])
            if not n:
                raise ValueError(f"{path}: {nbytes} bytes at {offset} run past the end")
            done += n
    return out


class _Reader:
    """Sequential reads of the header through a buffer (the header can be megabytes:
    a tokenizer's vocabulary and merges)."""

    CHUNK = 1 << 20

    def __init__(self, f) -> None:
        self.f, self.buf, self.at, self.pos = f, b"", 0, f.tell()

    def take(self, n: int) -> bytes:
        if self.at + n > len(self.buf):
            more = self.f.read(max(n, self.CHUNK))
            self.buf, self.at = self.buf[self.at:] + more, 0
            if n > len(self.buf):
                raise EOFError("the header runs past the end of the file")
        out = self.buf[self.at:self.at + n]
        self.at += n
        self.pos += n
        return out

    def unpack(self, fmt: str, tuple_: bool = False):
        values = struct.unpack(fmt, self.take(struct.calcsize(fmt)))
        return values if tuple_ else values[0]

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.unpack("<IQ", tuple_=True)
            if item == _STRING:
                return [self.string() for _ in range(count)]
            if item == _ARRAY:
                return [self.value(_ARRAY) for _ in range(count)]
            dtype = np.dtype(_NUMPY[item])
            return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
        return self.unpack(_SCALARS[kind])
