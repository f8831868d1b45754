"""Chat template renders and chat bodies are bounded (issue 40, items 1 and 8).

A request-supplied template is refused unless the operator trusts them; every render
(the model's own template included) runs in a worker process with a time, output and
memory bound, and is killed when its client leaves or the server stops; a chat body's
counts are checked before its validation, and a large one is validated off the loop.
The real server on loopback with the tiny random Llama (real SmolLM2 tokenizer).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from app.config import ServerSettings
from app.engine.errors import InvalidParameter
from app.engine.input_processor import InputProcessor
from app.engine.renderer import RenderPool
from models.render_worker import render_job
from models.tokenizer import (
    apply_chat_template,
    chat_render_job,
    encode_rendered,
    load_tokenizer,
)
from tests.server_harness import ServerThread, free_port, tiny_config
from tests.test_tokenizer_json import CONVERSATIONS, FEATURES, WEATHER

NESTED = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}x")
HUGE_STRING = "{{ 'a'*1000000000 }}"
RENDER_TIMEOUT = 2.0
HELLO = [{"role": "user", "content": "Hello"}]


def chat(**extra) -> dict:
    return {"messages": HELLO, "max_tokens": 2, **extra}


@pytest.fixture(scope="module")
def server(tiny_dir):
    """Default flags: request templates refused."""
    srv = ServerThread(tiny_config(tiny_dir),
                       ServerSettings(log_stats_interval=0.05)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def trusting(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, chat_template_render_timeout=RENDER_TIMEOUT),
                       ServerSettings(log_stats_interval=0.05,
                                      trust_request_chat_template=True)).start()
    yield srv
    srv.stop()


def worker_pids(srv: ServerThread, pool: str = "request_renderer") -> set[int]:
    return srv.call(lambda: {w.process.pid for w in getattr(srv.engine.inputs, pool)._workers})


def wait_for_workers(srv: ServerThread, count: int = 2, timeout: float = 20.0,
                     pool: str = "request_renderer") -> set[int]:
    """The pool's workers, once `count` are idle (the request templates' pool starts
    at its first render)."""
    srv.call(lambda: getattr(srv.engine.inputs, pool).start())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        idle = srv.call(lambda: getattr(srv.engine.inputs, pool)._idle.qsize())
        if idle >= count:
            return worker_pids(srv, pool)
        time.sleep(0.05)
    raise TimeoutError("the render workers did not come back")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
            return f.read().split(")")[-1].split()[0] != "Z"
    except (ProcessLookupError, FileNotFoundError):  # gone, even between the two looks
        return False


class Probe:
    """/health and a plain chat completion, asked again and again from a thread while
    something else runs: the slowest answer of each."""

    def __init__(self, url: str, with_chat: bool = True):
        self.url, self.with_chat = url, with_chat
        self.health: list[float] = []
        self.chats: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                assert c.get(self.url + "/health").status_code == 200
                self.health.append(time.perf_counter() - t0)
                if self.with_chat:
                    t0 = time.perf_counter()
                    r = c.post(self.url + "/v1/chat/completions", json=chat())
                    self.chats.append((time.perf_counter() - t0, r.status_code))
                time.sleep(0.02)

    def __enter__(self) -> Probe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)


# -- (a) request templates need the operator's trust --------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", chat(chat_template="{{ 'x' }}"), "chat_template"),
    ("/v1/chat/completions", chat(chat_template_kwargs={"chat_template": "{{ 'x' }}"}),
     "chat_template_kwargs.chat_template"),
    ("/v1/chat/completions/render", chat(chat_template="{{ 'x' }}"), "chat_template"),
    ("/tokenize", {"messages": HELLO, "chat_template": "{{ 'x' }}"}, "chat_template"),
])
def test_a_request_template_is_refused_without_trust(server, path, body, param):
    r = httpx.post(server.url + path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert "--trust-request-chat-template" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/chat/completions", json=chat()).status_code == 200


def test_a_trusted_request_template_is_rendered(trusting):
    template = "<{{ messages[0].content }}>"
    r = httpx.post(trusting.url + "/tokenize", json={"messages": HELLO, "chat_template": template})
    assert r.status_code == 200, r.text
    r2 = httpx.post(trusting.url + "/tokenize", json={"prompt": "<Hello>",
                                                      "add_special_tokens": False})
    assert r.json()["tokens"] == r2.json()["tokens"]
    r = httpx.post(trusting.url + "/v1/chat/completions", json=chat(chat_template="{% if %}"))
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"


# -- (b) every render is bounded ----------------------------------------------------------


def test_two_endless_templates_are_refused_within_the_bound_while_serving(trusting):
    """The issue's attack: two nested `range` loops, sent twice, held both tokenizer
    threads forever; now each is a 400 at the time bound, and chat and /health answer
    throughout."""
    wait_for_workers(trusting)
    results: list = [None, None]

    def attack(i: int) -> None:
        t0 = time.perf_counter()
        r = httpx.post(trusting.url + "/v1/chat/completions", json=chat(chat_template=NESTED),
                       timeout=60)
        results[i] = (time.perf_counter() - t0, r.status_code, r.json()["error"])

    attackers = [threading.Thread(target=attack, args=(i,)) for i in range(2)]
    with Probe(trusting.url) as probe:
        for t in attackers:
            t.start()
        for t in attackers:
            t.join(60)
    for elapsed, status, error in results:
        assert status == 400 and error["param"] == "chat_template", error
        assert "did not render within" in error["message"]
        assert elapsed < RENDER_TIMEOUT + 5
    assert probe.health and max(probe.health) < 1.0, probe.health
    # The request templates have workers of their own: the model's template, and so a
    # plain chat, is not held while both of theirs are busy.
    assert len(probe.chats) >= 3 and all(status == 200 for _, status in probe.chats)
    assert max(t for t, _ in probe.chats) < 1.5, probe.chats
    wait_for_workers(trusting)  # both killed and replaced
    assert httpx.post(trusting.url + "/v1/chat/completions", json=chat()).status_code == 200


def test_a_gigabyte_string_is_refused_without_freezing_the_loop(trusting):
    wait_for_workers(trusting)
    with Probe(trusting.url, with_chat=False) as probe:
        t0 = time.perf_counter()
        r = httpx.post(trusting.url + "/v1/chat/completions",
                       json=chat(chat_template=HUGE_STRING), timeout=60)
        elapsed = time.perf_counter() - t0
        time.sleep(0.2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "memory" in r.json()["error"]["message"]
    assert elapsed < RENDER_TIMEOUT + 3
    assert probe.health and max(probe.health) < 0.5, probe.health


def test_an_output_longer_than_any_prompt_is_refused(trusting):
    template = "{% for i in range(100000) %}{{ 'abcdefghijklmnopqrstuvwxyz' }}{% endfor %}"
    r = httpx.post(trusting.url + "/v1/chat/completions", json=chat(chat_template=template))
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template", r.text
    assert "more than" in r.json()["error"]["message"]


def test_a_client_that_leaves_kills_its_render(trusting):
    before = wait_for_workers(trusting)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(trusting.url + "/v1/chat/completions", json=chat(chat_template=NESTED),
                   timeout=0.5)
    left = time.monotonic()
    while time.monotonic() - left < RENDER_TIMEOUT - 0.5:  # well before the time bound
        if any(not alive(pid) for pid in before):
            break
        time.sleep(0.05)
    assert any(not alive(pid) for pid in before), "the render outlived its client"
    assert time.monotonic() - left < RENDER_TIMEOUT - 0.5
    wait_for_workers(trusting)


def test_the_models_own_template_is_bounded_too(smollm2_dir):
    """A model's template is code as well: bounded, and a 400 naming `messages`."""
    async def run() -> None:
        tokenizer = load_tokenizer(smollm2_dir, NESTED)
        inputs = InputProcessor(tokenizer, 256, render_timeout=1.0)
        inputs.start()
        try:
            t0 = time.perf_counter()
            with pytest.raises(InvalidParameter) as e:
                await inputs.apply_chat_template(HELLO)
            assert e.value.param == "messages" and "within 1 s" in str(e.value)
            assert time.perf_counter() - t0 < 5
        finally:
            await inputs.shutdown()
        assert inputs.renderer.num_workers == 0
    asyncio.run(run())


def test_the_server_path_renders_as_transformers(smollm2_dir):
    """The worker's render, then the tokenizer's encode, give transformers' ids, on the
    templates the tokenizer tests carry (and one round trip through a real worker)."""
    from transformers import AutoTokenizer

    ours = load_tokenizer(smollm2_dir)
    hf = AutoTokenizer.from_pretrained(str(smollm2_dir))
    for conversation in CONVERSATIONS:
        for kwargs in ({}, {"chat_template": FEATURES}):
            for extra in ({}, {"tools": [WEATHER]}, {"flavour": "spicy"}):
                for gp in (True, False):
                    try:
                        want = apply_chat_template(hf, conversation, gp, **kwargs, **extra)
                    except Exception:  # SmolLM2's own template needs a content
                        assert "error" in render_job(chat_render_job(
                            ours, conversation, gp, **kwargs, **extra))
                        continue
                    reply = render_job(chat_render_job(ours, conversation, gp, **kwargs,
                                                       **extra))
                    assert encode_rendered(ours, reply["text"]) == want

    async def through_a_worker() -> list[int]:
        pool = RenderPool()
        pool.start()
        try:
            text = await pool.render(chat_render_job(ours, CONVERSATIONS[1]), 10**6)
        finally:
            await pool.close()
        return encode_rendered(ours, text)
    assert asyncio.run(through_a_worker()) == apply_chat_template(hf, CONVERSATIONS[1])


def test_sigterm_exits_promptly_with_endless_renders(tiny_dir):
    """With renders that would run a minute, SIGTERM ends them (503) and the server and
    its workers exit at once (the server hung with the renders on the tokenizer threads;
    uvicorn alone would wait 5 s for their connections)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "serve", "--port", str(port), "--model",
         str(tiny_dir), "--dtype", "float32", "--trust-request-chat-template",
         "--chat-template-render-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        workers = _children(proc.pid)
        deadline = time.monotonic() + 20
        while len(workers) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
            workers = _children(proc.pid)
        assert len(workers) == 2, workers

        statuses: list[int] = []

        def attack() -> None:
            r = httpx.post(url + "/v1/chat/completions", json=chat(chat_template=NESTED),
                           timeout=60)
            statuses.append(r.status_code)
        attackers = [threading.Thread(target=attack, daemon=True) for _ in range(2)]
        for t in attackers:
            t.start()
        time.sleep(1.5)
        workers = _children(proc.pid)  # the request templates' pool has started too
        assert len(workers) == 4, workers
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
        assert time.monotonic() - t0 < 4
        for t in attackers:
            t.join(5)
        assert statuses == [503, 503]
        time.sleep(0.5)
        assert not [pid for pid in workers if alive(pid)]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


# -- item 8: counts before validation, large bodies off the loop --------------------------


def test_sixty_thousand_messages_are_refused_at_once(server):
    """The issue's body (2.1 MB of short messages) took 10 s to refuse and held /health
    for 4.7 s."""
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}] * 60000,
                       "max_tokens": 1}).encode()
    assert len(body) > 1_500_000
    with Probe(server.url, with_chat=False) as probe:
        t0 = time.perf_counter()
        r = httpx.post(server.url + "/v1/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=60)
        elapsed = time.perf_counter() - t0
        time.sleep(0.2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert "2048" in r.json()["error"]["message"]
    assert elapsed < 1.5
    assert probe.health and max(probe.health) < 0.5, probe.health


@pytest.mark.parametrize("body,param", [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 257}]},
     "messages.0.content"),
    ({"messages": HELLO, "tools": [WEATHER] * 129}, "tools"),
])
def test_parts_and_tools_are_counted(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_body_of_many_parts_is_validated_off_the_loop(server):
    """Within the counts a body still holds ~100,000 content parts: a second of
    validation, which runs on a thread while /health answers. Its 3 MB of JSON are
    parsed on the loop (a C parse holds the GIL on any thread: 0.06-0.3 s here, more on
    a busy host), so /health may wait that long, not the validation's second."""
    parts = [{"type": "text", "text": ""}] * 50
    body = {"messages": [{"role": "user", "content": parts}] * 2000, "max_tokens": 1}
    with Probe(server.url, with_chat=False) as probe:
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        time.sleep(0.2)
    assert r.status_code == 400, r.text  # the rendered conversation cannot fit
    assert probe.health and max(probe.health) < 0.8, probe.health


def test_a_pool_whose_workers_cannot_start_refuses_at_once_then_recovers(monkeypatch):
    """No worker: a render is a quick `unavailable` (the server's 503), not a wait;
    the pool keeps trying, and renders again once a worker starts."""
    from app.engine import renderer

    async def run() -> None:
        real = renderer.sys.executable
        monkeypatch.setattr(renderer.sys, "executable", "/nonexistent/python")
        pool = RenderPool()
        pool.start()
        await asyncio.sleep(0.2)
        t0 = time.perf_counter()
        with pytest.raises(renderer.RenderFailed) as e:
            await pool.render({"template": "x", "messages": HELLO}, 100)
        assert e.value.kind == "unavailable" and time.perf_counter() - t0 < 0.5
        monkeypatch.setattr(renderer.sys, "executable", real)
        async with asyncio.timeout(20):
            while True:
                try:
                    assert await pool.render({"template": "x", "messages": HELLO}, 100) == "x"
                    break
                except renderer.RenderFailed:
                    await asyncio.sleep(0.2)
        await pool.close()
    asyncio.run(run())
