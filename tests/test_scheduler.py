"""Scheduler and block manager transitions, pure Python, no model."""

import itertools

import pytest

from app.config import SchedulerConfig
from app.engine.errors import QueueFull
from app.engine.kv_blocks import BlockManager, NoFreeBlocks
from app.engine.request import Request, RequestStatus
from app.engine.sampling_params import SamplingParams
from app.engine.scheduler import Scheduler

_ids = itertools.count()


def make_req(prompt_len: int, priority: int = 0, max_tokens: int = 100) -> Request:
    n = next(_ids)
    return Request(
        request_id=f"r{n}",
        prompt_token_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=max_tokens),
        priority=priority,
        arrival_seq=n,
    )


def make_sched(num_blocks=64, block_size=4, budget=64, max_seqs=8, policy="newest", queue=None):
    # Prompts here repeat (1, 2, 3, ...): without the prefix cache, so that these tests
    # see budgets and preemption alone; sharing has its own tests (test_prefix_cache.py).
    blocks = BlockManager(num_blocks, block_size, enable_caching=False)
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=num_blocks * block_size,
        max_queued_requests=queue,
        preemption_policy=policy,
    )
    return Scheduler(cfg, blocks)


def step(s: Scheduler, token: int = 7):
    out = s.schedule()
    n_sample = sum(seq.samples for seq in out.seqs)
    s.update(out, [token] * n_sample)
    return out


def test_block_manager_allocate_grow_free():
    bm = BlockManager(4, 4)
    bm.allocate("a", 5)  # 2 blocks
    assert bm.num_free_blocks == 2 and len(bm.block_table("a")) == 2
    bm.allocate("a", 8)  # still 2 blocks
    assert bm.num_free_blocks == 2
    bm.allocate("a", 9)
    assert bm.num_free_blocks == 1
    t = bm.block_table("a")
    assert bm.slots("a", 3, 6) == [t[0] * 4 + 3, t[1] * 4 + 0, t[1] * 4 + 1]
    with pytest.raises(NoFreeBlocks):
        bm.allocate("b", 8)
    assert bm.block_table("b") == []  # all or nothing
    bm.check()
    assert bm.free("a") == 3 and bm.free("a") == 0
    assert bm.num_free_blocks == 4
    bm.check()


def test_block_manager_check_catches_corruption():
    bm = BlockManager(4, 4)
    bm.allocate("a", 4)
    bm._free.append(bm.block_table("a")[0])  # simulate a double free
    with pytest.raises(AssertionError):
        bm.check()


def test_admit_prefill_then_decode():
    s = make_sched()
    a, b = make_req(10), make_req(3)
    s.add(a)
    s.add(b)
    out = step(s)
    assert [(q.request.request_id, q.num_new_tokens, q.samples) for q in out.seqs] == [
        (a.request_id, 10, True),
        (b.request_id, 3, True),
    ]
    assert a.output_token_ids == [7] and a.num_computed_tokens == 10
    out = step(s)
    assert [q.num_new_tokens for q in out.seqs] == [1, 1]
    assert a.num_computed_tokens == 11 and a.num_tokens == 12
    s.blocks.check()


def test_chunked_prefill_under_token_budget():
    s = make_sched(budget=8)
    a = make_req(20)
    s.add(a)
    chunks = []
    while not a.output_token_ids:
        out = step(s)
        chunks.append((out.seqs[0].num_new_tokens, out.seqs[0].samples))
    assert chunks == [(8, False), (8, False), (4, True)]
    assert a.num_computed_tokens == 20 and len(s.blocks.block_table(a.request_id)) == 5


def test_budget_shared_running_first():
    s = make_sched(budget=8)
    a = make_req(4)
    s.add(a)
    step(s)
    b = make_req(20)
    s.add(b)
    out = step(s)
    # a decodes one token, b gets the remaining 7 of the budget.
    assert [(q.request is a, q.num_new_tokens) for q in out.seqs] == [(True, 1), (False, 7)]


def test_max_num_seqs_caps_running():
    s = make_sched(max_seqs=2)
    reqs = [make_req(2) for _ in range(3)]
    for r in reqs:
        s.add(r)
    out = step(s)
    assert len(out.seqs) == 2 and len(s.waiting) == 1
    s.finish(reqs[0], RequestStatus.FINISHED_LENGTH)
    out = step(s)
    assert reqs[2] in [q.request for q in out.seqs]


def test_queue_full_counts_free_run_slots():
    # 8 run slots are free: the first 8 arrivals start at the next step, so they are not
    # queued; 2 more may wait; the 11th is refused.
    s = make_sched(queue=2, max_seqs=8)
    for _ in range(10):
        s.add(make_req(2))
    with pytest.raises(QueueFull):
        s.add(make_req(2))
    step(s)  # 8 now run, 2 wait: still full
    assert len(s.running) == 8 and s.num_queued == 2
    with pytest.raises(QueueFull):
        s.add(make_req(2))


def test_preempt_newest_when_pool_full_and_resume():
    # 4 blocks of 4 tokens = 16 slots; two prompts of 8 fill it exactly.
    s = make_sched(num_blocks=4, block_size=4)
    a, b = make_req(8), make_req(8)
    s.add(a)
    s.add(b)
    step(s)  # both prefilled: 8 tokens cached each, one sampled token not yet cached
    assert s.blocks.num_free_blocks == 0
    out = step(s)  # both need a 3rd block for position 8: b (newest) is preempted
    assert out.preempted == [b] and s.num_preemptions == 1
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.waiting[0] is b and [q.request for q in out.seqs] == [a]
    assert b.output_token_ids == [7]  # generated tokens are kept for recompute
    s.blocks.check()
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    out = step(s)  # b recomputes prompt + its output token, then samples
    assert out.seqs[0].request is b and out.seqs[0].num_new_tokens == 9 and out.seqs[0].samples
    assert b.output_token_ids == [7, 7] and b.status is RequestStatus.RUNNING
    s.finish(b, RequestStatus.FINISHED_STOPPED)
    assert s.blocks.num_free_blocks == 4
    s.blocks.check()


def test_newest_request_needing_a_block_preempts_itself():
    s = make_sched(num_blocks=3, block_size=4)
    a, b = make_req(4), make_req(3)
    s.add(a)
    s.add(b)
    step(s)  # a caches 4 (1 block), b caches 3 (1 block); 1 block free
    out = step(s)  # a takes the free block for position 4; b fits position 3
    assert not out.preempted and s.blocks.num_free_blocks == 0
    out = step(s)  # b needs a block for position 4, none free: b is the newest
    assert out.preempted == [b] and [q.request for q in out.seqs] == [a]
    assert a.num_output_tokens == 3
    s.blocks.check()


@pytest.mark.parametrize(
    "policy,expected",
    [("newest", "c"), ("priority", "a"), ("length", "b")],
)
def test_preemption_policies_choose_victim(policy, expected):
    s = make_sched(num_blocks=6, block_size=4, policy=policy)
    reqs = {
        "a": make_req(3, priority=5),  # least important
        "b": make_req(7, priority=0),  # longest prompt, no output yet beyond 1
        "c": make_req(3, priority=1),  # newest
    }
    for r in reqs.values():
        s.add(r)
    step(s)  # cached: a 3 (1 block), b 7 (2), c 3 (1); 2 free
    step(s)  # positions 3, 7, 3: no new block
    assert s.num_preemptions == 0 and s.blocks.num_free_blocks == 2
    step(s)  # a and b take the last two blocks; c needs one: someone is preempted
    assert s.num_preemptions == 1
    victims = [r for r in reqs.values() if r.num_preemptions]
    assert [k for k, r in reqs.items() if r in victims][0] == expected
    s.blocks.check()


def test_abort_waiting_running_and_in_flight():
    s = make_sched()
    a, b, c = make_req(4), make_req(4), make_req(4)
    for r in (a, b, c):
        s.add(r)
    s.abort(c)  # waiting: leaves at once
    assert c not in s.waiting and c.status is RequestStatus.FINISHED_ABORTED
    step(s)
    s.abort(a)  # running, not in flight: blocks freed now
    assert s.blocks.block_table(a.request_id) == []
    out = s.schedule()  # b in flight
    s.abort(b)
    assert b not in s.running
    assert s.blocks.block_table(b.request_id) != []  # a kernel may still write them
    s.update(out, [9])
    assert b.output_token_ids == [7]  # the in-flight token is dropped
    assert s.blocks.num_free_blocks == s.blocks.num_blocks
    assert not s.has_work
    s.blocks.check()


def test_many_requests_drain_with_preemption_and_all_blocks_return():
    s = make_sched(num_blocks=8, block_size=4, budget=16, max_seqs=6)
    reqs = [make_req(2 + i % 5) for i in range(12)]
    for r in reqs:
        s.add(r)
    for _ in range(500):
        if not s.has_work:
            break
        step(s)
        for r in list(s.running):
            if r.num_output_tokens >= 6:
                s.finish(r, RequestStatus.FINISHED_LENGTH)
        s.blocks.check()
    assert not s.has_work
    assert all(r.num_output_tokens == 6 for r in reqs)
    assert s.num_preemptions > 0
    assert s.blocks.num_free_blocks == 8


def test_long_prefill_threshold_caps_chunks_only_while_others_decode():
    blocks = BlockManager(128, 4, enable_caching=False)
    s = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                  long_prefill_token_threshold=10), blocks)
    a = make_req(8)
    s.add(a)
    out = step(s)  # alone: a prefills all 8 (nobody decodes yet)
    assert out.seqs[0].num_new_tokens == 8
    b = make_req(40)
    s.add(b)
    out = step(s)  # a decodes: b's chunk is capped at 10
    assert {q.request.request_id: q.num_new_tokens for q in out.seqs} == {
        a.request_id: 1, b.request_id: 10}
