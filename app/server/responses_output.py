"""Generated text → Responses output items, and the typed stream events that build them.

One `OutputAssembler` serves both forms of an answer: a stream feeds it each step's
text and sends the events it returns; a whole answer feeds it the final text once and
keeps only the items. So a streamed response and an unstreamed one of the same
generation have the same items, and the items of `response.completed` are the ones
the events built. With tools in play the text goes through the tool-call parser
(`tools.ToolCallStream`): plain text becomes `message` items (`output_text`), each call
a `function_call` item whose arguments stream as `function_call_arguments.delta`.

Events follow OpenAI's order and shapes (`openai.types.responses`): for a message,
`output_item.added`, `content_part.added`, `output_text.delta`..., `output_text.done`,
`content_part.done`, `output_item.done`; for a call, `output_item.added`,
`function_call_arguments.delta`..., `function_call_arguments.done`, `output_item.done`.
Text that is only whitespace (between two calls, after the last) opens no message.

With `--reasoning-parser` the text first goes through `reasoning.ReasoningStream`: the
thinking becomes a `reasoning` item ahead of the answer's items (`reasoning_text`
content), streamed as `output_item.added`, `content_part.added`,
`reasoning_text.delta`..., `reasoning_text.done`, `content_part.done`,
`output_item.done`; the tool parser reads the answer only.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from app.server.reasoning import ReasoningStream
from app.server.tools import END, START, ToolCallStream

_CALL_EDGES = re.compile(f"(?={re.escape(START)})|(?<={re.escape(END)})")


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def text_part(text: str, logprobs: list | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


class OutputAssembler:
    def __init__(self, tool_parser: ToolCallStream | None,
                 reasoner: ReasoningStream | None = None):
        self.parser, self.reasoner = tool_parser, reasoner
        self.output: list[dict[str, Any]] = []  # the items, in order; final once closed
        self._reasoning: dict[str, Any] | None = None  # the reasoning item open now
        self._message: dict[str, Any] | None = None  # the message item open now
        self._call: dict[str, Any] | None = None  # the function_call item open now
        self._blank = ""  # whitespace held back until text follows it

    def feed(self, text: str, logprobs: list | None = None) -> list[dict[str, Any]]:
        """A step's text (and its tokens' logprobs, when asked for and neither tools
        nor a reasoning parser are in play) → the events it makes."""
        if self.reasoner is None:
            return self._answer(text, logprobs)
        thought, answer = self.reasoner.feed(text)
        return self._thought(thought) + self._answer(answer, None)

    def close(self, cut_short: bool) -> list[dict[str, Any]]:
        """The end of the generation: held-back text out, every open item closed;
        `cut_short` (the token limit) marks the last item `incomplete`."""
        events = []
        if self.reasoner is not None:
            thought, answer = self.reasoner.finish()
            events += self._thought(thought) + self._answer(answer, None)
        if self.parser is not None:
            events += self._parsed(self.parser.finish(), [])
        status = "incomplete" if cut_short else "completed"
        if not self.output:  # an empty answer is still a message, as OpenAI's is
            blank, self._blank = self._blank, ""
            events += self._open_message() + (self._text(blank, None) if blank else [])
        events += self._close_reasoning(status)
        events += self._close_message(status) + self._close_call(status)
        return events

    def feed_whole(self, text: str) -> None:
        """A whole output, fed as a stream would feed it: the thinking, then the answer in
        pieces that each hold text or one call, so that the items keep the text's order."""
        if self.reasoner is not None:
            thought, text = self.reasoner.feed(text)
            self._thought(thought)
        for piece in _CALL_EDGES.split(text) if self.parser is not None else [text]:
            if piece:
                self._answer(piece, None)

    def _answer(self, text: str, logprobs: list | None) -> list[dict[str, Any]]:
        if not text and not logprobs:
            return []
        events = self._close_reasoning("completed")  # the answer has begun
        if self.parser is None:
            return events + self._text(text, logprobs)
        return events + self._parsed(*self.parser.feed(text))

    # -- reasoning -----------------------------------------------------------------------

    def _thought(self, text: str) -> list[dict[str, Any]]:
        if not text:
            return []
        events = []
        if self._reasoning is None:
            self._reasoning = {"id": item_id("rs"), "type": "reasoning", "summary": [],
                               "content": [], "status": "in_progress"}
            self.output.append(self._reasoning)
            events.append(self._added(self._reasoning))
            part = {"type": "reasoning_text", "text": ""}
            self._reasoning["content"].append(part)
            events.append(self._event("response.content_part.added", self._reasoning,
                                      content_index=0, part=dict(part)))
        self._reasoning["content"][0]["text"] += text
        events.append(self._event("response.reasoning_text.delta", self._reasoning,
                                  content_index=0, delta=text))
        return events

    def _close_reasoning(self, status: str) -> list[dict[str, Any]]:
        item, self._reasoning = self._reasoning, None
        if item is None:
            return []
        item["status"] = status
        part = item["content"][0]
        return [self._event("response.reasoning_text.done", item, content_index=0,
                            text=part["text"]),
                self._event("response.content_part.done", item, content_index=0,
                            part=dict(part)),
                self._done(item)]

    def _parsed(self, content: str, deltas: list[dict]) -> list[dict[str, Any]]:
        """One step's parse: what continues the open call, then the step's text, then
        the calls it starts (a step spans at most one text segment: a token is short)."""
        first_new = next((i for i, d in enumerate(deltas) if "id" in d), len(deltas))
        events = self._deltas(deltas[:first_new])
        events += self._text(content, None)
        return events + self._deltas(deltas[first_new:])

    def _deltas(self, deltas: list[dict]) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for delta in deltas:
            if "id" in delta:  # a new call: its name and id, then its arguments
                events += self._close_message("completed") + self._close_call("completed")
                events += self._open_call(delta["id"], delta["function"]["name"])
            piece = delta["function"].get("arguments", "")
            if self._call is not None and not self._call["arguments"]:
                piece = piece.lstrip()  # where the head ends depends on the chunking
            if piece and self._call is not None:
                self._call["arguments"] += piece
                events.append(self._event("response.function_call_arguments.delta",
                                          self._call, delta=piece))
        return events

    # -- messages ------------------------------------------------------------------------

    def _text(self, text: str, logprobs: list | None) -> list[dict[str, Any]]:
        if not text and not logprobs:
            return []
        if self._message is None and not (self._blank + text).strip():
            self._blank += text
            return []
        events = self._close_call("completed")
        if self._message is None:
            events += self._open_message()
        text, self._blank = self._blank + text, ""
        part = self._message["content"][0]
        part["text"] += text
        part["logprobs"].extend(logprobs or [])
        events.append(self._event("response.output_text.delta", self._message, content_index=0,
                                  delta=text, logprobs=logprobs or []))
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        self._message = {"id": item_id("msg"), "type": "message", "role": "assistant",
                         "status": "in_progress", "content": []}
        self.output.append(self._message)
        added = self._added(self._message)
        self._message["content"].append(text_part(""))
        return [added, self._event("response.content_part.added", self._message,
                                   content_index=0, part=text_part(""))]

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message, self._message = self._message, None
        if message is None:
            return []
        self._blank = ""
        part = message["content"][0]
        message["status"] = status
        return [self._event("response.output_text.done", message, content_index=0,
                            text=part["text"], logprobs=part["logprobs"]),
                self._event("response.content_part.done", message, content_index=0,
                            part=dict(part)),
                self._done(message)]

    # -- function calls ------------------------------------------------------------------

    def _open_call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        self._call = {"id": item_id("fc"), "type": "function_call", "call_id": call_id,
                      "name": name, "arguments": "", "status": "in_progress"}
        self.output.append(self._call)
        return [self._added(self._call)]

    def _close_call(self, status: str) -> list[dict[str, Any]]:
        call, self._call = self._call, None
        if call is None:
            return []
        # A call whose arguments never closed (the token limit) is not a call to run.
        call["status"] = status if _is_json(call["arguments"]) else "incomplete"
        return [self._event("response.function_call_arguments.done", call,
                            name=call["name"], arguments=call["arguments"]),
                self._done(call)]

    # -- event shapes ----------------------------------------------------------------------

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i in range(len(self.output) - 1, -1, -1) if self.output[i] is item)

    def _event(self, kind: str, item: dict[str, Any], **fields: Any) -> dict[str, Any]:
        return {"type": kind, "item_id": item["id"], "output_index": self._index(item),
                **fields}

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"type": "response.output_item.added", "output_index": self._index(item),
                "item": _snapshot(item)}

    def _done(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"type": "response.output_item.done", "output_index": self._index(item),
                "item": _snapshot(item)}


def _snapshot(item: dict[str, Any]) -> dict[str, Any]:
    """The item as it is now: later deltas must not change an event already made."""
    out = dict(item)
    if "content" in out:
        out["content"] = [dict(p, logprobs=list(p["logprobs"])) if "logprobs" in p
                          else dict(p) for p in out["content"]]
    return out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
