"""Chat templates rendered in a small pool of worker processes, each render bounded.

A chat template is code: a model's own, or (with `--trust-request-chat-template`) a
client's. Its render is bounded in time (`render_timeout`), in output (the caller's
character bound) and in memory (each worker's RLIMIT_AS), and a render whose client
left or whose server stops is ended. A thread cannot be stopped inside a render, a
process can: the workers are `python -m models.render_worker` processes (jinja2 alone,
no torch, no server), spoken to through their pipes, and a worker whose render went
past a bound is killed and replaced. The output comes back as text; tokenising it stays
on the tokenizer threads (`app/engine/input_processor.py`).

Workers start in the background when the pool starts (after the model has loaded, or
at its first render) and each render waits for an idle one; a worker killed mid-render
is replaced the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import models
from models.render_worker import FRAME_HEADER, encode_frame

log = logging.getLogger("ridgeline.renderer")

# The worker's import path: the directory holding the `models` package, whatever the
# server's working directory is.
_SOURCE_ROOT = str(Path(models.__file__).resolve().parent.parent)
_START_TIMEOUT = 30.0  # seconds for a worker to import jinja2 and say it is ready


class RenderFailed(Exception):
    """A render that ended without text. `kind`: `template` (the template refused the
    input or is not Jinja), `too_long`, `memory`, `timeout` (the caller's 4xx), or
    `unavailable` (the pool is closed or its workers cannot start: a 503)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class _Worker:
    """One worker process and its pipes, read and written on the event loop."""

    def __init__(self, process: subprocess.Popen, reader: asyncio.StreamReader,
                 writer: asyncio.StreamWriter, read_transport: asyncio.BaseTransport):
        self.process, self.reader, self.writer = process, reader, writer
        self._read_transport = read_transport

    @classmethod
    async def start(cls, argv: list[str], env: dict[str, str]) -> _Worker:
        # Popen (vfork) on a thread: the loop's own spawn forks the whole server,
        # which with a model loaded held the loop for 0.3-0.45 s per worker.
        process = await asyncio.to_thread(subprocess.Popen, argv, stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, env=env, bufsize=0)
        loop = asyncio.get_running_loop()
        try:
            reader = asyncio.StreamReader(limit=1 << 20)
            read_transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(reader), process.stdout)
            transport, protocol = await loop.connect_write_pipe(
                asyncio.streams.FlowControlMixin, process.stdin)
        except BaseException:
            process.kill()
            raise
        return cls(process, reader, asyncio.StreamWriter(transport, protocol, reader, loop),
                   read_transport)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    async def call(self, job: dict[str, Any], max_reply_bytes: int) -> dict[str, Any]:
        self.writer.write(encode_frame(job))
        await self.writer.drain()
        return await self.read(max_reply_bytes)

    async def read(self, max_reply_bytes: int) -> dict[str, Any]:
        (size,) = FRAME_HEADER.unpack(await self.reader.readexactly(FRAME_HEADER.size))
        if size > max_reply_bytes:
            raise RenderFailed("too_long", f"the chat template's answer of {size} bytes "
                               f"exceeds {max_reply_bytes}")
        return json.loads(await self.reader.readexactly(size))

    def kill(self) -> None:
        """SIGKILL, and the pipes closed; `reap` collects the exit status."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.kill()
        self.writer.close()
        self._read_transport.close()

    async def reap(self) -> None:
        await asyncio.to_thread(self.process.wait)


class RenderPool:
    """`size` workers; a render takes an idle one, and gives it back unless the render
    went past a bound, was cancelled, or the worker died (then it is killed and a new
    one started)."""

    def __init__(self, size: int = 2, timeout: float = 5.0, memory_bytes: int = 512 << 20):
        self.size, self.timeout, self.memory_bytes = size, timeout, memory_bytes
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._workers: set[_Worker] = set()
        self._spawning: set[asyncio.Task] = set()
        self._closed = False
        self._started = False
        self._failure: str | None = None
        self._retries: set[asyncio.TimerHandle] = set()
        self._retry_delay = 1.0  # doubled at each failed start, up to a minute

    def start(self) -> None:
        """Start the workers in the background; renders wait for the first idle one.
        A pool not started starts at its first render."""
        if self._started:
            return
        self._started = True
        for _ in range(self.size):
            self._replace()

    async def render(self, job: dict[str, Any], max_chars: int) -> str:
        """The template's text, or `RenderFailed`. Cancelling the caller (its client left)
        kills the worker of its render."""
        self.start()
        worker = await self._take()
        keep = False
        try:
            async with asyncio.timeout(self.timeout):
                # ASCII JSON: at most twelve bytes a character (two \uXXXX escapes
                # beyond the BMP), plus the frame's own keys.
                reply = await worker.call({**job, "max_output_chars": max_chars},
                                          12 * max_chars + 4096)
            keep = "text" in reply or reply.get("kind") in ("template", "too_long")
        except TimeoutError:
            raise RenderFailed("timeout", f"the chat template did not render within "
                               f"{self.timeout:g} s") from None
        except (asyncio.IncompleteReadError, ConnectionError, ValueError) as e:
            if self._closed:
                raise RenderFailed("unavailable", "the server is shutting down") from e
            raise RenderFailed("memory", "the chat template's renderer died (out of "
                               "memory?)") from e
        finally:
            if keep and not self._closed:
                self._idle.put_nowait(worker)
            else:
                self._retire(worker)
        if "text" in reply:
            return reply["text"]
        raise RenderFailed(reply.get("kind", "template"), reply.get("error", "render failed"))

    async def close(self) -> None:
        """Kill every worker (renders in progress end as `unavailable`) and wait for them."""
        self._closed = True
        for handle in self._retries:
            handle.cancel()
        for w in list(self._workers):
            w.kill()
        if self._spawning:  # a start under way ends in a moment; it must not outlive us
            await asyncio.wait(list(self._spawning), timeout=_START_TIMEOUT)
        workers = list(self._workers)
        for w in workers:
            w.kill()
        for w in workers:
            with contextlib.suppress(Exception):
                await w.reap()
        self._workers.clear()

    @property
    def cannot_start(self) -> bool:
        """No worker runs or is starting, and the last start failed (retried later)."""
        return self._failure is not None and not self._workers and not self._spawning

    @property
    def num_workers(self) -> int:
        return len(self._workers)

    async def _take(self) -> _Worker:
        while True:
            if self._closed:
                raise RenderFailed("unavailable", "the server is shutting down")
            if self.cannot_start:
                raise RenderFailed("unavailable", f"the chat template renderer cannot "
                                   f"start: {self._failure}")
            try:
                async with asyncio.timeout(1.0):  # re-check the pool's state now and then
                    worker = await self._idle.get()
            except TimeoutError:
                continue
            if worker.alive:
                return worker
            self._retire(worker)  # died while idle

    def _retire(self, worker: _Worker) -> None:
        worker.kill()
        if worker in self._workers:
            self._workers.discard(worker)
            # The process is gone; wait for it in the background so it leaves no zombie.
            self._track(asyncio.ensure_future(worker.reap()))
        if not self._closed:
            self._replace()

    def _replace(self) -> None:
        self._track(asyncio.ensure_future(self._spawn()))

    def _retry_later(self) -> None:
        """Start another worker a little later; meanwhile, with no worker left, renders
        are refused at once (503) instead of waiting."""
        def retry() -> None:
            self._retries.discard(handle)
            if not self._closed:
                self._replace()
        handle = asyncio.get_running_loop().call_later(self._retry_delay, retry)
        self._retry_delay = min(60.0, 2 * self._retry_delay)
        self._retries.add(handle)

    def _track(self, task: asyncio.Future) -> None:
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def _spawn(self) -> None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [_SOURCE_ROOT,
                                                           env.get("PYTHONPATH")]))
        argv = [sys.executable, "-m", "models.render_worker", str(self.memory_bytes)]
        try:
            worker = await _Worker.start(argv, env)
        except OSError as e:
            self._failure = str(e)
            log.error("cannot start a chat template renderer", extra={"error": str(e)})
            self._retry_later()
            return
        self._workers.add(worker)
        try:
            async with asyncio.timeout(_START_TIMEOUT):
                ready = await worker.read(1024)
            if not ready.get("ready"):
                raise ValueError(f"unexpected first frame {ready!r}")
        except asyncio.CancelledError:
            worker.kill()
            raise
        except Exception as e:
            worker.kill()
            self._workers.discard(worker)
            self._track(asyncio.ensure_future(worker.reap()))
            if self._closed:
                return
            self._failure = f"{type(e).__name__}: {e}"
            log.error("a chat template renderer failed to start",
                      extra={"error": self._failure})
            self._retry_later()
            return
        if self._closed:
            worker.kill()  # close() reaps it: it is among the workers
            return
        self._failure, self._retry_delay = None, 1.0
        self._idle.put_nowait(worker)
