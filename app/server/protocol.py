"""OpenAI-compatible request bodies (pydantic), strictly typed.

Which fields each endpoint honours, ignores on purpose, or refuses is listed in
`docs/api.md`; a test walks that table.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from app.engine.grammar import StructuredOutput
from app.engine.sampling_params import INT64_MAX, INT64_MIN, SamplingParams
from app.server.errors import APIError
from models.generation_config import GenerationDefaults

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
MAX_PROMPTS = 256  # prompts in one /v1/completions body (each is a request)


class Body(BaseModel):
    """Every request body: strict types (`"no"` is not a boolean, 2.5 is not an integer),
    as the OpenAI API itself checks them, and nothing silently ignored: a field is a
    declared one (honoured), one of `IGNORED` (accepted on purpose: it cannot change the
    output), one of `ONLY_DEFAULT` (accepted at the value that means "off", refused
    otherwise), or a 400 naming it."""

    model_config = ConfigDict(extra="forbid", strict=True)
    IGNORED: ClassVar[frozenset[str]] = frozenset()
    ONLY_DEFAULT: ClassVar[dict[str, tuple]] = {}

    @model_validator(mode="before")
    @classmethod
    def _field_policy(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, allowed in cls.ONLY_DEFAULT.items():
            if name in data and data[name] not in allowed:
                raise PydanticCustomError(
                    "not_supported", "{field}={value} is not supported (accepted: {allowed})",
                    {"field": name, "value": repr(data[name])[:40],
                     "allowed": ", ".join(map(repr, allowed))})
        return {k: v for k, v in data.items()
                if k not in cls.IGNORED and k not in cls.ONLY_DEFAULT}


# OpenAI fields that cannot change what is generated, and fields vllm-router adds to
# every body it forwards (reasoning switches for reasoning models; Ridgeline has none).
IGNORED_OPENAI = frozenset({"user", "store", "metadata", "service_tier", "prediction"})
IGNORED_ROUTER = frozenset({"include_reasoning", "separate_reasoning", "stream_reasoning"})
# Accepted only at the value that means "off" (the router sends some of them).
ONLY_DEFAULT_COMMON = {"best_of": (None, 1), "return_hidden_states": (None, False),
                       "guided_decoding_backend": (None, "auto", "xgrammar"),
                       "spaces_between_special_tokens": (None, True),
                       "use_beam_search": (None, False), "length_penalty": (None, 1.0),
                       "truncate_prompt_tokens": (None,)}
# OpenAI's reasoning efforts and vLLM's additions ("none", "xhigh", "max"): chat passes
# them to the template (`ChatCompletionRequest.template_kwargs`).
REASONING_EFFORTS = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]


class StreamOptions(Body):
    """`include_usage`: a last chunk with the request's usage (OpenAI). With it,
    `continuous_usage_stats` (vLLM's) also puts the usage so far, of that chunk's
    choice, in every chunk; without `include_usage` it adds nothing, as in vLLM."""

    include_usage: bool = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(Body):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(True, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's `response_format`, and vLLM's `structural_tag` type in both its forms:
    xgrammar's `format`, or the older `structures` with `triggers`."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = None
    triggers: list[str] | None = None

    @model_validator(mode="after")
    def _fields_of_its_type(self) -> ResponseFormat:
        own = {"json_schema": ("json_schema",),
               "structural_tag": ("format", "structures", "triggers")}.get(self.type, ())
        for name in ("json_schema", "format", "structures", "triggers"):
            if getattr(self, name) is not None and name not in own:
                raise ValueError(f"{name} is not a field of a {self.type!r} response_format")
        return self


class StructuredOutputsField(Body):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    ONLY_DEFAULT = {"disable_any_whitespace": (None, False, True),
                    "disable_additional_properties": (None, False),
                    "whitespace_pattern": (None,), "backend": (None, "auto", "xgrammar")}


class _SamplingFields(Body):
    """Sampling fields shared by both OpenAI endpoints, plus vLLM's extensions."""

    IGNORED = IGNORED_OPENAI | IGNORED_ROUTER
    ONLY_DEFAULT = ONLY_DEFAULT_COMMON

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM / SGLang extensions
    top_k: int = 0
    min_p: float = 0.0
    min_tokens: int = 0
    repetition_penalty: float = 1.0
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    request_id: str | None = Field(None, max_length=256)
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None  # vLLM's: logprobs of every prompt token
    no_stop_trim: bool | None = None  # SGLang's include_stop_str_in_output (the router sends it)
    cache_salt: str | None = Field(None, max_length=256)  # vLLM's: a private prefix cache
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and the
    # older guided_* fields (at most one of them).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_params(self, max_tokens: int, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        structured: StructuredOutput | None = None,
                        defaults: GenerationDefaults | None = None) -> SamplingParams:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true",
                           "stream_options")
        if self.prompt_logprobs is not None and self.stream:
            raise APIError(400, "prompt_logprobs are not available when stream is true",
                           "prompt_logprobs")
        # The checkpoint's generation_config.json fills what the request left unset.
        knobs = {k: getattr(self, k) for k in ("temperature", "top_p", "top_k", "min_p",
                                               "repetition_penalty")
                 if k in self.model_fields_set}
        if defaults is not None:
            knobs = {k: v for k, v in defaults.apply(knobs).items() if k != "max_tokens"}
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if knobs.get("temperature") is None else knobs["temperature"],
            top_p=1.0 if knobs.get("top_p") is None else knobs["top_p"],
            top_k=knobs.get("top_k", self.top_k),
            min_p=knobs.get("min_p", self.min_p),
            seed=self.seed,
            stop=[self.stop] if isinstance(self.stop, str) else (self.stop or []),
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output or bool(self.no_stop_trim),
            skip_special_tokens=self.skip_special_tokens,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=knobs.get("repetition_penalty", self.repetition_penalty),
            logprobs=logprobs,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            logit_bias=self.logit_bias,
            structured=structured,
            cache_salt=self.cache_salt,
            n=self.n,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's `continuous_usage_stats`: usage so far in every chunk (guidellm asks)."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    # No chat template to take a reasoning effort: only "unset".
    ONLY_DEFAULT = {**ONLY_DEFAULT_COMMON, "suffix": (None,), "reasoning_effort": (None,)}

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # 0 only with echo: score the prompt alone
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True  # vLLM's: when tokenizing a text prompt

    @field_validator("prompt")
    @classmethod
    def _bounded(cls, prompt):
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts in one request")
        return prompt


class ContentPart(Body):
    """A text part (`cache_control`, which LiteLLM passes on, changes nothing here: the
    prefix cache is automatic). A part of another type keeps only its `type`, for
    `ChatMessage` to refuse it by name."""

    IGNORED = frozenset({"cache_control"})
    type: str
    text: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _other_types_refused_by_type(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") != "text" and "type" in data:
            return {"type": data["type"]}
        return data


class FunctionCall(Body):
    """An assistant's call as OpenAI writes it; `arguments` is a JSON string (an object is
    accepted too, as templates take it)."""

    name: str
    arguments: str | dict[str, Any]


class ToolCall(Body):
    IGNORED = frozenset({"index"})  # a streamed call's position, echoed back by clients
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    """A message: every key is typed, so a malformed or unknown one is a 400 naming its
    path (`messages.1.tool_calls.0.function`, `messages.0.foo`). Beside OpenAI's keys,
    the earlier turns' reasoning under the names chat templates read it
    (`reasoning_content`: Qwen3, GLM, DeepSeek; `reasoning`: vLLM's; `thinking`: gpt-oss)
    goes to the template. OpenAI's response-only keys, which SDKs echo back at null,
    are accepted there (`docs/api.md`)."""

    ONLY_DEFAULT = {"refusal": (None,), "annotations": (None, []), "audio": (None,),
                    "function_call": (None,)}
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    thinking: str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts_only(cls, content):
        if isinstance(content, list):
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise ValueError(f"content part {j} has type {part.type!r}: only text "
                                     f"parts ({{'type': 'text', 'text': ...}}) are supported")
        return content

    def template_dict(self) -> dict[str, Any]:
        """The message as the chat template takes it: text parts joined by newlines,
        as vLLM joins them for text-only models."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            out["content"] = "\n".join(part.text for part in self.content)
        return out


class FunctionDef(Body):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    IGNORED = IGNORED_OPENAI  # the reasoning switches are honoured here (`reasoning.py`)
    ONLY_DEFAULT = {**ONLY_DEFAULT_COMMON, "echo": (None, False)}

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None  # how many: app/server/body_checks.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # vLLM's: per request, with --trust-request-chat-template (app/server/body_checks.py)
    chat_template: str | None = Field(None, max_length=1 << 16)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: REASONING_EFFORTS | None = None  # to the template, as vLLM passes it
    documents: list[dict[str, Any]] | None = None  # for templates that render them
    # With --reasoning-parser (`reasoning.py`): vLLM's include_reasoning, SGLang's
    # separate_reasoning and stream_reasoning.
    include_reasoning: bool = True
    separate_reasoning: bool = True
    stream_reasoning: bool = True

    # What the render itself takes: set through the request's own (typed) fields, or not
    # at all (a second value for one argument of the render is a TypeError).
    RESERVED_TEMPLATE_KWARGS: ClassVar[frozenset[str]] = frozenset({
        "messages", "conversation", "add_generation_prompt", "continue_final_message",
        "tools", "documents", "tokenizer", "tokenize", "param"})

    @field_validator("chat_template_kwargs")
    @classmethod
    def _not_reserved(cls, kwargs):
        taken = sorted(cls.RESERVED_TEMPLATE_KWARGS & set(kwargs or ()))
        if taken:
            raise ValueError(f"{taken[0]!r} cannot be set in chat_template_kwargs (it is a "
                             "request field or the server's own)")
        return kwargs

    def template_kwargs(self) -> dict[str, Any]:
        """The chat template's extra variables, as vLLM sets them: `chat_template_kwargs`,
        then `reasoning_effort` (the field wins over a key of the same name) and, unless
        the client set it, `enable_thinking` (false only for effort "none") for templates
        that switch thinking on and off with it (Qwen3's)."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", self.reasoning_effort != "none")
            kwargs["reasoning_effort"] = self.reasoning_effort
        return kwargs


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}

