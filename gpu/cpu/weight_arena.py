"""Memory for a model's blocks, on transparent huge pages where the host allows them.

Why: a decode step streams every weight once, and on 4 KiB pages that is a TLB miss
every 4 KiB of each stream; the page walks stall the kernels' loads, which at one row
wait on memory already. On 2 MiB pages the walks all but vanish
(`benchmarks/cpu_huge_pages_ab.py` times a decode step both ways).

How: anonymous private mappings, advised `MADV_HUGEPAGE` before anything touches them,
so the load's own writes (`PanelBlocks.read` fills these tensors from the file) fault
in huge pages and nothing is copied afterwards. Tensors are carved from a chunk in load
order, so the layers' many small tensors (scale codes, supers) share huge pages rather
than each rounding one up; at most the last, partly filled huge page of a chunk is
memory no tensor uses. Each tensor is a view of its chunk, which lives until the last
of them goes: only what lives as long as the model belongs here.

The host decides: with transparent huge pages `never` (or a mapping the kernel will not
back with them) these are ordinary pages, as `torch.empty`'s would be. Linux's
`madvise` setting, the common default, is the one where the advice matters.

What it costs: a huge page is zeroed whole when first touched, the same bytes its 512
small pages would be. In a VM that hands freed memory back to its host (free page
reporting), huge pages come from memory the host must fault in again, and the load
takes longer (`benchmarks/cpu_huge_pages_ab.py` times the load too).
`RIDGELINE_HUGE_PAGES=0` maps the chunks without the advice, for a host where start-up
time matters more than the steps'.
"""

from __future__ import annotations

import logging
import math
import mmap
import os

import torch

HUGE_PAGE = 2 << 20
CHUNK = 256 << 20  # bytes a chunk maps (a tensor larger than this gets its own)
ALIGN = 64  # each tensor starts on a cache line, as torch's own allocator places them
ENV = "RIDGELINE_HUGE_PAGES"  # "0": no advice (ordinary pages)

log = logging.getLogger("ridgeline.cpu_linear")


def private_mapping(nbytes: int) -> mmap.mmap:
    """`nbytes` of anonymous memory, zero pages until touched: a private mapping where
    the platform has one (`gpu/memory.py` `zeroed_pool` says why not mmap's default
    shared one)."""
    private = getattr(mmap, "MAP_PRIVATE", None)  # absent on Windows
    return mmap.mmap(-1, nbytes) if private is None else mmap.mmap(-1, nbytes, flags=private)


class WeightArena:
    """A bump allocator over huge-page-advised chunks; `empty` is `torch.empty`'s."""

    def __init__(self, chunk_bytes: int = CHUNK, advise: bool | None = None):
        self.chunk_bytes = chunk_bytes
        self.advise = os.environ.get(ENV, "1").strip() != "0" if advise is None else advise
        self._chunk: torch.Tensor | None = None  # the current chunk, uint8
        self._used = 0
        self.allocated = 0  # bytes of the tensors handed out

    def empty(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised tensor of `shape` (ints, or one tuple) in a chunk."""
        if len(shape) == 1 and isinstance(shape[0], tuple | list | torch.Size):
            shape = tuple(shape[0])
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if nbytes > self.chunk_bytes:  # a mapping of its own; the current chunk goes on
            own = self._map(nbytes)
            if own is None:
                return torch.empty(shape, dtype=dtype)
            self.allocated += nbytes
            return own[:nbytes].view(dtype).view(shape)
        start = -(-self._used // ALIGN) * ALIGN
        if self._chunk is None or start + nbytes > self._chunk.numel():
            chunk = self._map(self.chunk_bytes)
            if chunk is None:
                return torch.empty(shape, dtype=dtype)
            self._chunk, start = chunk, 0
        self._used = start + nbytes
        self.allocated += nbytes
        return self._chunk[start:start + nbytes].view(dtype).view(shape)

    def _map(self, nbytes: int) -> torch.Tensor | None:
        """A chunk of at least `nbytes` starting on a huge page, advised before any touch;
        None where the host refuses the mapping (a strict overcommit limit counts a
        chunk's untouched rest too): the tensor then takes torch's own allocation."""
        size = -(-nbytes // HUGE_PAGE) * HUGE_PAGE
        # One huge page more, so that the chunk can start on a huge-page boundary.
        try:
            buffer = private_mapping(size + HUGE_PAGE)
        except OSError as e:
            log.warning("no %d-byte mapping for the blocks (%s): torch allocates them", size, e)
            return None
        whole = torch.frombuffer(buffer, dtype=torch.uint8)
        skip = -whole.data_ptr() % HUGE_PAGE
        advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
        if advice is not None and self.advise:
            try:
                buffer.madvise(advice, skip, size)
            except OSError:  # a kernel without transparent huge pages: ordinary pages
                pass
        return whole[skip:skip + size]


def huge_page_bytes() -> int | None:
    """Bytes of this process's anonymous memory on transparent huge pages (Linux's
    `/proc/self/smaps_rollup`), or None where the kernel does not say."""
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
