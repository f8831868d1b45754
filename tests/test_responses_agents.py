"""`/v1/responses` with the real SmolLM2 and the clients that speak it: the `openai` SDK
(a plain answer equal to the chat completion of the same greedy request, a stream the SDK
reassembles, a forced call whose arguments fit the schema, a two-turn tool loop sent
whole and through `previous_response_id`) and the OpenAI Agents SDK's `Runner` with a
function tool."""

from __future__ import annotations

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest

from app.config import EngineConfig, ServerSettings
from tests.server_harness import ServerThread, assert_idle_and_clean

pytest.importorskip("xgrammar")

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
        "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "strict": True,
           "description": "Get the current weather in a city", "parameters": CITY}


@pytest.fixture(scope="module")
def server():
    config = EngineConfig.from_kwargs(dtype="float32", max_model_len=2048, max_num_seqs=8,
                                      served_model_name="smollm2")
    srv = ServerThread(config, ServerSettings(log_stats_interval=0)).start(timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_a_plain_answer_equals_the_chat_completion(server, client):
    out = client.responses.create(model="smollm2", instructions="Answer in one sentence.",
                                  input="What is the capital of France?", temperature=0,
                                  max_output_tokens=40)
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "temperature": 0, "max_tokens": 40, "messages": [
            {"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": "What is the capital of France?"}]}).json()
    assert out.output_text == chat["choices"][0]["message"]["content"]
    assert "Paris" in out.output_text
    assert out.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert out.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert out.status == ("completed" if chat["choices"][0]["finish_reason"] == "stop"
                          else "incomplete")
    with client.responses.stream(model="smollm2", instructions="Answer in one sentence.",
                                 input="What is the capital of France?", temperature=0,
                                 max_output_tokens=40) as stream:
        text = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert text == final.output_text == out.output_text
    assert_idle_and_clean(server)


@pytest.mark.slow
def test_a_forced_call_fits_the_schema_and_the_loop_closes(server, client):
    question = "What's the weather in Paris?"
    first = client.responses.create(model="smollm2", input=question, tools=[WEATHER],
                                    tool_choice={"type": "function", "name": "get_weather"},
                                    temperature=0, max_output_tokens=60)
    (call,) = [o for o in first.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), CITY)
    result = {"type": "function_call_output", "call_id": call.call_id,
              "output": json.dumps({"temperature_c": 21, "sky": "sunny"})}
    # The second turn sent whole, as a stateless client sends it ...
    whole = client.responses.create(model="smollm2", tools=[WEATHER], temperature=0,
                                    max_output_tokens=60, store=False, input=[
                                        {"role": "user", "content": question},
                                        call.model_dump(exclude_none=True), result])
    # ... and through the stored conversation: the same prompt, the same answer.
    chained = client.responses.create(model="smollm2", tools=[WEATHER], temperature=0,
                                      max_output_tokens=60, previous_response_id=first.id,
                                      input=[result])
    assert chained.usage.input_tokens == whole.usage.input_tokens
    assert chained.output_text == whole.output_text
    assert [o.type for o in chained.output] == [o.type for o in whole.output]
    assert "21" in whole.output_text or "sunny" in whole.output_text.lower() or any(
        o.type == "function_call" for o in whole.output)
    assert_idle_and_clean(server)


@pytest.mark.slow
def test_the_agents_sdk_runs_a_tool_loop(server):
    """`Runner.run` (unstreamed requests) and `Runner.run_streamed` (typed events): a
    forced call, the tool's result sent back, then an answer (the SDK sets tool_choice
    back to auto after a call)."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        calls.append(city)
        return f"It is 21 C and sunny in {city}."

    async def run(streamed: bool):
        model = agents.OpenAIResponsesModel(model="smollm2", openai_client=openai.AsyncOpenAI(
            base_url=server.url + "/v1", api_key="unused", max_retries=0))
        agent = agents.Agent(name="weather", instructions="Use the tools to answer.",
                             model=model, tools=[get_weather],
                             model_settings=agents.ModelSettings(
                                 tool_choice="get_weather", temperature=0, max_tokens=80))
        if not streamed:
            return await agents.Runner.run(agent, "What's the weather in Paris?", max_turns=4)
        result = agents.Runner.run_streamed(agent, "What's the weather in Rome?", max_turns=4)
        async for _ in result.stream_events():
            pass
        return result

    for streamed in (False, True):
        calls.clear()
        result = asyncio.run(run(streamed))
        assert calls and all(isinstance(c, str) and c for c in calls)
        assert isinstance(result.final_output, str) and result.final_output
        kinds = [item.type for item in result.new_items]
        assert kinds[:2] == ["tool_call_item", "tool_call_output_item"]
        assert kinds[-1] == "message_output_item"
    assert_idle_and_clean(server)
