"""LoRA adapters on the real SmolLM2 (the embedded GGUF, converted: a GGUF-loaded base
whose few-row matmuls read the quantized blocks): PEFT adapters with random weights
large enough to change the answer; greedy ids in a batch mixing both adapters and the
base equal those of PEFT's merged model in transformers."""

from __future__ import annotations

import pytest
import torch

from app import LLM, SamplingParams
from tests.hf_reference import hf_greedy
from tests.lora_adapters import ATTENTION, MLP, make_adapter

pytest.importorskip("peft")
pytestmark = pytest.mark.slow

NUM_TOKENS = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land"]
ADAPTERS = {"everything": (ATTENTION + MLP, 8, 16), "attention": (["q_proj", "v_proj"], 16, 32)}


def test_mixed_adapters_on_smollm2_match_peft_merged(smollm2_dir, smollm2_tokenizer,
                                                     tmp_path):
    from transformers import AutoModelForCausalLM

    prompts = [smollm2_tokenizer.encode(p) for p in PROMPTS]
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    expected = {None: [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]}
    del hf
    for i, (name, (targets, r, alpha)) in enumerate(ADAPTERS.items()):
        merged = make_adapter(smollm2_dir, tmp_path / name, targets, r, alpha, seed=i,
                              std=0.05)
        expected[name] = [hf_greedy(merged, p, NUM_TOKENS) for p in prompts]
        assert expected[name] != expected[None]
        del merged
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=256, enable_lora=True,
              max_loras=2, lora_modules=[f"{n}={tmp_path / n}" for n in ADAPTERS])
    try:
        names = [None, *ADAPTERS]
        jobs = [(i, n) for i in range(len(prompts)) for n in names]
        outs = llm.generate([prompts[i] for i, _ in jobs],
                            [SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0,
                                            ignore_eos=True, lora_name=n) for _, n in jobs],
                            use_tqdm=False)
        got = {(i, n): o.token_ids for (i, n), o in zip(jobs, outs)}
        for i, n in jobs:
            assert got[(i, n)] == expected[n][i], (PROMPTS[i], n)
        llm.engine.check_invariants()
    finally:
        llm.shutdown()
