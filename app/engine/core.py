"""The engine core: boot, validate, schedule → Batch, update.

One object, driven one step at a time, shared by the offline `LLM` (which
waits on each step) and the online `AsyncEngine` (which awaits it). It is not
thread-safe on purpose: everything here runs on the caller's thread (the event
loop), and only `Batch`/`StepResult` cross to the model thread.

A step is `schedule()` (the scheduler picks the batch; the core flattens it
into a `Batch` and posts it), then `process(step, result)` (the scheduler
advances progress, the `OutputProcessor` turns tokens into outputs and decides
what finished, the scheduler frees what finished). The outputs travel with the
step's `StepStats`.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import replace
from types import MappingProxyType
from typing import NamedTuple

from app.config import EngineConfig
from app.engine.admission import AdmissionController
from app.engine.errors import ContextTooLong, InvalidParameter
from app.engine.grammar import GrammarLimits, GrammarService
from app.engine.kv_blocks import BlockManager
from app.engine.kv_events import KVEventLog, KVEventsConfig, ZmqPublisher
from app.engine.loras import batch_lora_ids, lora_id, start_registry
from app.engine.output_processor import OutputProcessor
from app.engine.outputs import RequestOutput, StepOutputs, StepStats
from app.engine.plan import resolve_max_model_len
from app.engine.request import Request, RequestSLO, RequestStatus
from app.engine.sampling_params import SamplingParams, check_prompt_logprobs, out_of_range
from app.engine.sampling_rows import sampled_rows, sampling_row, step_rows
from app.engine.scheduler import Scheduler, SchedulerOutput
from app.engine.spec.draft_model import DraftModelProposer, draft_model_dir
from app.engine.spec.speculator import Speculator
from app.engine.table_rows import TableRows
from gpu.batch import Batch, PromptLogprobsRequest, StepResult
from gpu.dtypes import choose_dtype, int8_activations_asked, kv_cache_dtype_asked, resolve_device
from gpu.roofline import StepCost
from gpu.runner import RunnerSpec
from gpu.worker import StepFailed, Worker
from models.config import ModelConfig
from models.generation_config import GenerationDefaults, load_generation_defaults
from models.resolve import resolve_model
from models.tokenizer import FastDecoder, NoTokenizer, load_tokenizer

log = logging.getLogger("ridgeline.engine")


class ScheduledStep(NamedTuple):
    """A step to run: what the scheduler chose and the flat batch to post for it."""

    scheduled: SchedulerOutput
    batch: Batch


def _usable(defaults: GenerationDefaults) -> GenerationDefaults:
    """The checkpoint's sampling defaults a request could set itself; the others are
    not used, and the log says so."""
    refused = out_of_range(defaults.sampling)
    for name, why in refused.items():
        log.warning("generation_config.json's %s is not used: %s", name, why)
    return replace(defaults, sampling=MappingProxyType(
        {k: v for k, v in defaults.sampling.items() if k not in refused}))


class EngineCore:
    def __init__(self, config: EngineConfig):
        device = resolve_device(config.device)
        spec = config.speculative_config
        int8 = config.flat()["int8_activations"]
        dtype, dtype_why = choose_dtype(config.dtype, device, int8_activations=int8)
        dtype_name = str(dtype).removeprefix("torch.")
        self.model_dir = resolve_model(config.model, dtype_name)  # a GGUF is cached in it
        self.model_config = ModelConfig.from_dir(self.model_dir)
        self.generation_defaults = _usable(load_generation_defaults(self.model_dir))
        self.tokenizer = (NoTokenizer() if config.skip_tokenizer_init else
                          load_tokenizer(config.tokenizer or self.model_dir,
                                         config.chat_template))
        self.max_model_len = resolve_max_model_len(self.model_config, config.max_model_len)
        log.info("Model %s: %s; dtype %s (%s); context: the model allows %s, serving "
                 "max_model_len=%d", self.model_dir, self.model_config.describe(), dtype_name,
                 dtype_why, self.model_config.context_note, self.max_model_len)
        # From here on the config holds the resolved length: every reader sees one value.
        self.config = replace(config, scheduler=replace(config.scheduler,
                                                        max_model_len=self.max_model_len))
        self.eos_token_ids = self._eos_ids()
        draft_dir = draft_model_dir(config.speculative_config, self.model_config.vocab_size,
                                    dtype_name)
        int8 = int8_activations_asked(int8, config.dtype, dtype, device)
        kv = kv_cache_dtype_asked(config.cache.kv_cache_dtype, config.dtype, dtype, device)
        self.worker = Worker(RunnerSpec.from_config(self.config.flat(), dtype=dtype_name,
                                                    int8_activations=int8, kv_cache_dtype=kv,
                                                    model_dir=str(self.model_dir),
                                                    draft_model_dir=draft_dir,
                                                    fit_max_model_len=config.max_model_len is None,
                                                    **(spec.verify_shape() if spec else {})))
        runner = self.worker.wait_ready()
        self.kv_plan = runner.plan
        if self.kv_plan.max_model_len < self.max_model_len:  # lowered to what the pool holds
            self.max_model_len = self.kv_plan.max_model_len
            self.config = replace(self.config, scheduler=replace(
                self.config.scheduler, max_model_len=self.max_model_len))
        self.peaks, self.cost = runner.peaks, runner.cost  # the roofline (gpu/roofline.py)
        self.dtype = str(runner.dtype).removeprefix("torch.")
        self.loras = start_registry(self.config.lora, self.worker, [config.model_name])
        self.kv_dtype = str(runner.kv_dtype).removeprefix("torch.")  # --kv-cache-dtype
        cache = self.config.cache
        self.blocks = BlockManager(self.kv_plan.num_blocks, cache.block_size,
                                   cache.enable_prefix_caching)
        self.kv_events = self._kv_event_publisher(KVEventsConfig.parse(cache.kv_events_config))
        sched = self.config.scheduler
        self.admission = AdmissionController(sched.max_num_seqs, sched.max_num_batched_tokens)
        self.speculator = None if spec is None else Speculator(
            spec, self.max_model_len, DraftModelProposer(self.worker, spec.draft_window)
            if draft_dir else None, self.config.per_request_spec_decode_metrics)
        self.scheduler = Scheduler(sched, self.blocks, self.admission, self.speculator, self.loras)
        # Block tables reach the model thread as deltas to its persistent rows.
        self.table_rows = TableRows(sched.max_num_seqs)
        self._submitted_at = 0.0
        self.outputs = OutputProcessor(FastDecoder(self.tokenizer), self.max_model_len)
        self.grammars = GrammarService(self.tokenizer, self.model_config.vocab_size,
                                       self.eos_token_ids, GrammarLimits.from_config(config))
        self._arrivals = 0

    def _kv_event_publisher(self, config: KVEventsConfig) -> ZmqPublisher | None:
        if not (config.enable_kv_cache_events and config.publisher == "zmq"):
            return None
        self.blocks.events = KVEventLog(self.blocks.block_size)
        return ZmqPublisher(config)

    def publish_kv_events(self) -> None:
        """Send what the last step (or a reset) changed in the prefix cache."""
        if self.kv_events is not None:
            self.kv_events.publish(self.blocks.events.take())

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model_config.eos_token_ids) | set(self.generation_defaults.eos_token_ids)
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
        for name, ids in (("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", params.logit_bias or ())):
            bad = next((t for t in ids if not 0 <= t < vocab), None)
            if bad is not None:  # it would index the logits row on the model thread
                raise InvalidParameter(
                    name, f"token id {bad} is outside the vocabulary [0, {vocab})")
        if params.n != 1:  # the server fans a request out into n sequences before this
            raise InvalidParameter("n", "the engine runs one sequence per request: "
                                   "add n requests (the HTTP server does this for n > 1)")
        if n + max(params.max_tokens, 1) > self.max_model_len:  # one token at least
            raise ContextTooLong("prompt" if n >= self.max_model_len else "max_tokens",
                                 self.max_model_len, n, params.max_tokens)
        check_prompt_logprobs(params, n)

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        priority: int = 0, slo: RequestSLO | None = None,
    ) -> Request:
        """Validate and queue; raises InvalidParameter or QueueFull, leaving nothing behind.

        With a deadline in `slo`, a request that is predicted to miss it is refused
        here (QueueFull, reason "deadline") rather than queued for nobody."""
        if request_id in self.outputs:
            raise InvalidParameter("request_id", f"request id {request_id!r} is already in use")
        self.validate(prompt_token_ids, params)
        req = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            eos_token_ids=() if params.ignore_eos else self.eos_token_ids,
            priority=priority,
            arrival_seq=self._arrivals,
            lora_id=lora_id(self.loras, params.lora_name),
        )
        req.sampling = sampling_row(req, self.model_config.vocab_size)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None]
        if params.structured is not None:  # compiled already when the server awaited it
            req.grammar = self.grammars.matcher(self.grammars.compile_now(params.structured))
        if slo is not None:
            req.slo = slo
            s = self.scheduler
            self.admission.check_arrival(req, slo, len(s.waiting), len(s.running), time.monotonic(),
                                         s.running)
        self.scheduler.add(req)  # may raise QueueFull: nothing tracked yet
        self._arrivals += 1
        self.outputs.add(req)
        return req

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a live request; its final output, or None if it is not live."""
        req = self.outputs.request(request_id)
        if req is None:
            return None
        self.scheduler.abort(req)
        return self.outputs.emit(req, "", [])

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    @property
    def num_unfinished(self) -> int:
        return len(self.outputs)

    # -- one step -------------------------------------------------------------------

    def schedule(self) -> ScheduledStep | None:
        scheduled = self.scheduler.schedule()
        if scheduled.empty:
            return None
        return ScheduledStep(scheduled, self._build_batch(scheduled))

    def _build_batch(self, out: SchedulerOutput) -> Batch:
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens, ctx_lens, tables, sample_idx, rows = [], [], [], [], []
        scoring: list[PromptLogprobsRequest] = []
        spec_lens: list[int] = []  # drafts per sampled sequence
        now = time.monotonic()
        for i, seq in enumerate(out.seqs):
            req, start, n = seq.request, seq.start, seq.num_new_tokens
            if req.times.first_scheduled is None:
                req.times.first_scheduled = now
            token_ids += req.tokens_slice(start, start + seq.num_known_tokens)
            token_ids += seq.drafts
            positions += range(start, start + n)
            slots += self.blocks.slots(req.request_id, start, start + n)
            qlens.append(n)
            ctx_lens.append(start + n)
            tables.append((req.request_id, self.blocks.block_table(req.request_id)))
            if seq.samples:
                sample_idx.append(i)
                rows += step_rows(req, seq.drafts, self.grammars)
                spec_lens.append(len(seq.drafts))
            if req.prompt_logprobs is not None and start + 1 < req.num_prompt_tokens:
                targets = req.prompt_token_ids[start + 1:min(start + n + 1,
                                                             req.num_prompt_tokens)]
                scoring.append(PromptLogprobsRequest(i, targets, req.params.prompt_logprobs))
        table_rows, table_updates = self.table_rows.assign(tables)
        return Batch(token_ids, positions, slots, qlens, ctx_lens, None, sample_idx, rows,
                     table_rows=table_rows, table_updates=table_updates, prompt_logprobs=scoring,
                     spec_lens=spec_lens if any(spec_lens) else [],
                     lora_ids=batch_lora_ids(out.seqs) if self.loras else [])

    def shed_expired(self) -> list[RequestOutput]:
        """Final outputs of waiting requests that can no longer make their deadline."""
        return [self.outputs.emit(req, "", [], error="could not start before its deadline")
                for req in self.scheduler.shed_expired(time.monotonic())]

    def predicted_wait(self) -> float | None:
        """Seconds a request arriving now would wait to start (None: not known yet)."""
        s = self.scheduler
        return self.admission.wait_seconds(len(s.waiting), len(s.running))

    def process(self, out: SchedulerOutput, result: StepResult) -> StepOutputs:
        """Apply a step's tokens: advance requests, emit deltas, finish what is done."""
        now = time.monotonic()
        self.admission.observe_step(out.num_batched_tokens, len(out.seqs),
                                    now - self._submitted_at, out.num_admitted,
                                    len(self.scheduler.waiting))
        prompt_tokens = 0
        for seq in out.seqs:  # every token but a decode step's one input is a prefill token
            if seq.is_prefill:
                prompt_tokens += seq.num_new_tokens
                seq.request.num_prefilled += seq.num_new_tokens
        for i, scores in result.prompt_logprobs.items():
            seq = out.seqs[i]
            got = seq.request.prompt_logprobs
            if got is not None:  # positions already scored (before a preemption) stay
                got.extend(scores[max(0, len(got) - seq.start - 1):])
        # Rows whose sampling failed on their own: those requests end with an error now.
        # A speculating sequence keeps the drafts the target agreed with, then its pick.
        outputs, kept, picks = [], [], {}
        for seq, (tokens, logprobs, error) in sampled_rows(out.seqs, result):
            req = seq.request
            if error is not None:
                outputs.append(self._fail(req, error))
            elif seq.drafts and not req.is_finished:
                tokens = self.speculator.verify(req, seq.drafts, tokens)
            kept.append(tokens)
            picks[req.request_id] = (tokens, logprobs)
        generated = 0
        got_tokens = self.scheduler.update(out, kept)
        for seq in out.seqs:  # blocks of rejected drafts went back: resend what regrows
            if seq.drafts:
                rid = seq.request.request_id
                self.table_rows.trim(rid, len(self.blocks.block_table(rid)))
        for req in got_tokens:
            if req.request_id not in self.outputs:
                continue
            if req.times.first_token is None:
                req.times.first_token = now
            delta, tokens, status = self.outputs.advance(req, *picks[req.request_id])
            generated += len(tokens)
            if status is RequestStatus.FINISHED_ERROR:  # the token left the request's grammar
                outputs.append(self._fail(req, f"token {tokens[-1]} is outside the grammar"))
                continue
            if status is not None:
                self.scheduler.finish(req, status)
            outputs.append(self.outputs.emit(req, delta, tokens))
        self.publish_kv_events()
        return StepOutputs(outputs, self._stats(prompt_tokens, generated, out, result.cost))

    def fail_step(self, out: SchedulerOutput, error: BaseException) -> StepOutputs:
        """The model thread could not run this step (but can run the next): every request
        in it ends with an error; the rest of the engine goes on."""
        self.release_in_flight()
        outputs = [self._fail(s.request, f"{error}") for s in out.seqs
                   if s.request.request_id in self.outputs]
        return StepOutputs(outputs, self._stats(0, 0, out))

    def _fail(self, req: Request, message: str) -> RequestOutput:
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self.outputs.emit(req, "", [], error=message)

    def _stats(self, prompt_tokens: int, generation_tokens: int,
               out: SchedulerOutput, cost: StepCost | None = None) -> StepStats:
        s = self.scheduler
        work = {} if cost is None else dict(model_seconds=cost.seconds, flops=cost.flops,
                                            bytes_read=cost.bytes_read,
                                            bytes_written=cost.bytes_written)
        if self.speculator is not None:
            c = self.speculator.take_counts()
            work |= dict(spec_num_drafts=c.num_drafts, spec_num_draft_tokens=c.num_draft_tokens,
                         spec_num_accepted_tokens=c.num_accepted_tokens,
                         spec_accepted_per_pos=tuple(c.accepted_per_pos))
        return StepStats(prompt_tokens, generation_tokens, len(out.preempted), len(s.running),
                         len(s.waiting), self.blocks.usage, out.prefix_queried, out.prefix_hit,
                         **work)

    def idle_stats(self) -> StepStats:
        """The state between steps (after aborts, or with nothing to run)."""
        s = self.scheduler
        return StepStats(num_running=len(s.running), num_waiting=len(s.waiting),
                         kv_cache_usage=self.blocks.usage)

    def submit(self, batch: Batch) -> concurrent.futures.Future[StepResult]:
        """Post a batch to the model thread."""
        self._submitted_at = time.monotonic()
        return self.worker.submit(batch)

    def release_in_flight(self) -> None:
        """The step in flight failed or was abandoned: its blocks may be reused now."""
        self.scheduler.release_in_flight()

    @property
    def alive(self) -> bool:
        return self.worker.alive

    def step(self) -> StepOutputs:
        """Synchronous step for offline use: schedule, run on the model thread, process."""
        step = self.schedule()
        if step is None:
            return StepOutputs([], self.idle_stats())
        future = self.submit(step.batch)
        try:
            result = future.result()
        except StepFailed as e:  # the device is fine: only this step's requests fail
            return self.fail_step(step.scheduled, e.cause)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: wait until the model thread is done with the
            # step's blocks, then let aborts free them at once.
            concurrent.futures.wait([future])
            self.release_in_flight()
            raise
        return self.process(step.scheduled, result)

    def block_report(self) -> dict:
        """The pool's O(1) health: counts, and whether they add up (free + cached + used ==
        total, and no table outlives its request beyond the step in flight)."""
        c = self.blocks.counts()
        owners = len(self.scheduler.running) + self.scheduler.num_deferred_frees
        c["consistent"] = (c["free"] + c["cached"] + c["used"] == c["total"]
                           and c["tables"] <= owners)
        return c

    def reset_prefix_cache(self) -> int:
        dropped = self.blocks.reset_prefix_cache()
        self.publish_kv_events()
        return dropped

    def check_invariants(self) -> None:
        """Block pool invariant plus: every owner of blocks is a live running request."""
        self.blocks.check()
        self.table_rows.check()
        running = {r.request_id for r in self.scheduler.running}
        owners = set(self.blocks.owners())
        assert owners <= running, f"blocks owned by requests not running: {owners - running}"

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.grammars.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
