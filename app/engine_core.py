"""The engine core: scheduler + block manager + model worker + output processing.

One object, driven one step at a time, shared by the offline `LLM` (which
waits on each step) and the online `AsyncEngine` (which awaits it). It is not
thread-safe on purpose: everything here runs on the caller's thread (the event
loop), and only `Batch`/`StepResult` cross to the model thread.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field, replace

from app.config import EngineConfig
from app.detokenizer import IncrementalDetokenizer
from app.kv_blocks import BlockManager
from app.outputs import RequestMetrics, RequestOutput
from app.request import Request, RequestStatus
from app.sampling_params import InvalidParameter, SamplingParams
from app.scheduler import Scheduler, SchedulerOutput
from app.stop import StopStringMatcher
from gpu.batch import Batch, SamplingRow, StepResult
from gpu.runner import RunnerSpec
from gpu.worker import Worker
from models.config import LlamaConfig
from models.resolve import resolve_model
from models.tokenizer import FastDecoder, load_tokenizer

log = logging.getLogger("ridgeline.engine")

DEFAULT_MAX_MODEL_LEN = 4096  # cap for models whose context is larger, unless asked


@dataclass
class _Tracked:
    """Event-loop state of one live request besides the Request itself."""

    request: Request
    detok: IncrementalDetokenizer
    stop: StopStringMatcher
    logprobs: list | None
    stop_reason: str | int | None = None
    # Deltas handed out so far (stop strings cut); joined once, at the end, to keep
    # per-token work O(1).
    parts: list[str] = field(default_factory=list)


@dataclass
class EngineStats:
    """Monotonic counters; metrics and the periodic stats line read their deltas."""

    prompt_tokens: int = 0  # prefill tokens computed (recompute after preemption included)
    generation_tokens: int = 0
    steps: int = 0
    last_step_end: float = 0.0


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_dir = resolve_model(config.model)
        self.model_config = LlamaConfig.from_dir(self.model_dir)
        self.tokenizer = load_tokenizer(self.model_dir)
        self._decoder = FastDecoder(self.tokenizer)
        self.max_model_len = self._resolve_max_model_len(config)
        self.scheduler_config = replace(config.scheduler, max_model_len=self.max_model_len)
        self.eos_token_ids = self._eos_ids()
        self.worker = Worker(RunnerSpec(
            model_dir=str(self.model_dir),
            dtype=config.dtype,
            device=config.device,
            max_model_len=self.max_model_len,
            block_size=config.cache.block_size,
            kv_cache_memory=config.cache.kv_cache_memory,
            gpu_memory_utilization=config.cache.gpu_memory_utilization,
            num_blocks=config.cache.num_blocks_override,
            attention_backend=config.attention_backend,
            seed=config.seed,
            enforce_eager=config.enforce_eager,
            max_num_seqs=config.scheduler.max_num_seqs,
            max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
        ))
        runner = self.worker.wait_ready()
        self.kv_plan = runner.plan
        self.dtype = str(runner.dtype).removeprefix("torch.")
        self.blocks = BlockManager(self.kv_plan.num_blocks, config.cache.block_size)
        self.scheduler = Scheduler(self.scheduler_config, self.blocks)
        self.stats = EngineStats()
        self._tracked: dict[str, _Tracked] = {}
        self._arrivals = 0
        self._step_id = 0

    def _resolve_max_model_len(self, config: EngineConfig) -> int:
        model_max = self.model_config.max_position_embeddings
        if config.max_model_len is None:
            return min(model_max, DEFAULT_MAX_MODEL_LEN)
        if config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len={config.max_model_len} exceeds the model's "
                f"max_position_embeddings={model_max}"
            )
        return config.max_model_len

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # -- requests -----------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise InvalidParameter("prompt", "the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in prompt_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidParameter(
                "prompt", f"token id {bad} is outside the vocabulary [0, {vocab})"
            )
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:  # it would index the logits row on the model thread
            raise InvalidParameter(
                "stop_token_ids", f"token id {bad} is outside the vocabulary [0, {vocab})"
            )
        if n >= self.max_model_len:
            raise InvalidParameter(
                "prompt",
                f"the prompt has {n} tokens, but max_model_len is {self.max_model_len} "
                f"(room is needed for at least one generated token)",
            )
        if n + params.max_tokens > self.max_model_len:
            raise InvalidParameter(
                "max_tokens",
                f"this model's maximum context length is {self.max_model_len} tokens; the request "
                f"asks for {n + params.max_tokens} ({n} in the prompt, {params.max_tokens} "
                f"for max_tokens)",
            )

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0,
    ) -> Request:
        """Validate and queue; raises InvalidParameter or QueueFull, leaving nothing behind."""
        if request_id in self._tracked:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
            priority=priority,
            arrival_seq=self._arrivals,
        )
        tracked = _Tracked(
            req,
            IncrementalDetokenizer(
                self._decoder, req.prompt_token_ids, params.skip_special_tokens
            ),
            StopStringMatcher(list(params.stop), params.include_stop_str_in_output),
            [] if params.logprobs is not None else None,
        )
        self.scheduler.add(req)  # may raise QueueFull: nothing tracked yet
        self._arrivals += 1
        self._tracked[request_id] = tracked
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:
            return None
        self.scheduler.abort(tracked.request)
        return self._output(tracked, "", [], finished=True)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_unfinished(self) -> int:
        return len(self._tracked)

    # -- one step -------------------------------------------------------------------

    def schedule(self) -> tuple[SchedulerOutput, Batch] | None:
        out = self.scheduler.schedule()
        if out.empty:
            return None
        self._step_id += 1
        return out, self._build_batch(out)

    def _build_batch(self, out: SchedulerOutput) -> Batch:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens, ctx_lens, tables, sample_idx, rows = [], [], [], [], []
        now = time.monotonic()
        for i, seq in enumerate(out.seqs):
            req, start, n = seq.request, seq.start, seq.num_new_tokens
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
            token_ids += req.tokens_slice(start, start + n)
            positions += range(start, start + n)
            slots += self.blocks.slots(req.request_id, start, start + n)
            qlens.append(n)
            ctx_lens.append(start + n)
            tables.append(list(self.blocks.block_table(req.request_id)))  # a snapshot
            if seq.samples:
                sample_idx.append(i)
                rows.append(self._sampling_row(req))
        return Batch(token_ids, positions, slots, qlens, ctx_lens, tables, sample_idx, rows,
                     self._step_id)

    def _sampling_row(self, req: Request) -> SamplingRow:
        p = req.params
        banned: tuple[int, ...] = ()
        if req.num_output_tokens < p.min_tokens:
            banned = tuple(sorted(set(req.eos_token_ids) | set(p.stop_token_ids)))
        penal = p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0
        return SamplingRow(
            temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
            seed=p.seed, output_index=req.num_output_tokens, banned_token_ids=banned,
            presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
            repetition_penalty=p.repetition_penalty,
            output_token_ids=tuple(req.output_token_ids) if penal else (),
            logprobs=p.logprobs,
        )

    def process(self, out: SchedulerOutput, result: StepResult) -> list[RequestOutput]:
        """Apply a step's tokens: advance requests, detokenize, stop, emit deltas."""
        now = time.monotonic()
        self.stats.steps += 1
        self.stats.last_step_end = now
        for seq in out.seqs:  # every token but a decode step's one input is a prefill token
            if not seq.samples or seq.start < seq.request.num_prompt_tokens:
                self.stats.prompt_tokens += seq.num_new_tokens
        logprobs_by_req = {}
        if result.logprobs:
            sampled = [s.request.request_id for s in out.seqs if s.samples]
            logprobs_by_req = dict(zip(sampled, result.logprobs))
        outputs = []
        for req in self.scheduler.update(out, result.token_ids):
            tracked = self._tracked.get(req.request_id)
            if tracked is None:
                continue
            token = req.output_token_ids[-1]
            self.stats.generation_tokens += 1
            if req.times.first_token is None:
                req.times.first_token = now
            req.times.last_token = now
            if tracked.logprobs is not None:
                tracked.logprobs.append(logprobs_by_req.get(req.request_id))
            outputs.append(self._advance(tracked, token))
        return outputs

    def _advance(self, tracked: _Tracked, token: int) -> RequestOutput:
        req, p = tracked.request, tracked.request.params
        status = None
        if token in req.eos_token_ids or token in p.stop_token_ids:
            status = RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                tracked.stop_reason = token
            delta = ""  # the stop token itself is not text
        elif req.num_output_tokens <= p.min_tokens:
            # Like vLLM, stop strings only count once min_tokens are out; text passes as is.
            delta = tracked.detok.add(token)
        else:
            delta, matched = tracked.stop.feed(tracked.detok.add(token))
            if matched:
                status = RequestStatus.FINISHED_STOPPED
                tracked.stop_reason = tracked.stop.matched_stop
        if status is None and (
            req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len
        ):
            status = RequestStatus.FINISHED_LENGTH
        if status is not None and not tracked.stop.matched:
            tail, matched = tracked.stop.feed(tracked.detok.flush())
            delta += tail if matched else tail + tracked.stop.flush()
            if matched:  # the held-back tail completed a stop string after all
                status = RequestStatus.FINISHED_STOPPED
                tracked.stop_reason = tracked.stop.matched_stop
        if status is None:
            return self._output(tracked, delta, [token], finished=False)
        req.times.finished = time.monotonic()
        self.scheduler.finish(req, status)
        del self._tracked[req.request_id]
        return self._output(tracked, delta, [token], finished=True)

    def _output(self, tracked: _Tracked, delta: str, delta_ids: list[int], finished: bool):
        req = tracked.request
        if delta:
            tracked.parts.append(delta)
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            text="".join(tracked.parts) if finished else "",
            token_ids=req.output_token_ids,
            delta_text=delta,
            delta_token_ids=delta_ids,
            finished=finished,
            finish_reason=req.status.finish_reason if finished else None,
            stop_reason=tracked.stop_reason,
            logprobs=tracked.logprobs,
            delta_logprobs=(tracked.logprobs[-len(delta_ids):]
                            if tracked.logprobs is not None and delta_ids else None),
            # Timings matter at the first token (TTFT) and at the end; not built per token.
            metrics=RequestMetrics(req.times.arrival, req.times.first_scheduled,
                                   req.times.first_token, req.times.finished,
                                   req.num_preemptions)
            if finished or req.num_output_tokens == 1 else None,
        )

    def step(self) -> list[RequestOutput]:
        """Synchronous step for offline use: schedule, run on the model thread, process."""
        scheduled = self.schedule()
        if scheduled is None:
            return []
        out, batch = scheduled
        future = self.worker.submit(batch)
        try:
            result = future.result()
        except BaseException:
            # Interrupted (Ctrl-C) or failed: wait until the model thread is done with the
            # step's blocks, then let aborts free them at once.
            concurrent.futures.wait([future])
            self.scheduler.release_in_flight()
            raise
        return self.process(out, result)

    def check_invariants(self) -> None:
        """Block pool invariant plus: every owner of blocks is a live running request."""
        self.blocks.check()
        running = {r.request_id for r in self.scheduler.running}
        owners = set(self.blocks.owners())
        assert owners <= running, f"blocks owned by requests not running: {owners - running}"

    def shutdown(self) -> None:
        self.worker.shutdown()
