"""The KV pool arithmetic (`gpu/memory.py`): what is left after weights, activations and
graphs, and never memory that was already in use when the runner started."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from gpu.memory import GiB, plan_kv_cache, zeroed_pool

PER_TOKEN = 128 << 10  # Llama-3-8B in bf16


def plan(**kw):
    args = dict(bytes_per_token=PER_TOKEN, block_size=16, max_model_len=8192,
                weights_bytes=15 * GiB, total_device_bytes=140 * GiB,
                gpu_memory_utilization=0.9, peak_activation_bytes=2 * GiB,
                graph_bytes=GiB // 2)
    return plan_kv_cache(**(args | kw))


def test_an_empty_gpu_gives_utilization_times_total_minus_the_rest():
    expect = int(140 * GiB * 0.9) - int(17.5 * GiB)
    assert plan().kv_bytes == expect // (16 * PER_TOKEN) * 16 * PER_TOKEN
    assert plan(free_device_bytes=140 * GiB).kv_bytes == plan().kv_bytes


def test_memory_in_use_at_start_is_not_given_away():
    """Another process holds 40 GiB: the headroom (10% of total) is still left free."""
    shared = plan(free_device_bytes=100 * GiB)
    usable = 100 * GiB - (140 * GiB - int(140 * GiB * 0.9))
    assert shared.kv_bytes <= usable - int(17.5 * GiB)
    assert shared.kv_bytes > usable - int(17.5 * GiB) - 16 * PER_TOKEN
    # A CUDA context's worth in use (it is this process's too) comes out of the pool.
    assert plan().kv_bytes - plan(free_device_bytes=139 * GiB).kv_bytes <= GiB


def test_a_cpu_pool_is_zero_writable_and_outlives_its_mapping() -> None:
    """The CPU pool comes from an anonymous mapping (zero pages on first touch); the
    tensor must be all zeros, hold its own reference to the mapping, and take writes."""
    pools = [zeroed_pool((64, 3, 16, 64), dtype, torch.device("cpu"))
             for dtype in (torch.float32, torch.bfloat16)]
    gc.collect()  # nothing but the tensors refers to the mappings now
    for pool, dtype in zip(pools, (torch.float32, torch.bfloat16)):
        assert pool.shape == (64, 3, 16, 64) and pool.dtype == dtype
        assert pool.is_contiguous() and not pool.any()
        pool[7].fill_(1.5)
        assert pool.sum().item() == 1.5 * 3 * 16 * 64
    assert zeroed_pool((0, 3), torch.float32, torch.device("cpu")).shape == (0, 3)


def huge_kb_backing(address: int) -> int | None:
    """AnonHugePages (kB) of this process's mapping that holds `address` (None: none)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(v, 16) for v in head.split("-"))
            inside = start <= address < end
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return None


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists()
                    or "[never]" in Path("/sys/kernel/mm/transparent_hugepage/enabled")
                    .read_text(), reason="the host has no transparent huge pages")
def test_a_cpu_pool_sits_on_huge_pages() -> None:
    """Decode attention jumps to another 4 KB block every 16 tokens: on huge pages it
    takes ~0.82x the time. A shared anonymous mapping (shmem) would silently get none."""
    pool = zeroed_pool((64, 2**20), torch.float32, torch.device("cpu"))  # 256 MiB
    pool.fill_(1.0)  # first touch: the pages are faulted in now
    assert huge_kb_backing(pool.data_ptr() + pool.nbytes // 2) >= 2048
