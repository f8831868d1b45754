"""The Responses API's request body (`POST /v1/responses`), typed as strictly as the
chat bodies of `protocol.py`.

Every field is honoured, on the `IGNORED` list (it cannot change what is generated),
accepted only at its "off" value, or a 400 naming it; `docs/api.md` lists them. Input
items and tools of kinds Ridgeline does not run (images, files, hosted tools) are
refused with a 400 that names the item and its kind, but for the tools Codex always
sends (`NOT_OFFERED`), which are accepted and not shown to the model.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from app.server.protocol import Body

ItemStatus = Literal["in_progress", "completed", "incomplete"]
# The kinds of input item and content part a text model can take.
INPUT_ITEMS = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PARTS = ("input_text", "output_text", "refusal")
# Tools Codex sends with every request that are not offered to the model: `web_search`
# is hosted (the server cannot search), and a `namespace` groups function tools whose
# calls would come back under the namespace's name, a form not produced here.
NOT_OFFERED = ("web_search", "namespace")


def _kind_check(value: Any, allowed: tuple[str, ...], what: str) -> Any:
    """A readable 400 for an item or part of a kind that is not run here (an image,
    a hosted tool's call), instead of pydantic's union error."""
    if isinstance(value, list):
        for i, entry in enumerate(value):
            kind = entry.get("type") if isinstance(entry, dict) else None
            if isinstance(kind, str) and kind not in allowed:
                raise ValueError(f"{what} {i} has type {kind!r}, which this server does not "
                                 f"take (supported: {', '.join(allowed)})")
    return value


class TextPart(Body):
    """A text content part: a user's `input_text`, an earlier answer's `output_text`
    (whose citations and scores are not the model's input: ignored), or a `refusal`."""

    IGNORED = frozenset({"annotations", "logprobs"})
    type: Literal["input_text", "output_text", "refusal"]
    text: str | None = None
    refusal: str | None = None

    @property
    def value(self) -> str:
        return (self.refusal if self.type == "refusal" else self.text) or ""


class MessageItem(Body):
    """A message of the conversation (`type` may be left out, as the SDK's easy form
    does). `id`, `status` and `phase` are an earlier output's bookkeeping: ignored."""

    IGNORED = frozenset({"id", "status", "phase"})
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[TextPart]

    @field_validator("content", mode="before")
    @classmethod
    def _text_only(cls, content):
        return _kind_check(content, TEXT_PARTS, "content part")


class FunctionCallItem(Body):
    """A call the model made in an earlier turn."""

    IGNORED = frozenset({"id", "status"})
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=128)
    arguments: str


class FunctionCallOutputItem(Body):
    """The result of a call, sent back by the client."""

    IGNORED = frozenset({"id", "status"})
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[TextPart]

    @field_validator("output", mode="before")
    @classmethod
    def _text_only(cls, output):
        return _kind_check(output, TEXT_PARTS, "output part")

    @property
    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "\n".join(p.value for p in self.output)


class ReasoningText(Body):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItem(Body):
    """An earlier turn's thinking. Its text goes to the template with the assistant turn
    that follows (`reasoning_content`, as vLLM passes it); templates that do not render
    it leave it out. Ridgeline encrypts nothing, so `encrypted_content` must be null."""

    IGNORED = frozenset({"id", "status"})
    ONLY_DEFAULT = {"encrypted_content": (None,)}
    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None

    @property
    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "\n".join(p.text for p in parts)


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem,
                      Field(discriminator="type")]


class FunctionTool(Body):
    """A function tool. `strict` is honoured as the chat route honours it: the arguments
    follow the schema whenever `tool_choice` forces a call (`required` or named)."""

    ONLY_DEFAULT = {"defer_loading": (None, False)}
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def chat_tool(self) -> dict[str, Any]:
        """The tool in the chat shape the template path and the tool parser take."""
        return {"type": "function", "function": self.model_dump(exclude={"type"},
                                                                exclude_none=True)}


class NamedFunctionChoice(Body):
    type: Literal["function"]
    name: str


class TextFormat(Body):
    """`text.format`: plain text, or a structured output."""

    type: Literal["text", "json_schema", "json_object"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(Body):
    format: TextFormat | None = None
    ONLY_DEFAULT = {"verbosity": (None, "medium")}


class ReasoningConfig(Body):
    """`effort` goes to the chat template as `reasoning_effort` (vLLM's way); no
    summaries are written, so `summary` and `generate_summary` change nothing."""

    IGNORED = frozenset({"summary", "generate_summary"})
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


# What `include` may ask for: the output's logprobs (with `top_logprobs`), and the
# encrypted reasoning Codex asks for when it does not store: there is none to add.
INCLUDABLE = ("message.output_text.logprobs", "reasoning.encrypted_content")


class ResponsesRequest(Body):
    IGNORED: ClassVar[frozenset[str]] = frozenset({
        "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier",
        "stream_options", "client_metadata"})
    ONLY_DEFAULT: ClassVar[dict[str, tuple]] = {
        "background": (None, False), "conversation": (None,), "prompt": (None,)}

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=256)
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(None,
                                                                            max_length=16)
    user: str | None = Field(None, max_length=256)
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Literal[INCLUDABLE]] | None = None  # type: ignore[valid-type]
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # vLLM's extensions, as on the chat route
    request_id: str | None = Field(None, max_length=256)
    priority: int = 0
    cache_salt: str | None = Field(None, max_length=256)

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, items):
        if not isinstance(items, list):
            return items
        items = [{"type": "message", **i} if isinstance(i, dict) and "type" not in i
                 and "role" in i else i for i in items]
        _kind_check(items, INPUT_ITEMS, "input item")
        for i, item in enumerate(items):  # here, for a message that names the part
            if isinstance(item, dict):
                parts = item.get("content" if item.get("type") == "message" else "output")
                _kind_check(parts, TEXT_PARTS, f"input item {i}: content part")
        return items

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, tools):
        if isinstance(tools, list):
            tools = [t for t in tools
                     if not (isinstance(t, dict) and t.get("type") in NOT_OFFERED)]
        return _kind_check(tools, ("function",), "tool")

    @field_validator("metadata")
    @classmethod
    def _short_keys(cls, metadata):
        if metadata and any(len(k) > 64 for k in metadata):
            raise ValueError("metadata keys are at most 64 characters")
        return metadata

    @property
    def wants_logprobs(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())
