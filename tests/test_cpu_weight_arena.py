"""The weights' arena (`gpu/cpu/weight_arena.py`): tensors carved from chunks advised onto
huge pages, apart and aligned, freed with their last tensor; a GGUF's blocks land there
at load, and `RIDGELINE_HUGE_PAGES=0` maps them without the advice."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import pytest
import torch

from gpu.cpu.linear import PackedLinear
from gpu.cpu.packing import pack_linears
from gpu.cpu.weight_arena import ALIGN, HUGE_PAGE, WeightArena
from models import gguf_blocks
from tests.test_cpu_blocks_only import KERNELS, needs_kernels
from tests.test_quantized_weights import load_model

linux_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux")
    or not Path("/sys/kernel/mm/transparent_hugepage").exists(),
    reason="madvise(MADV_HUGEPAGE) is Linux's, with transparent huge pages built in")


def mapping_of(ptr: int) -> tuple[int, int, set[str]] | None:
    """The mapping of this process holding address `ptr`: start, end, VmFlags."""
    found = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
            found = (start, end) if start <= ptr < end else None
        elif found and line.startswith("VmFlags:"):
            return (*found, set(line.split()[1:]))
    return None


def test_tensors_are_apart_aligned_and_keep_their_values():
    arena = WeightArena(chunk_bytes=HUGE_PAGE)
    shapes = [((3, 5), torch.uint8), ((7,), torch.int32), ((2, 3, 4), torch.float32),
              ((0, 4), torch.float32), ((100_000,), torch.uint8), ((9,), torch.int8)]
    tensors = [arena.empty(*shape, dtype=dtype) for shape, dtype in shapes]
    tensors.append(arena.empty((4, 4), dtype=torch.float32))  # one tuple, as torch.empty
    for t, (shape, dtype) in zip(tensors, shapes, strict=False):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
    assert tensors[-1].shape == (4, 4)
    real = [t for t in tensors if t.numel()]
    assert all(t.data_ptr() % ALIGN == 0 for t in real)
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in real)
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    for i, t in enumerate(real):
        t.view(torch.uint8).fill_(i + 1)
    for i, t in enumerate(real):
        assert bool((t.view(torch.uint8) == i + 1).all())
    assert arena.allocated == sum(t.nbytes for t in real)


def test_a_tensor_past_the_chunk_size_maps_its_own_and_the_chunk_goes_on():
    arena = WeightArena(chunk_bytes=HUGE_PAGE)
    a = arena.empty(1000, dtype=torch.uint8)
    big = arena.empty(3 * HUGE_PAGE, dtype=torch.uint8)
    c = arena.empty(10, dtype=torch.uint8)
    assert c.data_ptr() == a.data_ptr() + 1024  # right after a, on the next cache line
    assert not a.data_ptr() <= big.data_ptr() < a.data_ptr() + HUGE_PAGE
    d = arena.empty(HUGE_PAGE, dtype=torch.uint8)  # does not fit the rest: a new chunk
    assert d.data_ptr() % HUGE_PAGE == 0 and big.data_ptr() % HUGE_PAGE == 0


@linux_thp
@pytest.mark.parametrize("env, advised", [(None, True), ("0", False), ("1", True)])
def test_chunks_start_on_a_huge_page_advised_unless_switched_off(monkeypatch, env, advised):
    if env is None:
        monkeypatch.delenv("RIDGELINE_HUGE_PAGES", raising=False)
    else:
        monkeypatch.setenv("RIDGELINE_HUGE_PAGES", env)
    arena = WeightArena(chunk_bytes=4 * HUGE_PAGE)
    t = arena.empty(HUGE_PAGE + 1, dtype=torch.uint8)
    assert t.data_ptr() % HUGE_PAGE == 0 and arena.advise is advised
    start, end, flags = mapping_of(t.data_ptr())
    assert start <= t.data_ptr() and t.data_ptr() + 4 * HUGE_PAGE <= end
    assert ("hg" in flags) is advised


@linux_thp
def test_a_chunk_is_unmapped_with_its_last_tensor():
    arena = WeightArena(chunk_bytes=HUGE_PAGE)
    a, b = arena.empty(100, dtype=torch.uint8), arena.empty(100, dtype=torch.uint8)
    ptr = a.data_ptr()
    del arena, a
    gc.collect()
    assert mapping_of(ptr) is not None  # b holds the chunk
    del b
    gc.collect()
    assert mapping_of(ptr) is None


@linux_thp
@needs_kernels
def test_a_gguf_s_blocks_are_read_into_advised_chunks(smollm2_dir):
    """SmolLM2's GGUF packed as the runner does: every layer's block tensors lie in
    mappings advised onto huge pages."""
    model = load_model(smollm2_dir)
    pack_linears(model, gguf_blocks.load(smollm2_dir), KERNELS)
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    held = [t for m in layers for t in (*m._quantized_args[:-1], *m._dot_args[:-1])
            if isinstance(t, torch.Tensor) and t.numel()]
    assert len(layers) == 30 * 4 + 1 and len(held) >= len(layers)
    assert all("hg" in mapping_of(t.data_ptr())[2] for t in held)


def test_a_refused_mapping_leaves_the_tensor_to_torch(monkeypatch, caplog):
    """A host that refuses a chunk's mapping (strict overcommit counts its untouched
    rest): the tensors still come, from torch's allocator, and the load goes on."""
    import mmap as mmap_module

    def refuse(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    arena = WeightArena(chunk_bytes=HUGE_PAGE)
    kept = arena.empty(10, dtype=torch.uint8)  # a chunk mapped before the refusals
    monkeypatch.setattr(mmap_module, "mmap", refuse)
    small = arena.empty(2 * HUGE_PAGE, dtype=torch.uint8)  # past the chunk: its own
    other = arena.empty(HUGE_PAGE, dtype=torch.uint8)  # past the chunk's rest: a new one
    for t in (small, other):
        t.fill_(7)
        assert bool((t == 7).all())
    assert arena.allocated == kept.nbytes
    assert "torch allocates them" in caplog.text
