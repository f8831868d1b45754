"""Structured outputs: grammars compiled off the event loop, one matcher per request.

A request may carry a `StructuredOutput` (a JSON schema, any JSON object, a regex, a
choice among strings, an EBNF grammar, or an xgrammar structural tag for tool calls).
`GrammarService.compile` turns it into an xgrammar `CompiledGrammar` on a small
thread pool (xgrammar releases the GIL), through a cache keyed by the canonical spec:
a request waits for its grammar without blocking others, and a bad spec is a 400
before anything is queued. The request then gets its own `GrammarMatcher`.

Each step the core fills one bitmask row per constrained request (the tokens the
grammar allows next) and hands it to the model thread on the request's sampling row;
the sampler masks the logits before choosing (greedy included). After the step, the
sampled token advances the matcher; a grammar that has reached its end ends the
request (`finish_reason: stop`). Unconstrained requests pay nothing.

xgrammar is imported on first use: the engine runs without it until a request asks.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from app.engine.errors import InvalidParameter

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
GRAMMAR_THREADS = 2
CACHE_BYTES = 64 << 20
# JSON Schema keywords xgrammar accepts but does not enforce: refused, not ignored.
UNENFORCED = ("uniqueItems", "not", "if", "then", "else", "dependentSchemas",
              "dependentRequired", "patternProperties", "unevaluatedProperties")
_CPP_PREFIX = re.compile(r"^\[\d{2}:\d{2}:\d{2}\] \S+?:\d+: (?:Check failed: .*? is false: )?")


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match. `spec` is text: canonical JSON for `json` and
    `structural_tag`, a JSON list for `choice`, the pattern or the EBNF otherwise."""

    kind: str
    spec: str = ""

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutput:
        if isinstance(schema, str):
            schema = json.loads(schema)
        return cls("json", json.dumps(schema, sort_keys=True, separators=(",", ":")))


def check_schema(schema: Any, path: str = "") -> None:
    """Refuse what xgrammar would silently not enforce, naming where it is."""
    if isinstance(schema, dict):
        for key, value in schema.items():
            where = f"{path}.{key}" if path else key
            if key in UNENFORCED:
                raise ValueError(f"the schema keyword {where!r} is not supported (it could "
                                 f"not be enforced)")
            if key == "multipleOf" and schema.get("type") == "number":
                raise ValueError(f"{where!r}: multipleOf is supported on integers only")
            if key == "$ref" and isinstance(value, str) and not value.startswith("#"):
                raise ValueError(f"{where!r}: only local references ('#/...') are supported")
            check_schema(value, where)
    elif isinstance(schema, list):
        for i, item in enumerate(schema):
            check_schema(item, f"{path}[{i}]")


class GrammarService:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: tuple[int, ...]):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._stop_ids = list(stop_token_ids)
        self._compiler = None
        self._compiler_lock = threading.Lock()  # built once, by the first compiling thread
        self._cache: dict[StructuredOutput, Future] = {}
        self._pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="ridgeline-grammar")

    def _xgr(self):
        try:
            import xgrammar
        except ImportError as e:
            raise InvalidParameter("response_format", "structured outputs need xgrammar "
                                   "(pip install 'ridgeline[engine]')") from e
        return xgrammar

    def _get_compiler(self):
        with self._compiler_lock:
            return self._build_compiler()

    def _build_compiler(self):
        if self._compiler is None:
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
            info = xgr.TokenizerInfo(vocab, base.vocab_type, vocab_size=self.vocab_size,
                                     stop_token_ids=self._stop_ids,
                                     add_prefix_space=base.add_prefix_space)
            self._compiler = xgr.GrammarCompiler(info, max_threads=GRAMMAR_THREADS,
                                                 cache_enabled=True,
                                                 cache_limit_bytes=CACHE_BYTES)
        return self._compiler

    def _compile(self, so: StructuredOutput):
        compiler = self._get_compiler()
        if so.kind == "json":
            schema = json.loads(so.spec)
            check_schema(schema)
            return compiler.compile_json_schema(so.spec, any_whitespace=False)
        if so.kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False,
                                                strict_mode=False)
        if so.kind == "regex":
            return compiler.compile_regex(so.spec)
        if so.kind == "choice":
            choices = json.loads(so.spec)
            return compiler.compile_grammar("root ::= " + " | ".join(map(json.dumps, choices)))
        if so.kind == "grammar":
            return compiler.compile_grammar(so.spec)
        if so.kind == "structural_tag":
            return compiler.compile_structural_tag(so.spec)
        raise ValueError(f"unknown structured output kind {so.kind!r}")

    def submit(self, so: StructuredOutput) -> Future:
        """The compiled grammar, from the cache or a worker thread."""
        future = self._cache.get(so)
        if future is None or (future.done() and future.exception() is not None):
            future = self._cache[so] = self._pool.submit(self._compile, so)
        return future

    async def compile(self, so: StructuredOutput, param: str):
        """Compile off the loop; a spec that does not compile is a 400 naming `param`."""
        try:
            return await asyncio.wrap_future(self.submit(so))
        except InvalidParameter:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidParameter(param, f"invalid {so.kind}: "
                                   f"{_CPP_PREFIX.sub('', str(e).strip())}") from e

    def compile_now(self, so: StructuredOutput, param: str = "structured_outputs"):
        """The same, blocking: for the offline `LLM`."""
        try:
            return self.submit(so).result()
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidParameter(param, f"invalid {so.kind}: "
                                   f"{_CPP_PREFIX.sub('', str(e).strip())}") from e

    def matcher(self, compiled):
        return self._xgr().GrammarMatcher(compiled)

    def fill(self, matcher):
        """The bitmask row of the tokens the grammar allows next (int32, 1 = allowed)."""
        xgr = self._xgr()
        mask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(mask, 0)
        return mask[0]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
