"""Structured outputs: grammars compiled off the event loop, one matcher per request.

A request may carry a `StructuredOutput` (a JSON schema, any JSON object, a regex, a
choice among strings, an EBNF grammar, or an xgrammar structural tag for tool calls).
`GrammarService.compile` checks the spec's cheap bounds (`grammar_bounds.py`), then
turns it into an xgrammar `CompiledGrammar` in a worker process (`grammar_pool.py`),
bounded in time and memory and killed when every request waiting for it has left,
through an LRU cache keyed by the spec (compact, in the client's key order) and
bounded by the grammars' bytes: a request waits for its grammar without blocking
others, and a bad or too costly spec is a 400 naming its field before anything is
queued. The request then gets its own `GrammarMatcher`.

Each step the core fills one bitmask row per constrained request (the tokens the
grammar allows next) and hands it to the model thread on the request's sampling row;
the sampler masks the logits before choosing (greedy included). After the step, the
sampled token advances the matcher; a grammar that has reached its end ends the
request (`finish_reason: stop`). Under speculative decoding a step scores several
positions: each gets the mask after the drafts before it (`fill_drafts`), and the
matcher then accepts only the tokens verification kept. Unconstrained requests pay
nothing.

xgrammar is imported, and the workers started, on first use: the engine runs without
them until a request asks.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from typing import Any

from app.engine.errors import EngineDead, InvalidParameter, QueueFull
from app.engine.grammar_bounds import check_depth, check_spec, parse_json
from app.engine.grammar_pool import (
    Busy,
    CompileCancelled,
    CompileJob,
    CompilePool,
    InvalidSpec,
    TooCostly,
)

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
_CPP_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+?:\d+: (?:Check failed: .*? is false: )?")


@dataclass(frozen=True)
class GrammarLimits:
    """The bounds of compiling (settings of the same names, see app/config.py)."""

    compile_timeout: float = 10.0
    compile_memory: int = 512 << 20
    workers: int = 2
    cache_bytes: int = 64 << 20
    max_spec_bytes: int = 128 << 10

    @classmethod
    def from_config(cls, config) -> GrammarLimits:
        return cls(config.grammar_compile_timeout, config.grammar_compile_memory,
                   config.grammar_workers, config.grammar_cache_bytes,
                   config.grammar_max_spec_bytes)


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `spec` is text: compact JSON for `json` and
    `structural_tag` (keys in the client's order: a schema's property order is the
    output's, so two orders are two grammars), a JSON list for `choice`, the pattern or
    the EBNF otherwise.
    `compiled` carries the compiled grammar from the server's compile to the engine,
    so an eviction from the cache in between costs nothing; it is not part of the key."""

    kind: str
    spec: str = ""
    compiled: Any = field(default=None, compare=False, hash=False, repr=False)

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutput:
        """From a schema or its text; a ValueError (for a 400) past the nesting bound."""
        if isinstance(schema, str):
            schema = parse_json(schema, "the schema")
        else:
            check_depth(schema, "the schema")
        return cls("json", json.dumps(schema, separators=(",", ":")))


class GrammarService:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...],
                 limits: GrammarLimits | None = None):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = list(stop_token_ids)
        self.limits = limits or GrammarLimits()
        self._lock = threading.Lock()  # the cache, the jobs in flight, the pool's start
        self._cache: OrderedDict[StructuredOutput, Any] = OrderedDict()  # least recent first
        self.cache_bytes = 0
        self._jobs: dict[StructuredOutput, CompileJob] = {}
        self._pool: CompilePool | None = None
        self._closed = False

    def _xgr(self):
        try:
            import xgrammar
        except ImportError as e:
            raise InvalidParameter("response_format", "structured outputs need xgrammar "
                                   "(pip install 'ridgeline[engine]')") from e
        return xgrammar

    def _tokenizer_info(self):
        from models.tokenizer import transformers_tokenizer  # not in the light install

        xgr = self._xgr()
        # Added tokens (<|im_start|>, ...) are blanked: a grammar must never allow them
        # as text inside a JSON string (from_huggingface lets them through for BPE vocabs).
        vocab = [""] * self.vocab_size
        for token, i in self._tokenizer.get_vocab().items():
            if i < self.vocab_size:
                vocab[i] = token
        for i in getattr(self._tokenizer, "added_tokens_decoder", {}):
            if i < self.vocab_size:
                vocab[i] = ""
        base = xgr.TokenizerInfo.from_huggingface(transformers_tokenizer(self._tokenizer),
                                                   vocab_size=self.vocab_size)
        return xgr.TokenizerInfo(vocab, base.vocab_type, vocab_size=self.vocab_size,
                                 stop_token_ids=self._stop_ids,
                                 add_prefix_space=base.add_prefix_space)

    @property
    def pool(self) -> CompilePool:
        """The worker processes, started by the first compile (xgrammar is loaded then)."""
        with self._lock:
            if self._closed:
                raise EngineDead("the server is shutting down")
            if self._pool is None:
                lim = self.limits
                self._pool = CompilePool(self._tokenizer_info(), lim.workers,
                                         lim.compile_timeout, lim.compile_memory)
            return self._pool

    def check(self, so: StructuredOutput, param: str) -> None:
        """The cheap bounds (`app/engine/grammar_bounds.py`): a 400 naming `param`."""
        try:
            check_spec(so.kind, so.spec, self.limits.max_spec_bytes)
        except ValueError as e:
            raise InvalidParameter(param, f"invalid {so.kind}: {e}") from e

    # -- the cache: least recently used out first, bounded by the grammars' bytes ----------

    def cached(self, so: StructuredOutput):
        with self._lock:
            compiled = self._cache.get(so)
            if compiled is not None:
                self._cache.move_to_end(so)
            return compiled

    def _keep(self, so: StructuredOutput, compiled) -> None:
        size = compiled.memory_size_bytes
        with self._lock:
            if so in self._cache or size > self.limits.cache_bytes:
                return
            self._cache[so] = compiled
            self.cache_bytes += size
            while self.cache_bytes > self.limits.cache_bytes:
                _, old = self._cache.popitem(last=False)
                self.cache_bytes -= old.memory_size_bytes

    # -- compiling -------------------------------------------------------------------------

    def _join(self, so: StructuredOutput) -> CompileJob:
        """The job compiling `so` (one per spec, shared), with one more waiter."""
        pool = self.pool
        with self._lock:
            job = self._jobs.get(so)
            if job is None:
                job = self._jobs[so] = CompileJob(so.kind, so.spec)
                job.future.add_done_callback(lambda _, so=so, job=job: self._done(so, job))
                pool.submit(job)
            job.waiters += 1
            return job

    def _done(self, so: StructuredOutput, job: CompileJob) -> None:
        with self._lock:
            if self._jobs.get(so) is job:
                del self._jobs[so]

    def _leave(self, so: StructuredOutput, job: CompileJob) -> None:
        """A waiter left; the last one to leave stops the compile."""
        with self._lock:
            job.waiters -= 1
            if job.waiters > 0 or job.future.done():
                return
            if self._jobs.get(so) is job:
                del self._jobs[so]
        self.pool.cancel(job)

    def _error(self, e: BaseException, so: StructuredOutput, param: str) -> Exception:
        if isinstance(e, CompileCancelled):
            return EngineDead("the server is shutting down")
        if isinstance(e, Busy):
            return QueueFull(f"{param}: {e}; retry later", retry_after=self.limits.compile_timeout)
        if isinstance(e, TooCostly):
            return InvalidParameter(param, f"the {so.kind} grammar is too costly to compile "
                                    f"({e.reason}); simplify it")
        return InvalidParameter(param, f"invalid {so.kind}: "
                                f"{_CPP_PREFIX.sub('', str(e).strip())}")

    async def compile(self, so: StructuredOutput, param: str, checked: bool = False):
        """The compiled grammar, off the loop; a 400 naming `param` for a spec past a
        bound or that does not compile (`checked`: the caller ran `check`). A request
        that leaves stops its compile when it was the last one waiting for it."""
        if not checked:
            self.check(so, param)
        compiled = self.cached(so)
        if compiled is not None:
            return compiled
        if self._pool is None:  # the tokenizer's info takes about a second to build
            await asyncio.to_thread(lambda: self.pool)
        job = self._join(so)
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def relay(f) -> None:
            loop.call_soon_threadsafe(_settle, waiter, f)

        job.future.add_done_callback(relay)
        try:
            compiled = await waiter
            self._keep(so, compiled)  # here, not in a callback: cached once it is returned
            return compiled
        except (InvalidSpec, TooCostly, CompileCancelled, Busy) as e:
            raise self._error(e, so, param) from e
        finally:
            self._leave(so, job)

    def compile_now(self, so: StructuredOutput, param: str = "structured_outputs"):
        """The same, blocking: for the offline `LLM`, and for the engine when the server
        did not hand the compiled grammar along."""
        if so.compiled is not None:
            return so.compiled
        self.check(so, param)
        compiled = self.cached(so)
        if compiled is not None:
            return compiled
        job = self._join(so)
        try:
            compiled = job.future.result()
            self._keep(so, compiled)
            return compiled
        except CancelledError as e:
            raise self._error(CompileCancelled(), so, param) from e
        except (InvalidSpec, TooCostly, CompileCancelled, Busy) as e:
            raise self._error(e, so, param) from e
        finally:
            self._leave(so, job)

    def matcher(self, compiled):
        return self._xgr().GrammarMatcher(compiled)

    def fill(self, matcher):
        """The bitmask row of the tokens the grammar allows next (int32, 1 = allowed)."""
        xgr = self._xgr()
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask, 0)
        return mask[0]

    def fill_drafts(self, matcher, drafts: list[int]) -> list:
        """The bitmask rows of a speculating request's positions 0..k: position j is
        scored as if drafts 1..j were output, so its mask is the grammar's state after
        them. The matcher walks the drafts (which it accepts: the speculator kept only
        those) and rolls back, so between steps it stays at the request's real output."""
        xgr = self._xgr()
        masks = xgr.allocate_token_bitmask(len(drafts) + 1, self.vocab_size)
        accepted = 0
        try:
            for j, token in enumerate(drafts):
                matcher.fill_next_token_bitmask(masks, j)
                if not matcher.accept_token(token):
                    raise RuntimeError(f"draft token {token} is outside the grammar")
                accepted += 1
            matcher.fill_next_token_bitmask(masks, len(drafts))
        finally:  # also on an error: the matcher stays at the request's real output
            if accepted:
                matcher.rollback(accepted)
        return list(masks)

    def shutdown(self) -> None:
        """Kill every compile (the server is stopping)."""
        with self._lock:
            self._closed, pool = True, self._pool
        if pool is not None:
            pool.shutdown()


def _settle(waiter: asyncio.Future, done) -> None:
    if waiter.done():
        return
    if done.cancelled():
        waiter.set_exception(CompileCancelled())
    elif done.exception() is not None:
        waiter.set_exception(done.exception())
    else:
        waiter.set_result(done.result())
