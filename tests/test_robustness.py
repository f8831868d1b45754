"""No request can hurt the server: one test per class of defect found by a hostile client.

The real server on loopback with the tiny random Llama (real SmolLM2 tokenizer). After
every scenario the engine is healthy, idle, and its block pool is whole.
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import socket
import threading
import time

import aiohttp
import httpx
import pytest

from app.config import ServerSettings
from app.engine.stop import StopStringMatcher
from tests.server_harness import ServerThread, assert_idle_and_clean, metric, tiny_config

ROUTES = ("/v1/completions", "/v1/chat/completions", "/generate")


def body_for(path: str, **sampling) -> dict:
    if path == "/v1/completions":
        return {"prompt": "Hello", "max_tokens": 4, **sampling}
    if path == "/v1/chat/completions":
        return {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, **sampling}
    return {"text": "Hello", "sampling_params": {"max_new_tokens": 4, **sampling}}


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_num_seqs=8),
                       ServerSettings(log_stats_interval=0.05, header_timeout=1.0)).start()
    yield srv
    srv.stop()


def healthy(srv: ServerThread) -> bool:
    return httpx.get(srv.url + "/health").status_code == 200


# -- 1. nothing unbounded reaches the model thread ---------------------------------------


@pytest.mark.parametrize("path", ROUTES)
def test_huge_top_k_is_clamped_not_fatal(server, path):
    r = httpx.post(server.url + path, json=body_for(path, top_k=10**20, temperature=0.7))
    assert r.status_code == 200, r.text
    assert healthy(server)
    assert httpx.post(server.url + path, json=body_for(path)).status_code == 200


@pytest.mark.parametrize("path,field,value", [
    (path, field, value) for path in ROUTES for field, value in (
        ("seed", 2**64), ("seed", -(2**63) - 1), ("temperature", float("inf")),
        ("top_p", 2.0), ("repetition_penalty", 0.0), ("min_p", -0.1))
])
def test_out_of_range_numbers_are_400s(server, path, field, value):
    body = body_for(path, **{field: value})
    # 1e999 is valid JSON that parses to infinity (the literal Infinity is not JSON).
    r = httpx.post(server.url + path, content=json.dumps(body).replace("Infinity", "1e999"),
                   headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert field in (r.json()["error"]["param"] or "")
    assert healthy(server)


def test_tiny_temperature_is_greedy(server):
    greedy = httpx.post(server.url + "/v1/completions",
                        json={"prompt": "Once", "max_tokens": 8, "temperature": 0,
                              "ignore_eos": True}).json()
    tiny = httpx.post(server.url + "/v1/completions",
                      json={"prompt": "Once", "max_tokens": 8, "temperature": 1e-300,
                            "ignore_eos": True}).json()
    assert tiny["choices"][0]["text"] == greedy["choices"][0]["text"]


def test_nan_and_infinity_are_not_json(server):
    for literal in ("NaN", "Infinity", "-Infinity"):
        r = httpx.post(server.url + "/v1/completions",
                       content=f'{{"prompt": "x", "temperature": {literal}}}',
                       headers={"content-type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]


def test_a_row_that_fails_to_sample_fails_alone(server):
    """Defence in depth: a failure inside one row's sampling fails that request only."""
    runner = server.engine.core.worker.wait_ready()
    real = runner.sampler

    class PoisonedSampler:
        def __call__(self, logits, rows):
            if any(r.seed == 4242 for r in rows):
                raise RuntimeError("injected sampling fault")
            return real(logits, rows)

    runner.sampler = PoisonedSampler()
    try:
        async def main():
            async with aiohttp.ClientSession() as s:
                async def post(seed):
                    async with s.post(server.url + "/v1/completions", json={
                            "prompt": "Hi", "max_tokens": 30, "seed": seed,
                            "ignore_eos": True}) as r:
                        return r.status, await r.json()
                return await asyncio.gather(post(4242), post(1), post(2))

        (bad_status, bad), *good = asyncio.run(main())
        assert bad_status == 500 and "sampling failed" in bad["error"]["message"]
        assert all(status == 200 and b["usage"]["completion_tokens"] == 30 for status, b in good)
        assert healthy(server)
        text = httpx.get(server.url + "/metrics").text
        assert metric(text, "request_success_total", 'finished_reason="error"') >= 1
    finally:
        runner.sampler = real
    assert_idle_and_clean(server)


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(server):
    runner = server.engine.core.worker.wait_ready()
    real = runner.execute
    calls = {"n": 0}

    def fail_once(batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise ValueError("injected step fault (not a device fault)")
        return real(batch)

    runner.execute = fail_once
    try:
        r = httpx.post(server.url + "/v1/completions",
                       json={"prompt": "Hi", "max_tokens": 10, "ignore_eos": True})
        assert r.status_code == 500 and "injected step fault" in r.json()["error"]["message"]
        assert healthy(server)
        r = httpx.post(server.url + "/v1/completions",
                       json={"prompt": "Hi", "max_tokens": 10, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10
    finally:
        runner.execute = real
    assert_idle_and_clean(server)


# -- 2. stop strings: bounded, and linear in their length --------------------------------


def test_stop_strings_are_bounded(server):
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": "x", "stop": ["a" * 1025]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": "x", "stop": [f"s{i}" for i in range(65)]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"
    ok = httpx.post(server.url + "/v1/completions",
                    json={"prompt": "x", "max_tokens": 4, "stop": ["ab" * 512]})
    assert ok.status_code == 200


def test_stop_matcher_is_linear_in_the_stop_length():
    import tracemalloc

    tracemalloc.start()
    t0 = time.perf_counter()
    matcher = StopStringMatcher(["ab" * 500_000])  # 1 MB: the naive prefix set is ~500 GB
    out = [matcher.feed("abab") for _ in range(1000)]
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    # The bound tells linear from quadratic (the naive matcher never finishes), with room
    # for a loaded two-core host: tracemalloc slows every allocation several-fold.
    assert peak < 64 << 20 and elapsed < 30.0
    assert all(text == "" and not hit for text, hit in out)  # all held: it may still match


# -- 3. big prompts never reach the tokenizer, and tokenizing runs off the loop -----------


def test_a_prompt_too_long_to_fit_is_refused_before_tokenizing(server):
    inputs = server.engine.inputs
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": "word " * (inputs.max_chars // 5 + 1), "max_tokens": 2})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"]
    assert time.perf_counter() - t0 < 5
    assert healthy(server)


def test_tokenizing_and_templating_run_off_the_event_loop(server):
    inputs = server.engine.inputs
    seen = []
    real = inputs._encode

    def spy(*a, **kw):
        seen.append(threading.current_thread().name)
        return real(*a, **kw)

    inputs._encode = spy
    try:
        assert httpx.post(server.url + "/v1/completions",
                          json={"prompt": "Hi", "max_tokens": 2}).status_code == 200
    finally:
        inputs._encode = real
    assert seen and all(name.startswith("ridgeline-tokenize") for name in seen)


# -- 4. every error is JSON -----------------------------------------------------------------


@pytest.mark.parametrize("path,raw,status", [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', 400),
    ("/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}', 400),
    ("/v1/completions", "[" * 100_000 + "]" * 100_000, 400),
    ("/tokenize", '{"messages": [{"role": "nobody", "content": 3}]}', 400),
    ("/tokenize", '{"messages": "not a list"}', 400),
    ("/v1/nope", "{}", 404),
])
def test_errors_are_json(server, path, raw, status):
    r = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.json()["error"]["message"]


def test_wrong_method_and_unexpected_errors_are_json(server):
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"]
    inputs = server.engine.inputs
    real = inputs.tokenize

    async def broken(*a, **kw):
        raise KeyError("injected bug")

    inputs.tokenize = broken
    try:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x"})
    finally:
        inputs.tokenize = real
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
    assert healthy(server)


# -- 5. /generate is typed like the OpenAI routes ------------------------------------------


@pytest.mark.parametrize("sampling,param", [
    ({"ignore_eos": "no"}, "sampling_params.ignore_eos"),
    ({"max_new_tokens": 5.5}, "sampling_params.max_new_tokens"),
    ({"top_k": 2.5}, "sampling_params.top_k"),
    ({"temperature": "hot"}, "sampling_params.temperature"),
    ({"stop": 3}, "sampling_params.stop"),
])
def test_generate_sampling_params_are_type_checked(server, sampling, param):
    r = httpx.post(server.url + "/generate", json={"text": "x", "sampling_params": sampling})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "<class" not in err["message"]


def test_openai_bodies_are_strict_too(server):
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": "x", "ignore_eos": "no", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"


# -- 6. a body must be declared JSON ---------------------------------------------------------


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_non_json_content_type_is_415(server, content_type):
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "x"}', headers=headers)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1},
                      headers={"content-type": "application/json; charset=utf-8"}
                      ).status_code == 200


# -- 7. logs carry tracebacks ------------------------------------------------------------------


def test_logged_exceptions_carry_their_traceback():
    from app.logging_setup import configure_logging

    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        configure_logging(json_lines=True)
        buf = io.StringIO()
        root.handlers[0].stream = buf
        try:
            raise ZeroDivisionError("boom")
        except ZeroDivisionError:
            logging.getLogger("ridgeline.test").exception("failed", extra={"request_id": "r1"})
        line = json.loads(buf.getvalue().strip().splitlines()[-1])
    finally:
        root.handlers, root.level = saved[0], saved[1]
    assert line["request_id"] == "r1"
    assert line["exception"].startswith("Traceback")
    assert "ZeroDivisionError: boom" in line["exception"]


# -- 8. /v1/models shows the served name, not the machine's paths ---------------------------


def test_models_shows_no_local_paths(server):
    data = httpx.get(server.url + "/v1/models").json()["data"]
    assert data[0]["id"] == "tiny" and data[0]["root"] == "tiny"
    assert os.sep + "tmp" not in json.dumps(data) and str(server.engine.core.model_dir) not in \
        json.dumps(data)


# -- 10. an interrupted conversion leaves no temp directory behind ---------------------------


def test_stale_conversion_directories_are_removed(tmp_path):
    from models.resolve import remove_stale_conversions

    dead_pid = 2**22 + 12345  # above pid_max on common kernels: never alive
    stale = tmp_path / f".smollm2-abc.{dead_pid}.x1y2.tmp"
    live = tmp_path / f".smollm2-abc.{os.getpid()}.z3w4.tmp"
    entry = tmp_path / "smollm2-abc"
    for d in (stale, live, entry):
        d.mkdir()
    assert remove_stale_conversions(tmp_path) == [stale]
    assert not stale.exists() and live.exists() and entry.exists()


# -- 11. admission counts free run slots -------------------------------------------------------


def test_burst_into_idle_server_fills_run_slots_and_queue(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_num_seqs=4, max_queued_requests=4)).start()
    try:
        async def main():
            async with aiohttp.ClientSession() as s:
                async def one(i):
                    async with s.post(srv.url + "/v1/completions", json={
                            "prompt": f"burst {i}", "max_tokens": 100,
                            "ignore_eos": True}) as r:
                        return r.status
                return await asyncio.gather(*(one(i) for i in range(32)))

        statuses = asyncio.run(main())
        assert statuses.count(200) == 8 and statuses.count(503) == 24
        assert_idle_and_clean(srv)
    finally:
        srv.stop()


# -- 12. slow headers are timed out --------------------------------------------------------------


def test_slow_headers_get_408_and_the_connection_closes(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        t0 = time.monotonic()
        chunks = []
        try:
            for _ in range(20):  # one header byte every 0.2 s: slower than 1 s allows
                sock.sendall(b"X")
                time.sleep(0.2)
        except OSError:  # the server closed on us
            pass
        sock.settimeout(5)
        while data := sock.recv(4096):
            chunks.append(data)
        reply = b"".join(chunks)
    assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
    assert time.monotonic() - t0 < 4
    assert healthy(server)


# -- 13. chat content as a list of parts --------------------------------------------------------


def test_chat_text_parts_are_accepted_and_other_parts_refused(server):
    def chat(content):
        return httpx.post(server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": content}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True})

    plain = chat("Hello there")
    parts = chat([{"type": "text", "text": "Hello there"}])
    assert plain.status_code == parts.status_code == 200
    assert parts.json()["choices"][0]["message"]["content"] == \
        plain.json()["choices"][0]["message"]["content"]
    image = chat([{"type": "text", "text": "what is this"},
                  {"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    assert image.status_code == 400
    assert image.json()["error"]["param"].startswith("messages.0.content")
    assert "image_url" in image.json()["error"]["message"]
    assert_idle_and_clean(server)


# -- SSE framing that naive clients parse ----------------------------------------------------


@pytest.mark.parametrize("path", ROUTES)
def test_sse_events_split_on_blank_lines_with_lf(server, path):
    """vLLM's benchmark client splits the stream on "\\n\\n"; with "\\r\\n" framing it lost
    every event that shared a read with another."""
    body = body_for(path, ignore_eos=True)
    body["stream"] = True
    if path == "/generate":
        body["sampling_params"]["max_new_tokens"] = 12
    else:
        body["max_tokens"] = 12
    raw = httpx.post(server.url + path, json=body).content
    assert b"\r" not in raw
    events = [e for e in raw.decode().split("\n\n") if e.strip()]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    parsed = [json.loads(e[6:]) for e in events[:-1]]
    assert len(parsed) >= 2
