"""Automatic prefix caching: the block pool's bookkeeping, the scheduler's use of it
(pure Python), and greedy parity with the cache on and off against HF transformers."""

from __future__ import annotations

import random

import pytest
import torch

from app import LLM, SamplingParams
from app.config import SchedulerConfig
from app.engine.kv_blocks import BlockManager
from app.engine.request import Request, RequestStatus
from app.engine.scheduler import Scheduler
from tests.hf_reference import hf_greedy

BS = 4


def tokens_of(seq):
    return lambda a, b: seq[a:b]


# -- the pool ----------------------------------------------------------------------------------


def fill(bm: BlockManager, rid: str, seq: list[int], names: list[int] | None = None) -> list[int]:
    """Allocate `seq` for `rid` from scratch (with whatever prefix the cache holds) and
    name its full blocks, as the scheduler does once a step has computed them."""
    names = names if names is not None else []
    bm.block_names(tokens_of(seq), names, len(seq) - 1)
    hits = bm.match_prefix(names)
    bm.allocate(rid, len(seq), hits)
    bm.block_names(tokens_of(seq), names, len(seq))
    bm.register(rid, names, len(hits), len(seq) // BS)
    return hits


def test_full_blocks_are_shared_and_counted_by_reference():
    bm = BlockManager(16, BS)
    a = list(range(1, 11))  # 10 tokens: blocks [1-4] [5-8] and a partial [9 10]
    assert fill(bm, "a", a) == []
    table_a = bm.block_table("a")
    b = a[:8] + [77, 78, 79]  # same first two blocks, then its own
    hits = fill(bm, "b", b)
    assert hits == table_a[:2] and bm.block_table("b")[:2] == table_a[:2]
    assert bm.counts() == {"free": 16 - 4, "cached": 0, "used": 4, "total": 16, "tables": 2}
    bm.check()
    bm.free("a")  # its shared blocks stay used by b; its partial block goes back free
    assert bm.counts()["used"] == 3 and bm.counts()["cached"] == 0
    bm.free("b")  # now the named blocks stay, cached and evictable
    assert bm.counts() == {"free": 16 - 2, "cached": 2, "used": 0, "total": 16, "tables": 0}
    assert bm.num_free_blocks == 16 and bm.usage == 0.0
    bm.check()


def test_a_partial_block_is_never_shared_and_one_token_is_always_computed():
    bm = BlockManager(16, BS)
    seq = list(range(1, 9))  # exactly two full blocks
    fill(bm, "a", seq)
    bm.free("a")
    names: list[int] = []
    bm.block_names(tokens_of(seq), names, len(seq) - 1)  # all but the last token
    assert len(names) == 1 and len(bm.match_prefix(names)) == 1  # block 2 is recomputed


def test_eviction_takes_the_least_recently_used_tail_first():
    bm = BlockManager(6, BS)
    first = list(range(100, 112))  # three full blocks
    fill(bm, "x", first)
    bm.free("x")  # x's blocks cached: tail first in LRU order
    assert bm.counts()["cached"] == 3
    # A request needing 4 fresh blocks takes the 3 free ones, then evicts x's tail.
    fill(bm, "y", list(range(500, 516)))
    assert bm.counts()["cached"] == 2
    names: list[int] = []
    bm.block_names(tokens_of(first), names, len(first))
    assert len(bm.match_prefix(names)) == 2  # the prefix survived, the tail went
    bm.check()


def test_a_pool_full_of_cached_blocks_serves_new_requests():
    bm = BlockManager(8, BS)
    for i in range(4):
        fill(bm, f"r{i}", [1000 * (i + 1) + t for t in range(8)])
        bm.free(f"r{i}")
    assert bm.counts()["cached"] == 8 and bm.counts()["free"] == 0
    assert bm.can_allocate("new", 32)
    fill(bm, "new", list(range(32)))
    assert bm.counts()["used"] == 8 and bm.counts()["cached"] == 0
    bm.check()


def test_reset_drops_cached_blocks_and_names():
    bm = BlockManager(8, BS)
    seq = list(range(1, 10))
    fill(bm, "a", seq)
    fill(bm, "b", seq)
    bm.free("a")
    bm.free("b")
    assert bm.reset_prefix_cache() == 2
    assert bm.counts() == {"free": 8, "cached": 0, "used": 0, "total": 8, "tables": 0}
    assert fill(bm, "c", seq) == []
    bm.check()


# -- the scheduler ----------------------------------------------------------------------------


def make_req(rid: str, prompt: list[int], max_tokens: int = 8, n: int = 0) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival_seq=n)


def sched(num_blocks=64, budget=64, seqs=8) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget),
                     BlockManager(num_blocks, BS))


def run_step(s: Scheduler, token: int = 7):
    """One step; requests that reached max_tokens finish (the output processor's job)."""
    out = s.schedule()
    s.update(out, [token] * sum(q.samples for q in out.seqs))
    for r in list(s.running):
        if r.num_output_tokens >= r.params.max_tokens:
            s.finish(r, RequestStatus.FINISHED_LENGTH)
    return out


def test_a_second_request_waits_one_step_then_starts_at_the_cached_prefix():
    s = sched()
    prefix = list(range(1, 13))  # three blocks shared
    a, b = make_req("a", prefix + [50, 51]), make_req("b", prefix + [60, 61, 62], n=1)
    s.add(a)
    s.add(b)
    out = run_step(s)
    assert [q.request for q in out.seqs] == [a]  # b's prefix is being computed: b waits
    assert out.prefix_queried == 14 and out.prefix_hit == 0
    out = run_step(s)
    seq_b = next(q for q in out.seqs if q.request is b)
    assert seq_b.start == 12 and seq_b.num_new_tokens == 3  # only its own tokens
    assert out.prefix_hit == 12
    assert s.blocks.block_table("b")[:3] == s.blocks.block_table("a")[:3]
    s.blocks.check()


def test_preempting_a_sharer_keeps_the_blocks_of_the_others():
    s = sched(num_blocks=9, budget=64, seqs=4)
    prefix = list(range(1, 13))
    a = make_req("a", prefix + [50], max_tokens=20)
    b = make_req("b", prefix + [60], max_tokens=20, n=1)
    s.add(a)
    run_step(s)
    s.add(b)
    run_step(s)
    shared = s.blocks.block_table("a")[:3]
    assert s.blocks.block_table("b")[:3] == shared
    while not s.num_preemptions:  # both decode until the 9-block pool runs out
        run_step(s)
    victim = b if b.status is RequestStatus.PREEMPTED else a
    other = a if victim is b else b
    assert s.blocks.block_table(other.request_id)[:3] == shared
    assert not s.blocks.block_table(victim.request_id)
    s.blocks.check()
    for _ in range(60):
        if not s.has_work:
            break
        run_step(s)
    assert a.is_finished and b.is_finished
    s.blocks.check()
    assert s.blocks.counts()["used"] == 0


def test_many_sharers_finishing_in_random_order_leave_a_whole_pool():
    rng = random.Random(3)
    s = sched(num_blocks=64, budget=32, seqs=8)
    prefix = list(range(1, 17))
    reqs = [make_req(f"r{i}", prefix + [100 + i] * (1 + i % 3), max_tokens=rng.randint(1, 9),
                     n=i) for i in range(8)]
    for r in reqs:
        s.add(r)
    aborted = set()
    for _ in range(80):
        if not s.has_work:
            break
        out = s.schedule()
        live = [q.request for q in out.seqs if not q.request.is_finished]
        if live and rng.random() < 0.2:  # abort one while its step is in flight
            victim = rng.choice(live)
            s.abort(victim)
            aborted.add(victim.request_id)
        s.update(out, [7] * sum(q.samples for q in out.seqs))
        for r in list(s.running):
            if r.num_output_tokens >= r.params.max_tokens:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
        s.blocks.check()  # after every step, aborts and finishes included
    assert not s.has_work and all(r.is_finished for r in reqs)
    c = s.blocks.counts()
    assert c["used"] == 0 and c["free"] + c["cached"] == 64 and c["cached"] >= 4


# -- the engine, against HF -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def shared_prompts():
    g = torch.Generator().manual_seed(5)
    system = torch.randint(3, 49000, (37,), generator=g).tolist()
    return [system + torch.randint(3, 49000, (n,), generator=g).tolist()
            for n in (1, 4, 9, 16, 3, 11)]


@pytest.mark.parametrize("settings", [
    {},
    {"num_blocks": 24, "block_size": 4, "max_num_batched_tokens": 16, "max_model_len": 96},
], ids=["plain", "preemption+chunks"])
def test_greedy_is_identical_with_the_cache_on_and_off(tiny_dir, hf_tiny, shared_prompts,
                                                       settings):
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    expected = [hf_greedy(hf_tiny, p, 24) for p in shared_prompts]
    results = {}
    for caching in (True, False):
        kw = {"max_model_len": 128, "dtype": "float32", **settings}
        llm = LLM(str(tiny_dir), enable_prefix_caching=caching, **kw)
        try:
            outs = llm.generate(shared_prompts, greedy, use_tqdm=False)  # a cold cache
            again = llm.generate(shared_prompts[::-1], greedy, use_tqdm=False)  # a warm one
            results[caching] = ([o.token_ids for o in outs], [o.token_ids for o in again])
            llm.engine.check_invariants()
            assert llm.engine.blocks.counts()["used"] == 0
            hits = llm.engine.blocks.counts()["cached"]
            assert (hits > 0) == caching
        finally:
            llm.shutdown()
    assert results[True] == results[False]
    assert results[True][0] == expected and results[True][1] == expected[::-1]
