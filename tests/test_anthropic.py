"""Anthropic's Messages API with the real `anthropic` SDK.

The real SmolLM2: a plain answer equal to the chat route's for the same greedy request,
a stream the SDK reassembles into the same message, a forced tool call whose input fits
its schema, a two-turn tool loop, an abort by closing the stream (KV blocks back to 0).
The tiny model: errors in Anthropic's shape, `x-api-key`, `count_tokens` equal to the
chat route's prompt, and the output path (thinking blocks, stop sequences, the SSE event
order) with the output forced to a known text by a regex.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

from app.config import EngineConfig, ServerSettings
from app.engine.grammar import StructuredOutput
from app.engine.outputs import RequestOutput
from app.server import anthropic as anthropic_routes
from app.server.anthropic_protocol import MessagesRequest, OutputConfig, chat_body
from app.server.structured import compiled
from tests.server_harness import ServerThread, assert_idle_and_clean, metric, tiny_config

pytest.importorskip("xgrammar")

WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
           "input_schema": {"type": "object", "required": ["city"], "properties": {
               "city": {"type": "string", "maxLength": 30}}}}
GREEDY = {"temperature": 0}  # this SDK has no temperature argument: sent as extra_body


@pytest.fixture(scope="module")
def smollm2():
    config = EngineConfig.from_kwargs(dtype="float32", max_model_len=1024, max_num_seqs=8,
                                      served_model_name="smollm2")
    srv = ServerThread(config, ServerSettings(log_stats_interval=0)).start(timeout=300)
    yield anthropic.Anthropic(base_url=srv.url, api_key="unused"), srv
    srv.stop()


@pytest.mark.slow
def test_a_plain_answer_is_the_chat_answer(smollm2):
    client, srv = smollm2
    question = [{"role": "user", "content": "What is the capital of France?"}]
    msg = client.messages.create(model="smollm2", max_tokens=30, messages=question,
                                 system="Answer briefly.", extra_body=GREEDY)
    chat = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "model": "smollm2", "max_tokens": 30, "temperature": 0,
        "messages": [{"role": "system", "content": "Answer briefly."}, *question]}).json()
    (block,) = msg.content
    assert block.type == "text" and block.text == chat["choices"][0]["message"]["content"]
    assert msg.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert msg.usage.output_tokens == chat["usage"]["completion_tokens"]
    assert msg.stop_reason == {"stop": "end_turn", "length": "max_tokens"}[
        chat["choices"][0]["finish_reason"]]
    with client.messages.stream(model="smollm2", max_tokens=30, messages=question,
                                system="Answer briefly.", extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].text == block.text and streamed.stop_reason == msg.stop_reason
    assert streamed.usage.output_tokens == msg.usage.output_tokens
    assert_idle_and_clean(srv)


@pytest.mark.slow
def test_a_forced_tool_call_fits_its_schema_and_the_loop_completes(smollm2):
    client, srv = smollm2
    messages = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = client.messages.create(model="smollm2", max_tokens=60, messages=messages,
                                   tools=[WEATHER], extra_body=GREEDY,
                                   tool_choice={"type": "tool", "name": "get_weather"})
    assert first.stop_reason == "tool_use"
    (call,) = [b for b in first.content if b.type == "tool_use"]
    assert call.name == "get_weather" and call.id.startswith("toolu_")
    jsonschema.validate(call.input, WEATHER["input_schema"])
    with client.messages.stream(model="smollm2", max_tokens=60, messages=messages,
                                tools=[WEATHER], extra_body=GREEDY,
                                tool_choice={"type": "tool", "name": "get_weather"}) as s:
        streamed = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content if b.type == "tool_use"] == [
        ("tool_use", "get_weather", call.input)]
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                   for b in first.content]},
                 {"role": "user", "content": [{
                     "type": "tool_result", "tool_use_id": call.id,
                     "content": json.dumps({"temperature_c": 18, "sky": "sunny"})}]}]
    final = client.messages.create(model="smollm2", max_tokens=60, messages=messages,
                                   tools=[WEATHER], extra_body=GREEDY)
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use") and final.content
    assert_idle_and_clean(srv)


@pytest.mark.slow
def test_an_output_format_is_followed(smollm2):
    client, _ = smollm2
    schema = {"type": "object", "required": ["capital"], "additionalProperties": False,
              "properties": {"capital": {"type": "string", "maxLength": 30}}}
    msg = client.messages.create(
        model="smollm2", max_tokens=40, extra_body=GREEDY,
        messages=[{"role": "user", "content": "France's capital, as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(msg.content[0].text), schema)


@pytest.mark.slow
def test_closing_the_stream_aborts_the_request(smollm2):
    client, srv = smollm2
    before = metric(httpx.get(srv.url + "/metrics").text, "request_success_total",
                    'finished_reason="abort"')
    with client.messages.stream(model="smollm2", max_tokens=400, extra_body=GREEDY,
                                messages=[{"role": "user", "content": "Tell a long story."}]
                                ) as stream:
        deltas = 0
        for event in stream:
            deltas += event.type == "content_block_delta"
            if deltas == 3:
                break
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and srv.engine.num_unfinished:
        time.sleep(0.05)
    after = metric(httpx.get(srv.url + "/metrics").text, "request_success_total",
                   'finished_reason="abort"')
    assert after == before + 1
    assert_idle_and_clean(srv)


# -- the tiny model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_model_len=1024), ServerSettings(
        log_stats_interval=0, api_key="secret", reasoning_parser="qwen3")).start()
    yield anthropic.Anthropic(base_url=srv.url, api_key="secret", max_retries=0), srv
    srv.stop()


def test_errors_come_in_anthropics_shape(tiny):
    client, srv = tiny
    hi = [{"role": "user", "content": "hi"}]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=10, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "AAAA"}}]}])
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "image" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="top_logprobs"):
        client.messages.create(model="tiny", max_tokens=10, messages=hi,
                               extra_body={"top_logprobs": 2})
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nonesuch", max_tokens=10, messages=hi)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0).messages.create(
            model="tiny", max_tokens=10, messages=hi)
    r = httpx.post(srv.url + "/v1/messages", headers={"x-api-key": "secret"},
                   json={"model": "tiny", "messages": hi})  # max_tokens is required
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in r.json()["error"]["message"]
    bearer = httpx.post(srv.url + "/v1/messages", headers={"authorization": "Bearer secret"},
                        json={"model": "tiny", "messages": hi, "max_tokens": 2,
                              "metadata": {"user_id": "u"}})
    assert bearer.status_code == 200, bearer.text  # ANTHROPIC_AUTH_TOKEN's way; metadata ignored
    assert_idle_and_clean(srv)


def test_count_tokens_is_the_chat_prompt(tiny):
    client, srv = tiny
    counted = client.messages.count_tokens(
        model="tiny", system=[{"type": "text", "text": "Be brief."}], tools=[WEATHER],
        messages=[{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": [
                      {"type": "text", "text": "Let me check."},
                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                       "input": {"city": "Oslo"}}]},
                  {"role": "user", "content": [
                      {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}])
    rendered = httpx.post(srv.url + "/v1/chat/completions/render",
                          headers={"authorization": "Bearer secret"}, json={
        "model": "tiny", "tools": [{"type": "function", "function": {
            "name": "get_weather", "description": WEATHER["description"],
            "parameters": WEATHER["input_schema"]}}],
        "messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": "Weather in Oslo?"},
                     {"role": "assistant", "content": "Let me check.", "tool_calls": [{
                         "id": "toolu_1", "type": "function", "function": {
                             "name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
                     {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"}]}).json()
    assert counted.input_tokens == len(rendered["token_ids"]) > 50


@pytest.fixture
def forced(monkeypatch):
    """Force the tiny model's whole output to a known text (a regex, thinking included)."""
    box = {}

    async def whole_output(request, wanted, parser):
        pattern = "".join("\\" + ch if ch in "\\.^$*+?()[]{}|/" else ch for ch in box["text"])
        return await compiled(request, (StructuredOutput("regex", pattern), "test"))
    monkeypatch.setattr(anthropic_routes, "compiled_for_answer", whole_output)
    return box


def test_thinking_blocks_streamed_and_not(tiny, forced):
    client, srv = tiny
    forced["text"] = "<think>Paris is in France.</think>\n\nParis."
    args = dict(model="tiny", max_tokens=40, messages=[{"role": "user", "content": "?"}],
                thinking={"type": "enabled", "budget_tokens": 1024})
    with pytest.raises(anthropic.BadRequestError, match="budget_tokens"):
        client.messages.create(**args)  # the budget must be below max_tokens
    args["thinking"] = {"type": "adaptive"}  # the tiny model's context is below the budget
    msg = client.messages.create(**args)

    def blocks(message):
        return [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None))
                for b in message.content]
    assert blocks(msg) == [("thinking", "Paris is in France."), ("text", "Paris.")]
    assert msg.stop_reason == "end_turn"
    with client.messages.stream(**args) as stream:
        kinds = [(e.type, getattr(e, "index", None)) for e in stream]
        final = stream.get_final_message()
    assert blocks(final) == blocks(msg)
    assert kinds[0] == ("message_start", None)
    assert ("content_block_start", 0) in kinds and ("content_block_start", 1) in kinds
    assert ("content_block_stop", 0) in kinds and ("content_block_stop", 1) in kinds
    assert kinds[-2][0] == "message_delta" and kinds[-1][0] == "message_stop"
    assert_idle_and_clean(srv)


def test_a_stop_sequence_is_named(tiny, forced):
    client, _ = tiny
    forced["text"] = "one two STOP three"
    msg = client.messages.create(model="tiny", max_tokens=40, stop_sequences=["STOP"],
                                 messages=[{"role": "user", "content": "count"}])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "STOP"
    assert msg.content[0].text == "one two "


def test_raw_stream_events_follow_anthropics_order(tiny, forced):
    _, srv = tiny
    forced["text"] = "hello there"
    events = []
    with httpx.stream("POST", srv.url + "/v1/messages", headers={"x-api-key": "secret"},
                      json={"model": "tiny", "max_tokens": 20, "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("event: "):
                events.append(line[7:])
    assert events[:4] == ["message_start", "ping", "content_block_start",
                          "content_block_delta"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


# -- docs/api.md's table of the route's fields ---------------------------------------------


def _documented() -> dict[str, str]:
    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    table = text[text.index("| messages field |"):].split("\n\n")[0]
    rows = {}
    for line in table.splitlines()[2:]:
        names, treatment = (c.strip() for c in line.strip("|").split("|")[:2])
        for name in re.findall(r"`([^`]+)`", names):
            rows.setdefault(name, treatment.split(" ")[0])
    return rows


def test_the_table_lists_every_field_and_each_does_what_it_says(tiny):
    client, srv = tiny
    rows = _documented()
    declared = {f.alias or name for name, f in MessagesRequest.model_fields.items()}
    declared |= set(MessagesRequest.IGNORED)
    declared |= {f"output_config.{name}" for name in OutputConfig.model_fields} | {
        f"output_config.{name}" for name in OutputConfig.ONLY_DEFAULT}
    declared -= {"output_config"}
    assert declared <= set(rows), declared - set(rows)
    base = {"model": "tiny", "max_tokens": 5, "temperature": 0,
            "messages": [{"role": "user", "content": "hi"}]}
    key = {"x-api-key": "secret"}

    def post(body):
        return httpx.post(srv.url + "/v1/messages", json=body, headers=key, timeout=60)
    plain = post(base).json()["content"]
    for name, value in (("metadata", {"user_id": "u"}), ("service_tier", "auto"),
                        ("cache_control", {"type": "ephemeral"})):
        assert rows[name] == "ignored"
        r = post(base | {name: value})
        assert r.status_code == 200 and r.json()["content"] == plain, (name, r.text)
    # Claude Code's effort and context edit: honoured (this template reads no effort, and
    # the conversation has no thinking to keep); another effort or edit is a 400.
    assert rows["output_config.effort"] == "honoured"
    r = post(base | {"output_config": {"effort": "high"}, "context_management": {
        "edits": [{"type": "clear_thinking_20251015", "keep": "all"}]}})
    assert r.status_code == 200 and r.json()["content"] == plain, r.text
    r = post(base | {"output_config": {"effort": "extreme"}})
    assert r.status_code == 400 and "output_config.effort" in r.json()["error"]["message"]
    r = post(base | {"context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}})
    assert r.status_code == 400 and "context_management.edits.0" in r.json()["error"]["message"]
    for name in ("container", "mcp_servers", "context_management", "no_such_field"):
        r = post(base | {name: "x"})
        assert r.status_code == 400 and name in r.json()["error"]["message"], name
    r = post(base | {"tools": [{"type": "web_search_20250305", "name": "web_search"}]})
    assert r.status_code == 400 and "tools.0" in r.json()["error"]["message"]


@pytest.mark.parametrize("edit, kept", [
    (None, []), ({"type": "clear_thinking_20251015", "keep": "all"}, ["t1", "t2"]),
    ({"type": "clear_thinking_20251015"}, ["t2"]),  # Anthropic's default: the last turn
    ({"type": "clear_thinking_20251015", "keep": {"type": "thinking_turns", "value": 0}}, [])])
def test_context_management_keeps_the_thinking_it_names(edit, kept):
    """Earlier turns' thinking is dropped from the prompt, but for the turns a
    `clear_thinking` edit keeps: those carry it as `reasoning_content`. A mid-conversation
    system message stays where it stands; `effort` reaches the template."""
    def turn(thought, text):
        return {"role": "assistant", "content": [
            {"type": "thinking", "thinking": thought, "signature": "s"},
            {"type": "text", "text": text}]}
    body = {"model": "m", "max_tokens": 8, "output_config": {"effort": "high"}, "messages": [
        {"role": "user", "content": "a"}, turn("t1", "b"), {"role": "user", "content": "c"},
        {"role": "system", "content": "be brief"}, turn("t2", "d"),
        {"role": "user", "content": "e"}]}
    if edit is not None:
        body["context_management"] = {"edits": [edit]}
    chat = chat_body(MessagesRequest.model_validate(body))
    assert [m.get("reasoning_content") for m in chat["messages"]
            if m.get("reasoning_content")] == kept
    assert [m["role"] for m in chat["messages"]] == [
        "user", "assistant", "user", "system", "assistant", "user"]
    assert chat["reasoning_effort"] == "high"


# -- the output path alone -----------------------------------------------------------------


def _out(text: str, delta: str = "", finished: bool = True, reason: str = "stop",
         stop=None) -> RequestOutput:
    return RequestOutput("r", [1], text, [1] * 7, delta, [1], finished,
                         reason if finished else None, None, stop)


def test_stream_blocks_follow_the_output_thinking_text_then_calls():
    reply = anthropic_routes._Reply("msg_1", "m", 3, [], "deepseek_r1", True, True)
    text = ('weighing it</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", '
            '"arguments": {"city": "Oslo"}}\n</tool_call>\n')
    pieces = [text[k:k + 4] for k in range(0, len(text), 4)]

    async def outputs():
        for k, piece in enumerate(pieces):
            yield 0, _out(text, piece, finished=k == len(pieces) - 1)

    async def run():
        return [e async for e in reply.events(outputs())]
    events = asyncio.run(run())
    starts = [d["content_block"]["type"] for kind, d in events if kind == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas: dict[int, str] = {}
    for kind, d in events:
        if kind == "content_block_delta":
            piece = d["delta"].get("thinking") or d["delta"].get("text") or d["delta"].get(
                "partial_json")
            deltas[d["index"]] = deltas.get(d["index"], "") + piece
    assert deltas[0] == "weighing it" and deltas[1] == "Checking.\n"
    assert json.loads(deltas[2]) == {"city": "Oslo"}
    assert [k for k, _ in events][-3:] == ["content_block_stop", "message_delta",
                                           "message_stop"]
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    assert [k for k, _ in events].count("content_block_stop") == 3
    whole = reply.message(_out(text))
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    assert whole["content"][2]["input"] == {"city": "Oslo"} and whole["stop_reason"] == "tool_use"


def test_a_call_whose_arguments_are_not_an_object_stays_text():
    reply = anthropic_routes._Reply("msg_1", "m", 3, ["END"], None, True, True)
    msg = reply.message(_out('<tool_call>{"name": "f", "arguments": "x"}</tool_call>'))
    assert [b["type"] for b in msg["content"]] == ["text"] and msg["stop_reason"] == "end_turn"
    cut = reply.message(_out("abc", reason="length"))
    assert cut["stop_reason"] == "max_tokens"
    assert reply.message(_out("abc", stop="END"))["stop_sequence"] == "END"
