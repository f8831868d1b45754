"""Iteration-level scheduler: re-forms the batch every step under a token budget.

There are no prefill and decode phases, only requests whose computed tokens
(`num_computed_tokens`, K/V in the cache) catch up with their known tokens (prompt
and output so far). Each step: running requests first (one decode token each, or
their next prefill chunk), then waiting ones while the token budget, the sequence
cap and the free blocks allow. A waiting request starts at the longest prefix of
its tokens already in the prefix cache (`kv_blocks.py`), always leaving one token
to compute so there are logits to sample; a request whose first uncached block is
being computed in this very step waits one step and then finds it cached.

When a running request needs a block and none is free, a victim (by policy) is
preempted: it lets go of its blocks (shared ones stay for the others, named ones
stay cached) and goes back to the front of the waiting queue, to recompute later.

Blocks of a request aborted while its step is in flight are freed only when
that step's results come back (`update`), never while a kernel may write them.

Speculative decoding (`app/engine/spec/`): a decoding request may carry draft tokens
after its one known token. They take budget and blocks like any new token, but only
if they fit without preempting anyone; they never enter the request's tokens, so
block names (and the prefix cache) see only real tokens. After the step the cache
counts the drafts the target accepted, and the blocks that held only rejected ones go
back to the pool.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from app.config import SchedulerConfig
from app.engine.admission import AdmissionController
from app.engine.errors import QueueFull
from app.engine.kv_blocks import BlockManager
from app.engine.loras import LoRARegistry
from app.engine.request import Request, RequestStatus
from app.engine.spec.speculator import Speculator


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # num_computed_tokens when scheduled
    num_new_tokens: int
    samples: bool  # this chunk reaches the end of the known tokens: sample the next one
    drafts: list[int] = field(default_factory=list)  # after the known ones, to verify

    @property
    def is_prefill(self) -> bool:
        """Anything but one decode token and its drafts (recomputes after preemption
        included)."""
        return not (self.num_new_tokens == 1 + len(self.drafts) and self.samples)

    @property
    def num_known_tokens(self) -> int:
        """The new tokens that are the request's own (not drafts)."""
        return self.num_new_tokens - len(self.drafts)


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_admitted: int = 0  # requests that joined the running batch this step
    prefix_queried: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_hit: int = 0  # ... and found there

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.seqs)

    @property
    def empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, blocks: BlockManager,
                 admission: AdmissionController | None = None,
                 speculator: Speculator | None = None, loras: LoRARegistry | None = None):
        self.config = config
        self.blocks = blocks
        self.admission = admission  # None: admit by memory and caps alone
        self.speculator = speculator  # None: no speculative decoding
        # Distinct LoRA adapters a step may hold (None: no adapters are served).
        self.max_loras = loras.config.max_loras if loras is not None else None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0  # monotonic; metrics read deltas
        self._in_flight: set[str] = set()
        self._free_after_step: list[str] = []

    # -- arrivals and departures -------------------------------------------------

    def add(self, request: Request) -> None:
        # A request that cannot fit the context would never finish; the core validates
        # this with a message for the client, the scheduler refuses it regardless.
        max_len = self.config.max_model_len
        if max_len is not None and request.num_tokens >= max_len:
            raise ValueError(f"request {request.request_id} has {request.num_tokens} tokens, "
                             f"max_model_len is {max_len}")
        limit = self.config.max_queued_requests
        if limit is not None and self.num_queued >= limit:
            raise QueueFull(f"waiting queue is full ({limit} requests)")
        request.status = RequestStatus.WAITING
        self.waiting.append(request)
        if self.speculator is not None:
            self.speculator.admit(request)

    def abort(self, request: Request) -> None:
        """Take the request out at once; its blocks go back now or after the step in flight."""
        if request.is_finished:
            return
        if request in self.waiting:
            self.waiting.remove(request)
        self.finish(request, RequestStatus.FINISHED_ABORTED)  # leaves `running` too

    def finish(self, request: Request, status: RequestStatus) -> None:
        assert status.finished
        request.status = status
        if request in self.running:
            self.running.remove(request)
        if request.request_id in self._in_flight:
            self._free_after_step.append(request.request_id)
        else:
            self.blocks.free(request.request_id)
        if self.speculator is not None:
            self.speculator.finish(request)

    @property
    def num_queued(self) -> int:
        """Waiting requests beyond the free run slots: those that start at the next step
        are not queued, so a burst into an idle server is not refused."""
        free_slots = max(0, self.config.max_num_seqs - len(self.running))
        return max(0, len(self.waiting) - free_slots)

    @property
    def num_deferred_frees(self) -> int:
        """Finished requests whose blocks wait for the step in flight to return."""
        return len(self._free_after_step)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the step ---------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        assert not self._in_flight, "schedule() called while a step is in flight"
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        # A request's prefill chunk is capped by a fixed threshold (vLLM's
        # long_prefill_token_threshold), so a long prompt leaves room in its steps for
        # waiting requests and a short one's first token does not wait for the whole long
        # prefill. Prefill chunks together are capped only by the budget and the decoders'
        # TPOT targets: spreading a wave of short prompts over more steps slows more of the
        # decoders' steps (`benchmarks/run_peers.sh` conc32 shows it in TPOT and tokens/s).
        threshold = self.config.long_prefill_token_threshold or budget
        prefill_left = budget
        decodes = sum(1 for r in self.running if r.num_tokens - r.num_computed_tokens == 1)
        if self.admission is not None:
            cap = self.admission.prefill_budget(self.running, decodes)
            prefill_left = prefill_left if cap is None else min(cap, prefill_left)
        scheduled: dict[str, ScheduledSeq] = {}
        drafts = self.speculator.propose(self.running) if self.speculator is not None else {}

        def take(req: Request) -> int:
            """Tokens `req` may compute this step: one to decode, or a prefill chunk."""
            left = req.num_tokens - req.num_computed_tokens
            if left == 1:
                return min(left, budget)
            return min(left, budget, prefill_left, threshold)

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = take(req)
            if num_new == 0:
                continue  # a prefill chunk with no room this step
            draft = self._fit(req, drafts.get(req.request_id), budget) if num_new == 1 else []
            num_new += len(draft)
            while not self.blocks.can_allocate(req.request_id, req.num_computed_tokens + num_new):
                victim = self._pick_victim()
                if victim.request_id in scheduled:
                    refund = scheduled.pop(victim.request_id)
                    budget += refund.num_new_tokens
                    if refund.is_prefill:
                        prefill_left += refund.num_new_tokens
                self._preempt(victim, out)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                continue
            self.blocks.allocate(req.request_id, req.num_computed_tokens + num_new)
            seq = scheduled[req.request_id] = self._seq(req, num_new, draft)
            budget -= num_new
            prefill_left -= num_new if seq.is_prefill else 0

        # Admit waiting requests (preempted ones were put at the front) unless
        # something was just preempted: admitting now would only thrash.
        computing = self._names_computed_by(scheduled.values())
        # LoRA: the running requests' adapters, which a step must not hold more than
        # max_loras of; a waiting request for another adapter waits for room.
        loras = {r.lora_id for r in self.running} - {0} if self.max_loras else set()
        for req in self._waiting_order() if not out.preempted else ():
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self.admission is not None and not self.admission.can_join(req, self.running):
                break  # one more sequence would break a TPOT target
            if req.lora_id and req.lora_id not in loras and len(loras) >= self.max_loras:
                continue
            hits = self._prefix_hits(req)
            names = req.block_names
            if len(names) > len(hits) and names[len(hits)] in computing:
                continue  # its next block is being computed now: next step it is cached
            req.num_computed_tokens = len(hits) * self.blocks.block_size
            num_new = take(req)
            if num_new == 0 or not self.blocks.can_allocate(
                    req.request_id, req.num_computed_tokens + num_new, hits):
                req.num_computed_tokens = 0
                break
            self.waiting.remove(req)
            self.blocks.allocate(req.request_id, req.num_computed_tokens + num_new, hits)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            seq = scheduled[req.request_id] = self._seq(req, num_new)
            budget -= num_new
            prefill_left -= num_new if seq.is_prefill else 0
            out.num_admitted += 1
            if req.lora_id:
                loras.add(req.lora_id)
            out.prefix_queried += req.num_tokens
            out.prefix_hit += req.num_computed_tokens
            computing |= self._names_computed_by([seq])

        out.seqs = list(scheduled.values())
        self._in_flight = set(scheduled)
        return out

    def _fit(self, req: Request, draft: list[int] | None, budget: int) -> list[int]:
        """The part of `draft` that fits this step beside the request's known token:
        within the budget and the free blocks, never at the price of a preemption."""
        if not draft:
            return []
        draft = draft[:budget - 1]
        # Blocks stay free for every running request's next token first.
        room = self.blocks.num_free_blocks - len(self.running)
        while draft and self.blocks.num_new_blocks_needed(
                req.request_id, req.num_computed_tokens + 1 + len(draft)) > room:
            draft = draft[:-1]
        return draft

    def _waiting_order(self) -> list[Request]:
        if self.config.preemption_policy == "priority":
            return sorted(self.waiting, key=lambda r: (r.priority, r.arrival_seq))
        return list(self.waiting)

    def _prefix_hits(self, req: Request) -> list[int]:
        """Cached blocks for the longest cached prefix of `req`'s tokens, at most all
        but its last token (one must be computed to sample from). A request that wants
        logprobs for its prompt computes every position."""
        if not self.blocks.enable_caching or req.params.prompt_logprobs is not None:
            return []
        names = self.blocks.block_names(req.tokens_slice, req.block_names, req.num_tokens - 1,
                                        req.cache_key)
        return self.blocks.match_prefix(names)

    def _names_computed_by(self, seqs) -> set[int]:
        """Names of the blocks these chunks fill this step."""
        if not self.blocks.enable_caching:
            return set()
        out: set[int] = set()
        for seq in seqs:
            end = seq.start + seq.num_known_tokens
            req = seq.request
            names = self.blocks.block_names(req.tokens_slice, req.block_names, end,
                                            req.cache_key)
            out.update(names[seq.start // self.blocks.block_size:end // self.blocks.block_size])
        return out

    def shed_expired(self, now: float) -> list[Request]:
        """Take out the waiting requests that can no longer make their deadline. Only
        requests never started: a preempted one has streamed tokens to finish."""
        if self.admission is None:
            return []
        shed = [r for r in self.waiting if r.times.first_scheduled is None
                and self.admission.expired(r, len(self.running), now)]
        for req in shed:
            self.waiting.remove(req)
            self.finish(req, RequestStatus.FINISHED_SHED)
        return shed

    def update(self, out: SchedulerOutput, sampled: Sequence[int | Sequence[int]]
               ) -> list[Request]:
        """Advance progress with the step's results; returns requests that got tokens.

        `sampled` has one entry per seq with `samples` True, in `out.seqs` order: its
        token, or for a seq with drafts the tokens verification kept (the accepted
        drafts, then the target's next token).
        """
        got_token = []
        it = iter(sampled)
        for seq in out.seqs:
            tokens = next(it) if seq.samples else ()
            tokens = (tokens,) if isinstance(tokens, int) else tokens
            req = seq.request
            if req.is_finished:  # aborted while the step was in flight
                continue
            # The accepted drafts' K/V stay: they are the first of the kept tokens.
            accepted = max(0, len(tokens) - 1) if seq.drafts else 0
            req.num_computed_tokens = seq.start + seq.num_known_tokens + accepted
            req.output_token_ids.extend(tokens)
            if seq.drafts:  # blocks that held only rejected drafts go back
                self.blocks.trim(req.request_id, req.num_computed_tokens + 1)
            self._register_full_blocks(req)
            if tokens:
                got_token.append(req)
        self.release_in_flight()
        return got_token

    def _register_full_blocks(self, req: Request) -> None:
        """Name the blocks this step filled, so later requests can share them."""
        full = req.num_computed_tokens // self.blocks.block_size
        if self.blocks.enable_caching and full > req.num_registered_blocks:
            names = self.blocks.block_names(req.tokens_slice, req.block_names,
                                            req.num_computed_tokens, req.cache_key)
            self.blocks.register(req.request_id, names, req.num_registered_blocks, full,
                                 req.tokens_slice, req.lora_id)
            req.num_registered_blocks = full

    @staticmethod
    def _seq(req: Request, num_new: int, drafts: list[int] | None = None) -> ScheduledSeq:
        start, drafts = req.num_computed_tokens, drafts or []
        return ScheduledSeq(req, start, num_new, start + num_new - len(drafts) == req.num_tokens,
                            drafts)

    def release_in_flight(self) -> None:
        """The step in flight failed: nothing will write its blocks any more."""
        self._in_flight.clear()
        for rid in self._free_after_step:
            self.blocks.free(rid)
        self._free_after_step.clear()

    # -- preemption ---------------------------------------------------------------

    def _pick_victim(self) -> Request:
        policy = self.config.preemption_policy
        if policy == "priority":  # least important (largest value), newest among equals
            return max(self.running, key=lambda r: (r.priority, r.arrival_seq))
        if policy == "length":  # SGLang: retract short-output, long-input first
            return min(self.running, key=lambda r: (r.num_output_tokens, -r.num_prompt_tokens))
        return max(self.running, key=lambda r: r.arrival_seq)

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.blocks.free(req.request_id)  # named blocks stay cached: a resume may hit them
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req)

