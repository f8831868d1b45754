"""Reasoning output (`--reasoning-parser`, vLLM's names): `<think>…</think>` split
from the answer, for chat's `reasoning_content`, Responses' reasoning items and
Messages' thinking blocks.

The two parsers differ only in where thinking starts:

- `qwen3`: only text inside `<think>…</think>` is reasoning; an output that never opens
  `<think>` is all answer (Qwen3 with `enable_thinking: false`).
- `deepseek_r1`: the chat template opens `<think>` itself, so the model may not write it:
  everything before `</think>` is reasoning (a leading `<think>` is dropped).

Either way, an output that stops before `</think>` (at `max_tokens`) was still thinking:
what it wrote is reasoning, streamed or not. The tags are text, never a token id, so a
tag split across deltas is held back until it is known not to be one. Structured
outputs and tool calls apply to the answer alone: `structured_after_reasoning` wraps a
grammar so that it starts after `</think>`, and the tool parser reads the answer.
"""

from __future__ import annotations

import json

from starlette.requests import Request

from app.engine.grammar import StructuredOutput
from app.server.errors import APIError
from app.server.structured import compiled

START, END = "<think>", "</think>"
PARSERS = ("qwen3", "deepseek_r1")


class ReasoningStream:
    """Text deltas in, `(reasoning_delta, content_delta)` out; `finish()` flushes what
    was held back. `split()` does a whole text at once, the same way."""

    def __init__(self, parser: str):
        if parser not in PARSERS:
            raise ValueError(f"unknown reasoning parser {parser!r} (known: {PARSERS})")
        self.parser = parser
        # qwen3 starts in the answer and waits for <think>; deepseek_r1 starts thinking.
        self._mode = "content" if parser == "qwen3" else "reasoning"
        self._at_start = True  # deepseek_r1: a leading <think> is dropped
        self._buf = ""
        self.reasoning = ""  # everything reasoned so far (for a non-streamed answer)
        self.ended = False  # `</think>` seen: the answer has started
        self._after_end = False  # right after </think>: newlines still to drop

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        while self._buf:
            if self._at_start and self.parser == "deepseek_r1":
                stripped = self._buf.lstrip()
                if len(stripped) < len(START) and START.startswith(stripped):
                    break  # maybe a leading <think>: wait
                if stripped.startswith(START):
                    self._buf = stripped[len(START):]
                self._at_start = False
                continue
            if self.ended:  # the answer: the newlines right after </think> are dropped
                if self._after_end:
                    self._buf = self._buf.lstrip("\n")
                    self._after_end = not self._buf
                content, self._buf = content + self._buf, ""
                break
            tag = START if self._mode == "content" else END
            i = self._buf.find(tag)
            if i < 0:
                cut = len(self._buf) - _partial_suffix(self._buf, tag)
                out, self._buf = self._buf[:cut], self._buf[cut:]
                if self._mode == "content":
                    content += out
                else:
                    reasoning += out
                break
            before, self._buf = self._buf[:i], self._buf[i + len(tag):]
            if self._mode == "content":
                content += before
                self._mode = "reasoning"
            else:
                reasoning += before
                self._mode, self.ended, self._after_end = "content", True, True
        self.reasoning += reasoning
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held back: a partial tag that never completed is text."""
        held, self._buf, self._at_start = self._buf, "", False
        if self._mode == "reasoning":
            self.reasoning += held
            return held, ""
        return "", held

    def split(self, text: str) -> tuple[str | None, str | None]:
        """A whole output: (reasoning or None, answer or None), as vLLM returns them."""
        reasoning, content = self.feed(text)
        r2, c2 = self.finish()
        reasoning, content = reasoning + r2, content + c2
        return (reasoning if reasoning or self._mode == "reasoning" or self.ended else None,
                content or None)


class ChoiceReasoning:
    """One streamed choice's reasoning as the request asked for it: dropped
    (`include_reasoning: false`) or held until the thinking ends (`stream_reasoning:
    false`); `feed` returns (reasoning to send, answer text)."""

    def __init__(self, parser: str, include: bool = True, incremental: bool = True):
        self.stream = ReasoningStream(parser)
        self.include, self.incremental = include, incremental
        self._held = ""

    def feed(self, text: str, finished: bool) -> tuple[str, str]:
        reasoning, content = self.stream.feed(text)
        if finished:
            r, c = self.stream.finish()
            reasoning, content = reasoning + r, content + c
        if not self.include:
            return "", content
        if not self.incremental:
            self._held += reasoning
            if not (self.stream.ended or finished):
                return "", content
            reasoning, self._held = self._held, ""
        return reasoning, content


def _partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1)
                 if tag.startswith(text[-k:])), 0)


def _format(so: StructuredOutput) -> dict:
    """A structured output as a structural-tag format (xgrammar's), to put after thinking."""
    if so.kind == "json":
        return {"type": "json_schema", "json_schema": json.loads(so.spec)}
    if so.kind == "json_object":
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if so.kind == "regex":
        return {"type": "regex", "pattern": so.spec}
    if so.kind == "choice":
        return {"type": "grammar",
                "grammar": "root ::= " + " | ".join(map(json.dumps, json.loads(so.spec)))}
    if so.kind == "grammar":
        return {"type": "grammar", "grammar": so.spec}
    tag = json.loads(so.spec)
    if "format" not in tag:
        raise ValueError("with a reasoning parser a structural_tag must give its `format` "
                         "(xgrammar's newer form), so that it can follow the thinking")
    return tag["format"]


def structured_after_reasoning(so: StructuredOutput, parser: str) -> StructuredOutput:
    """The grammar of `so` moved after the thinking: free text up to `</think>` (opened
    by `<think>` for qwen3, which may also skip thinking), optional newlines, then `so`."""
    answer = {"type": "sequence", "elements": [
        {"type": "regex", "pattern": r"[ \n]*"}, _format(so)]}
    if parser == "qwen3":
        thinking = {"type": "tag", "begin": START, "content": {"type": "any_text"}, "end": END}
        fmt = {"type": "or", "elements": [
            {"type": "sequence", "elements": [thinking, answer]}, _format(so)]}
    else:
        thinking = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": END}
        fmt = {"type": "sequence", "elements": [thinking, answer]}
    return StructuredOutput("structural_tag", json.dumps({"type": "structural_tag",
                                                          "format": fmt}))


async def compiled_for_answer(request: Request, wanted: tuple[StructuredOutput, str] | None,
                              parser: str | None) -> StructuredOutput | None:
    """Compile a request's structured output (a 400 naming its field if it does not
    compile), then, with a reasoning parser, the same moved after the thinking."""
    so = await compiled(request, wanted)
    if so is None or parser is None:
        return so
    try:
        after = structured_after_reasoning(so, parser)
    except ValueError as e:
        raise APIError(400, str(e), wanted[1]) from e
    return await compiled(request, (after, wanted[1]))
