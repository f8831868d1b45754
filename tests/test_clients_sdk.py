"""The aiohttp SDK's `async with` stream form aborts on the server when the block is left;
`/metrics` speaks OpenMetrics to a scraper that asks for it."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from app.client import AsyncClient
from tests.server_harness import ServerThread, assert_idle_and_clean, metric, tiny_config

LONG = 900  # tokens: far more than the test waits for, so only an abort ends it early


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_model_len=1024, max_num_seqs=4)).start()
    yield srv
    srv.stop()


def aborted(srv) -> float:
    return metric(httpx.get(srv.url + "/metrics").text, "request_success_total",
                  'finished_reason="abort"')


async def wait_for_free_blocks(srv, timeout: float = 10.0) -> float:
    core, t0 = srv.engine.core, time.monotonic()
    while core.blocks.num_free_blocks != core.blocks.num_blocks:
        assert time.monotonic() - t0 < timeout, "the request kept its KV blocks"
        await asyncio.sleep(0.02)
    return time.monotonic() - t0


@pytest.mark.parametrize("route", ["completions", "chat"])
async def test_leaving_the_async_with_block_aborts_while_the_stream_is_held(server, route):
    before = aborted(server)
    async with AsyncClient(server.url, max_retries=0) as client:
        call = (client.completions("Once upon a time", max_tokens=LONG, ignore_eos=True,
                                   stream=True) if route == "completions" else
                client.chat([{"role": "user", "content": "Tell a story"}], max_tokens=LONG,
                            ignore_eos=True, stream=True))
        async with call as stream:
            async for delta in stream:
                if delta.tokens >= 3:
                    break
        held = stream  # the caller still holds the stream: the block's exit closed it
        waited = await wait_for_free_blocks(server)
        assert held is stream and waited < 5.0
    assert aborted(server) == before + 1
    assert_idle_and_clean(server)


async def test_awaited_form_still_works_and_aclose_aborts(server):
    before = aborted(server)
    async with AsyncClient(server.url, max_retries=0) as client:
        done = await client.completions("Hello", max_tokens=3, ignore_eos=True)
        assert done.usage.completion_tokens == 3
        stream = await client.completions("Hello", max_tokens=LONG, ignore_eos=True,
                                          stream=True)
        async for _ in stream:
            break
        await stream.aclose()
        await wait_for_free_blocks(server)
    assert aborted(server) == before + 1


PROMETHEUS_2_ACCEPT = ("application/openmetrics-text;version=1.0.0,application/openmetrics-text;"
                      "version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1")


def test_metrics_negotiate_openmetrics_as_prometheus_client_does(server):
    plain = httpx.get(server.url + "/metrics")
    assert plain.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "# EOF" not in plain.text
    for accept in (PROMETHEUS_2_ACCEPT, "application/openmetrics-text"):
        om = httpx.get(server.url + "/metrics", headers={"Accept": accept})
        assert om.status_code == 200
        assert om.headers["content-type"].startswith("application/openmetrics-text")
        assert om.text.endswith("# EOF\n")
        # the same series names as the text format: a dashboard's queries still match
        assert "# TYPE ridgeline:request_success counter" in om.text
        assert "\nridgeline:request_success_total{" in om.text
        assert "\nridgeline:num_requests_running{" in om.text
    # a scraper that asks for underscores gets them, as prometheus_client gives them
    told = httpx.get(server.url + "/metrics", headers={
        "Accept": "application/openmetrics-text;version=1.0.0;escaping=underscores"})
    assert "escaping=underscores" in told.headers["content-type"]
    assert "\nridgeline_request_success_total{" in told.text
