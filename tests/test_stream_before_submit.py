"""On CPU a step writes its chunks before the next step is posted
(`AsyncEngine.stream_before_submit`); otherwise they stream while the next one runs.

Checked on the real server (loopback, tiny random model): the same text either way and
as the offline engine gives, every consumer has taken its delta by the time the next
step is posted (few streams), aborts by disconnect in the middle of a stream leave the
pool clean, and a step of more streams than one dispatch chunk still works.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from app import LLM, SamplingParams
from app.engine.async_engine import DISPATCH_CHUNK
from tests.server_harness import ServerThread, assert_idle_and_clean, tiny_config

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_num_seqs=16)).start()
    assert srv.engine.stream_before_submit  # the tests run on CPU
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def prompts():
    return [[5 + 7 * i + j for j in range(3 + i)] for i in range(DISPATCH_CHUNK + 4)]


@pytest.fixture(scope="module")
def offline(tiny_dir, prompts):
    llm = LLM(str(tiny_dir), max_model_len=256, dtype="float32")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outs = [o.text for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.shutdown()
    return outs


async def stream_text(client: httpx.AsyncClient, url: str, prompt: list[int],
                      stop_after: int | None = None) -> str:
    """The streamed text; with `stop_after`, the connection closes after that many chunks."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True,
            "temperature": 0, "ignore_eos": True}
    pieces: list[str] = []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            pieces.append(json.loads(line[5:])["choices"][0]["text"])
            if stop_after is not None and len(pieces) >= stop_after:
                break  # leaving the block closes the connection mid-stream
    return "".join(pieces)


def run_streams(srv: ServerThread, prompts: list[list[int]], stop_after=None):
    async def go():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*(stream_text(client, srv.url, p, stop_after)
                                          for p in prompts))
    return asyncio.run(go())


def set_mode(srv: ServerThread, on: bool) -> None:
    srv.call(setattr, srv.engine, "stream_before_submit", on)


class CountingQueue(asyncio.Queue):
    """A stream's queue that counts the outputs its consumer has taken."""

    taken = 0

    def get_nowait(self):
        item = super().get_nowait()
        self.taken += 1
        return item


def watch_submits(srv: ServerThread) -> list[int]:
    """At each step posted: the tokens generated that no consumer has taken yet (one
    output per token here, no speculation)."""
    engine, pending = srv.engine, []
    add, submit = engine.add_request, engine.core.submit

    def adding(*args, **kwargs):
        stream = add(*args, **kwargs)
        stream.queue = CountingQueue()
        return stream

    def counting(batch):
        pending.append(sum(engine.core.outputs.request(rid).num_output_tokens - s.queue.taken
                           for rid, s in engine._streams.items()
                           if engine.core.outputs.request(rid) is not None))
        return submit(batch)
    srv.call(setattr, engine, "add_request", adding)
    srv.call(setattr, engine.core, "submit", counting)
    return pending


@pytest.mark.parametrize("on", [True, False])
@pytest.mark.parametrize("streams", [3, DISPATCH_CHUNK + 4])
def test_same_text_either_way(server, prompts, offline, on, streams):
    set_mode(server, on)
    try:
        got = run_streams(server, prompts[:streams])
    finally:
        set_mode(server, True)
    assert got == offline[:streams]
    assert_idle_and_clean(server)


@pytest.mark.parametrize("streams", [3, DISPATCH_CHUNK + 4])
def test_streams_are_written_before_the_next_step(server, prompts, streams):
    pending = watch_submits(server)
    try:
        run_streams(server, prompts[:streams])
        assert len(pending) >= MAX_TOKENS
        assert max(pending) == 0, pending
        set_mode(server, False)  # the other order: the step's tokens go out after it
        pending.clear()
        run_streams(server, prompts[:streams])
        assert max(pending) > 0, pending
    finally:
        set_mode(server, True)
        server.call(delattr, server.engine.core, "submit")
        server.call(delattr, server.engine, "add_request")
    assert_idle_and_clean(server)


def test_disconnects_mid_stream_free_everything(server, prompts):
    run_streams(server, prompts[:4], stop_after=3)
    for _ in range(100):  # the aborts land on the loop after the connections close
        if server.engine.num_unfinished == 0:
            break
        asyncio.run(asyncio.sleep(0.02))
    assert_idle_and_clean(server)
