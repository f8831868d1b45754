"""What agents and apps do, with the real `openai` SDK against the real SmolLM2:
`chat.completions.parse(Model)`, a forced tool call, `tool_choice: required`, a
streamed call, and a two-turn tool loop (call → tool result → final answer)."""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

from app.config import EngineConfig, ServerSettings
from tests.server_harness import ServerThread, assert_idle_and_clean

pytest.importorskip("xgrammar")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"]}}}


class Capital(BaseModel):
    country: str = Field(max_length=40)
    capital: str = Field(max_length=40)


@pytest.fixture(scope="module")
def client():
    config = EngineConfig.from_kwargs(dtype="float32", max_model_len=1024, max_num_seqs=8,
                                      served_model_name="smollm2")
    srv = ServerThread(config, ServerSettings(log_stats_interval=0)).start(timeout=300)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="unused"), srv
    srv.stop()


@pytest.mark.slow
def test_parse_returns_a_pydantic_object(client):
    c, srv = client
    done = c.chat.completions.parse(
        model="smollm2", messages=[{"role": "user", "content": "France's capital, as JSON."}],
        response_format=Capital, temperature=0, max_tokens=80)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, Capital) and parsed.country and parsed.capital
    assert_idle_and_clean(srv)


@pytest.mark.slow
def test_a_forced_call_has_arguments_that_fit_the_schema(client):
    c, _ = client
    out = c.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What's the weather in Paris?"}],
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {
            "name": "get_weather"}}, temperature=0, max_tokens=60)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)


@pytest.mark.slow
def test_required_calls_and_a_streamed_call(client):
    c, _ = client
    out = c.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Weather and time in Rome?"}],
        tools=[WEATHER, TIME], tool_choice="required", temperature=0, max_tokens=120)
    calls = out.choices[0].message.tool_calls
    assert calls and all(cl.function.name in ("get_weather", "get_time") for cl in calls)
    assert all("city" in json.loads(cl.function.arguments) for cl in calls)
    stream = c.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=60, stream=True)
    name, args, finish, pieces = None, "", None, 0
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                name = tc.function.name or name
                args += tc.function.arguments or ""
                pieces += 1
            finish = ch.finish_reason or finish
    # One entry for the call, its name and whole arguments together (`docs/api.md`).
    assert name == "get_weather" and finish == "tool_calls" and pieces == 1
    assert set(json.loads(args)) == {"city"}


@pytest.mark.slow
def test_a_two_turn_tool_loop_completes(client):
    c, srv = client
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = c.chat.completions.create(
        model="smollm2", messages=messages, tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        temperature=0, max_tokens=60).choices[0].message
    messages.append(first.model_dump(exclude_none=True))  # content None, tool_calls
    messages.append({"role": "tool", "tool_call_id": first.tool_calls[0].id,
                     "content": json.dumps({"temperature_c": 18, "sky": "sunny"})})
    final = c.chat.completions.create(model="smollm2", messages=messages, tools=[WEATHER],
                                      temperature=0, max_tokens=60).choices[0]
    assert final.finish_reason in ("stop", "length", "tool_calls")
    assert final.message.content or final.message.tool_calls
    assert_idle_and_clean(srv)
