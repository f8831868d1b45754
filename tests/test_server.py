"""The real HTTP server on a loopback port, driven by real clients (openai, aiohttp, httpx).

The model is the tiny random-weight Llama (with the real SmolLM2 tokenizer) so the
suite stays fast; tests/test_e2e_smollm2.py covers the real model.
"""

from __future__ import annotations

import asyncio
import json
import logging

import aiohttp
import httpx
import openai
import pytest

from app.server import ServerSettings
from app.server.streaming import sse
from tests.server_harness import ServerThread, assert_idle_and_clean, metric, tiny_config


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_num_seqs=16)).start()
    yield srv
    srv.stop()


def test_openai_client_completions_chat_streaming_usage(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == ["tiny"]

    c = client.completions.create(model="tiny", prompt="Hello there", max_tokens=7,
                                  temperature=0, extra_body={"ignore_eos": True})
    assert c.usage.completion_tokens == 7 and c.choices[0].finish_reason == "length"
    assert c.usage.prompt_tokens == len(httpx.post(server.url + "/tokenize",
                                                   json={"prompt": "Hello there"}).json()["tokens"])

    messages = [{"role": "user", "content": "Say something"}]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=9,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 9

    chunks = list(client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=9, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == chat.choices[0].message.content  # greedy: streaming equals non-streaming
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert all(ch.usage is None for ch in chunks[:-1])

    plain = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=3,
                                                temperature=0, stream=True))
    assert all(ch.choices for ch in plain)  # no usage chunk unless asked

    streamed = list(client.completions.create(model="tiny", prompt="Hello there", max_tokens=7,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in streamed) == c.choices[0].text
    assert_idle_and_clean(server)


def test_one_event_per_generated_token(server):
    """vLLM's benchmark client times inter-token latency by events: a token whose text
    is held back (half a UTF-8 character) still gets its own, empty, event, as in vLLM.
    The tiny model's random weights sample byte-fallback tokens often, so some of these
    48 tokens have no text of their own."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    n = 48
    streamed = [ch for ch in client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=n, temperature=1.0, seed=3,
        stream=True, extra_body={"ignore_eos": True}) if ch.choices]
    assert len(streamed) == n and streamed[-1].choices[0].finish_reason == "length"
    messages = [{"role": "user", "content": "Say something"}]
    chat = [ch for ch in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=n, temperature=1.0, seed=3, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices]
    assert len(chat) == 1 + n  # the role, then one per token
    assert all(ch.choices[0].delta.content is not None for ch in chat)
    assert_idle_and_clean(server)


def test_streams_send_no_keepalive_comments():
    """sse-starlette pings every 15 s unless told not to. vLLM's benchmark client strips
    each read's trailing newlines, so a `: ping` comment swallowed every event after it
    (52 of 128 tokens per request were lost under load). OpenAI and vLLM send none."""
    async def events():
        yield {}
    assert sse(events()).ping_interval == 0


@pytest.mark.parametrize(
    "path,body,status,param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": -0.1}, 400, "top_p"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1000}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "", "max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 99999999]}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "n": 65}, 400, "n"),  # n > 1 works; 64 is the bound
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
         "stream_options"),
        ("/v1/completions", {"prompt": "x", "model": "gpt-nope"}, 404, "model"),
        ("/v1/completions", {"prompt": "x", "stop": [""]}, 400, "stop"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages.0.role"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_completion_tokens": -5}, 400, "max_tokens"),
        ("/generate", {"text": "x", "sampling_params": {"temperature": -2}}, 400,
         "sampling_params.temperature"),
        ("/generate", {"text": "x", "sampling_params": {"bogus": 1}}, 400, "sampling_params"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
        ("/generate", {"text": "x", "sampling_params": {"min_new_tokens": 1,
                                                        "stop_token_ids": [99999999]}}, 400,
         "stop_token_ids"),
    ],
)
def test_bad_input_table(server, path, body, status, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_malformed_json_and_body_limit(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir), ServerSettings(max_body_bytes=1000)).start()
    try:
        r = httpx.post(srv.url + "/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x" * 2000})
        assert r.status_code == 413 and r.json()["error"]["message"]
    finally:
        srv.stop()


def test_api_key(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir), ServerSettings(api_key="s3cret")).start()
    try:
        body = {"prompt": "hi", "max_tokens": 2}
        assert httpx.post(srv.url + "/v1/completions", json=body).status_code == 401
        bad = httpx.post(srv.url + "/v1/completions", json=body,
                         headers={"Authorization": "Bearer wrong"})
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
        ok = httpx.post(srv.url + "/v1/completions", json=body,
                        headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
        for path, payload in (("/generate", {"text": "hi"}), ("/abort_request", {"rid": "x"}),
                              ("/tokenize", {"prompt": "hi"})):
            assert httpx.post(srv.url + path, json=payload).status_code == 401, path
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret")
        assert client.models.list().data[0].id == "tiny"
    finally:
        srv.stop()


async def _stream(session, url, body, stop_after=None):
    """Read SSE events; close the connection after `stop_after` data events."""
    events = []
    async with session.post(url, json=body) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            events.append(line[5:].strip())
            if stop_after is not None and len(events) >= stop_after:
                resp.close()  # the client goes away mid-stream
                return events
    return events


def test_disconnect_aborts_and_frees_blocks(server):
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 120, "stream": True,
            "ignore_eos": True, "temperature": 0, "stream_options": {"include_usage": True}}

    async def main():
        async with aiohttp.ClientSession() as s:
            url = server.url + "/v1/completions"
            tasks = [_stream(s, url, body, stop_after=5 if i % 2 else None) for i in range(8)]
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    full = [r for i, r in enumerate(results) if i % 2 == 0]
    assert all(r[-1] == "[DONE]" for r in full)
    assert all(json.loads(r[-2])["usage"]["completion_tokens"] == 120 for r in full)
    assert all(len(r) == 5 for i, r in enumerate(results) if i % 2)
    text = httpx.get(server.url + "/metrics").text
    assert metric(text, "request_success_total", 'finished_reason="abort"') >= 4
    assert_idle_and_clean(server)


def test_overload_gets_503_with_retry_after_and_accepted_complete(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_num_seqs=1, max_queued_requests=1)).start()
    try:
        async def one(s, i):
            async with s.post(srv.url + "/v1/completions", json={
                    "prompt": f"request {i}", "max_tokens": 40, "ignore_eos": True}) as r:
                return r.status, r.headers.get("Retry-After"), await r.json()

        async def main():
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(one(s, i) for i in range(8)))

        results = asyncio.run(main())
        rejected = [r for r in results if r[0] == 503]
        accepted = [r for r in results if r[0] == 200]
        assert rejected and accepted and len(rejected) + len(accepted) == 8
        assert all(r[1] == "1" and r[2]["error"]["code"] == "queue_full" for r in rejected)
        assert all(r[2]["usage"]["completion_tokens"] == 40 for r in accepted)
        assert_idle_and_clean(srv)
    finally:
        srv.stop()


def test_metrics_ttft_count_and_preemptions_in_stats_line(tiny_dir, caplog):
    # 20 blocks x 4 = 80 slots; 6 requests of ~60 tokens each must preempt.
    cfg = tiny_config(tiny_dir, max_model_len=80, num_blocks=20, block_size=4,
                      max_num_seqs=6)
    srv = ServerThread(cfg, ServerSettings(log_stats_interval=0.01)).start()
    try:
        caplog.set_level(logging.INFO, logger="ridgeline.stats")

        async def main():
            async with aiohttp.ClientSession() as s:
                return await asyncio.gather(*(s.post(srv.url + "/v1/completions", json={
                    "prompt": "count with me " * 3, "max_tokens": 50, "ignore_eos": True,
                }) for _ in range(6)))

        responses = asyncio.run(main())
        assert all(r.status == 200 for r in responses)
        text = httpx.get(srv.url + "/metrics").text
        finished = metric(text, "request_success_total", 'finished_reason="length"')
        assert finished == 6
        assert metric(text, "time_to_first_token_seconds_count") == finished
        assert metric(text, "e2e_request_latency_seconds_count") == finished
        assert metric(text, "generation_tokens_total") == 6 * 50
        assert metric(text, "num_preemptions_total") > 0
        lines = [r.getMessage() for r in caplog.records if r.name == "ridgeline.stats"]
        assert any("Preemptions: " in line for line in lines)
        assert any("Avg generation throughput" in line and "Preemptions" not in line
                   for line in lines)  # quiet intervals omit it
        assert_idle_and_clean(srv)
    finally:
        srv.stop()


def test_model_thread_failure_turns_health_red_and_ends_streams(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir)).start()
    try:
        assert httpx.get(srv.url + "/health").status_code == 200
        runner = srv.engine.core.worker.wait_ready()
        real_execute = runner.execute
        calls = {"n": 0}

        def failing(batch):  # fault injection: the device step raises mid-stream
            calls["n"] += 1
            if calls["n"] > 5:
                raise RuntimeError("CUDA error: an illegal memory access (injected device fault)")
            return real_execute(batch)

        runner.execute = failing

        async def main():
            async with aiohttp.ClientSession() as s:
                return await asyncio.wait_for(_stream(s, srv.url + "/v1/completions", {
                    "prompt": "x", "max_tokens": 100, "stream": True, "ignore_eos": True}), 30)

        events = asyncio.run(main())
        assert events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2])
        assert httpx.get(srv.url + "/health").status_code == 503
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503
    finally:
        srv.stop()


def test_native_endpoints(server):
    g = httpx.post(server.url + "/generate", json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 5, "temperature": 0,
                                             "ignore_eos": True}}).json()
    assert len(g["output_ids"]) == 5 and g["meta_info"]["finish_reason"]["type"] == "length"
    d = httpx.post(server.url + "/detokenize", json={"tokens": g["output_ids"]}).json()
    assert d["prompt"] == g["text"]
    t = httpx.post(server.url + "/tokenize", json={
        "messages": [{"role": "user", "content": "hi"}]}).json()
    assert t["count"] == len(t["tokens"]) > 3

    async def main():
        async with aiohttp.ClientSession() as s:
            events = []
            async with s.post(server.url + "/generate", json={
                    "text": "Hello", "stream": True,
                    "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}) as resp:
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    events.append(line[5:].strip())
                    if len(events) == 1:  # abort by the id the server answered with
                        rid = json.loads(events[0])["meta_info"]["id"]
                        r = await s.post(server.url + "/abort_request", json={"rid": rid})
                        assert (await r.json())["aborted"]
            return events

    events = asyncio.run(main())
    last = json.loads(events[-2])
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(last["output_ids"]) < 200
    assert_idle_and_clean(server)


def test_logprobs_streamed_equal_non_streamed(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
              temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [e for ch in client.chat.completions.create(stream=True, **kw) if ch.choices
                and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert len(whole) == 6 and len(streamed) == 6
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in whole]
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in whole)
    assert whole[0].logprob == pytest.approx(whole[0].top_logprobs[0].logprob)  # greedy: top-1

    body = {"prompt": "Hi", "max_tokens": 4, "temperature": 0, "logprobs": 1, "ignore_eos": True}
    c = httpx.post(server.url + "/v1/completions", json=body).json()
    lp = c["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 4
