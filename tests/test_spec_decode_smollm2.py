"""Speculative decoding on the real SmolLM2: a prompt the answer repeats, greedy, the
same tokens as plain decoding, with drafts accepted and rejected; cold and hot prefix
cache, chunked prefill, and preemption in a small pool. In float32: in bfloat16 the CPU's
matmul kernels depend on a call's row count, so a near-tie can fall either way whenever
the batch's shape changes, with or without drafts (docs/speculative.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from app import LLM, SamplingParams

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
        "prompt_lookup_max": 5}
PARAMS = SamplingParams(max_tokens=96, temperature=0.0)


def repeat_prompt(tokenizer, lines: slice) -> list[int]:
    code = "\n".join((ROOT / "app/engine/stop.py").read_text().splitlines()[lines])
    ask = f"Repeat this Python code exactly.\n\n{code}"
    chat = tokenizer.apply_chat_template([{"role": "user", "content": ask}],
                                         add_generation_prompt=True, tokenize=True)
    return chat + tokenizer.encode("```python\n")


@pytest.fixture(scope="module")
def plain(smollm2_dir):
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=1024)
    yield llm
    llm.shutdown()


def test_smollm2_greedy_with_ngram_equals_plain(smollm2_dir, plain):
    prompts = [repeat_prompt(plain.tokenizer, slice(10, 40)),
               repeat_prompt(plain.tokenizer, slice(40, 70))]
    want = [o.token_ids for o in plain.generate(prompts, PARAMS, use_tqdm=False)]
    # Chunked prefill (64 tokens a step), then the same prompts again with the cache hot.
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=1024, max_num_batched_tokens=64,
              long_prefill_token_threshold=64, speculative_config=SPEC)
    for _ in range(2):
        assert [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == want
    total = llm.engine.speculator.total
    assert total.num_accepted_tokens > 30  # the answer repeats the prompt
    assert total.num_accepted_tokens < total.num_draft_tokens  # and departs from it
    llm.engine.check_invariants()
    llm.shutdown()
    # A pool that holds both prompts but not both answers: one is preempted and recomputed.
    assert all(len(w) == PARAMS.max_tokens for w in want)
    blocks = sum(-(-len(p) // 16) for p in prompts) + 3
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=blocks * 16, block_size=16,
              num_blocks=blocks, speculative_config=SPEC)
    assert [o.token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)] == want
    assert llm.engine.scheduler.num_preemptions > 0
    llm.engine.check_invariants()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    llm.shutdown()
