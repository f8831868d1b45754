"""Engine behaviour on a tiny random-weight Llama (fast), compared with HF transformers."""

from __future__ import annotations

import pytest
import torch

from app import LLM, SamplingParams
from app.engine.errors import ContextTooLong, InvalidParameter
from tests.hf_reference import hf_greedy

PROMPT_LENGTHS = [1, 3, 7, 12, 17, 26, 33, 41]


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49000, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def expected(hf_tiny, prompts):
    return [hf_greedy(hf_tiny, p, 32) for p in prompts]


def make_llm(tiny_dir, **kw) -> LLM:
    kw.setdefault("max_model_len", 128)
    kw.setdefault("dtype", "float32")
    return LLM(str(tiny_dir), **kw)


GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def test_greedy_parity_batched(tiny_dir, prompts, expected):
    llm = make_llm(tiny_dir)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == expected
    assert all(o.finish_reason == "length" for o in outs)
    assert llm.engine.scheduler.num_preemptions == 0
    llm.engine.check_invariants()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    llm.shutdown()


def test_greedy_parity_under_preemption_and_chunked_prefill(tiny_dir, prompts, expected):
    # 24 blocks x 4 = 96 slots for 8 requests wanting up to 73 each: preemption is certain.
    # A 16-token budget is smaller than the longest prompts: they prefill in chunks.
    llm = make_llm(tiny_dir, num_blocks=24, block_size=4, max_num_batched_tokens=16,
                   max_model_len=80)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert sum(o.metrics.num_preemptions for o in outs) == llm.engine.scheduler.num_preemptions
    llm.engine.check_invariants()
    assert llm.engine.blocks.num_free_blocks == 24
    llm.shutdown()


@pytest.mark.parametrize("policy", ["priority", "length"])
def test_other_preemption_policies_keep_parity(tiny_dir, prompts, expected, policy):
    llm = make_llm(tiny_dir, num_blocks=24, block_size=4, max_model_len=80,
                   preemption_policy=policy)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False, priority=list(range(8)))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.blocks.num_free_blocks == 24
    llm.shutdown()


def test_seeded_sampling_is_batch_independent(tiny_dir, prompts):
    llm = make_llm(tiny_dir)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=1234,
                            ignore_eos=True)
    alone = llm.generate([prompts[3]], seeded, use_tqdm=False)[0].token_ids
    unseeded = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    mixed = llm.generate(
        [prompts[0], prompts[3], prompts[5], prompts[7]],
        [unseeded, seeded, GREEDY, unseeded], use_tqdm=False,
    )
    assert mixed[1].token_ids == alone
    other_seed = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=50, seed=99,
                                ignore_eos=True)
    assert llm.generate([prompts[3]], other_seed, use_tqdm=False)[0].token_ids != alone
    llm.shutdown()


def test_top_k_one_and_temperature_zero_are_greedy(tiny_dir, prompts, expected):
    llm = make_llm(tiny_dir)
    out = llm.generate([prompts[2]], SamplingParams(max_tokens=32, top_k=1, ignore_eos=True),
                       use_tqdm=False)
    assert out[0].token_ids == expected[2]
    llm.shutdown()


def test_stop_strings_ids_min_max_tokens(tiny_dir, prompts, expected):
    llm = make_llm(tiny_dir)
    tok = llm.tokenizer
    ids = expected[4]
    # A stop string that straddles the boundary between generated tokens 5 and 6.
    t5, t6 = tok.decode(ids[:6]), tok.decode(ids[:7])
    full = tok.decode(ids)
    stop = t5[-2:] + t6[len(t5):][:2]
    assert len(stop) >= 3 and full.find(stop) == len(t5) - 2
    out = llm.generate([prompts[4]], SamplingParams(max_tokens=32, temperature=0, stop=[stop],
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.find(stop)]
    out = llm.generate([prompts[4]], SamplingParams(
        max_tokens=32, temperature=0, stop=[stop], include_stop_str_in_output=True,
        ignore_eos=True), use_tqdm=False)[0]
    assert out.text == full[: full.find(stop) + len(stop)]

    # A stop token id ends generation and is reported; min_tokens masks it until reached.
    stop_id = ids[3]
    out = llm.generate([prompts[4]], SamplingParams(max_tokens=32, temperature=0,
                                                    stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.token_ids == ids[: ids.index(stop_id) + 1] and out.stop_reason == stop_id
    out = llm.generate([prompts[4]], SamplingParams(max_tokens=32, min_tokens=8, temperature=0,
                                                    stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert len(out.token_ids) >= 8 and stop_id not in out.token_ids[:7]

    # Like vLLM, stop strings do not count before min_tokens.
    first = tok.decode(ids[:1])
    out = llm.generate([prompts[4]], SamplingParams(max_tokens=32, temperature=0, stop=[first],
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 1 and out.text == ""
    out = llm.generate([prompts[4]], SamplingParams(max_tokens=32, min_tokens=10, temperature=0,
                                                    stop=[first], ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.token_ids) >= 10 and out.text.startswith(first)

    # max_tokens
    out = llm.generate([prompts[4]], SamplingParams(max_tokens=5, temperature=0),
                       use_tqdm=False)[0]
    assert out.token_ids == ids[:5] and out.finish_reason == "length"
    llm.engine.check_invariants()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    llm.shutdown()


def test_eos_stops_unless_ignored(tiny_dir, prompts, expected):
    llm = make_llm(tiny_dir)
    ids = expected[6]
    eos = ids[2]  # pretend this token is EOS for this engine
    llm.engine.eos_token_ids = (eos,)
    out = llm.generate([prompts[6]], SamplingParams(max_tokens=32, temperature=0),
                       use_tqdm=False)[0]
    assert out.token_ids == ids[: ids.index(eos) + 1] and out.finish_reason == "stop"
    out = llm.generate([prompts[6]], SamplingParams(max_tokens=32, temperature=0,
                                                    ignore_eos=True), use_tqdm=False)[0]
    assert out.token_ids == ids
    out = llm.generate([prompts[6]], SamplingParams(max_tokens=32, min_tokens=10, temperature=0),
                       use_tqdm=False)[0]
    assert eos not in out.token_ids[:9] and len(out.token_ids) >= 10
    llm.shutdown()


def test_outputs_in_input_order_and_abort_frees_blocks(tiny_dir, prompts):
    llm = make_llm(tiny_dir)
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True)
              for m in (20, 3, 11, 1, 7, 2, 15, 4)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [20, 3, 11, 1, 7, 2, 15, 4]
    assert [o.prompt_token_ids for o in outs] == prompts

    eng = llm.engine
    eng.add_request("a", prompts[5], GREEDY)
    eng.add_request("b", prompts[6], GREEDY)
    eng.step()
    eng.step()
    assert eng.blocks.num_used_blocks > 0
    assert eng.abort("a").finish_reason == "abort"
    eng.check_invariants()
    scheduled = eng.schedule()  # b in flight: abort must wait for the step to return
    eng.abort("b")
    assert eng.blocks.num_used_blocks > 0
    out, batch = scheduled
    eng.process(out, eng.worker.submit(batch).result())
    eng.check_invariants()
    assert eng.blocks.num_free_blocks == eng.blocks.num_blocks and not eng.has_work
    llm.shutdown()


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.5}, "temperature"),
        ({"top_p": -0.1}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(InvalidParameter) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param
    assert str(list(kwargs.values())[0]) in str(e.value) or param in str(e.value)


def test_bad_prompts_leave_nothing_behind(tiny_dir):
    llm = make_llm(tiny_dir)
    with pytest.raises(InvalidParameter, match="empty"):
        llm.generate([[]], GREEDY, use_tqdm=False)
    with pytest.raises(ContextTooLong, match="maximum context length is 128 tokens") as e:
        llm.generate([[5] * 200], GREEDY, use_tqdm=False)
    assert e.value.param == "prompt"
    with pytest.raises(ContextTooLong, match=r"\(120 in the messages, 32 in the completion\)"):
        llm.generate([[5] * 120], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidParameter, match="outside the vocabulary"):
        llm.generate([[5, 10**6]], GREEDY, use_tqdm=False)
    # A valid prompt next to a bad one: nothing is queued.
    with pytest.raises(InvalidParameter):
        llm.generate([[5, 6], []], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="exactly one of"):
        llm.generate([{"prompt": "a", "prompt_token_ids": [5]}], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="must be ints"):
        llm.generate([{"prompt_token_ids": ["5"]}], GREEDY, use_tqdm=False)
    assert not llm.engine.has_work and llm.engine.num_unfinished == 0
    llm.engine.check_invariants()
    llm.shutdown()


def test_vllm_prompt_dicts(tiny_dir):
    """vLLM's TextPrompt and TokensPrompt dicts work as text and token ids do."""
    llm = make_llm(tiny_dir)
    ids = llm.tokenizer.encode("Hello there")
    outs = llm.generate([{"prompt": "Hello there"}, {"prompt_token_ids": ids}, ids],
                        GREEDY, use_tqdm=False)
    assert outs[0].prompt_token_ids == ids and outs[0].token_ids == outs[1].token_ids \
        == outs[2].token_ids
    assert llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0].token_ids \
        == outs[0].token_ids
    llm.shutdown()


def test_bad_engine_config(tiny_dir, tmp_path):
    with pytest.raises(FileNotFoundError):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="fewer than max_model_len=128"):
        make_llm(tiny_dir, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="max_position_embeddings=1024"):
        make_llm(tiny_dir, max_model_len=4096)
    with pytest.raises(ValueError, match="preemption_policy"):
        make_llm(tiny_dir, preemption_policy="random")
