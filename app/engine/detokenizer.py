"""Incremental detokenization: token ids in, safe-to-emit text out, one token at a time.

Runs on the event loop once per generated token, so the cost per token is one
`decode` of a short window, never of the whole sequence.

Two things make naive per-token decoding wrong:

* A token's text depends on its left neighbours. SentencePiece decoders drop the
  leading space of the first token they see, so `decode([tok])` of "▁world" is
  "world" while in context it is " world". We therefore decode a window that starts
  a few tokens back (context whose text was already emitted) and emit only the
  characters past what the window had already produced. This is the familiar
  prefix_offset/read_offset technique, kept here as one window plus a character
  count.
* Byte-level BPE (and SentencePiece byte fallback) can split one UTF-8 character
  across tokens; the partial bytes decode to U+FFFD. Trailing U+FFFD is held back
  until a later token completes the character.

Invariant: `decode(window)[:emitted_chars]` is text already handed out, and
`decode(window)[emitted_chars:]` is at most the held-back incomplete tail.
"""

from collections.abc import Sequence
from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"

# Tokens of already-emitted context kept at the front of the window. Enough for
# any decoder's leading-space rule and for a 4-byte character split one byte a token.
CONTEXT_TOKENS = 5
# Re-anchor the window once it is this long and its text ends cleanly; re-anchoring
# costs one extra decode, so doing it every few tokens rather than every token halves
# the decode work.
SLIDE_AT_TOKENS = 2 * CONTEXT_TOKENS
# A window still ending in U+FFFD at this length is not a character waiting for its
# last byte (that takes at most 3 more tokens) but invalid bytes from the model. Emit
# them as U+FFFD so the window, and the cost per token, stay bounded.
MAX_WINDOW_TOKENS = 32


class Decoder(Protocol):
    """The one tokenizer method we need (any Hugging Face tokenizer has it)."""

    def decode(
        self,
        token_ids: list[int],
        skip_special_tokens: bool = ...,
        clean_up_tokenization_spaces: bool | None = ...,
    ) -> str: ...


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text deltas that are safe to stream."""

    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        # The tail of the prompt is context only: its text is never emitted, but it
        # gives the first generated token its correct leading whitespace.
        self._window: list[int] = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self._emitted_chars = len(self._decode(self._window))
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """All text emitted so far (joined lazily; the per-token path only appends)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int) -> str:
        """Append one generated token; return the new text that is now safe to emit."""
        window = self._window
        window.append(token_id)
        text = self._decode(window)
        safe_end = len(text)
        if text.endswith(REPLACEMENT_CHAR) and len(window) < MAX_WINDOW_TOKENS:
            safe_end = len(text.rstrip(REPLACEMENT_CHAR))
        new_text = text[self._emitted_chars : safe_end]
        if new_text:
            self._emitted_chars = safe_end
            self._pieces.append(new_text)
        if safe_end == len(text) and len(window) > SLIDE_AT_TOKENS:
            # Nothing is held back, so any suffix of the window is a valid anchor.
            del window[:-CONTEXT_TOKENS]
            self._emitted_chars = len(self._decode(window))
        return new_text

    def flush(self) -> str:
        """Release held-back text (an unfinished character, as U+FFFD) at request end."""
        text = self._decode(self._window)
        new_text = text[self._emitted_chars :]
        if new_text:
            self._emitted_chars = len(text)
            self._pieces.append(new_text)
        return new_text

    def _decode(self, token_ids: list[int]) -> str:
        # Clean-up rewrites spaces around punctuation depending on what follows,
        # which would change text we already emitted; streaming must not use it.
        return self._tokenizer.decode(
            token_ids,
            skip_special_tokens=self._skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
