"""The native (SGLang-style) request bodies: /generate, /tokenize, /detokenize,
/abort_request, typed as strictly as the OpenAI bodies of `protocol.py`."""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field, field_validator

from app.engine.sampling_params import SamplingParams
from app.server.protocol import Body, ChatMessage


class GenerateSamplingParams(Body):
    """SGLang's `sampling_params`, typed as strictly as the OpenAI bodies."""

    model_config = ConfigDict(extra="forbid", strict=True)
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    n: int = 1  # one sequence: several choices are /v1/completions' `n`
    no_stop_trim: bool = False  # keep the stop string in the text
    # Structured outputs, SGLang's names (at most one).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None

    @field_validator("n")
    @classmethod
    def _one_sequence(cls, n):
        if n != 1:
            raise ValueError("/generate runs one sequence per request: n must be 1 (for "
                             "several choices use /v1/completions with n)")
        return n

    def to_params(self, **extra: Any) -> SamplingParams:
        fields = self.model_dump(exclude={"max_new_tokens", "min_new_tokens", "stop",
                                          "stop_token_ids", "no_stop_trim", "json_schema",
                                          "regex", "ebnf"})
        return SamplingParams(max_tokens=self.max_new_tokens, min_tokens=self.min_new_tokens,
                              stop=[self.stop] if isinstance(self.stop, str) else self.stop or [],
                              stop_token_ids=self.stop_token_ids or [],
                              include_stop_str_in_output=self.no_stop_trim, **fields, **extra)


class GenerateRequest(Body):
    """SGLang's native /generate body."""

    ONLY_DEFAULT = {"return_hidden_states": (None, False)}  # vllm-router sends false

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    stream: bool = False
    rid: str | None = Field(None, max_length=256)
    # SGLang's logprobs: of the output tokens, and of the input from logprob_start_len
    # on (-1: none), with the top `top_logprobs_num` alternatives.
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    top_logprobs_num: int = Field(0, ge=0, le=20)


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = Field(None, max_length=1 << 16)  # as the chat body's


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


class AbortRequest(Body):
    """SGLang's body: a call's id, or every request (`abort_all`, admin only)."""

    rid: str | None = Field(None, max_length=256)
    abort_all: bool = False
