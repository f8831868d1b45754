"""Parity with Hugging Face transformers on the real SmolLM2-135M-Instruct (float32)."""

from __future__ import annotations

import pytest
import torch

from app import LLM, SamplingParams
from models.tokenizer import apply_chat_template
from tests.hf_reference import hf_greedy

QUESTIONS = [
    "Hi",
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "Explain in one paragraph why the sky is blue, mentioning Rayleigh scattering.",
    "List the planets of the solar system in order from the sun, with one fact about each.",
    "Translate to French: The cat sleeps on the warm windowsill while the rain falls outside.",
    "You are a careful assistant. Summarise the plot of Romeo and Juliet in three sentences, "
    "then give one lesson a modern reader could take from it, and finally suggest a film.",
]
N_TOKENS = 32


@pytest.fixture(scope="module")
def chat_prompts(smollm2_tokenizer):
    return [apply_chat_template(smollm2_tokenizer, [{"role": "user", "content": q}])
            for q in QUESTIONS]


@pytest.fixture(scope="module")
def hf_expected(hf_gguf_model, chat_prompts):
    return [hf_greedy(hf_gguf_model, p, N_TOKENS) for p in chat_prompts]


@pytest.fixture(scope="module")
def llm():
    engine = LLM(dtype="float32", max_model_len=512)
    yield engine
    engine.shutdown()


GREEDY = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)


def test_prompts_differ_in_length(chat_prompts):
    assert len({len(p) for p in chat_prompts}) == len(chat_prompts)


def test_greedy_parity_with_transformers(llm, chat_prompts, hf_expected):
    outs = llm.generate(chat_prompts, GREEDY, use_tqdm=False)
    for out, ref in zip(outs, hf_expected, strict=True):
        assert out.token_ids == ref
    llm.engine.check_invariants()


def test_greedy_parity_with_preemption_and_chunked_prefill(chat_prompts, hf_expected):
    longest = max(len(p) for p in chat_prompts)
    # 8 requests of up to ~100 tokens in a 160-token pool; a budget below the longest prompt.
    small = LLM(dtype="float32", max_model_len=160, num_blocks=20, block_size=8,
                max_num_batched_tokens=longest // 2)
    try:
        outs = small.generate(chat_prompts, GREEDY, use_tqdm=False)
        assert small.engine.scheduler.num_preemptions > 0
        assert [o.token_ids for o in outs] == hf_expected
        assert small.engine.blocks.num_free_blocks == 20
        small.engine.check_invariants()
    finally:
        small.shutdown()


def test_repetition_penalty_counts_the_prompt_as_transformers_does(llm, hf_gguf_model,
                                                                   smollm2_tokenizer):
    """Parity with HF's generate. The first token has no output behind it, so only the
    prompt's tokens can penalize it: it must differ from the unpenalized greedy one."""
    prompts = [smollm2_tokenizer.encode(t) for t in (
        "red, green, blue, red, green, blue, red, green,", "1 2 3 4 5 1 2 3 4 5 1 2 3")]
    params = SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0,
                            repetition_penalty=1.3)  # min_tokens: HF's min_new_tokens
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        with torch.inference_mode():
            ref = hf_gguf_model.generate(torch.tensor([prompt]), do_sample=False,
                                         repetition_penalty=1.3, max_new_tokens=8,
                                         min_new_tokens=8)[0, len(prompt):].tolist()
        assert out.token_ids == ref
        assert out.token_ids[0] != hf_greedy(hf_gguf_model, prompt, 1)[0]


def test_capital_of_france(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)[0]
    assert out.text == "The capital of France is Paris."
    assert out.finish_reason == "stop"  # <|im_end|>, not the length limit
