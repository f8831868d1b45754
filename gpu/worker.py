"""The one dedicated model thread.

The event loop posts a Batch with `submit()` and gets a concurrent Future; an
asyncio caller awaits it through `asyncio.wrap_future`, which hands the result
back to the loop with `call_soon_threadsafe`. The runner is built on this
thread so that device state (a CUDA context, graphs) belongs to it.

A failed step is not the end: unless the device state is unknown (`is_fatal`) or
steps keep failing, the future carries `StepFailed`, the engine fails that step's
requests, and the next step runs. The sampler isolates a row that fails on its own
(`ModelRunner._sample`), so one bad request does not even fail its neighbours.
"""

from __future__ import annotations

import logging
import queue
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from gpu.batch import Batch, StepResult
from gpu.draft import DraftJob
from gpu.runner import ModelRunner, RunnerSpec

log = logging.getLogger("ridgeline.worker")

_STOP = object()


# A failure that keeps coming back is not one bad request: after this many failed
# steps in a row the model thread stops, and health turns red.
MAX_CONSECUTIVE_FAILURES = 3
# Messages after which the device state is unknown (a CUDA context that saw a
# device-side assert or an illegal address is unusable until the process restarts).
_FATAL_MARKERS = ("CUDA error", "device-side assert", "illegal memory access",
                  "CUBLAS_STATUS", "CUDNN_STATUS", "NCCL error", "unspecified launch failure")


# How long a thread may keep the GIL while another waits for it. The model thread
# waits on the device with the GIL released; getting it back while the event loop runs
# Python (streaming, detokenizing) takes up to one interval: at Python's default of
# 5 ms, 30 waits of 0.1 ms beside a busy thread take 160 ms, at 0.5 ms 23 ms
# (tests/test_gil.py). A short interval bounds that cost per wait; the model thread
# also waits only once per step (`gpu/staging.py`).
SWITCH_INTERVAL_S = 0.0005


def shorten_switch_interval(seconds: float = SWITCH_INTERVAL_S) -> float:
    """Lower the interpreter's GIL switch interval to `seconds` (never raise it); returns
    the interval now in force. Process-wide: it matters as soon as a model thread runs."""
    if sys.getswitchinterval() > seconds:
        sys.setswitchinterval(seconds)
    return sys.getswitchinterval()


class WorkerDead(RuntimeError):
    """The model thread has stopped; no step can run."""


class StepFailed(RuntimeError):
    """One step failed but the device is intact: the step's requests fail, the engine
    goes on. `cause` is the original exception."""

    def __init__(self, cause: BaseException):
        super().__init__(f"model step failed: {cause!r}")
        self.cause = cause


def is_fatal(e: BaseException) -> bool:
    """Whether the model thread can go on after `e`."""
    if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit
        return True
    return any(marker in str(e) for marker in _FATAL_MARKERS)


class Worker:
    def __init__(self, spec: RunnerSpec):
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ready: Future[ModelRunner] = Future()
        self.error: BaseException | None = None
        shorten_switch_interval()
        self._thread = threading.Thread(target=self._main, args=(spec,), name="ridgeline-model",
                                        daemon=True)
        self._thread.start()

    def wait_ready(self, timeout: float | None = None) -> ModelRunner:
        """Block until the runner is built; re-raises any load error here."""
        return self._ready.result(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def submit(self, batch: Batch) -> Future[StepResult]:
        fut: Future[StepResult] = Future()
        if not self.alive:
            fut.set_exception(WorkerDead(f"model thread is not running: {self.error!r}"))
            return fut
        self._inbox.put((batch, fut))
        return fut

    def call(self, fn: Callable[[ModelRunner], Any]) -> Future:
        """Run `fn(runner)` on the model thread between steps (loading or dropping a LoRA
        adapter); its exception, if any, is the future's and leaves the thread running."""
        fut: Future = Future()
        if not self.alive:
            fut.set_exception(WorkerDead(f"model thread is not running: {self.error!r}"))
            return fut
        self._inbox.put((fn, fut))
        return fut

    def draft(self, job: DraftJob) -> Future[list[list[int]]]:
        """The draft model's guesses for `job` (speculative decoding's `draft_model`),
        computed on this thread between steps."""
        return self.submit(job)  # type: ignore[arg-type]

    def shutdown(self, timeout: float = 10.0) -> None:
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    def _main(self, spec: RunnerSpec) -> None:
        try:
            runner = ModelRunner(spec)
        except BaseException as e:  # surfaced to wait_ready()
            self.error = e
            self._ready.set_exception(e)
            return
        draft = runner.draft  # loaded before the KV pool's plan, which counts it
        self._ready.set_result(runner)
        failures = 0
        while True:
            item = self._inbox.get()
            if item is _STOP:
                break
            batch, fut = item
            if not fut.set_running_or_notify_cancel():
                continue
            if not isinstance(batch, Batch | DraftJob):  # a `call`: not a step, never fatal
                try:
                    fut.set_result(batch(runner))
                except Exception as e:
                    fut.set_exception(e)
                continue
            try:
                fut.set_result(draft.propose(batch) if isinstance(batch, DraftJob)
                               else runner.execute(batch))
                failures = 0
            except BaseException as e:
                failures += 1
                if is_fatal(e) or failures >= MAX_CONSECUTIVE_FAILURES:
                    # Device state unknown, or failing for good: the thread stops and
                    # every later submit fails fast, so health turns red at once.
                    log.exception("model step failed; the model thread stops")
                    self.error = e
                    fut.set_exception(e)
                    break
                log.exception("model step failed; its requests fail, the engine goes on")
                fut.set_exception(StepFailed(e))
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not _STOP:
                item[1].set_exception(WorkerDead(f"model thread stopped: {self.error!r}"))
