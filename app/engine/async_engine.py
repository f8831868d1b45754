"""AsyncEngine: the engine loop on the event loop, one asyncio queue per request.

One task runs `await the step's result (the loop keeps serving HTTP) →
process → schedule and post the next Batch → push this step's deltas`, so the
model thread computes while the loop streams (on a GPU; on CPU the deltas go
out first: `stream_before_submit`). It sleeps when there is no work
and wakes on the next arrival. A consumer that goes away
(CancelledError / GeneratorExit) aborts its request at once; blocks of a step
in flight are freed when that step returns (the scheduler defers them).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator

from app.engine.core import EngineCore, ScheduledStep
from app.engine.errors import (
    EngineDead,
    InvalidParameter,
    QueueFull,
)
from app.engine.input_processor import InputProcessor
from app.engine.loras import LoRAAdapter, adapters_in_use, stats_note, unload
from app.engine.metrics import Metrics
from app.engine.outputs import RequestOutput, StepStats
from app.engine.plan import cache_config_info, plan_report
from app.engine.request import RequestSLO
from app.engine.request_stream import RequestGroup, RequestStream, labelled
from app.engine.roofline import RooflineTracker
from app.engine.sampling_params import SamplingParams
from app.engine.stats_logger import StatsLogger
from gpu.dtypes import resolve_device
from gpu.worker import StepFailed

log = logging.getLogger("ridgeline.engine")

# /health turns red when a step has been running longer than this.
STEP_STALL_SECONDS = 60.0
# Streams woken per loop iteration when a step's outputs are handed out.
DISPATCH_CHUNK = 8


class AsyncEngine:
    def __init__(self, core: EngineCore, model_name: str, log_stats_interval: float = 10.0,
                 log_requests: bool = True):
        """`log_requests`: a `request finished` / `request aborted` line per request (off:
        vLLM's `--disable-log-requests`)."""
        self.core = core
        self.log_requests = log_requests
        self.inputs = InputProcessor(core.tokenizer, core.max_model_len,
                                     render_timeout=core.config.chat_template_render_timeout,
                                     render_memory=core.config.chat_template_render_memory)
        self.model_name = model_name
        self.metrics = Metrics(model_name, core.max_model_len)
        self.metrics.block_report = core.block_report
        self.metrics.set_static(cache_config_info(core.config.cache, core.kv_plan, core.kv_dtype),
                                core.peaks)
        self.roofline = RooflineTracker(core.peaks)
        self.stats = StatsLogger(log_stats_interval, core.peaks)
        if core.loras is not None:
            self.stats.note = lambda: stats_note(core.loras, core.scheduler.running)
        self._streams: dict[str, RequestStream] = {}
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._lag_task: asyncio.Task | None = None
        self.dead: BaseException | None = None
        self.step_started: float | None = None
        # On CPU the forward takes every core torch may use and, between its ops, the
        # GIL: the loop's Python beside it only delays it and sends tokens late by
        # varying amounts. So there a step's outputs go out (and its stats are recorded)
        # before the next step is posted (`benchmarks/conc1_itl_ab.py`).
        self.stream_before_submit = resolve_device(core.config.device).type == "cpu"

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop(), name="engine-loop")
        self._lag_task = loop.create_task(self._watch_lag(), name="loop-lag")
        self.inputs.start()

    async def _watch_lag(self, period: float = 0.01) -> None:
        """Measure how late a 10 ms timer fires: the event loop's responsiveness."""
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(period)
            self.metrics.lag.observe(max(0.0, time.perf_counter() - t0 - period))

    async def stop(self) -> None:
        if self._lag_task:
            self._lag_task.cancel()
        if self._task:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        await self.inputs.shutdown()
        await asyncio.to_thread(self.core.shutdown)

    @property
    def healthy(self) -> bool:
        """Alive: the model thread runs and no step has stalled."""
        if self.dead is not None or not self.core.alive:
            return False
        if self._task is None or self._task.done():
            return False
        started = self.step_started
        return started is None or time.monotonic() - started < STEP_STALL_SECONDS

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def plan(self) -> dict:
        """The memory plan, the device's peaks, and where steps sit on the roofline:
        expected (from the arithmetic) and live (from the steps run)."""
        core, sched = self.core, self.core.config.scheduler
        report = plan_report(
            model=self.model_name, model_config=core.model_config, dtype=core.dtype,
            device=core.peaks.device if core.peaks else core.config.device, plan=core.kv_plan,
            cost=core.cost, peaks=self.roofline.peaks, max_num_seqs=sched.max_num_seqs,
            max_num_batched_tokens=sched.max_num_batched_tokens)
        report["live"] = self.roofline.snapshot()
        return report

    # -- requests -----------------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    request_id: str | None = None, priority: int = 0,
                    slo: RequestSLO | None = None, group: RequestGroup | None = None,
                    call_id: str | None = None, label: str | None = None) -> RequestStream:
        """Queue a request; raises InvalidParameter / QueueFull / EngineDead synchronously.
        `group`: the n sequences of one client request this one belongs to (metrics);
        `call_id`, `label`: see RequestStream. The server generates `request_id`: an id a
        client chose would let it abort or squat another client's request."""
        if self.dead is not None:
            raise EngineDead(f"engine is not running: {self.dead!r}")
        rid = request_id or f"req-{uuid.uuid4().hex}"
        if rid in self._streams:
            raise InvalidParameter("request_id", f"request id {rid!r} is already in use")
        try:
            self.core.add_request(rid, prompt_token_ids, params, priority, slo)
        except QueueFull as e:
            self.metrics.admission_rejected(e.reason)
            raise
        stream = RequestStream(self, rid, params.max_tokens, group, call_id, label)
        self._streams[rid] = stream
        self._wakeup.set()
        return stream

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None, priority: int = 0
                       ) -> AsyncIterator[RequestOutput]:
        async for out in self.add_request(prompt_token_ids, params, request_id, priority):
            yield out

    def abort_call(self, call_id: str, by_label: bool = False) -> int:
        """Abort every live sequence of the call `call_id` names (or the one sequence whose
        engine id it is); with `by_label`, also every one whose client chose that id.
        Returns how many were aborted."""
        ids = [rid for rid, s in self._streams.items()
               if rid == call_id or s.call_id == call_id or (by_label and s.label == call_id)]
        return sum(self.abort(rid) for rid in ids)

    def abort_all(self) -> int:
        return sum(self.abort(rid) for rid in list(self._streams))

    def abort(self, request_id: str) -> bool:
        """Abort a live request. One that already finished keeps its stream: its final
        output may still be waiting to be dispatched, and its consumer must get it."""
        out = self.core.abort(request_id)
        if out is None:
            return False
        self.metrics.observe_aborted(out)
        stream = self._streams.pop(request_id, None)
        if stream is None:
            self._log_request("request aborted", {"request_id": request_id})
        else:  # in its caller's context, as `request finished`
            stream.context.run(self._log_request, "request aborted",
                               {"request_id": request_id} | labelled(stream))
            self._end_of_sequence(stream, out)
            if not stream.finished:
                stream.finished = True
                stream.queue.put_nowait(out)
        self.metrics.record_step(self.core.idle_stats())  # gauges: the pool just shrank
        return True

    # -- LoRA adapters (app/engine/loras.py) ----------------------------------------

    async def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Read an adapter on the model thread (between steps) and serve it under `name`;
        a 400 (InvalidParameter) for a bad name, path or adapter."""
        loras = self.core.loras
        if loras is None:
            raise InvalidParameter("lora_name", "this server was started without "
                                   "--enable-lora")
        adapter = loras.begin(name, path)
        read = self.core.worker.call(lambda r: r.loras.add(adapter.lora_id, adapter.path))
        await asyncio.wait([asyncio.wrap_future(read)])
        return loras.finish(adapter, read)

    async def unload_lora(self, name: str) -> None:
        """Stop serving an adapter; refused (`AdapterInUse`) while requests use it."""
        unload(self.core, name)

    # -- the loop -------------------------------------------------------------------

    async def _loop(self) -> None:
        """Step forever. The next step is posted before this step's outputs are sent,
        so the model thread computes while the loop streams (the next batch depends
        only on the scheduler, which `process` has already updated); on CPU after
        them (`stream_before_submit`)."""
        core = self.core
        in_flight: tuple[ScheduledStep, asyncio.Future] | None = None
        try:
            while True:
                if in_flight is None:
                    in_flight = await self._wait_for_work()
                    continue
                step, future = in_flight
                # 1. Await the model thread (the loop serves HTTP meanwhile).
                try:
                    result = await future
                except StepFailed as e:  # the device is fine: only this step's requests fail
                    result = e
                got_result = time.monotonic()
                # 2. Process: tokens → outputs; the scheduler frees what finished.
                if isinstance(result, StepFailed):
                    done = core.fail_step(step.scheduled, result.cause)
                else:
                    done = core.process(step.scheduled, result)
                # 3. Shed what can no longer make its deadline.
                done.outputs.extend(core.shed_expired())
                streams_first = self.stream_before_submit
                if streams_first:  # on CPU: outputs and stats before the next step
                    await self._dispatch(done.outputs)
                    await asyncio.sleep(0)  # the woken handlers write their chunks now
                    self._record(done.stats)
                # 4. Post the next step (the model thread waited this long for us).
                in_flight = self._submit_next()
                self.metrics.overhead.inc(time.monotonic() - got_result)
                if not streams_first:  # 5. Record the stats, hand the outputs over.
                    self._record(done.stats)
                    await self._dispatch(done.outputs)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the model thread failed: fail every request, go red
            self.dead = e
            self.step_started = None
            core.release_in_flight()
            log.exception("engine loop stopped")
            self._fail_all(EngineDead(f"engine failed: {e!r}"))

    async def _wait_for_work(self) -> tuple[ScheduledStep, asyncio.Future] | None:
        """Sleep until a request arrives, then post its first step."""
        if not self.core.has_work:
            self._record(self.core.idle_stats())
            self._wakeup.clear()
            await self._wakeup.wait()
            return None
        in_flight = self._submit_next()
        if in_flight is None:
            await asyncio.sleep(0)  # nothing fits now; let arrivals and aborts in
        return in_flight

    def _submit_next(self) -> tuple[ScheduledStep, asyncio.Future] | None:
        step = self.core.schedule() if self.core.has_work else None
        if step is None:
            self.step_started = None
            return None
        self.step_started = time.monotonic()
        return step, asyncio.wrap_future(self.core.submit(step.batch))

    def _record(self, stats: StepStats) -> None:
        peaks = self.roofline.peaks
        position = self.roofline.record(stats)
        if self.roofline.peaks is not peaks:  # raised to what this step achieved
            self.stats.peaks = self.roofline.peaks
            self.metrics.set_peaks(self.roofline.peaks)
        self.metrics.record_step(stats, position)
        if (loras := self.core.loras) is not None:
            s = self.core.scheduler
            self.metrics.set_lora(*adapters_in_use(loras, s.running, s.waiting),
                                  loras.config.max_loras)
        self.stats.record(stats)

    async def _dispatch(self, outputs: list[RequestOutput]) -> None:
        """Hand outputs to their streams in chunks, yielding to the loop in between, so
        that hundreds of SSE writes do not hold up timers and new connections."""
        for i in range(0, len(outputs), DISPATCH_CHUNK):
            if i:
                await asyncio.sleep(0)
            now = time.monotonic()
            for out in outputs[i : i + DISPATCH_CHUNK]:
                stream = self._streams.get(out.request_id)
                if stream is None:  # aborted meanwhile
                    continue
                m = out.metrics
                if stream.last_token_time is None:
                    if m and m.ttft is not None:
                        self.metrics.observe_first_token(m.ttft)
                else:
                    self.metrics.observe_itl(now - stream.last_token_time)
                stream.last_token_time = now
                if out.finished:
                    del self._streams[out.request_id]
                    self._observe_finished(stream, out)
                stream.queue.put_nowait(out)

    def _observe_finished(self, stream: RequestStream, out: RequestOutput) -> None:
        m = out.metrics
        self._end_of_sequence(stream, out)
        if out.finish_reason == "shed":  # never started: an admission decision, not a result
            self.metrics.admission_rejected("shed")
            return
        if m is None or m.finished_time is None:
            return
        self.metrics.observe_finished(out, stream.max_tokens)
        # In the caller's context: the line carries what the server bound (x_request_id).
        stream.context.run(
            self._log_request, "request finished",
            {"request_id": out.request_id, "prompt_tokens": len(out.prompt_token_ids),
             "output_tokens": len(out.token_ids), "ttft_s": round(m.ttft or 0.0, 4),
             "e2e_s": round(m.e2e, 4), "finish_reason": out.finish_reason,
             "preemptions": m.num_preemptions} | labelled(stream),
        )

    def _log_request(self, message: str, fields: dict) -> None:
        if self.log_requests:
            log.info(message, extra=fields)

    def _end_of_sequence(self, stream: RequestStream, out: RequestOutput) -> None:
        if stream.group.end(len(out.token_ids)):
            self.metrics.observe_group(stream.group.n, stream.group.max_generation_tokens)

    def _fail_all(self, error: BaseException) -> None:
        for rid in list(self._streams):
            stream = self._streams.pop(rid)
            self.core.abort(rid)
            stream.queue.put_nowait(error)

    def fail_unfinished(self, message: str) -> int:
        """End every live request with an error (shutdown timeout); returns how many."""
        n = len(self._streams)
        self._fail_all(EngineDead(message))
        return n

