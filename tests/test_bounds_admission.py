"""Bounds on what one request may put in flight, and deadlines checked for the whole
request with default flags (issue 40, items 4, 7 and 9)."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import httpx
import pytest

from app.config import SchedulerConfig, ServerSettings
from app.engine.admission import AdmissionController
from app.engine.errors import QueueFull
from app.engine.kv_blocks import BlockManager
from app.engine.request import Request, RequestSLO, RequestStatus
from app.engine.sampling_params import SamplingParams
from app.engine.scheduler import Scheduler
from tests.server_harness import ServerThread, assert_idle_and_clean, tiny_config


def trained(a=0.010, b=0.001, c=0.002, max_num_seqs=8) -> AdmissionController:
    """A warm controller whose steps cost a + b·tokens + c·seqs."""
    ctl = AdmissionController(max_num_seqs=max_num_seqs, max_num_batched_tokens=64)
    for tokens, seqs in [(1, 1), (64, 1), (4, 4), (40, 2), (8, 3), (64, 4), (2, 2), (33, 1),
                         (5, 2), (17, 3)] * 3:
        ctl.observe_step(tokens, seqs, a + b * tokens + c * seqs, started=1, waiting=1)
    return ctl


def req(n: int, max_tokens: int, prompt: int = 8, slo: RequestSLO | None = None) -> Request:
    r = Request(f"r{n}", list(range(1, prompt + 1)), SamplingParams(max_tokens=max_tokens),
                arrival_seq=n)
    r.slo = slo or RequestSLO()
    return r


# -- item 7: the whole request's deadline, checked at arrival and in the queue --------------


def test_a_request_that_cannot_finish_by_its_deadline_is_refused_at_arrival():
    ctl, now = trained(), time.monotonic()
    slo = RequestSLO(ttft_deadline=now + 5, deadline=now + 5)
    # Four running, a free slot: it would start at once, but 1000 tokens at >= 20 ms a
    # step cannot finish within 5 s.
    with pytest.raises(QueueFull) as e:
        ctl.check_arrival(req(0, 1000), slo, ahead=0, running=4, now=now)
    assert e.value.reason == "deadline" and e.value.retry_after >= 10
    # What fits is admitted: 50 tokens take about a second.
    ctl.check_arrival(req(1, 50), slo, ahead=0, running=4, now=now)


def test_a_newcomer_that_would_make_a_running_request_late_is_refused():
    ctl, now = trained(), time.monotonic()
    before, after = ctl.token_seconds(1, 1), ctl.token_seconds(1, 2)
    assert after > before  # one more sequence makes every step a little longer
    running = req(0, 1000, slo=RequestSLO(deadline=now + 1000 * (before + after) / 2))
    newcomer = req(1, 5)
    slo = RequestSLO(ttft_deadline=now + 60, deadline=now + 60)
    with pytest.raises(QueueFull) as e:  # it fits, but the running one would be late
        ctl.check_arrival(newcomer, slo, ahead=0, running=1, now=now, others=[running])
    assert e.value.reason == "deadline"
    running.slo = RequestSLO(deadline=now + 1000 * after + 1)  # room for one more
    ctl.check_arrival(newcomer, slo, ahead=0, running=1, now=now, others=[running])


def test_an_idle_server_or_a_cold_model_refuses_nothing():
    now = time.monotonic()
    slo = RequestSLO(ttft_deadline=now + 5, deadline=now + 5)
    trained().check_arrival(req(0, 1000), slo, ahead=0, running=0, now=now)  # idle
    cold = AdmissionController(max_num_seqs=8, max_num_batched_tokens=64)
    for _ in range(3):  # a few steps, far too slow: still not enough to refuse on
        cold.observe_step(64, 4, 5.0, started=1, waiting=1)
    cold.check_arrival(req(1, 1000), slo, ahead=3, running=4, now=now)


def test_a_streamed_request_or_an_unchosen_length_is_held_to_its_first_token_only():
    ctl, now = trained(), time.monotonic()
    # The openai SDK's 600 s on a stream (or a chat without max_tokens): no `deadline`,
    # only the first token's, and a free slot means it starts at once.
    ctl.check_arrival(req(0, 100_000), RequestSLO(ttft_deadline=now + 600), ahead=0,
                      running=7, now=now)


def test_an_ordinary_request_under_the_sdk_default_timeout_is_admitted():
    ctl, now = trained(), time.monotonic()
    slo = RequestSLO(ttft_deadline=now + 600, deadline=now + 600)
    ctl.check_arrival(req(0, 1024, prompt=60), slo, ahead=2, running=8, now=now)


def test_a_waiting_request_that_can_no_longer_finish_is_shed_before_its_prefill():
    ctl = trained(max_num_seqs=1)
    s = Scheduler(SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=64),
                  BlockManager(256, 4), ctl)
    now = time.monotonic()
    hog = req(0, 100)
    late = req(1, 200, slo=RequestSLO(deadline=now + 3))  # 200 tokens x >= 12 ms
    on_time = req(2, 5, slo=RequestSLO(deadline=now + 3))
    for r in (hog, late, on_time):
        s.add(r)
    s.update(s.schedule(), [7])  # hog runs; the others wait
    assert s.shed_expired(now) == [late] and late.status is RequestStatus.FINISHED_SHED
    assert list(s.waiting) == [on_time] and late.num_prefilled == 0
    s.blocks.check()


# -- item 9: a long prefill shares its steps ---------------------------------------------------


def test_with_default_settings_a_short_request_gets_its_token_before_a_long_prefill_ends():
    cfg = SchedulerConfig(max_model_len=4096)
    assert cfg.long_prefill_token_threshold > 0
    s = Scheduler(cfg, BlockManager(1024, 16, enable_caching=False))
    long, short = req(0, 10, prompt=2000), req(1, 1, prompt=5)
    s.add(long)
    out = s.schedule()
    assert out.seqs[0].num_new_tokens <= cfg.long_prefill_token_threshold
    s.update(out, [])
    s.add(short)  # arrives while the long prompt is prefilling
    while not short.output_token_ids:
        out = s.schedule()
        chunk = {q.request.request_id: q.num_new_tokens for q in out.seqs}
        assert chunk.get(long.request_id, 0) <= cfg.long_prefill_token_threshold
        s.update(out, [7] * sum(q.samples for q in out.seqs))
    assert long.num_computed_tokens < long.num_prompt_tokens  # its prefill is not done
    assert not long.output_token_ids


# -- on the real server -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_dir):
    """Default flags but a short context and a small queue bound."""
    srv = ServerThread(tiny_config(tiny_dir, max_model_len=1024, max_queued_requests=4),
                       ServerSettings(log_stats_interval=0.05)).start()
    yield srv
    srv.stop()


def test_a_request_of_too_many_sequences_or_tokens_is_400(server):
    url = server.url + "/v1/completions"
    r = httpx.post(url, json={"prompt": ["Hello"] * 256, "n": 64, "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    assert "16384 sequences" in r.json()["error"]["message"]
    # 256 sequences of up to 1023 tokens each: more tokens than 64 contexts of 1024.
    r = httpx.post(url, json={"prompt": ["Hello"] * 256, "max_tokens": 1000}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert server.engine.num_unfinished == 0


def test_sequences_count_in_the_queue_bound_and_a_refusal_leaves_nothing(server):
    async def main():
        async with aiohttp.ClientSession() as s:
            hogs = [asyncio.create_task(s.post(server.url + "/v1/completions", json={
                "prompt": "hog", "max_tokens": 400, "ignore_eos": True}))
                for _ in range(8)]
            await asyncio.sleep(0.3)
            # 248 run slots left and 4 queue places: 256 sequences (4 prompts x n=64), one
            # request within the per-request bound, cannot all fit now.
            async with s.post(server.url + "/v1/completions", json={
                    "prompt": ["a", "b", "c", "d"], "n": 64, "max_tokens": 2}) as r:
                status, retry, body = r.status, r.headers.get("Retry-After"), await r.json()
            for h in hogs:
                (await h).release()
            return status, retry, body

    status, retry, body = asyncio.run(main())
    assert status == 503 and body["error"]["code"] == "queue_full", body
    assert retry is not None and int(retry) >= 1
    time.sleep(0.3)
    assert_idle_and_clean(server)


def test_a_deadline_header_refuses_at_arrival_what_cannot_finish_in_time(server):
    url = server.url + "/v1/completions"
    for _ in range(4):  # warm the step-time model
        assert httpx.post(url, json={"prompt": "warm", "max_tokens": 8}).status_code == 200

    async def main():
        async with aiohttp.ClientSession() as s:
            hog = asyncio.create_task(s.post(url, json={
                "prompt": "hog", "max_tokens": 900, "ignore_eos": True}))
            await asyncio.sleep(0.3)
            # A free slot, but 900 tokens cannot come back within 0.2 s.
            async with s.post(url, headers={"X-Request-Timeout": "0.2"}, json={
                    "prompt": "in a hurry", "max_tokens": 900, "ignore_eos": True}) as r:
                refused = r.status, r.headers.get("Retry-After"), await r.json()
            # The openai SDK's default on an ordinary request: admitted.
            async with s.post(server.url + "/v1/chat/completions",
                              headers={"x-stainless-read-timeout": "600"}, json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 16}) as r:
                ordinary = r.status
            (await hog).release()
            return refused, ordinary

    (status, retry, body), ordinary = asyncio.run(main())
    assert status == 503 and body["error"]["code"] == "deadline", body
    assert retry is not None and int(retry) >= 1
    assert ordinary == 200
    time.sleep(0.3)
    assert_idle_and_clean(server)


def test_the_sequence_cost_is_the_least_squares_fit_of_its_window():
    """The per-sequence cost kept in running sums equals numpy's least squares over the
    last SEQ_COST_STEPS steps (with and without prefill in the window), and a window of
    one batch size has no slope to tell."""
    import random

    import numpy as np

    from app.engine.admission import SEQ_COST_STEPS, SequenceCost
    rng = random.Random(0)
    cost, rows = SequenceCost(), []
    for _ in range(3 * SEQ_COST_STEPS + 7):
        seqs, prefill = rng.randint(1, 32), rng.choice([0, 0, 0, 100, 512])
        seconds = 0.01 + 0.002 * seqs + 0.0005 * prefill + rng.gauss(0, 0.001)
        cost.observe(seqs + prefill, seqs, seconds)
        rows.append((seqs, prefill, seconds))
    a = np.array(rows[-SEQ_COST_STEPS:])
    x = np.column_stack([np.ones(len(a)), a[:, 0], a[:, 1]])
    assert cost.per_seq == pytest.approx(np.linalg.lstsq(x, a[:, 2], rcond=None)[0][1])
    decode_only = SequenceCost()
    for _ in range(40):
        seqs = rng.randint(1, 32)
        decode_only.observe(seqs, seqs, 0.01 + 0.003 * seqs)
    assert decode_only.per_seq == pytest.approx(0.003)
    same = SequenceCost()
    for _ in range(40):
        same.observe(5, 5, 0.1)
    assert same.per_seq is None
