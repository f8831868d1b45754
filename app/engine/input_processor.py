"""Prompts and conversations → token ids: bounded first, then tokenised off the event loop.

- Text longer than the model could ever hold is refused before any tokeniser work.
  The bound is in characters: `max_model_len` tokens × the most characters one
  token can stand for (the longest string in the vocabulary), so no prompt that
  fits is ever refused by it.
- A lone surrogate (JSON lets a client send `"\\ud800"`) is not text: refused with a 400
  naming the field, instead of failing deep in the tokeniser.
- Tokenising and templating run on a small thread pool. The Rust tokeniser releases
  the GIL only in its batch call, so that is the call made; a 250 K-character prompt
  costs ~250 ms of tokeniser time, which on the loop would freeze every stream.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from app.engine.errors import InvalidParameter
from models.tokenizer import NoTokenizer, apply_chat_template

_SURROGATE = re.compile("[\ud800-\udfff]")
TOKENIZER_THREADS = 2


class InputProcessor:
    def __init__(self, tokenizer, max_model_len: int, threads: int = TOKENIZER_THREADS):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        longest_token = max((len(t) for t in tokenizer.get_vocab()), default=1)
        self.max_chars = max_model_len * max(1, longest_token)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ridgeline-tokenize")

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
        """The conversation's token ids; a template that cannot render it is a 400."""
        self.need_tokenizer(param)
        total = 0
        for i, m in enumerate(messages):
            content = m.get("content")
            if isinstance(content, str):
                total += len(content)
                self.check_text(content, f"{param}[{i}].content", total)
        try:
            return await self._run(apply_chat_template, self.tokenizer, messages,
                                   add_generation_prompt, **template_kwargs)
        except InvalidParameter:
            raise
        except Exception as e:  # the template's own checks (roles, order) are the input's
            raise InvalidParameter(param, f"cannot apply the chat template: {e}") from e

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
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
