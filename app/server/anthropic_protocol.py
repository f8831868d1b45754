"""Anthropic's Messages API bodies (pydantic), and their conversion to the chat shape.

The same rule as every body (`protocol.Body`): a field is honoured, ignored on purpose
(`IGNORED`: it cannot change the output), or a 400 naming it; `docs/api.md` lists them.
Messages become OpenAI chat messages, which the one chat-template path renders:
`system` → a system message, `tool_use` blocks → the assistant's `tool_calls`,
`tool_result` blocks → `tool` messages (before the user's text, as Anthropic orders
them), a mid-conversation `system` message → a system message where it stands, earlier
turns' `thinking` blocks dropped (Anthropic drops them from the prompt too) unless
`context_management`'s `clear_thinking` edit keeps them (then they are the assistant
turns' `reasoning_content`, as vLLM passes it to the template). Images and documents
are refused: the models served read text.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from app.server.errors import APIError
from app.server.protocol import Body

# Prompt caching is automatic here (the prefix cache): `cache_control` marks change nothing.
IGNORED_BLOCK = frozenset({"cache_control", "citations"})


class TextBlock(Body):
    IGNORED = IGNORED_BLOCK
    type: Literal["text"]
    text: str


class ToolUseBlock(Body):
    IGNORED = IGNORED_BLOCK
    type: Literal["tool_use"]
    id: str = Field(max_length=256)
    name: str
    input: dict[str, Any]


class ToolResultBlock(Body):
    IGNORED = IGNORED_BLOCK
    type: Literal["tool_result"]
    tool_use_id: str = Field(max_length=256)
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ThinkingBlock(Body):
    """An earlier turn's thinking, sent back by clients: not part of the prompt."""

    IGNORED = IGNORED_BLOCK | {"signature", "data"}
    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None


class MediaBlock(Body):
    """An image or a document: refused by name (the models served read text only)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["image", "document", "search_result"]


def _block_kind(block: Any) -> str | None:
    """The block's model, by its `type`. Tagged by class name, which an error's path
    leaves out (`messages.0.content.0.foo`, not `...0.text.foo`: `text` is a key)."""
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return {"text": "TextBlock", "tool_use": "ToolUseBlock", "tool_result": "ToolResultBlock",
            "thinking": "ThinkingBlock", "redacted_thinking": "ThinkingBlock", "image":
            "MediaBlock", "document": "MediaBlock", "search_result": "MediaBlock"}.get(kind)


Block = Annotated[Annotated[TextBlock, Tag("TextBlock")]
                  | Annotated[ToolUseBlock, Tag("ToolUseBlock")]
                  | Annotated[ToolResultBlock, Tag("ToolResultBlock")]
                  | Annotated[ThinkingBlock, Tag("ThinkingBlock")]
                  | Annotated[MediaBlock, Tag("MediaBlock")], Discriminator(_block_kind)]


class Message(Body):
    """A turn; `system` is Anthropic's mid-conversation system message (Claude Code sends
    one after the first user turn)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[Block]


class Tool(Body):
    """A client tool (`input_schema`); Anthropic's server tools (`web_search_…`) are not
    served, and a `type` other than `custom` is a 400."""

    IGNORED = frozenset({"cache_control"})
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1024)
    IGNORED = frozenset({"display"})


class OutputFormat(Body):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(Body):
    """`effort` goes to the chat template as `reasoning_effort`, as the chat route's does
    (a template that reads it sizes its thinking by it; one that does not is unchanged)."""

    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "max"] | None = None


class ThinkingTurns(Body):
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class ClearThinking(Body):
    """Which earlier assistant turns keep their thinking in the prompt: the last `keep`
    (`thinking_turns`), or all. Other edits (`clear_tool_uses_…`) would cut tool results
    from the prompt, which is not done here: a 400 names them."""

    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | ThinkingTurns = Field(
        default_factory=lambda: ThinkingTurns(type="thinking_turns", value=1))


class ContextManagement(Body):
    edits: list[ClearThinking] = Field(default_factory=list, max_length=8)

    def thinking_kept(self, assistant_turns: int) -> int:
        """How many of the last assistant turns keep their thinking."""
        kept = 0
        for edit in self.edits:
            kept = assistant_turns if edit.keep == "all" else edit.keep.value
        return kept


class CountTokensRequest(Body):
    """`/v1/messages/count_tokens`: what renders the prompt."""

    IGNORED: ClassVar[frozenset[str]] = frozenset({"cache_control"})
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    context_management: ContextManagement | None = None


class MessagesRequest(CountTokensRequest):
    IGNORED: ClassVar[frozenset[str]] = frozenset({"metadata", "service_tier", "cache_control"})
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False


def chat_body(req: CountTokensRequest) -> dict[str, Any]:
    """The request as a `/v1/chat/completions` body (validated again as one)."""
    messages: list[dict[str, Any]] = []
    if req.system:
        system = req.system if isinstance(req.system, str) else "\n".join(
            b.text for b in req.system)
        messages.append({"role": "system", "content": system})
    assistant_turns = sum(m.role == "assistant" for m in req.messages)
    keep = (0 if req.context_management is None
            else req.context_management.thinking_kept(assistant_turns))
    seen = 0
    for i, m in enumerate(req.messages):
        seen += m.role == "assistant"
        messages.extend(_chat_messages(m, f"messages.{i}.content",
                                       keep_thinking=seen > assistant_turns - keep))
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({"description": t.description} if t.description is not None else {})}}
            for t in req.tools]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise APIError(400, "tool_choice of type tool needs a name", "tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                choice.type]
        if req.tools:
            body["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if req.thinking is not None:  # Qwen3's templates switch thinking with this
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_config.format.schema_}}
    if req.output_config is not None and req.output_config.effort is not None:
        body["reasoning_effort"] = req.output_config.effort
    return body


def _chat_messages(m: Message, path: str, keep_thinking: bool = False) -> list[dict[str, Any]]:
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results, thoughts = [], [], [], []
    for j, block in enumerate(m.content):
        if isinstance(block, MediaBlock):
            raise APIError(400, f"{block.type} content is not supported: the model reads "
                           "text only", f"{path}.{j}")
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ThinkingBlock):
            if keep_thinking and m.role == "assistant" and block.thinking:
                thoughts.append(block.thinking)
        elif isinstance(block, ToolUseBlock):
            if m.role != "assistant":
                raise APIError(400, "tool_use blocks belong to assistant messages",
                               f"{path}.{j}")
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input)}})
        elif isinstance(block, ToolResultBlock):
            if m.role != "user":
                raise APIError(400, "tool_result blocks belong to user messages", f"{path}.{j}")
            text = block.content if isinstance(block.content, str) else "\n".join(
                b.text for b in block.content)
            results.append({"role": "tool", "tool_call_id": block.tool_use_id,
                            "content": f"Error: {text}" if block.is_error else text})
    out = list(results)
    if texts or calls or not results:
        message: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
        if calls:
            message["tool_calls"] = calls
        if thoughts:
            message["reasoning_content"] = "\n".join(thoughts)
        out.append(message)
    return out
