"""Speculative decoding's draft model on the GPU path (`gpu/draft.py`).

On CUDA the KV pool is sized from the GPU's memory, so the draft model must be in the
arithmetic: its weights are subtracted beside the target's, and its largest call runs
in the memory profile (`gpu/profiling.py`). Off CUDA the plan takes an explicit
budget, so the arithmetic is checked on its function, the profile's draft call by
running it, and the engine path through the Triton backend (interpreted) and the
verify graphs' CPU replay against plain decoding.
"""

from __future__ import annotations

import logging

import pytest
import torch

from app.engine.sampling_params import SamplingParams
from gpu.draft import DraftModel
from gpu.memory import GiB, plan_kv_cache
from gpu.profiling import MemoryProfile, profile_memory
from gpu.runner import cpu_capabilities, make_backend
from models.config import ModelConfig
from tests.test_spec_decode import assert_clean, make_llm
from tests.test_spec_verify_graphs import BLOCK, DEVICE, graph_dir  # noqa: F401

PLAN = dict(bytes_per_token=4096, block_size=16, max_model_len=1024, weights_bytes=2 * GiB,
            total_device_bytes=16 * GiB, gpu_memory_utilization=0.9,
            peak_activation_bytes=GiB // 2, graph_bytes=GiB // 8)


def test_the_pool_shrinks_by_the_draft_models_bytes(caplog) -> None:
    """Every byte of the draft's weights comes out of the pool, and the logged
    arithmetic names it."""
    draft = 96 << 20  # whole blocks: 96 MiB / (16 × 4096 B) = 1536 blocks
    without = plan_kv_cache(**PLAN)
    with caplog.at_level(logging.INFO, logger="ridgeline.memory"):
        with_draft = plan_kv_cache(**PLAN, draft_bytes=draft)
    assert without.kv_bytes - with_draft.kv_bytes == draft
    assert without.num_blocks - with_draft.num_blocks == draft // (16 * 4096)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("GPU"))
    assert "- weights 2.00 GiB - draft model 0.09 GiB - peak activations 0.50 GiB" in line
    # Off the GPU's arithmetic (an explicit budget) the draft takes nothing from it.
    assert plan_kv_cache(**PLAN | dict(total_device_bytes=None), kv_cache_memory=GiB,
                         draft_bytes=draft).kv_bytes == GiB


@pytest.fixture(scope="module")
def draft(graph_dir):  # noqa: F811
    return DraftModel(str(graph_dir), torch.float32, torch.device(DEVICE), max_positions=128)


def test_the_largest_call_guesses_from_a_full_window(draft) -> None:
    assert draft.nbytes == sum(p.numel() * 4 for p in draft.model.parameters())
    out = draft.largest_call(window=100, num_tokens=4)()
    assert len(out) == 1 and len(out[0]) == 4
    assert all(0 <= t < draft.config.vocab_size for t in out[0])


def test_the_profile_runs_the_draft_models_largest_call(graph_dir, draft) -> None:  # noqa: F811
    """The draft runs between steps on the same thread: the profile measures its call
    and keeps the larger peak (0 off CUDA, where the allocator is not measured)."""
    cfg, device = ModelConfig.from_dir(graph_dir), torch.device(DEVICE)
    backend = make_backend("torch", device, cfg, BLOCK, cpu_capabilities("torch", device))
    calls = []
    call = draft.largest_call(window=64, num_tokens=3)
    profile = profile_memory(draft.model, backend, device=device, dtype=torch.float32,
                             max_num_batched_tokens=64, max_num_seqs=4, max_model_len=128,
                             graph_sizes=[], draft_call=lambda: calls.append(call()))
    assert len(calls) == 1 and len(calls[0][0]) == 3
    if DEVICE != "cuda":
        assert profile == MemoryProfile(0, 0)


def test_draft_model_is_no_longer_refused_on_cuda(tiny_dir, monkeypatch) -> None:
    """On CUDA the engine hands the draft model and its window to the model thread
    (whose plan counts it) instead of refusing; the thread is stubbed, no GPU needed."""
    import app.engine.core as core

    seen = []

    class Stop(Exception):
        pass

    class StubWorker:
        def __init__(self, spec):
            seen.append(spec)

        def wait_ready(self):
            raise Stop

    monkeypatch.setattr(core, "Worker", StubWorker)
    spec = {"method": "draft_model", "model": str(tiny_dir), "num_speculative_tokens": 2,
            "draft_window": 16}
    with pytest.raises(Stop):
        make_llm(tiny_dir, spec, device="cuda")
    assert seen[0].device == "cuda" and seen[0].draft_model_dir is not None
    assert seen[0].draft_window == 16 and seen[0].num_speculative_tokens == 2


def test_engine_draft_model_through_verify_graphs_equals_plain(graph_dir) -> None:  # noqa: F811
    """Greedy ids with the draft model proposing (a window of 8 tokens: some guesses
    wrong), verified through the Triton backend and the verify graphs, are plain
    decoding's, token for token, in float32."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() * 3 for n in (2, 7)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    kw = dict(attention_backend="triton", max_num_seqs=4, device=DEVICE,
              skip_tokenizer_init=True, enforce_eager=True, num_blocks=64, block_size=BLOCK)
    plain = make_llm(graph_dir, **kw)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    plain.shutdown()

    spec = {"method": "draft_model", "model": str(graph_dir), "num_speculative_tokens": 3,
            "draft_window": 8}
    llm = make_llm(graph_dir, spec, **kw)
    runner = llm.engine.worker.wait_ready()
    assert runner.draft is not None and runner.spec.draft_window == 8
    runner.graph_sizes = [1, 2, 4]  # off CUDA the runner captures nothing by itself
    runner.graphs = runner._capture_graphs()
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    total = llm.engine.speculator.total
    assert 0 < total.num_accepted_tokens < total.num_draft_tokens  # rejections rolled back
    assert runner.graphs.verify.replays > 0
    assert_clean(llm)
    llm.shutdown()


def test_the_runner_profiles_the_draft_at_its_window(graph_dir, monkeypatch) -> None:  # noqa: F811
    """Where the pool is sized from the GPU's memory, the runner's profile gets the
    draft's call at the configured window and k guesses (here forced on CPU)."""
    import gpu.runner

    spec = {"method": "draft_model", "model": str(graph_dir), "num_speculative_tokens": 3,
            "draft_window": 24}
    llm = make_llm(graph_dir, spec, skip_tokenizer_init=True, num_blocks=16, block_size=BLOCK)
    runner = llm.engine.worker.wait_ready()
    seen = {}
    monkeypatch.setattr(runner, "_auto_sized", lambda: True)
    monkeypatch.setattr(gpu.runner, "profile_memory", lambda *a, **kw: seen.update(kw))
    jobs = []
    monkeypatch.setattr(runner.draft, "propose", jobs.append)
    runner._profile()
    seen["draft_call"]()
    assert len(jobs[0].windows[0]) == 24 and jobs[0].num_tokens == [3]
    llm.shutdown()
