"""Replicas behind vllm-router, as real processes (the tiny model, so it stays quick):
a replica killed under load, a replica drained under load, and KV events the router
routes by."""

from __future__ import annotations

import asyncio
import shutil
import signal
import time

import aiohttp
import httpx
import pytest

from app.replicas import Cluster, Replica, healthy
from tests.server_harness import metric

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("vllm-router") is None,
                                 reason="needs vllm-router (pip install 'ridgeline[router]')")]


def serve_args(tiny_dir) -> list[str]:
    return ["--model", str(tiny_dir), "--dtype", "float32", "--max-model-len", "512",
            "--shutdown-timeout", "30", "--served-model-name", "tiny"]


async def stream(session, url: str, tokens: int) -> tuple[int, bool]:
    """(data events, whether [DONE] came) of one streamed completion."""
    events, done = 0, False
    try:
        async with session.post(url + "/v1/completions", json={
                "prompt": "hello", "max_tokens": tokens, "ignore_eos": True,
                "stream": True}) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    events += 1
    except aiohttp.ClientError:
        pass  # the router cut the stream: a replica died under it
    return events, done


async def complete(session, url: str, tokens: int = 40) -> int:
    async with session.post(url + "/v1/completions", json={
            "prompt": "hi", "max_tokens": tokens, "ignore_eos": True}) as r:
        await r.read()
        return r.status


def wait_for(check, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def test_a_killed_replica_fails_over_and_rejoins(tiny_dir, tmp_path):
    with Cluster(2, "round_robin", serve_args(tiny_dir), log_dir=str(tmp_path)) as cluster:
        async def load():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as s:
                streams = [asyncio.create_task(stream(s, cluster.url, 450)) for _ in range(4)]
                await asyncio.sleep(0.8)  # they are running on both replicas now
                cluster.nodes[0].process.kill()  # no drain: the device or host died
                t0 = time.monotonic()
                results = await asyncio.gather(*streams)
                ended_in = time.monotonic() - t0
                after = await asyncio.gather(*(complete(s, cluster.url) for _ in range(6)))
                return results, ended_in, after

        results, ended_in, after = asyncio.run(load())
        cut = [r for r in results if not r[1]]
        assert cut and len(cut) < len(results)  # the dead replica's streams ended, cut
        assert all(done for _, done in results if (_, done) not in cut)
        assert ended_in < 30  # nothing hung
        assert after == [200] * 6  # new requests went to the live replica (or were retried)
        assert wait_for(lambda: httpx.get(cluster.url + "/health").status_code == 503, 15)
        dead = cluster.nodes[0]
        replacement = Replica(dead.port, dead.args, log_path=str(tmp_path / "again.log"))
        replacement.start()
        cluster.nodes[0] = replacement
        assert wait_for(lambda: healthy(replacement.url), 120)
        assert wait_for(lambda: httpx.get(cluster.url + "/health").status_code == 200, 30)
        for _ in range(4):  # round robin reaches the replica that rejoined
            assert httpx.post(cluster.url + "/v1/completions", timeout=30,
                              json={"prompt": "x", "max_tokens": 2}).status_code == 200
        served = httpx.get(replacement.url + "/metrics").text
        assert metric(served, "request_success_total", 'finished_reason="length"') >= 1


def test_a_draining_replica_finishes_its_work_and_clients_see_no_error(tiny_dir, tmp_path):
    with Cluster(2, "round_robin", serve_args(tiny_dir), log_dir=str(tmp_path)) as cluster:
        async def load():
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as s:
                first = [asyncio.create_task(complete(s, cluster.url, 300)) for _ in range(6)]
                await asyncio.sleep(0.8)
                cluster.nodes[1].process.send_signal(signal.SIGTERM)  # drain one
                more = [asyncio.create_task(complete(s, cluster.url, 20)) for _ in range(8)]
                return await asyncio.gather(*first, *more)

        statuses = asyncio.run(load())
        assert statuses == [200] * 14
        assert cluster.nodes[1].process.wait(60) == 0  # drained, then exited cleanly


def test_kv_aware_routing_follows_the_replicas_events(tiny_dir, tmp_path):
    """Each replica publishes its cache; the router credits the replica holding a prompt's
    blocks (its `kv_placement_lookups` hit counter goes up) and routes the prompt there."""
    with Cluster(2, "kv_aware", serve_args(tiny_dir), log_dir=str(tmp_path)) as cluster:
        prompt = " ".join(f"word{i}" for i in range(120))  # many full blocks
        first = httpx.post(cluster.url + "/v1/completions", timeout=60, json={
            "prompt": prompt, "max_tokens": 2})
        assert first.status_code == 200
        time.sleep(1.0)  # the events reach the router
        holders = [n for n in cluster.nodes if _queries(n.url) > 0]
        assert len(holders) == 1
        for _ in range(4):
            assert httpx.post(cluster.url + "/v1/completions", timeout=60, json={
                "prompt": prompt + " again", "max_tokens": 2}).status_code == 200
        hits = {n.url: _hits(n.url) for n in cluster.nodes}
        assert hits[holders[0].url] > 0 and sum(hits.values()) == hits[holders[0].url]
        router = httpx.get(f"http://127.0.0.1:{cluster.router_metrics_port}/metrics").text
        assert any(line.startswith("vllm_router_kv_placement_lookups_total")
                   and 'result="hit"' in line and float(line.rsplit(" ", 1)[1]) > 0
                   for line in router.splitlines()), router[-2000:]


def _value(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"ridgeline:{name}"))


def _queries(url: str) -> float:
    return _value(url, "prefix_cache_queries_total")


def _hits(url: str) -> float:
    return _value(url, "prefix_cache_hits_total")

