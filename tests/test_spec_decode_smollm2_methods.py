"""Suffix decoding and a draft model on the real SmolLM2: greedy, the same tokens as
plain decoding on prompts the answer repeats, with drafts accepted; the prefix cache
cold then hot, and preemption in a small pool. The draft model is SmolLM2 itself, so
nearly every draft is accepted. In float32: under bfloat16 the verification's
multi-row products round differently from a decode step's, and a near tie can flip."""

from __future__ import annotations

import pytest

from app import LLM, SamplingParams
from tests.test_spec_decode_smollm2 import repeat_prompt

pytestmark = pytest.mark.slow

PARAMS = SamplingParams(max_tokens=48, temperature=0.0)


@pytest.fixture(scope="module")
def case(smollm2_dir):
    llm = LLM(str(smollm2_dir), max_model_len=1024, dtype="float32")
    prompts = [repeat_prompt(llm.tokenizer, slice(10, 30)),
               repeat_prompt(llm.tokenizer, slice(40, 60))]
    want = [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    llm.shutdown()
    return prompts, want


@pytest.mark.parametrize("method", ["suffix", "draft_model"])
def test_smollm2_greedy_equals_plain(smollm2_dir, case, method):
    prompts, want = case
    spec = {"method": method, "num_speculative_tokens": 4}
    if method == "draft_model":
        spec |= {"model": str(smollm2_dir), "draft_window": 512}
    llm = LLM(str(smollm2_dir), max_model_len=1024, dtype="float32", speculative_config=spec)
    for _ in range(2):  # cold, then hot
        assert [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == want
    total = llm.engine.speculator.total
    assert total.num_accepted_tokens > 40
    if method == "draft_model":
        assert total.num_accepted_tokens > 0.9 * total.num_draft_tokens
    llm.engine.check_invariants()
    llm.shutdown()
    # A pool that holds both prompts but not both answers: one is preempted.
    blocks = sum(-(-len(p) // 16) for p in prompts) + 2
    llm = LLM(str(smollm2_dir), max_model_len=blocks * 16, block_size=16, num_blocks=blocks,
              dtype="float32", speculative_config=spec)
    assert [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == want
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_invariants()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    llm.shutdown()
