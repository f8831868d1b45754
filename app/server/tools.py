"""Tool calls: tools rendered into the prompt, calls parsed out of the output.

Rendering. A chat template that knows `tools` gets them as they are (and assistant
`tool_calls` with their arguments as objects, as templates expect). A template that
does not (SmolLM2's) gets Ridgeline's default tool prompt — a system message in the
Hermes convention that most small open models were trained on — and the history in
the same convention: an assistant's calls as `<tool_call>` blocks, a tool's result as a
`<tool_response>` block in a user turn, `developer` as `system`, `content: null` as "".

Parsing (`--tool-call-parser hermes`, vLLM's name): `<tool_call>{"name": ...,
"arguments": {...}}</tool_call>` blocks become `message.tool_calls` with ids, the rest
stays `content`, and the finish reason becomes `tool_calls` (`length` stays `length`).
`ToolCallStream` does the same on a stream, as OpenAI streams a call (its id and name,
then its arguments), once the call's block has closed: a call cut off by the token
limit is neither a call nor content, streamed or not, and the arguments are the same
text both ways.

`tool_choice` "required" and a named function constrain the output with the tools'
JSON schemas (xgrammar structural tags), so the arguments are valid whatever the model.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from app.engine.grammar import StructuredOutput
from app.engine.grammar_bounds import check_depth, check_schema

START, END = "<tool_call>", "</tool_call>"
PARSERS = ("hermes",)
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_BLOCK = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)

DEFAULT_TOOL_PROMPT = """# Tools

You can call functions to help with the user's request. Their signatures, as JSON, are \
inside <tools></tools>:
<tools>
{tools}
</tools>

To call a function, answer with a JSON object holding its name and arguments inside \
<tool_call></tool_call>, one block per call:
<tool_call>
{{"name": <function name>, "arguments": <arguments as a JSON object>}}
</tool_call>"""


def template_supports_tools(tokenizer, template: str | None = None) -> bool:
    source = template or getattr(tokenizer, "chat_template", None) or ""
    return "tools" in source


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except ValueError:
            return raw
    return raw


def render(messages: list[dict], tools: list[dict] | None,
           native: bool) -> tuple[list[dict], dict[str, Any]]:
    """Messages (and template keyword arguments) ready for the chat template."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "developer":
            m["role"] = "system"
        calls = m.get("tool_calls") or []
        if native:
            if calls:
                m["tool_calls"] = [{**c, "function": {**c.get("function", {}), "arguments":
                                    _arguments(c.get("function", {}).get("arguments"))}}
                                   for c in calls]
            out.append(m)
            continue
        m.pop("tool_calls", None)
        content = m.get("content") or ""
        if calls:
            blocks = [f"{START}\n" + json.dumps({
                "name": c.get("function", {}).get("name"),
                "arguments": _arguments(c.get("function", {}).get("arguments"))}) + f"\n{END}"
                for c in calls]
            content = "\n".join([content, *blocks]) if content else "\n".join(blocks)
        if m.get("role") == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
        else:
            m["content"] = content
        out.append(m)
    if not tools:
        return out, {}
    if native:
        return out, {"tools": tools}
    prompt = DEFAULT_TOOL_PROMPT.format(tools="\n".join(json.dumps(t) for t in tools))
    if out and out[0].get("role") == "system":
        out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{prompt}".strip()}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _tag(function: dict) -> dict:
    params = function.get("parameters") or {"type": "object"}
    return {"type": "tag", "begin": f'{START}\n{{"name": {json.dumps(function["name"])}, '
                                    f'"arguments": ',
            "content": {"type": "json_schema", "json_schema": params}, "end": f"}}\n{END}"}


def check_enforced_schemas(tools: list[dict], choice: Any) -> None:
    """The parameter schemas a required or named `tool_choice` will enforce pass the same
    checks as `response_format`'s; a ValueError names the tool's field."""
    if choice != "required" and not isinstance(choice, dict):
        return  # "auto": the schemas are shown to the model, not enforced
    for i, tool in enumerate(tools):
        fn = tool.get("function") or {}
        if isinstance(choice, dict) and fn.get("name") != choice["function"]["name"]:
            continue
        try:
            check_depth(fn.get("parameters"), "the schema")
            check_schema(fn.get("parameters"))
        except ValueError as e:
            raise ToolSchemaError(f"tools[{i}].function.parameters", str(e)) from e


class ToolSchemaError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def grammar_for(tools: list[dict], choice: Any, parallel: bool) -> StructuredOutput | None:
    """The structural tag that forces calls: any of the tools ("required") or one named."""
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        fn = next((t["function"] for t in tools if t["function"]["name"] == name), None)
        if fn is None:
            raise ValueError(f"tool_choice names {name!r}, which is not among the tools")
        fmt: dict = _tag(fn)
    elif choice == "required":
        fmt = {"type": "tags_with_separator", "tags": [_tag(t["function"]) for t in tools],
               "separator": "\n", "at_least_one": True, "stop_after_first": not parallel}
    else:
        return None
    return StructuredOutput("structural_tag", json.dumps({"type": "structural_tag",
                                                          "format": fmt}))


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _block_call(inner: str) -> tuple[str, str] | None:
    """The name and arguments (JSON text) of a closed block, or None if it is no call."""
    try:
        obj = json.loads(inner)
        name, args = obj["name"], obj.get("arguments", {})
    except (ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(name, str):
        return None
    return name, args if isinstance(args, str) else json.dumps(args)


def _json_open(text: str) -> bool:
    """Whether `text` (a call's block so far) ends inside its JSON object: in a string,
    or with a brace or bracket not yet closed."""
    start = text.find("{")
    if start < 0:
        return False
    depth, in_string, escaped = 0, False, False
    for ch in text[start:]:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return False
    return True


def parse(text: str, parallel: bool = True,
          cut_off: bool = False) -> tuple[str | None, list[dict]]:
    """Content and tool calls of a whole output (`cut_off`: it ended at the token limit):
    the stream's parse of it in one piece, so that a streamed answer and a whole one
    agree to the character."""
    stream = ToolCallStream(parallel)
    content, _ = stream.feed(text)
    content += stream.finish(cut_off)
    if stream.calls:
        return content.strip() or None, stream.calls
    return content, []


class ToolCallStream:
    """Streamed text in, content and tool-call deltas out.

    A call is only a call once its block is closed (`</tool_call>`) and holds a JSON
    object with a string `name`: then it is sent whole, in one entry of its index (id,
    name and arguments; OpenAI and vLLM send the id and name first and the arguments in
    that entry or later ones, never two entries of one index in one chunk). A block cut
    off by the token limit or the end of the output is neither a call nor content: no
    client sees half a call (`{"city": "`) as a call or as text. A closed block that is not a call
    is text; with `parallel` false, calls after the first are dropped. Text after
    `<tool_call>` that does not start like a call (`{"name": ..., "arguments": ...`)
    within 512 characters is text too."""

    HEAD_LIMIT = 512  # characters after <tool_call> before a non-call is let out as text

    def __init__(self, parallel: bool = True):
        self.parallel = parallel
        self.calls: list[dict] = []
        self._buf = ""
        self._mode = "text"  # text → head → block → text
        self._searched = 0  # how much of a block's buffer holds no END
        self._after_call = False  # newlines right after a call are not content

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self._buf += text
        content, deltas = "", []
        while True:
            step = getattr(self, f"_{self._mode}")()
            if step is None:
                return content, deltas
            text_out, new = step
            content += text_out
            deltas += new

    def _text(self):
        if self._after_call:
            self._buf = self._buf.lstrip("\n")
            self._after_call = not self._buf
        i = self._buf.find(START)
        if i < 0:
            keep = next((k for k in range(min(len(START) - 1, len(self._buf)), 0, -1)
                         if START.startswith(self._buf[-k:])), 0)
            out, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
            return (out, []) if out else None
        out, self._buf, self._mode = self._buf[:i], self._buf[i + len(START):], "head"
        self._searched = 0
        return out, []

    def _head(self):
        """Right after <tool_call>: a call's start, or text after all."""
        if _HEAD.match(self._buf) or END in self._buf:
            self._mode = "block"
            return "", []
        stripped = self._buf.lstrip()
        if (stripped and not stripped.startswith("{")) or len(self._buf) > self.HEAD_LIMIT:
            out, self._buf, self._mode = START + self._buf, "", "text"
            return out, []
        return None

    def _block(self):
        """Held until the block closes; then a call, text, or (a call too many) nothing.
        A `</tool_call>` inside the call's JSON (in an argument's string: a forced call's
        grammar allows any text there) does not close it."""
        i = self._buf.find(END, self._searched)
        while i >= 0 and _json_open(self._buf[:i]):
            i = self._buf.find(END, i + len(END))
        if i < 0:
            self._searched = max(0, len(self._buf) - len(END) + 1)
            return None
        inner, self._buf, self._mode = self._buf[:i], self._buf[i + len(END):], "text"
        found = _block_call(inner.strip())
        if found is None:
            return START + inner + END, []
        self._after_call = True
        if self.calls and not self.parallel:
            return "", []
        call = _call(*found)
        self.calls.append(call)
        # One entry for the call, id, name and arguments together: a chunk never holds
        # two entries of one index, which clients that read `tool_calls[0]` would split.
        return "", [{"index": len(self.calls) - 1, **call}]

    def finish(self, cut_off: bool = False) -> str:
        """Text still held back: a possible `<tool_call>` prefix that never completed,
        unless the output was `cut_off` by the token limit (then it is the start of a
        call cut off: `3 <` at the end of an answer that stopped is text). An unclosed
        block is dropped; one whose JSON never closed though the output ended on its own
        was text after all, up to the `</tool_call>` it held and on."""
        out = self._buf if self._mode == "text" and not cut_off else ""
        if self._mode == "block" and not cut_off and END in self._buf:
            out = START + self._buf
        self._buf, self._mode = "", "text"
        return out
