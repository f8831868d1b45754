"""Run the real server (uvicorn + uvloop + httptools) on a free loopback port in a thread."""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time

import httpx
import uvicorn
import uvloop

from app.config import EngineConfig
from app.server import ServerSettings, build_app, uvicorn_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    def __init__(self, config: EngineConfig, settings: ServerSettings | None = None):
        self.settings = settings or ServerSettings(log_stats_interval=0.05)
        self.app = build_app(config, self.settings)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn_config(self.app, self.settings, host="127.0.0.1", port=self.port,
                             loop="none", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(cfg)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        self.loop = uvloop.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    @property
    def state(self):
        return self.app.state.ridgeline

    @property
    def engine(self):
        return self.state.engine

    def start(self, timeout: float = 120.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.state.load_error is not None:
                raise RuntimeError("model failed to load") from self.state.load_error
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError("server did not become healthy")

    def call(self, fn, *args):
        """Run `fn(*args)` on the server's event loop (where all request state lives)."""
        done = threading.Event()
        box: list = []

        def run() -> None:
            try:
                box.append(fn(*args))
            finally:
                done.set()

        self.loop.call_soon_threadsafe(run)
        done.wait(10)
        return box[0] if box else None

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def tiny_config(model_dir, max_model_len: int = 256, **settings) -> EngineConfig:
    return EngineConfig.from_kwargs(model=str(model_dir), served_model_name="tiny",
                                    dtype="float32", max_model_len=max_model_len, **settings)


def metric(text: str, name: str, labels: str = "") -> float:
    pattern = rf"^ridgeline:{name}(\{{[^}}]*{labels}[^}}]*\}})? ([0-9.e+-]+)$"
    values = [float(m.group(2)) for m in re.finditer(pattern, text, re.M)]
    assert values, f"metric {name} {labels} not found"
    return sum(values)


def assert_idle_and_clean(srv: ServerThread) -> None:
    text = httpx.get(srv.url + "/metrics").text
    assert metric(text, "num_requests_running") == 0
    assert metric(text, "num_requests_waiting") == 0
    assert metric(text, "kv_cache_usage_perc") == 0
    srv.call(srv.engine.core.check_invariants)
    core = srv.engine.core
    assert core.blocks.num_free_blocks == core.blocks.num_blocks
