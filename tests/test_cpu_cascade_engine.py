"""Cascade decode attention end to end: a bf16 tiny random model serving requests that
share a long prompt prefix (held once by the prefix cache) gives the same greedy ids with
cascade attention as with the per-row decode kernel, and cascade attention did run.

The kernel's own agreement with a torch reference is in test_cpu_cascade_decode.py."""

from __future__ import annotations

import pytest
import torch

from app.engine.sampling_params import SamplingParams
from app.llm import LLM
from gpu.cpu.capabilities import CpuCapabilities
from gpu.cpu.kernels.build import cpu_kernels
from models.tiny import make_tiny_llama

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
CAPS = CpuCapabilities.of(KERNELS)
needs_amx = pytest.mark.skipif(
    not (CAPS.amx and CAPS.has("cascade_decode_amx_")),
    reason="needs the C++ kernels built with AMX-BF16 and Linux's grant of the tile state")


@needs_amx
def test_shared_prefix_batch_gives_the_same_greedy_ids_with_cascade_on_and_off(
        tmp_path, smollm2_dir) -> None:
    # head_dim 64 (the tile kernels take multiples of 32), GQA 3 as SmolLM2's.
    model = make_tiny_llama(tmp_path / "tiny", smollm2_dir, head_dim=64,
                            num_attention_heads=6, num_key_value_heads=2)
    system = ("You are a careful assistant for a hardware shop. Answer briefly, cite the "
              "part number, and never invent stock levels. ") * 12
    questions = ["Do you sell 2 TB drives?", "Which fans fit a 1U case?",
                 "Is the 650 W supply modular?", "How long is the warranty on cables?",
                 "Can I return an opened keyboard?", "What is the lead time on racks?"]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results = {}
    for cascades in (True, False):
        llm = LLM(model=str(model), dtype="bfloat16", max_model_len=512,
                  kv_cache_memory="64MiB")
        try:
            backend = llm.engine.worker.wait_ready().backend
            backend.cascades = cascades
            calls = []
            backend._cascade = lambda *a, calls=calls, run=backend._cascade: (
                calls.append(1) or run(*a))
            llm.generate([system + "Hello."], params)  # the system prompt into the cache
            results[cascades] = [o.token_ids for o in
                                 llm.generate([system + q for q in questions], params)]
            assert bool(calls) == cascades
        finally:
            llm.shutdown()
    assert results[True] == results[False]
