"""A few grammar worker processes, each driven by one thread of the server.

Why processes: see `app/engine/grammar_worker.py`. Each `CompileJob` (one spec, shared
by every request waiting on it) is queued here and taken by the first free worker
thread, which sends it to its process and waits, with the time bound, for the answer.
Past the bound, or when `cancel` is called because every request waiting on the job
has left, or at `shutdown`, the process is killed (SIGKILL) and a fresh one started at
once, so the next job does not pay for the start.

A costly spec must not hold up a cheap one: with two workers or more, the first takes
only specs of at most `SMALL_SPEC_BYTES` (a fast lane), so a short regex waits at most
for other short specs, never for a large one, nor for a killed worker's replacement.
And a job waits in the queue at most the time bound (counted from when every worker has
started: starting one takes seconds): past it, a reaper thread refuses it as `Busy` (a
503 with Retry-After), so a queue of costly specs delays a request by at most about
twice the bound, however long the queue.

The threads block on pipes and never hold the GIL while the process works; results are
deserialized on them (milliseconds for a typical schema), never on the event loop.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future

SMALL_SPEC_BYTES = 1024
START_TIMEOUT_S = 120.0  # importing xgrammar (and the torch it loads) on a busy host


class InvalidSpec(ValueError):
    """The spec does not compile (the compiler's message, for a 400)."""


class TooCostly(Exception):
    """The compile ran past a bound (time, memory, result size); `reason` says which."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Busy(Exception):
    """The job waited in the queue longer than the time bound: every worker is busy."""


class CompileCancelled(Exception):
    """Nobody waits for the compile any more, or the server is stopping."""


class CompileJob:
    def __init__(self, kind: str, spec: str):
        self.kind, self.spec = kind, spec
        self.large = len(spec) > SMALL_SPEC_BYTES
        self.queued_at = time.monotonic()
        self.future: Future = Future()
        self.waiters = 0
        self.worker: _Worker | None = None
        self.cancelled = False


class CompilePool:
    def __init__(self, tokenizer_info, workers: int, timeout_s: float, memory_bytes: int,
                 threads: int = 1):
        self.info = tokenizer_info
        self._hello = ({"threads": threads, "memory_bytes": memory_bytes},
                       tokenizer_info.serialize_json().encode())
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._queue: deque[CompileJob] = deque()
        self._closed = False
        self.ready_at: float | None = None  # when every worker had started once
        self._started: set[int] = set()
        self.workers = [_Worker(self, i) for i in range(workers)]
        for w in self.workers:
            w.thread.start()
        threading.Thread(target=self._reap, daemon=True, name="ridgeline-grammar-reaper").start()

    def submit(self, job: CompileJob) -> None:
        with self._cond:
            if self._closed:
                raise RuntimeError("the grammar workers are shut down")
            self._queue.append(job)
            self._cond.notify_all()

    def cancel(self, job: CompileJob) -> None:
        """Nobody waits for `job` any more: drop it from the queue or kill its process."""
        with self._cond:  # futures are resolved outside it: their callbacks take locks
            queued = job in self._queue
            if queued:
                self._queue.remove(job)
            job.cancelled = True
            worker = job.worker
        if queued:
            job.future.cancel()
            return
        if worker is not None and not job.future.done():
            worker.kill(job)

    def pids(self) -> list[int]:
        """The worker processes started and ready (for tests and metrics)."""
        return [p.pid for w in self.workers
                if w.ready and (p := w.proc) is not None and p.poll() is None]

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            queued = list(self._queue)
            self._queue.clear()
            self._cond.notify_all()
        for job in queued:
            job.future.cancel()
        for w in self.workers:
            w.kill(None)
        for w in self.workers:  # SIGKILLed, maybe still unmapping: gone when this returns
            if (proc := w.proc) is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=2)

    def _take(self, worker: _Worker) -> CompileJob | None:
        """The first queued job `worker` may run (called holding the condition)."""
        fast_lane = worker is self.workers[0] and len(self.workers) > 1
        for job in self._queue:
            if not (fast_lane and job.large):
                self._queue.remove(job)
                return job
        return None

    def _reap(self) -> None:
        """Refuse the jobs that waited in the queue longer than the time bound."""
        while True:
            with self._cond:
                if self._closed:
                    return
                self._cond.wait(0.25 if self._queue else None)
                now, ready = time.monotonic(), self.ready_at
                expired = [] if ready is None else [
                    j for j in self._queue if now - max(j.queued_at, ready) > self.timeout_s]
                for job in expired:
                    self._queue.remove(job)
            for job in expired:
                job.future.set_exception(Busy(f"every grammar worker was busy for "
                                              f"{self.timeout_s:g} s"))


class _Worker:
    def __init__(self, pool: CompilePool, index: int):
        self.pool = pool
        self.proc: subprocess.Popen | None = None
        self.job: CompileJob | None = None
        self.ready = False
        self._buf = bytearray()
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"ridgeline-grammar-{index}")

    def kill(self, job: CompileJob | None) -> None:
        """Kill the process if it is running `job` (any job when None)."""
        proc = self.proc
        if proc is not None and (job is None or self.job is job):
            proc.kill()

    def _run(self) -> None:
        pool = self.pool
        try:
            self._start()  # every worker at once, in the background, with the first job
        except (OSError, RuntimeError):
            pass  # the first job tries again, and reports it
        while True:
            with pool._cond:
                while not pool._closed and (job := pool._take(self)) is None:
                    pool._cond.wait()
                if pool._closed:
                    break
                self.job, job.worker = job, self
            try:
                job.future.set_result(self._compile(job))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting requests
                if not job.future.done():
                    job.future.set_exception(e)
            finally:
                with pool._cond:
                    self.job = None
            if (self.proc is None or self.proc.poll() is not None) and not pool._closed:
                try:
                    self._start()  # replaced now, so that the next job does not wait for it
                except (OSError, RuntimeError):
                    pass  # the next job tries again, and reports it
        self._stop()

    def _compile(self, job: CompileJob):
        if self.proc is None or self.proc.poll() is not None:
            self._start()
        if job.cancelled:
            raise CompileCancelled()
        from app.engine.grammar_worker import write_frame  # not at the top: `-m` runs it

        try:
            write_frame(self.proc.stdin, {"kind": job.kind}, job.spec.encode())
        except OSError:  # the process ended since it was checked: once more, on a new one
            self._start()
            if job.cancelled:
                raise CompileCancelled() from None
            write_frame(self.proc.stdin, {"kind": job.kind}, job.spec.encode())
        deadline = time.monotonic() + self.pool.timeout_s
        frame = self._read(deadline)
        if frame is None:
            timed_out = time.monotonic() >= deadline
            self._stop()
            if job.cancelled or self.pool._closed:
                raise CompileCancelled()
            raise TooCostly(f"it took more than {self.pool.timeout_s:g} s" if timed_out
                            else "it needed more memory than the compile bound")
        header, payload = frame
        if header.get("costly"):  # past its memory: the worker ends, and is replaced
            self._stop()
            raise TooCostly(header["error"])
        if "error" in header:
            raise InvalidSpec(header["error"])
        import xgrammar as xgr

        return xgr.CompiledGrammar.deserialize_json(payload.decode(), self.pool.info)

    def _start(self) -> None:
        from app.engine.grammar_worker import write_frame

        self._stop()
        env = {**os.environ, "MALLOC_ARENA_MAX": "2", "CUDA_VISIBLE_DEVICES": ""}
        self.proc = subprocess.Popen([sys.executable, "-m", "app.engine.grammar_worker"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._buf = bytearray()
        write_frame(self.proc.stdin, *self.pool._hello)
        frame = self._read(time.monotonic() + START_TIMEOUT_S)
        if frame is None or not frame[0].get("ready"):
            self._stop()
            raise RuntimeError("a grammar worker process did not start")
        self.ready = True
        with self.pool._cond:
            self.pool._started.add(id(self))
            if self.pool.ready_at is None and len(self.pool._started) == len(self.pool.workers):
                self.pool.ready_at = time.monotonic()

    def _stop(self) -> None:
        proc, self.proc, self.ready = self.proc, None, False
        if proc is not None:
            proc.kill()
            proc.wait()
            for pipe in (proc.stdin, proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass

    def _read(self, deadline: float) -> tuple[dict, bytes] | None:
        """One frame, or None when the process ended or the deadline passed first."""
        line = self._read_until(lambda: self._buf.find(b"\n"), deadline)
        if line is None:
            return None
        header = json.loads(line)
        payload = self._read_until(lambda: header["n"] if len(self._buf) >= header["n"]
                                   else -1, deadline, keep_sep=False)
        return (header, payload) if payload is not None else None

    def _read_until(self, find, deadline: float, keep_sep: bool = True) -> bytes | None:
        fd = self.proc.stdout.fileno()
        while (i := find()) < 0:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return None
            self._buf += chunk
        out = bytes(self._buf[:i])
        del self._buf[:i + (1 if keep_sep else 0)]
        return out
