"""Responses input items → the chat messages the chat template path takes.

The conversation becomes what `/v1/chat/completions` would be sent for it: a message
item is a message (text parts joined by newlines, as for chat content parts); the
`function_call` items of one turn become the `tool_calls` of one assistant message
(joined to the assistant's text of that turn when it comes right before); a
`function_call_output` is a `tool` message with its `tool_call_id` (and the function's
`name`, which some templates print); a `reasoning` item's text is the
`reasoning_content` of the assistant turn that follows it, as vLLM passes it.
"""

from __future__ import annotations

from typing import Any

from app.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
)


def to_messages(items: str | list, earlier: list[dict[str, Any]] | None = None
                ) -> list[dict[str, Any]]:
    """The chat messages for `items`, following the `earlier` ones (which are not
    changed): a string is one user message."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict[str, Any]] = []
    names = {c["id"]: c["function"]["name"] for m in (earlier or [])
             for c in m.get("tool_calls", ())}
    thinking: list[str] = []

    def assistant(message: dict[str, Any]) -> dict[str, Any]:
        if thinking:
            message["reasoning_content"] = "\n".join(thinking)
            thinking.clear()
        out.append(message)
        return message

    for item in items:
        if isinstance(item, MessageItem):
            content = item.content if isinstance(item.content, str) else "\n".join(
                part.value for part in item.content)
            message = {"role": item.role, "content": content}
            if item.role == "assistant":
                assistant(message)
            else:
                out.append(message)
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            names[item.call_id] = item.name
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and not thinking:
                last.setdefault("tool_calls", []).append(call)
            else:
                assistant({"role": "assistant", "content": "", "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            message = {"role": "tool", "tool_call_id": item.call_id, "content": item.text}
            if item.call_id in names:
                message["name"] = names[item.call_id]
            out.append(message)
        elif isinstance(item, ReasoningItem):
            thinking.append(item.text)
    return out
