"""Fields real clients send that used to break (issue 42): `reasoning_effort` and
`chat_template_kwargs` reach the chat template; a tool call cut off by the token limit
is neither a call nor content, streamed or not; a JSON schema's property order is the
output's; an unknown key at any depth is a 400 naming its path."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from app.config import EngineConfig, ServerSettings
from app.server.tools import ToolCallStream, parse
from tests.server_harness import ServerThread, assert_idle_and_clean, tiny_config

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir), ServerSettings(
        log_stats_interval=0.05, trust_request_chat_template=True)).start()
    yield srv
    srv.stop()


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, timeout=60)


def assert_400(r: httpx.Response, named: str) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert named in error["message"] or error["param"] == named, error


# -- 2. reasoning_effort and chat_template_kwargs reach the template -----------------------

PRINTS = ("{{ reasoning_effort | default('unset') }}|{{ enable_thinking | default('unset') }}"
          "|{{ custom | default('unset') }}")


def rendered(srv, **fields) -> str:
    r = post(srv, CHAT + "/render", {"messages": USER, "chat_template": PRINTS, **fields})
    assert r.status_code == 200, r.text
    return srv.engine.core.tokenizer.decode(r.json()["token_ids"])


def test_reasoning_effort_and_template_kwargs_reach_the_template(server):
    assert rendered(server) == "unset|unset|unset"
    assert rendered(server, reasoning_effort="low",
                    chat_template_kwargs={"custom": "K"}) == "low|True|K"
    assert rendered(server, reasoning_effort="none") == "none|False|unset"
    # The client's own enable_thinking wins; the field wins over a kwarg of its name.
    assert rendered(server, reasoning_effort="high", chat_template_kwargs={
        "enable_thinking": False, "reasoning_effort": "low"}) == "high|False|unset"


def test_reasoning_effort_values_as_the_sdk_sends_them(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    for effort in ("minimal", "low", "medium", "high", "none", "xhigh", "max"):
        out = client.chat.completions.create(model="tiny", messages=USER, max_tokens=2,
                                             reasoning_effort=effort)
        assert out.choices[0].finish_reason == "length"
    r = post(server, CHAT, {"messages": USER, "max_tokens": 2, "reasoning_effort": "extreme"})
    assert_400(r, "reasoning_effort")
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2,
                                         "reasoning_effort": "low"})
    assert_400(r, "reasoning_effort")  # no template to take it


# -- 3. a tool call cut off by the token limit ----------------------------------------------

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CUT = [CALL + '\n<tool_call>\n{"name": "get_weather", "arguments": {\n    "city": "',
       CALL + "\n<tool_call>\n{\"name\": \"get_we", CALL + "\n<tool_call", CALL + "\n<tool_c"]


def streamed(text: str, cut_off: bool, step: int = 3) -> tuple[str, list[dict]]:
    stream, content, calls = ToolCallStream(), "", {}
    for k in range(0, len(text), step):
        piece, deltas = stream.feed(text[k:k + step])
        content += piece
        for d in deltas:
            call = calls.setdefault(d["index"], {"name": None, "arguments": ""})
            call["name"] = d.get("function", {}).get("name") or call["name"]
            call["arguments"] += d["function"].get("arguments", "")
    content += stream.finish(cut_off)
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize("text", CUT)
def test_a_cut_off_call_is_neither_a_call_nor_content(text):
    content, calls = parse(text, cut_off=True)
    assert content is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_weather", '{"city": "Paris"}')]
    s_content, s_calls = streamed(text, cut_off=True)
    assert s_content.strip() == ""
    assert s_calls == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]


def test_streamed_and_whole_arguments_are_the_same_text():
    text = ('<tool_call>\n{"name": "add", "arguments": {"a":1,   "b": [2, {"c": "}"}]}}'
            "\n</tool_call>")
    (whole,) = parse(text)[1]
    (part,) = streamed(text, cut_off=False, step=2)[1]
    assert part["arguments"] == whole["function"]["arguments"]
    assert json.loads(part["arguments"]) == {"a": 1, "b": [2, {"c": "}"}]}


def test_text_that_only_looks_like_a_tag_stays_text():
    assert parse("3 <") == ("3 <", [])  # an answer that stopped: its end is text
    assert parse("use <tool_call> tags") == ("use <tool_call> tags", [])
    assert streamed("use <tool_call> tags", cut_off=False) == ("use <tool_call> tags", [])


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("xgrammar")
    config = EngineConfig.from_kwargs(dtype="float32", max_model_len=1024, max_num_seqs=8,
                                      served_model_name="smollm2")
    srv = ServerThread(config, ServerSettings(log_stats_interval=0)).start(timeout=300)
    yield srv
    srv.stop()


@pytest.mark.slow
def test_required_calls_cut_by_max_tokens_with_the_real_model(smollm2):
    client = openai.OpenAI(base_url=smollm2.url + "/v1", api_key="unused")
    ask = dict(model="smollm2", tools=[WEATHER], tool_choice="required", temperature=0,
               parallel_tool_calls=True, messages=[
                   {"role": "user", "content": "What's the weather in Paris and in Rome?"}])
    full = client.chat.completions.create(max_tokens=160, **ask)
    n_calls = len(full.choices[0].message.tool_calls)
    assert n_calls >= 2 and full.choices[0].finish_reason == "tool_calls"
    # Cut inside the last call: a few tokens before its end, and mid-argument.
    for cut in (full.usage.completion_tokens - 3, full.usage.completion_tokens - 8):
        out = client.chat.completions.create(max_tokens=cut, **ask).choices[0]
        assert out.finish_reason == "length"
        assert not out.message.content, out.message.content  # no raw half call
        whole = [(c.function.name, c.function.arguments) for c in out.message.tool_calls]
        assert len(whole) == n_calls - 1
        calls: dict[int, list[str]] = {}
        content, finish, naive = "", None, []
        for chunk in client.chat.completions.create(max_tokens=cut, stream=True, **ask):
            for ch in chunk.choices:
                content += ch.delta.content or ""
                entries = ch.delta.tool_calls or []
                assert len({tc.index for tc in entries}) == len(entries)  # one an index
                # What a naive client reads, `tool_calls[0]` of the chunk that opens a
                # call: its whole arguments, not an empty string.
                naive += [json.loads(tc.function.arguments) for tc in entries if tc.id]
                for tc in entries:
                    call = calls.setdefault(tc.index, ["", ""])
                    call[0] += tc.function.name or ""
                    call[1] += tc.function.arguments or ""
                finish = ch.finish_reason or finish
        assert finish == "length" and not content.strip(), content
        assert [tuple(calls[i]) for i in sorted(calls)] == whole
        assert naive == [json.loads(args) for _, args in whole]
        assert all(json.loads(args)["city"] for _, args in whole)
    assert_idle_and_clean(smollm2)


# -- 4. a JSON schema's property order is the output's --------------------------------------

def schema(order: list[str]) -> dict:
    props = {"zzz": {"type": "string", "enum": ["20"]}, "age": {"type": "integer", "enum": [20]}}
    return {"type": "object", "properties": {k: props[k] for k in order},
            "required": ["age", "zzz"]}


@pytest.mark.parametrize("order", [["zzz", "age"], ["age", "zzz"]])
def test_json_schema_output_follows_the_property_order(server, order):
    pytest.importorskip("xgrammar")
    r = post(server, CHAT, {"messages": USER, "max_tokens": 40, "temperature": 0,
                            "response_format": {"type": "json_schema", "json_schema": {
                                "name": "x", "schema": schema(order)}}})
    assert r.status_code == 200, r.text
    assert list(json.loads(r.json()["choices"][0]["message"]["content"])) == order


# -- 6. an unknown key below the top level is a 400 naming its path --------------------------

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
ASSISTANT_CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
NESTED = [  # (body fields, the unknown key's path)
    ({"response_format": {"type": "json_object", "foo": 1}}, "response_format.foo"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {}, "foo": 1}}}, "response_format.json_schema.foo"),
    ({"structured_outputs": {"regex": "a", "foo": 1}}, "structured_outputs.foo"),
    ({"stream": True, "stream_options": {"include_usage": True, "foo": 1}}, "stream_options.foo"),
    ({"messages": [{"role": "user", "content": "hi", "foo": 1}]}, "messages.0.foo"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "foo": 1}]}]},
     "messages.0.content.0.foo"),
    ({"messages": [*USER, {**ASSISTANT_CALL, "tool_calls": [
        {**ASSISTANT_CALL["tool_calls"][0], "foo": 1}]}]}, "messages.1.tool_calls.0.foo"),
    ({"messages": [*USER, {**ASSISTANT_CALL, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}",
                                                      "foo": 1}}]}]},
     "messages.1.tool_calls.0.function.foo"),
    ({"tools": [{**TOOL, "foo": 1}]}, "tools.0.foo"),
    ({"tools": [{"type": "function", "function": {"name": "f", "foo": 1}}]},
     "tools.0.function.foo"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"},
                                       "foo": 1}}, "tool_choice.foo"),
    ({"tools": [TOOL], "tool_choice": {"type": "function",
                                       "function": {"name": "f", "foo": 1}}},
     "tool_choice.function.foo"),
]


@pytest.mark.parametrize("fields,path", NESTED, ids=[p for _, p in NESTED])
def test_an_unknown_nested_key_is_a_400_naming_its_path(server, fields, path):
    r = post(server, CHAT, {"messages": USER, "max_tokens": 2, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f"Unrecognized request argument supplied: {path}"


def test_generate_and_tokenize_nested_keys(server):
    r = post(server, "/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2,
                                                                     "foo": 1}})
    assert_400(r, "sampling_params.foo")
    r = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi", "foo": 1}]})
    assert_400(r, "messages.0.foo")


def test_keys_templates_read_and_keys_sdks_echo_are_accepted(server):
    history = [*USER, {**ASSISTANT_CALL, "reasoning_content": "think", "reasoning": "think",
                       "thinking": "think", "refusal": None, "annotations": [],
                       "audio": None, "function_call": None,
                       "tool_calls": [{**ASSISTANT_CALL["tool_calls"][0], "index": 0}]},
               {"role": "tool", "tool_call_id": "c1", "content": [
                   {"type": "text", "text": "sunny", "cache_control": {"type": "ephemeral"}}]}]
    r = post(server, CHAT, {"messages": history, "max_tokens": 2, "tools": [TOOL]})
    assert r.status_code == 200, r.text
    # A response-only key with a value would be dropped from the history: refused.
    r = post(server, CHAT, {"messages": [*USER, {"role": "assistant", "content": "x",
                                                 "refusal": "no"}], "max_tokens": 2})
    assert_400(r, "messages.1.refusal")
    # Fields of another response_format type are refused, not ignored.
    r = post(server, CHAT, {"messages": USER, "max_tokens": 2, "response_format": {
        "type": "json_object", "json_schema": {"name": "x", "schema": {}}}})
    assert_400(r, "response_format")


def test_reasoning_in_the_history_reaches_the_template(server):
    template = "{% for m in messages %}[{{ m.reasoning_content }}]{% endfor %}"
    r = post(server, CHAT + "/render", {"chat_template": template, "messages": [
        *USER, {"role": "assistant", "content": "x", "reasoning_content": "why"}]})
    assert r.status_code == 200, r.text
    assert server.engine.core.tokenizer.decode(r.json()["token_ids"]) == "[][why]"


ANTHROPIC_NESTED = [
    ({"messages": [{"role": "user", "content": "hi", "foo": 1}]}, "messages.0.foo"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "foo": 1}]}]},
     "messages.0.content.0.foo"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                                 "content": [{"type": "text", "text": "a",
                                                              "foo": 1}]}]}]},
     "messages.0.content.0.content.0.foo"),
    ({"system": [{"type": "text", "text": "be brief", "foo": 1}]}, "system.0.foo"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "foo": 1}]}, "tools.0.foo"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}],
      "tool_choice": {"type": "auto", "foo": 1}}, "tool_choice.foo"),
    ({"thinking": {"type": "disabled", "foo": 1}}, "thinking.foo"),
    ({"output_config": {"format": {"type": "json_schema", "schema": {}, "foo": 1}}},
     "output_config.format.foo"),
]


@pytest.mark.parametrize("fields,path", ANTHROPIC_NESTED, ids=[p for _, p in ANTHROPIC_NESTED])
def test_an_unknown_nested_key_in_a_messages_body_is_a_400_naming_its_path(server, fields, path):
    body = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = post(server, "/v1/messages", {**body, **fields})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == f"Unrecognized request argument supplied: {path}"
