"""`/v1/responses` on the tiny random model, with the real `openai` SDK: the Response
object, the typed stream the SDK reassembles, errors in OpenAI's shape, the bounded
store behind `previous_response_id` and GET/DELETE, abort when the stream is closed,
and the field table of docs/api.md."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import httpx
import openai
import pytest

from app.config import ServerSettings
from app.server.response_store import ResponseStore
from app.server.responses_protocol import (
    FunctionTool,
    ReasoningConfig,
    ResponsesRequest,
    TextConfig,
    TextFormat,
)
from tests.server_harness import ServerThread, assert_idle_and_clean, metric, tiny_config

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"


@pytest.fixture(scope="module")
def server(tiny_dir):
    settings = ServerSettings(log_stats_interval=0.05, responses_store_max_entries=3,
                              max_chat_messages=16, max_content_parts=4)
    srv = ServerThread(tiny_config(tiny_dir, max_model_len=512), settings).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


OWNER = {"Authorization": "Bearer unused"}  # the SDK client's key: the tenant it stores as


def post(srv, body: dict) -> httpx.Response:
    return httpx.post(srv.url + "/v1/responses", json=body, timeout=60)


def test_a_response_and_its_stream_have_the_same_items(server, client):
    body = dict(model="tiny", input="Hello there", max_output_tokens=12, temperature=0)
    whole = client.responses.create(**body)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + 12
    (message,) = whole.output
    assert message.type == "message" and message.status == "incomplete"
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 12,
        "temperature": 0}).json()
    assert whole.output_text == chat["choices"][0]["message"]["content"]

    with client.responses.stream(**body) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == "incomplete"
    assert kinds[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert_idle_and_clean(server)


def test_the_stream_is_framed_as_openai_frames_it(server):
    with httpx.stream("POST", server.url + "/v1/responses", json={
            "input": "Hi", "max_output_tokens": 4, "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    frames = [f for f in text.split("\n\n") if f.strip()]
    numbers = []
    for frame in frames:
        event, data = frame.split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert event == f"event: {payload['type']}"
        numbers.append(payload["sequence_number"])
    assert numbers == list(range(len(frames)))
    assert "[DONE]" not in text


def test_a_forced_call_is_a_function_call_item(server, client):
    tool = {"type": "function", "name": "get_weather", "description": "the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                     "maxLength": 8}},
                           "required": ["city"], "additionalProperties": False},
            "strict": True}
    body = dict(model="tiny", input="Weather in Paris?", tools=[tool], temperature=0,
                tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=120)
    out = client.responses.create(**body)
    calls = [o for o in out.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    if calls[0].status == "completed":  # a random model may spend its tokens on spaces
        assert set(json.loads(calls[0].arguments)) == {"city"}
    with client.responses.stream(**body) as stream:
        deltas = [e for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    streamed = [o for o in final.output if o.type == "function_call"]
    assert [c.arguments for c in streamed] == [c.arguments for c in calls]
    assert "".join(d.delta for d in deltas) == streamed[0].arguments


def test_bad_requests_are_400s_naming_the_field(server, client):
    cases = [
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input_image"),
        ({"input": "x", "tools": [{"type": "file_search"}]}, "file_search"),
        ({"input": "x", "max_tool_calls": 3}, "max_tool_calls"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "text": {"verbosity": "high"}}, "verbosity"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "item_reference"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": "x", "temperature": 5.0}, "temperature"),
        ({"input": "x", "include": ["file_search_call.results"]}, "include"),
    ]
    for body, named in cases:
        r = post(server, body)
        assert r.status_code == 400, (body, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert named in error["message"] + str(error["param"]), (body, error)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="tiny", input="x", tools=[{"type": "file_search"}])
    # What Codex sends with every request: accepted, and the hosted or grouped tools not
    # offered to the model (the prompt is the one without them).
    plain = post(server, {"input": "x", "max_output_tokens": 4, "temperature": 0}).json()
    codex = post(server, {"input": "x", "max_output_tokens": 4, "temperature": 0,
                          "client_metadata": {"session_id": "s"},
                          "tools": [{"type": "web_search", "external_web_access": False},
                                    {"type": "namespace", "name": "agents", "tools": []}]})
    assert codex.status_code == 200, codex.text
    assert codex.json()["usage"]["input_tokens"] == plain["usage"]["input_tokens"]
    assert codex.json()["output"][0]["content"][0]["text"] == \
        plain["output"][0]["content"][0]["text"]
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="tiny", input="x", previous_response_id="resp_nope")


def test_previous_response_id_carries_the_conversation(server, client):
    first = client.responses.create(model="tiny", input="My name is Ada.",
                                    max_output_tokens=5, temperature=0)
    second = client.responses.create(model="tiny", input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=5,
                                     temperature=0)
    # The same conversation sent whole gives the same prompt, hence the same tokens.
    whole = client.responses.create(model="tiny", max_output_tokens=5, temperature=0, input=[
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"}], store=False)
    assert second.usage.input_tokens == whole.usage.input_tokens > first.usage.input_tokens
    assert second.output_text == whole.output_text
    assert second.previous_response_id == first.id
    # store: false kept nothing
    assert httpx.get(server.url + f"/v1/responses/{whole.id}").status_code == 404


def test_the_store_is_bounded_and_get_delete_work(server, client):
    ids = [client.responses.create(model="tiny", input=f"turn {i}", max_output_tokens=2,
                                   metadata={"turn": str(i)}).id for i in range(4)]
    store = server.app.state.response_store
    assert len(store) == 3  # the server's bound
    server.call(store.check)
    missing = httpx.get(server.url + f"/v1/responses/{ids[0]}")  # the least recently used
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"
    got = client.responses.retrieve(ids[3])
    assert got.id == ids[3] and got.metadata == {"turn": "3"}
    deleted = httpx.delete(server.url + f"/v1/responses/{ids[3]}", headers=OWNER).json()
    assert deleted == {"id": ids[3], "object": "response.deleted", "deleted": True}
    assert httpx.delete(server.url + f"/v1/responses/{ids[3]}", headers=OWNER).status_code == 404
    assert httpx.get(server.url + f"/v1/responses/{ids[2]}?stream=true").status_code == 400


def test_a_stored_response_belongs_to_the_key_that_made_it(server, client):
    """Another key (or none) cannot read, continue or delete it: a 404, as for an id
    that never was; its owner still can, whatever the case of its Bearer scheme."""
    made = client.responses.create(model="tiny", input="a secret", max_output_tokens=2)
    url = server.url + f"/v1/responses/{made.id}"
    for other in ({"Authorization": "Bearer someone-else"}, {}):
        assert httpx.get(url, headers=other).status_code == 404
        assert httpx.delete(url, headers=other).status_code == 404
        chained = httpx.post(server.url + "/v1/responses", headers=other, timeout=60, json={
            "model": "tiny", "input": "go on", "previous_response_id": made.id,
            "max_output_tokens": 2})
        assert chained.status_code == 404, chained.text
        assert chained.json()["error"]["param"] == "previous_response_id"
    assert httpx.get(url, headers={"Authorization": "bearer unused"}).json()["id"] == made.id
    assert client.responses.create(model="tiny", input="go on", previous_response_id=made.id,
                                   max_output_tokens=2).previous_response_id == made.id
    assert httpx.delete(url, headers=OWNER).status_code == 200


def test_the_store_bounds_bytes_and_entries():
    store = ResponseStore(max_entries=10, max_bytes=1000)
    for i in range(6):
        assert store.put({"id": f"r{i}", "pad": "x" * 200}, [])
        store.check()
    assert len(store) < 6 and store.get("r0") is None and store.get("r5") is not None
    assert not store.put({"id": "big", "pad": "x" * 2000}, [])
    assert ResponseStore(0, 1000).put({"id": "r"}, []) is False


def test_closing_the_stream_aborts_and_frees_the_blocks(server, client):
    before = metric(httpx.get(server.url + "/metrics").text, "request_success_total",
                    'finished_reason="abort"')
    stream = client.responses.create(model="tiny", input="Tell me a long story",
                                     max_output_tokens=400, temperature=0, stream=True)
    seen = 0
    for event in stream:
        seen += event.type == "response.output_text.delta"
        if seen == 3:
            break
    stream.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = httpx.get(server.url + "/metrics").text
        if metric(text, "request_success_total", 'finished_reason="abort"') > before:
            break
        time.sleep(0.05)
    assert metric(text, "request_success_total", 'finished_reason="abort"') == before + 1
    assert_idle_and_clean(server)


def test_truncation_auto_drops_the_oldest_turns(server):
    long_turns = [{"role": "user" if i % 2 == 0 else "assistant",
                   "content": f"turn {i}: " + "word " * 60} for i in range(12)]
    body = {"input": long_turns, "max_output_tokens": 8, "temperature": 0}
    refused = post(server, body)  # disabled by default: too long
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "input"
    r = post(server, {**body, "truncation": "auto"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["input_tokens"] + 8 <= 512


def test_json_schema_text_format_is_enforced(server, client):
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    out = client.responses.create(model="tiny", input="a number", temperature=0,
                                  max_output_tokens=40, text={"format": {
                                      "type": "json_schema", "name": "n", "schema": schema}})
    if out.status == "completed":
        assert isinstance(json.loads(out.output_text)["n"], int)
    assert out.text.format.type == "json_schema"


def _table_names() -> set[str]:
    """Every name in backquotes in the Responses table of docs/api.md."""
    text = DOC.read_text()
    section = text[text.index("## `/v1/responses`"):]
    table = section[section.index("| field | treatment |"):].split("\n\n")[0]
    return set(re.findall(r"`([^`]+)`", table))


def test_the_doc_table_covers_every_field():
    documented = _table_names()
    for model, prefix in ((ResponsesRequest, ""), (TextConfig, "text."),
                          (ReasoningConfig, "reasoning."), (TextFormat, ""),
                          (FunctionTool, "")):
        declared = {prefix + (model.model_fields[f].alias or f) for f in model.model_fields
                    if f != "type"}  # the kinds are listed in the notes
        declared |= {prefix + f for f in set(model.IGNORED) | set(model.ONLY_DEFAULT)}
        assert declared <= documented, (model.__name__, declared - documented)


def test_a_failure_after_the_start_is_a_failed_response(server, client):
    """The engine failing mid-stream (as a drain's timeout ends requests) ends the stream
    with `response.failed` carrying the reason, not a cut connection."""
    stream = client.responses.create(model="tiny", input="Tell me a story", temperature=0,
                                     max_output_tokens=400, stream=True)
    kinds = []
    for event in stream:
        kinds.append(event.type)
        if kinds.count("response.output_text.delta") == 2:
            server.call(server.engine.fail_unfinished, "the server is stopping")
    assert kinds[-1] == "response.failed"
    assert event.response.status == "failed"
    assert "the server is stopping" in event.response.error.message
    assert_idle_and_clean(server)


def test_a_codex_shaped_request_streams_to_completion(server):
    """The body Codex sends (codex-rs `ResponsesApiRequest`): empty tools with
    tool_choice auto, `reasoning: null`, `include: []`, `prompt_cache_key`, developer
    messages with `input_text` parts, a call and its output from an earlier turn."""
    body = {"model": "tiny", "instructions": "You are a coding agent.", "input": [
        {"type": "message", "role": "developer",
         "content": [{"type": "input_text", "text": "Sandbox: read-only."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "ls"}]},
        {"type": "function_call", "name": "shell", "arguments": "{\"command\": [\"ls\"]}",
         "call_id": "call_1"},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md"}],
        "tools": [], "tool_choice": "auto", "parallel_tool_calls": False, "reasoning": None,
        "store": False, "stream": True, "include": [], "prompt_cache_key": "conv-1",
        "max_output_tokens": 6}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.completed"
    assert events[-1]["response"]["usage"]["output_tokens"] == 6


def test_input_items_become_chat_messages():
    from app.server.responses_input import to_messages

    req = ResponsesRequest.model_validate({"input": [
        {"role": "user", "content": "hi"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text",
                                                          "text": "think"}]},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "two"}]}]})
    messages = to_messages(req.input)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assistant = messages[1]
    assert assistant["content"] == "Let me look." and assistant["reasoning_content"] == "think"
    assert [c["id"] for c in assistant["tool_calls"]] == ["c1", "c2"]
    assert messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "one", "name": "f"}
    assert messages[3]["content"] == "two" and messages[3]["name"] == "g"


def test_logprobs_are_included_when_asked(server, client):
    body = dict(model="tiny", input="Hello", max_output_tokens=5, temperature=0,
                top_logprobs=2, include=["message.output_text.logprobs"])
    out = client.responses.create(**body)
    part = out.output[0].content[0]
    assert len(part.logprobs) == 5
    assert all(len(lp.top_logprobs) == 2 and lp.bytes == list(lp.token.encode())
               for lp in part.logprobs)
    with client.responses.stream(**body) as stream:
        streamed = [lp for e in stream if e.type == "response.output_text.delta"
                    for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]
    plain = client.responses.create(**{**body, "include": []})
    assert plain.output[0].content[0].logprobs == []


def test_reasoning_effort_reaches_the_chat_template(server, monkeypatch):
    inputs = server.engine.inputs
    seen: list[dict] = []
    original = inputs.apply_chat_template

    async def recording(messages, add_generation_prompt=True, **kwargs):
        seen.append(kwargs)
        return await original(messages, add_generation_prompt, **kwargs)

    monkeypatch.setattr(inputs, "apply_chat_template", recording)
    r = post(server, {"input": "Hi", "max_output_tokens": 2,
                      "reasoning": {"effort": "low", "summary": "auto"}})
    assert r.status_code == 200 and r.json()["reasoning"]["effort"] == "low"
    assert seen and seen[-1].get("reasoning_effort") == "low"


def test_the_chat_counts_bound_the_input_and_the_stored_conversation(server):
    many = [{"role": "user", "content": "hi"}] * 17
    r = post(server, {"input": many, "max_output_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input"
    assert "--max-chat-messages" in r.json()["error"]["message"]
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "a"}] * 5}]
    r = post(server, {"input": parts, "max_output_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input.0.content"
    first = post(server, {"input": many[:15], "max_output_tokens": 1}).json()  # 16 stored
    r = post(server, {"input": "one more", "previous_response_id": first["id"],
                      "max_output_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
