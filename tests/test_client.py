"""app.client.AsyncClient against the real server (tiny random Llama) and a fault-injecting one.

The fault server is a few lines of aiohttp.web written here: it can answer 503 on
cue, drop a connection before answering, or drop it after a few SSE events —
what the real server never does on purpose but a network or a proxy may.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer as AiohttpTestServer

from app.client import (
    APIConnectionError,
    APIStatusError,
    APIStreamError,
    AsyncClient,
    parse_retry_after,
)
from tests.server_harness import ServerThread, assert_idle_and_clean, metric, tiny_config


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_num_seqs=16)).start()
    yield srv
    srv.stop()


def wait_idle(srv: ServerThread, timeout: float = 10.0) -> None:
    """The server notices a closed connection asynchronously: wait for it, then check."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(srv.url + "/metrics").text
        if metric(text, "num_requests_running") == 0 and srv.engine.num_unfinished == 0:
            break
        time.sleep(0.02)
    assert_idle_and_clean(srv)


GREEDY = {"temperature": 0, "ignore_eos": True}


async def test_endpoints(server):
    async with AsyncClient(server.url) as c:
        assert await c.health()
        assert [m["id"] for m in await c.models()] == ["tiny"]
        ids = await c.tokenize("Hello there")
        assert ids and all(isinstance(t, int) for t in ids)
        assert len(await c.tokenize(messages=[{"role": "user", "content": "hi"}])) > 3

        done = await c.completions("Hello there", model="tiny", max_tokens=7, **GREEDY)
        assert done.finish_reason == "length" and done.usage.completion_tokens == 7
        assert done.usage.prompt_tokens == len(ids) and done.text == done.raw["choices"][0]["text"]

        chat = await c.chat([{"role": "user", "content": "Say something"}], max_tokens=9,
                            **GREEDY)
        assert chat.usage.completion_tokens == 9 and chat.text

        gen = await c.generate("Hello", sampling_params={"max_new_tokens": 5, **GREEDY})
        assert gen.usage.completion_tokens == 5 and gen.finish_reason == "length"
        assert len(gen.raw["output_ids"]) == 5
    async with AsyncClient("http://127.0.0.1:1") as c:
        assert not await c.health()  # unreachable: False, not an exception


async def test_streams_concatenate_to_greedy_text(server):
    messages = [{"role": "user", "content": "Tell me a story"}]
    async with AsyncClient(server.url) as c:
        for call, args, kw in [
            (c.completions, ("Once upon a time",), {"max_tokens": 12, **GREEDY}),
            (c.chat, (messages,), {"max_tokens": 12, **GREEDY}),
            (c.generate, ("Once upon a time",),
             {"sampling_params": {"max_new_tokens": 12, **GREEDY}}),
        ]:
            whole = await call(*args, **kw)
            deltas = [d async for d in await call(*args, stream=True, **kw)]
            assert "".join(d.text for d in deltas) == whole.text
            assert [d.finish_reason for d in deltas if d.finish_reason] == ["length"]
            assert deltas[-1].usage is not None and deltas[-1].usage.completion_tokens == 12
            assert deltas[-1].tokens == 12
            counts = [d.tokens for d in deltas]
            assert counts == sorted(counts)  # tokens so far never goes back
    wait_idle(server)


async def test_breaking_out_of_a_stream_aborts_on_the_server(server):
    def aborted() -> float:
        text = httpx.get(server.url + "/metrics").text
        if 'finished_reason="abort"' not in text:
            return 0.0
        return metric(text, "request_success_total", 'finished_reason="abort"')

    before = await asyncio.to_thread(aborted)
    async with AsyncClient(server.url) as c:
        got = 0
        async for d in await c.completions("Count to a thousand", max_tokens=200, stream=True,
                                           **GREEDY):
            got += bool(d.text)
            if got == 3:
                break  # the dropped Stream closes its connection
        stream = await c.chat([{"role": "user", "content": "go on"}], max_tokens=200,
                              stream=True, **GREEDY)
        async with stream:  # leaving the block closes it, whatever was read
            await stream.__anext__()
    await asyncio.to_thread(wait_idle, server)
    assert await asyncio.to_thread(aborted) == before + 2


async def test_bad_request_is_status_error_with_param(server):
    async with AsyncClient(server.url) as c:
        with pytest.raises(APIStatusError) as e:
            await c.completions("x", temperature=-1)
        assert e.value.status == 400 and e.value.param == "temperature"
        assert e.value.type == "invalid_request_error" and e.value.message
        with pytest.raises(APIStatusError) as e:
            await c.completions("x", model="gpt-nope", stream=True)
        assert e.value.status == 404 and e.value.code == "model_not_found"
        assert c.num_retries == 0  # 4xx other than 429 are never retried


async def test_overload_503_is_retried_after_retry_after(tiny_dir):
    srv = await asyncio.to_thread(
        lambda: ServerThread(tiny_config(tiny_dir, max_num_seqs=1, max_queued_requests=1))
        .start())
    try:
        async with AsyncClient(srv.url, max_retries=8) as c:
            t0 = time.monotonic()
            outs = await asyncio.gather(*(c.completions(f"request {i}", max_tokens=30,
                                                        ignore_eos=True) for i in range(5)))
            elapsed = time.monotonic() - t0
        assert all(o.usage.completion_tokens == 30 for o in outs)
        assert c.num_retries >= 3  # one running, one queued: at least three were turned away
        assert elapsed >= 1.0  # the server's Retry-After: 1 was honoured
        await asyncio.to_thread(wait_idle, srv)
    finally:
        await asyncio.to_thread(srv.stop)


# -- a server that misbehaves on cue -------------------------------------------------------


class FaultServer:
    def __init__(self, script: list[str]):
        self.script, self.requests = list(script), 0
        app = web.Application()
        app.router.add_post("/v1/completions", self.handle)
        self.server = AiohttpTestServer(app)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        action = self.script.pop(0) if self.script else "ok"
        if action == "503":
            return web.json_response(
                {"error": {"message": "busy", "type": "service_unavailable", "param": None,
                           "code": "queue_full"}}, status=503, headers={"Retry-After": "0"})
        if action == "drop":  # hang up before any byte of a response
            request.transport.close()
            await asyncio.sleep(0.1)
            return web.Response()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        if action == "cut":  # the stream has begun, then the connection dies
            await asyncio.sleep(0.05)
            request.transport.close()
            return resp
        if action == "error":
            await resp.write(b'data: {"error": {"message": "boom", "type": "server_error"}}\n\n')
        else:
            await resp.write(b'data: {"choices": [{"index": 0, "text": "", '
                             b'"finish_reason": "length"}]}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def __aenter__(self) -> str:
        await self.server.start_server()
        return str(self.server.make_url("")).rstrip("/")

    async def __aexit__(self, *exc: object) -> None:
        await self.server.close()


async def test_no_retry_once_a_stream_has_begun():
    fault = FaultServer(["cut"])
    async with fault as url, AsyncClient(url, max_retries=3) as c:
        texts = []
        with pytest.raises(APIConnectionError):
            async for d in await c.completions("x", stream=True):
                texts.append(d.text)
        assert texts == ["t0", "t1", "t2"]
    assert fault.requests == 1 and c.num_retries == 0


async def test_in_band_error_event_raises():
    async with FaultServer(["error"]) as url, AsyncClient(url) as c:
        with pytest.raises(APIStreamError) as e:
            _ = [d async for d in await c.completions("x", stream=True)]
        assert e.value.message == "boom" and e.value.type == "server_error"


async def test_retries_503_and_connection_drop_before_response():
    fault = FaultServer(["503", "drop", "ok"])
    async with fault as url, AsyncClient(url, max_retries=3, backoff=0.01) as c:
        deltas = [d async for d in await c.completions("x", stream=True)]
    assert "".join(d.text for d in deltas) == "t0t1t2" and deltas[-1].finish_reason == "length"
    assert fault.requests == 3 and c.num_retries == 2

    fault = FaultServer(["503"] * 5)
    async with fault as url, AsyncClient(url, max_retries=2, backoff=0.01) as c:
        with pytest.raises(APIStatusError) as e:
            await c.completions("x")
    assert e.value.status == 503 and e.value.code == "queue_full" and fault.requests == 3


def test_retry_delay_honours_retry_after():
    c = AsyncClient("http://x", max_retries=3, backoff=0.5, max_backoff=30)
    assert 2.0 <= c.retry_delay(0, 2.0) <= 2.5  # at least what the server asked
    assert 2.0 <= c.retry_delay(2, None) <= 2.5  # 0.5 * 2**2, plus jitter
    assert c.retry_delay(0, 120.0) is None  # asks for longer than we wait: give up now
    assert c.retry_delay(3, None) is None  # out of retries
    assert parse_retry_after("3") == 3.0 and parse_retry_after(None) is None
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past
