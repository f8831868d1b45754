"""Suffix decoding and the draft model on a tiny random Llama, through `LLM.generate`:
greedy output equal to plain decoding (prefix cache cold and hot, chunked prefill and
preemption), the global tree drafting a repeated request from its first token, each
request's tree dropped when it finishes or is aborted, the model as its own draft
accepted throughout, a draft model of another vocabulary refused, no block held after."""

from __future__ import annotations

import pytest
import torch

from app import LLM, SamplingParams
from models.tiny import make_tiny_llama
from tests.test_spec_decode import GREEDY, assert_clean, make_llm

BASE = {"num_speculative_tokens": 4, "disable_by_batch_size": 1000}
SETTINGS = {"cold": {}, "no_prefix_cache": dict(enable_prefix_caching=False),
            # 24 blocks of 4 for 5 requests of up to 71 tokens: preemption is certain; a
            # 16-token budget is smaller than the longer prompts: they prefill in chunks.
            "preempt_chunked": dict(num_blocks=24, block_size=4, max_num_batched_tokens=16,
                                    max_model_len=80)}


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(3, 49000, (n,), generator=g).tolist() * 2 for n in (2, 5, 9, 16)]


@pytest.fixture(scope="module")
def plain(tiny_dir, prompts):
    llm = make_llm(tiny_dir)
    out = [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    llm.shutdown()
    return out


def spec(method: str, tiny_dir, **kw) -> dict:
    extra = {"model": str(tiny_dir)} if method == "draft_model" else {}
    return {"method": method, **BASE, **extra, **kw}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("method", ["suffix", "draft_model"])
def test_greedy_equals_plain(tiny_dir, prompts, plain, method, setting):
    llm = make_llm(tiny_dir, spec(method, tiny_dir), **SETTINGS[setting])
    for _ in range(2):  # the second time the prefix cache is hot, the global tree full
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain
    total = llm.engine.speculator.total
    # The random model seldom repeats itself: suffix drafts come from the first pass's
    # answers; the model drafting for itself agrees with itself.
    assert total.num_accepted_tokens > 0.9 * total.num_draft_tokens > 0
    if setting == "preempt_chunked":
        assert llm.engine.scheduler.num_preemptions > 0
    if setting == "cold":
        assert llm.engine.blocks.num_cached_blocks > 0
    assert_clean(llm)
    llm.shutdown()


def test_suffix_global_tree_drafts_a_repeated_request_from_its_first_token(tiny_dir, prompts,
                                                                           plain):
    llm = make_llm(tiny_dir, spec("suffix", tiny_dir))
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    proposer = llm.engine.speculator.proposer
    assert proposer.requests == {} and len(proposer.global_trees[None].seqs) == 1
    before = llm.engine.speculator.total.num_drafts
    # The same prompt again: each step but the first drafts, 1 + 1 + 4 + 4 ... tokens.
    out = llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0]
    assert out.token_ids == plain[0]
    total = llm.engine.speculator.total
    steps = total.num_drafts - before
    assert steps <= 2 + (GREEDY.max_tokens - 5) // 5 + 1
    assert total.num_accepted_tokens == total.num_draft_tokens
    assert_clean(llm)
    llm.shutdown()


def test_suffix_trees_are_dropped_after_finish_and_abort(tiny_dir, prompts):
    llm = make_llm(tiny_dir, spec("suffix", tiny_dir, suffix_decoding_max_cached_requests=2))
    engine = llm.engine
    proposer = engine.speculator.proposer
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=30, temperature=0,
                                                      ignore_eos=True))
    for _ in range(6):
        engine.step()
    assert set(proposer.requests) == {f"r{i}" for i in range(len(prompts))}
    engine.abort("r1")
    assert "r1" not in proposer.requests
    while engine.has_work:
        engine.step()
    assert proposer.requests == {}
    assert len(proposer.global_trees[None].seqs) == 2  # the cap
    assert_clean(llm)
    llm.shutdown()


def test_a_draft_model_of_another_vocabulary_is_refused(tiny_dir, smollm2_dir, tmp_path):
    other = make_tiny_llama(tmp_path / "other", smollm2_dir, vocab_size=1024)
    with pytest.raises(ValueError, match="vocabulary of 1024 tokens, the target 49152"):
        LLM(str(tiny_dir), max_model_len=128,
            speculative_config=spec("draft_model", tiny_dir, model=str(other)))


def test_a_different_draft_model_keeps_the_output(tiny_dir, smollm2_dir, tmp_path, prompts,
                                                  plain):
    other = make_tiny_llama(tmp_path / "seed1", smollm2_dir, seed=1)
    llm = make_llm(tiny_dir, spec("draft_model", tiny_dir, model=str(other), draft_window=8))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == plain
    total = llm.engine.speculator.total
    assert total.num_drafts > 0 and total.num_accepted_tokens < total.num_draft_tokens
    assert_clean(llm)
    llm.shutdown()
