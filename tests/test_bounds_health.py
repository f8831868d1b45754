"""`/health` tells the truth about the request path, not only about the model thread:
when a plain chat or text prompt cannot be served (every tokenizer thread held, the
model's template renderer unable to start), it is 503 with the reason, and 200 again
once that passes. The bounds make both unlikely; these tests force them."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from app.config import ServerSettings
from app.engine import input_processor, renderer
from tests.server_harness import ServerThread, tiny_config


@pytest.fixture
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir), ServerSettings(log_stats_interval=0)).start()
    yield srv
    srv.stop()


def health(url: str) -> tuple[int, dict]:
    r = httpx.get(url + "/health", timeout=5)
    return r.status_code, r.json()


def wait_for(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_health_is_503_while_every_tokenizer_thread_is_held(server, monkeypatch):
    monkeypatch.setattr(input_processor, "STUCK_SECONDS", 0.3)
    inputs = server.engine.inputs
    release = threading.Event()
    real = inputs._encode

    def held(text: str, add_special_tokens: bool) -> list[int]:
        if text.startswith("hold"):
            release.wait(30)
        return real(text, add_special_tokens)
    monkeypatch.setattr(inputs, "_encode", held)
    assert health(server.url)[0] == 200
    clients = [threading.Thread(target=httpx.post, args=(server.url + "/v1/completions",),
                                kwargs={"json": {"prompt": "hold me", "max_tokens": 1},
                                        "timeout": 60}) for _ in range(2)]
    for c in clients:
        c.start()
    try:
        wait_for(lambda: health(server.url)[1].get("reason") == "tokenizer threads stuck")
        assert health(server.url)[0] == 503
    finally:
        release.set()
        for c in clients:
            c.join(60)
    wait_for(lambda: health(server.url)[0] == 200)


def test_health_is_503_while_the_template_renderer_cannot_start(server, monkeypatch):
    pool = server.engine.inputs.renderer
    monkeypatch.setattr(renderer.sys, "executable", "/nonexistent/python")
    for w in list(pool._workers):  # the running ones die; their replacements cannot start
        w.kill()
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code in (400, 503), r.text  # the render in flight, or none to take
    wait_for(lambda: health(server.url)[1].get("reason") ==
             "chat template renderer cannot start")
    assert health(server.url)[0] == 503
    monkeypatch.undo()  # the next retry starts a worker
    wait_for(lambda: health(server.url)[0] == 200, timeout=90)
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert r.status_code == 200, r.text
