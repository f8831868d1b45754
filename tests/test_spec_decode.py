"""Speculative decoding on a tiny random Llama: output identical to plain decoding.

Drafts come from the n-gram proposer, and from a scripted one that proposes the plain
run's own continuation with some tokens wrong, so every step has drafts and both
accepted and rejected ones (a random model seldom repeats itself for the n-gram
proposer to find). Every scenario ends with the block pool's invariant and no block
held.
"""

from __future__ import annotations

import pytest
import torch

from app import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
        "prompt_lookup_max": 3, "disable_by_batch_size": 1000}
GREEDY = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def make_llm(tiny_dir, spec=None, **kw) -> LLM:
    kw.setdefault("max_model_len", 128)
    kw.setdefault("dtype", "float32")
    return LLM(str(tiny_dir), speculative_config=spec, **kw)


class ScriptedProposer:
    """Proposes what the plain run produced next, with about one draft in three wrong."""

    def __init__(self, want: dict[tuple[int, ...], list[int]]):
        self.want = want

    def propose(self, requests, num_tokens):
        out = []
        for req, k in zip(requests, num_tokens):
            m = req.num_output_tokens
            truth = self.want[tuple(req.prompt_token_ids)][m:m + k]
            out.append([t + 1 if hash((m + j, len(req.prompt_token_ids))) % 3 == 0 else t
                        for j, t in enumerate(truth)])
        return out

    def finish(self, request):
        pass


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    # Each prompt repeats a random phrase, so the n-gram proposer has matches to draft from.
    return [torch.randint(3, 49000, (n,), generator=g).tolist() * 3 for n in (1, 3, 5, 8, 13)]


@pytest.fixture(scope="module")
def plain(tiny_dir, prompts):
    llm = make_llm(tiny_dir)
    yield llm, {tuple(p): o.token_ids for p, o in
                zip(prompts, llm.generate(prompts, GREEDY, use_tqdm=False))}
    llm.shutdown()


def scripted(llm: LLM, want) -> LLM:
    llm.engine.speculator.proposer = ScriptedProposer(want)
    return llm


def assert_clean(llm: LLM) -> None:
    llm.engine.check_invariants()
    blocks = llm.engine.blocks
    assert blocks.num_free_blocks == blocks.num_blocks  # cached blocks count as free


def test_ngram_greedy_equals_plain(tiny_dir, prompts, plain):
    llm = make_llm(tiny_dir, SPEC)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [plain[1][tuple(p)] for p in prompts]
    total = llm.engine.speculator.total
    assert total.num_drafts > 0  # the repeated prompts gave drafts (rejected, mostly)
    assert_clean(llm)
    llm.shutdown()


@pytest.mark.parametrize("setting", ["cold", "no_prefix_cache", "hot", "preempt_chunked"])
def test_verified_drafts_give_plain_output(tiny_dir, prompts, plain, setting):
    kw = {"no_prefix_cache": dict(enable_prefix_caching=False),
          # 24 blocks of 4 for 5 requests of up to 71 tokens: preemption is certain; a
          # 16-token budget is smaller than the longer prompts: they prefill in chunks.
          "preempt_chunked": dict(num_blocks=24, block_size=4, max_num_batched_tokens=16,
                                  max_model_len=80)}.get(setting, {})
    llm = scripted(make_llm(tiny_dir, SPEC, **kw), plain[1])
    want = [plain[1][tuple(p)] for p in prompts]
    if setting == "hot":
        llm.generate(prompts, GREEDY, use_tqdm=False)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == want
    total = llm.engine.speculator.total
    assert 0 < total.num_accepted_tokens < total.num_draft_tokens
    if setting == "preempt_chunked":
        assert llm.engine.scheduler.num_preemptions > 0
    if setting == "hot":
        assert llm.engine.blocks.num_cached_blocks > 0
    assert_clean(llm)
    llm.shutdown()


def test_penalties_bias_bans_and_logprobs_keep_their_meaning(tiny_dir, prompts):
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                             presence_penalty=0.5, frequency_penalty=0.3,
                             repetition_penalty=1.3, logprobs=2),
              SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                             logit_bias={int(prompts[2][0]): 3.0}),
              SamplingParams(max_tokens=24, temperature=0.0, min_tokens=12, logprobs=0)]
    ps = prompts[1:4]
    ref = make_llm(tiny_dir)
    want = ref.generate(ps, params, use_tqdm=False)
    ref.shutdown()
    llm = scripted(make_llm(tiny_dir, SPEC), {tuple(p): o.token_ids for p, o in zip(ps, want)})
    got = llm.generate(ps, params, use_tqdm=False)
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.finish_reason == w.finish_reason
        if w.logprobs is not None:
            assert len(g.logprobs) == len(w.logprobs)
            for a, b in zip(w.logprobs, g.logprobs):
                assert a[0] == pytest.approx(b[0], abs=1e-4)
                assert [t for t, _ in a[1]] == [t for t, _ in b[1]]
    assert llm.engine.speculator.total.num_accepted_tokens > 0
    assert_clean(llm)
    llm.shutdown()


def test_stop_strings_stop_ids_and_max_tokens_are_exact(tiny_dir, prompts, plain):
    llm = scripted(make_llm(tiny_dir, SPEC), plain[1])
    tok = llm.tokenizer
    p = prompts[3]
    ids = plain[1][tuple(p)]
    full = tok.decode(ids)
    for n in range(1, 12):  # max_tokens: never one past it, whatever the drafts
        out = llm.generate([p], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                           use_tqdm=False)[0]
        assert out.token_ids == ids[:n] and out.finish_reason == "length"
    # A stop string that straddles generated tokens 6 and 7, met inside a verified run.
    t6, t7 = tok.decode(ids[:7]), tok.decode(ids[:8])
    stop = t6[-2:] + t7[len(t6):][:2]
    assert full.find(stop) == len(t6) - 2
    out = llm.generate([p], SamplingParams(max_tokens=32, temperature=0, stop=[stop],
                                           ignore_eos=True), use_tqdm=False)[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[:full.find(stop)]
    assert out.token_ids == ids[:8]
    stop_id = ids[5]
    out = llm.generate([p], SamplingParams(max_tokens=32, temperature=0,
                                           stop_token_ids=[stop_id]), use_tqdm=False)[0]
    assert out.token_ids == ids[:ids.index(stop_id) + 1] and out.stop_reason == stop_id
    assert llm.engine.speculator.total.num_accepted_tokens > 0
    assert_clean(llm)
    llm.shutdown()


def test_seeded_sampling_is_reproducible_and_as_without_speculation(tiny_dir, prompts):
    params = [SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, top_k=50, seed=s,
                             ignore_eos=True) for s in (1, 2, 3)]
    ps = prompts[:3]
    ref = make_llm(tiny_dir)
    want = [o.token_ids for o in ref.generate(ps, params, use_tqdm=False)]
    ref.shutdown()
    llm = scripted(make_llm(tiny_dir, SPEC), {tuple(p): w for p, w in zip(ps, want)})
    # Each position draws from (seed, output index) alone: the same tokens as without
    # speculation, run after run.
    assert [o.token_ids for o in llm.generate(ps, params, use_tqdm=False)] == want
    assert [o.token_ids for o in llm.generate(ps, params, use_tqdm=False)] == want
    assert llm.engine.speculator.total.num_accepted_tokens > 0
    llm.shutdown()


def test_abort_mid_run_leaks_no_block(tiny_dir, prompts, plain):
    llm = scripted(make_llm(tiny_dir, SPEC, num_blocks=64, block_size=4), plain[1])
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    for step in range(40):
        engine.step()
        if step in (3, 6, 9):  # mid-run, drafts in the cache
            engine.abort(f"r{step // 3}")
        engine.check_invariants()
        if not engine.has_work:
            break
    while engine.has_work:
        engine.step()
    assert engine.speculator.total.num_drafts > 0
    assert_clean(llm)
    llm.shutdown()

