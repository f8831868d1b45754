"""Prompts and conversations → token ids: bounded first, then tokenised off the event loop.

- Text longer than the model could ever hold is refused before any tokeniser work.
  The bound is in characters: `max_model_len` tokens × the most characters one
  token can stand for (the longest string in the vocabulary), so no prompt that
  fits is ever refused by it.
- A lone surrogate (JSON lets a client send `"\\ud800"`) is not text: refused with a 400
  naming the field, instead of failing deep in the tokeniser.
- Tokenising runs on a small thread pool. The Rust tokeniser releases the GIL only in
  its batch call, so that is the call made; a 250 K-character prompt costs ~250 ms of
  tokeniser time, which on the loop would freeze every stream.
- A conversation is rendered by its chat template in a worker process
  (`app/engine/renderer.py`: bounded in time, memory and output, killed when its
  client leaves), then tokenised here like a prompt. The output bound is the same
  `max_chars`: a rendered text longer than that could not fit either. Templates sent
  with requests (`--trust-request-chat-template`) render in a pool of their own, started
  at the first one: a client's template that runs to its time bound then holds none of
  the workers the model's own template needs.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app.engine.errors import EngineDead, InvalidParameter
from app.engine.renderer import RenderFailed, RenderPool
from models.tokenizer import NoTokenizer, chat_render_job, encode_rendered

_SURROGATE = re.compile("[\ud800-\udfff]")
TOKENIZER_THREADS = 2
STUCK_SECONDS = 30.0  # far past any bounded tokenisation (a whole context takes ~0.1 s)
RENDER_WORKERS = 2  # per pool: the model's template's, and requests' templates'


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, threads: int = TOKENIZER_THREADS,
                 render_timeout: float = 5.0, render_memory: int = 512 << 20):
        self.tokenizer = tokenizer
        self.renderer = RenderPool(RENDER_WORKERS, render_timeout, render_memory)
        self.request_renderer = RenderPool(RENDER_WORKERS, render_timeout, render_memory)
        self.max_model_len = max_model_len
        longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_chars = max_model_len * max(1, longest_token)
        self._threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ridgeline-tokenize")
        self._running: dict[int, float] = {}  # tokenizer job -> when a thread took it

    def check_text(self, text: str, param: str, total: int | None = None) -> None:
        """Refuse what cannot be tokenised or cannot fit, before tokenising it."""
        size = len(text) if total is None else total
        if size > self.max_chars:
            raise InvalidParameter(
                param, f"{param} has {size} characters; at most {self.max_chars} can fit in "
                f"max_model_len={self.max_model_len} tokens")
        bad = _SURROGATE.search(text)
        if bad is not None:
            raise InvalidParameter(
                param, f"{param} is not valid Unicode: lone surrogate "
                f"U+{ord(bad.group()):04X} at character {bad.start()}")

    def need_tokenizer(self, param: str) -> None:
        """A 400 naming `param` when the server runs without a tokenizer."""
        if isinstance(self.tokenizer, NoTokenizer):
            raise InvalidParameter(param, f"{param} needs a tokenizer, and this server runs "
                                   "with --skip-tokenizer-init: send token ids instead (a "
                                   "prompt of ids, or /generate's input_ids)")

    async def tokenize(self, text: str, param: str = "prompt",
                       add_special_tokens: bool = True) -> list[int]:
        self.need_tokenizer(param)
        self.check_text(text, param)
        return await self._run(self._encode, text, add_special_tokens)

    async def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                                  add_generation_prompt: bool = True,
                                  param: str = "messages", **template_kwargs: Any) -> list[int]:
        """The conversation's token ids; a template that cannot render it, or not within
        its bounds, is a 400 naming `chat_template` when the request supplied the
        template, else `param`."""
        self.need_tokenizer(param)
        total = 0
        for i, m in enumerate(messages):
            content = m.get("content")
            if isinstance(content, str):
                total += len(content)
                self.check_text(content, f"{param}[{i}].content", total)
        renderer = self.renderer
        if template_kwargs.get("chat_template") is not None:
            param, renderer = "chat_template", self.request_renderer
        try:
            job = chat_render_job(self.tokenizer, messages, add_generation_prompt,
                                  **template_kwargs)
            text = await renderer.render(job, self.max_chars)
        except RenderFailed as e:
            if e.kind == "unavailable":
                raise EngineDead(str(e)) from e
            raise InvalidParameter(param, f"cannot apply the chat template: {e}") from e
        except (ValueError, TypeError) as e:  # no template, or a bad argument to it
            raise InvalidParameter(param, f"cannot apply the chat template: {e}") from e
        self.check_text(text, param)
        return await self._run(encode_rendered, self.tokenizer, text)

    async def detokenize(self, token_ids: list[int], param: str = "tokens") -> str:
        self.need_tokenizer(param)
        return await self._run(self.tokenizer.decode, token_ids)

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        rust = getattr(self.tokenizer, "backend_tokenizer", None)
        if rust is None:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        (encoding,) = rust.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    async def _run(self, fn, *args, **kwargs):
        loop = asyncio.get_running_loop()
        job = object()

        def run():
            self._running[id(job)] = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                self._running.pop(id(job), None)
        return await loop.run_in_executor(self._pool, run)

    def stuck(self) -> str | None:
        """Why a plain chat or text prompt cannot be served now, else None: every
        tokenizer thread held past `STUCK_SECONDS`, or the model's template renderer
        unable to start. The bounds make both unlikely; `/health` says so if they happen."""
        started = list(self._running.values())
        if len(started) >= self._threads and \
                time.monotonic() - max(started) > STUCK_SECONDS:
            return "tokenizer threads stuck"
        if self.renderer.cannot_start:
            return "chat template renderer cannot start"
        return None

    def start(self) -> None:
        """Start the model's template workers (in the background: nothing waits)."""
        self.renderer.start()

    async def stop_rendering(self) -> None:
        """Kill the template workers: renders in progress end now (503), not at their
        time bound, and later ones are refused."""
        await self.renderer.close()
        await self.request_renderer.close()

    async def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        await self.stop_rendering()
