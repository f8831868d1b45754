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


def mapping_of(address: int) -> tuple[str, str]:
    """(permissions, backing) of this process's mapping that holds `address`."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        start, end = (int(v, 16) for v in fields[0].split("-"))
        if start <= address < end:
            return fields[1], fields[5] if len(fields) > 5 else ""
    raise LookupError(hex(address))


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux's /proc")
def test_a_cpu_pool_is_private_memory_not_shmem() -> None:
    """A shared anonymous mapping (mmap's default) is shmem: slower to fault in, and
    outside the host's transparent-huge-page setting, which the pool should follow."""
    pool = zeroed_pool((16, 2**16), torch.float32, torch.device("cpu"))  # 4 MiB
    perms, backing = mapping_of(pool.data_ptr())
    assert perms.endswith("p") and "/dev/zero" not in backing, (perms, backing)


def test_a_model_the_host_cannot_hold_is_refused_before_any_weight_is_read(tiny_dir,
                                                                            monkeypatch):
    """The host's MemAvailable (faked: no machine here is small enough to hold less than
    a real model) below the weights' floor plus the KV pool: the load stops before any
    weight is read, with the arithmetic; above it, the model loads."""
    from app.config import EngineConfig
    from app.engine.core import EngineCore
    from gpu import memory

    weights = sum(p.stat().st_size for p in Path(tiny_dir).glob("*.safetensors"))
    assert memory.checkpoint_bytes(tiny_dir) == weights
    kv = 64 << 20
    config = EngineConfig.from_kwargs(model=str(tiny_dir), dtype="float32",
                                      kv_cache_memory=kv, max_model_len=256)
    read = []
    monkeypatch.setattr(memory, "mem_available", lambda: kv)  # the pool, and no weights
    import models.decoder

    original = models.decoder.DecoderForCausalLM.load_weights
    monkeypatch.setattr(models.decoder.DecoderForCausalLM, "load_weights",
                        lambda self, *a, **k: read.append(1) or original(self, *a, **k))
    with pytest.raises(ValueError, match=r"this host cannot hold the model: .* GiB is "
                                         r"available \(MemAvailable\)"):
        EngineCore(config)
    assert read == []
    monkeypatch.setattr(memory, "mem_available", lambda: weights + kv + (64 << 20))
    core = EngineCore(config)
    core.shutdown()
    assert read == [1]


def test_a_gguf_served_from_its_blocks_counts_the_file_not_dense_weights(tmp_path):
    """The floor of a GGUF's weights is the file the blocks are read from (what they
    hold at least) beside the directory's own safetensors, not the dense parameters."""
    from gpu import memory
    from models.gguf_blocks import BlockSource, save

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"\0" * 4096)
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "norms.safetensors").write_bytes(b"\0" * 100)
    save({"w": BlockSource("w", "Q4_K", 0, 4096, 32, 256, "q4_1")}, gguf, tmp_path / "model")
    assert memory.checkpoint_bytes(tmp_path / "model") == 4096 + 100


def test_the_whole_context_by_default_lowered_to_what_the_pool_holds(tiny_dir, caplog):
    """vLLM's default: the model's whole context (the tiny model's 1024 tokens); a pool too
    small for one sequence of it lowers it, and the log says so and why. A length asked
    for that the pool cannot hold is still refused."""
    from app.config import EngineConfig
    from app.engine.core import EngineCore

    whole = EngineCore(EngineConfig.from_kwargs(model=str(tiny_dir), dtype="float32"))
    try:
        assert whole.max_model_len == 1024
    finally:
        whole.shutdown()
    per_token = whole.kv_plan.bytes_per_token
    small = dict(model=str(tiny_dir), dtype="float32", kv_cache_memory=512 * per_token)
    with caplog.at_level("WARNING", logger="ridgeline.memory"):
        core = EngineCore(EngineConfig.from_kwargs(**small))
    try:
        assert core.max_model_len == 512 == core.config.scheduler.max_model_len
        assert core.kv_plan.max_model_len == 512
    finally:
        core.shutdown()
    assert "max_model_len lowered from 1024 (the model's context) to 512" in caplog.text
    with pytest.raises(ValueError, match="fewer than max_model_len=1024"):
        EngineCore(EngineConfig.from_kwargs(**small, max_model_len=1024))


def test_a_gguf_plan_counts_the_weights_as_they_are_held():
    """The embedded GGUF served from its blocks: the server's plan logs what its layers
    hold once read, the offline plan the file's blocks (a Q4_1's float32 scales make the
    first ~15-20 % more), within 25 % of each other and both far under the dense
    arithmetic (which counts every weight in the served dtype)."""
    from app.config import EngineConfig
    from app.engine.core import EngineCore
    from app.engine.plan import offline_plan

    config = EngineConfig.from_kwargs(kv_cache_memory=64 << 20, max_model_len=512)
    offline = offline_plan(config)
    core = EngineCore(config)
    try:
        served = core.kv_plan.weights_bytes
        dense = core.cost.weights_bytes
    finally:
        core.shutdown()
    assert offline["memory"]["weights_bytes"] == pytest.approx(served, rel=0.25)
    assert served < 0.6 * dense
    assert any("GGUF's blocks" in note for note in offline["notes"])
