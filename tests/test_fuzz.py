"""Property-based fuzzing of every route and field, against the real SmolLM2 server.

Each example of the first test takes a valid body and replaces or adds fields with
arbitrary JSON (wrong types, huge and non-finite numbers, huge strings, odd Unicode), or
sends a body that is not JSON at all. The second builds the nested structures a flat
mutation never reaches: conversations (roles, content as text, parts or odd types,
assistant `tool_calls` of every shape, tool messages), tools with odd parameter
schemas and tool choices, structured-output specs (`response_format`, regexes, choices,
small grammars, SGLang's names) and request-supplied chat templates.

Properties, per example: never a 5xx (there is no shutdown here), an error is a JSON 4xx
in OpenAI's shape, a success is a JSON body (or, for a stream, SSE events that parse).
After all of them: the engine is healthy and idle, no KV block is in use, the block
invariant holds, and the next greedy request still answers "The capital of France is
Paris."

CI runs a bounded number of examples; a nightly run sets RIDGELINE_FUZZ_EXAMPLES
(e.g. 2000) for more.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.config import EngineConfig, ServerSettings
from tests.server_harness import ServerThread, assert_idle_and_clean

EXAMPLES = int(os.environ.get("RIDGELINE_FUZZ_EXAMPLES", "60"))

BASES = {
    "/v1/completions": {"prompt": "Hello", "max_tokens": 4},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
    "/generate": {"text": "Hello", "sampling_params": {"max_new_tokens": 4}},
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
    "/abort_request": {"rid": "nobody"},
}
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
          "top_k", "min_p", "n", "stream", "stream_options", "stop", "stop_token_ids", "seed",
          "logprobs", "top_logprobs", "echo", "logit_bias", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "priority",
          "request_id", "prompt_logprobs", "model", "user", "text", "input_ids",
          "sampling_params", "tokens", "rid", "add_special_tokens", "bogus_field"]

numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0, -1, 1, 2**31, 2**63, 2**64, 1e-300, 1e300, 0.5]),
)
text = st.one_of(st.text(max_size=40), st.text(alphabet=st.characters(codec=None), max_size=20),
                 st.just("a\ud800b"), st.just("x" * 20000))
leaves = st.one_of(st.none(), st.booleans(), numbers, text)
json_values = st.recursive(leaves, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=8)


# Values a real client might send, so that mutated bodies also run, not only fail.
PLAUSIBLE = {
    "temperature": st.floats(0, 2), "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 60),
    "min_p": st.floats(0, 0.5), "seed": st.integers(0, 2**40), "n": st.integers(1, 3),
    "stream": st.booleans(), "stop": st.lists(st.text(min_size=1, max_size=4), max_size=3),
    "max_tokens": st.integers(1, 8), "logprobs": st.integers(0, 3), "echo": st.booleans(),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2), "ignore_eos": st.booleans(),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100),
                                  max_size=3),
    "prompt": st.text(max_size=30), "min_tokens": st.integers(0, 3),
}


@st.composite
def requests(draw):
    path = draw(st.sampled_from(sorted(BASES)))
    if draw(st.integers(0, 9)) == 0:  # not JSON at all
        return path, draw(st.binary(max_size=64)), {"content-type": "application/json"}
    body = json.loads(json.dumps(BASES[path]))
    for _ in range(draw(st.integers(0, 3))):
        field = draw(st.sampled_from(FIELDS))
        plausible = field in PLAUSIBLE and draw(st.booleans())
        value = draw(PLAUSIBLE[field] if plausible else json_values)
        if path == "/generate" and draw(st.booleans()):
            name = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}.get(
                field, field)
            body["sampling_params"][name] = value
        else:
            body[field] = value
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep valid generations short: CI time, not coverage
    return path, json.dumps(body).encode(), {"content-type": "application/json"}


# -- nested structures: conversations, tools, structured outputs, templates ---------------

short = st.text(max_size=12)
odd = st.one_of(json_values, st.just({}), st.just([]), st.just(""))


def some(valid, weird=odd, weight: int = 8):
    """Mostly well-formed values (`weight` to 1), with odd ones mixed in (anything JSON
    can hold): each level of a structure is odd now and then, the whole often valid."""
    return st.sampled_from(range(weight + 1)).flatmap(lambda i: weird if i == weight else valid)


schemas = st.recursive(
    st.one_of(st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "boolean"},
                               {"type": "number", "minimum": 0}, {"enum": ["a", "b"]},
                               {"type": "string", "maxLength": 3}, {"const": 1}]),
              st.sampled_from([{"type": 5}, {"type": "nope"}, {"enum": []}, {"$ref": "#/x"},
                               {"not": {}}, {"pattern": "("}, {"minimum": "x"}, True, False])),
    lambda inner: st.one_of(
        st.builds(lambda props, req: {"type": "object", "properties": props, "required": req},
                  st.dictionaries(st.sampled_from("abc"), inner, max_size=3),
                  some(st.lists(st.sampled_from("abcd"), max_size=2))),
        st.builds(lambda items: {"type": "array", "items": items, "maxItems": 2}, inner),
        st.builds(lambda alts: {"anyOf": alts}, st.lists(inner, max_size=2)),
        st.builds(lambda props: {"type": "object", "properties": props}, odd)),
    max_leaves=5)
arguments = some(st.one_of(st.just('{"a": 1}'), st.just("{}"), st.just("not json"),
                           st.dictionaries(st.sampled_from("ab"), json_values, max_size=2)))
functions = st.fixed_dictionaries(
    {"name": some(st.sampled_from(["get_weather", "f", "x" * 200])),
     "arguments": arguments})
tool_calls = some(st.lists(some(st.fixed_dictionaries(
    {"function": some(functions, st.one_of(st.none(), st.just("x"), odd))},
    optional={"id": some(short), "type": some(st.just("function")), "index": odd})),
    max_size=3), st.sampled_from(["x", 3, None, {}, [[]]]))
parts = st.lists(some(st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": short}),
    st.fixed_dictionaries({"type": st.sampled_from(["image_url", "input_audio", "file"]),
                           "image_url": st.just({"url": "data:,"})}),
    st.fixed_dictionaries({"type": odd}, optional={"text": odd}))), max_size=3)
contents = st.one_of(short, short, st.none(), parts, odd)
messages = st.lists(some(st.fixed_dictionaries(
    {"role": some(st.sampled_from(["system", "user", "assistant", "tool", "developer"]),
                  st.sampled_from(["function", "", "ROBOT", None, 5])),
     "content": contents},
    optional={"tool_calls": tool_calls, "tool_call_id": some(short), "name": some(short),
              "reasoning_content": odd})), min_size=1, max_size=5)
tools = st.lists(some(st.fixed_dictionaries(
    {"type": some(st.just("function")),
     "function": some(st.fixed_dictionaries(
         {"name": some(st.sampled_from(["get_weather", "f"]))},
         optional={"description": some(short), "parameters": some(schemas),
                   "strict": some(st.booleans())}))})), max_size=3)
tool_choices = st.one_of(st.sampled_from(["none", "auto", "required", "any"]),
                         st.fixed_dictionaries({"type": st.just("function"), "function":
                                                st.fixed_dictionaries({"name": some(
                                                    st.sampled_from(["get_weather", "g"]))})}),
                         odd)
regexes = st.sampled_from(["[a-z]{1,3}", "(yes|no)", r"\\d+", "(", "a**", "", "[z-a]"])
grammars = st.sampled_from(['root ::= "yes" | "no"', 'root ::= [a-z]+', "root ::= ",
                            "root ::= x", 'root ::= "a" root?', "nonsense"])
choices = some(st.lists(some(short, st.integers()), max_size=3))
response_formats = some(st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object"])}),
    st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": some(
        st.fixed_dictionaries({"name": some(short)},
                              optional={"schema": some(schemas), "strict": st.booleans()}))}),
    st.fixed_dictionaries({"type": st.just("structural_tag"), "format": odd}),
    st.fixed_dictionaries({"type": st.sampled_from(["json", "regex", ""])})))
structured_outputs = st.one_of(
    st.fixed_dictionaries({"regex": regexes}), st.fixed_dictionaries({"choice": choices}),
    st.fixed_dictionaries({"grammar": grammars}), st.fixed_dictionaries({"json": schemas}),
    st.fixed_dictionaries({"json_object": some(st.just(True))}),
    st.fixed_dictionaries({"regex": regexes, "choice": choices}), odd)
# Templates that stay small whatever they are given (their size and time bounds are
# another test's): each touches the nested inputs in its own way.
templates = st.sampled_from([
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    "{% for m in messages %}{{ m.content | tojson }}{% endfor %}{{ tools | tojson }}",
    "{{ messages[0].tool_calls[0].function.arguments.a }}",
    "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.name }}"
    "{% endfor %}{% endfor %}",
    "{{ raise_exception('refused by the template') }}", "{% if %}", "{{ 1 / 0 }}",
    "{{ documents | length }}{{ x.y.z }}", "{{ messages.__class__ }}", "",
    "{{ bos_token }}{% for m in messages %}{{ m['content'][0]['text'] }}{% endfor %}"])
template_kwargs = some(st.dictionaries(
    st.sampled_from(["enable_thinking", "x", "bos_token", "add_generation_prompt", "tools",
                     "chat_template", "messages", "conversation"]), json_values, max_size=2))


@st.composite
def nested_requests(draw):
    """A chat, tokenize, completion or /generate body built around nested structures."""
    path = draw(st.sampled_from(["/v1/chat/completions"] * 4 + ["/tokenize",
                                "/v1/completions", "/generate"]))
    if path == "/generate":
        name, value = draw(st.sampled_from([("regex", regexes), ("ebnf", grammars),
                                            ("json_schema", schemas.map(json.dumps)),
                                            ("json_schema", odd),
                                            ("n", st.one_of(st.integers(0, 3), odd))]))
        sp = {"max_new_tokens": 4, name: draw(value)}
        return path, {"text": "Hello", "sampling_params": sp}
    spec = {"response_format": response_formats, "structured_outputs": structured_outputs,
            "guided_regex": regexes, "guided_grammar": grammars, "guided_choice": choices,
            "guided_json": some(schemas)}
    if path == "/v1/completions":
        field = draw(st.sampled_from(sorted(spec)))
        return path, {"prompt": "Hello", "max_tokens": 4, field: draw(spec[field])}
    body: dict = {"messages": draw(some(messages, st.sampled_from(["hi", {}, [], [3], None])))}
    if path == "/tokenize":
        return path, body
    body["max_tokens"] = 4
    optional = {"tools": tools, "tool_choice": tool_choices, "chat_template": templates,
                "chat_template_kwargs": template_kwargs, "parallel_tool_calls": some(
                    st.booleans()), "documents": some(st.lists(odd, max_size=2)),
                "continue_final_message": st.booleans(), "add_generation_prompt":
                st.booleans(), "stream": st.booleans(), **spec}
    for field in draw(st.lists(st.sampled_from(sorted(optional)), max_size=3, unique=True)):
        body[field] = draw(optional[field])
    return path, body


@pytest.fixture(scope="module")
def smollm2_server():
    config = EngineConfig.from_kwargs(dtype="float32", max_model_len=96, max_num_seqs=8,
                                      kv_cache_memory="256MiB")
    settings = {"log_stats_interval": 0, "header_timeout": 5.0}
    if "trust_request_chat_template" in ServerSettings.__dataclass_fields__:
        settings["trust_request_chat_template"] = True  # so that templates are rendered
    srv = ServerThread(config, ServerSettings(**settings))
    srv.start(timeout=300)
    yield srv
    srv.stop()


def check_response(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:500])
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        events = [e for e in r.text.split("\n\n") if e.strip()]
        assert events and events[-1] == "data: [DONE]", r.text[-300:]
        for e in events[:-1]:
            assert e.startswith("data: "), e[:200]
            json.loads(e[6:])
    else:
        body = json.loads(r.text)  # every answer is JSON, errors included
        if r.status_code >= 400:
            error = body["error"]
            assert set(error) == {"message", "type", "param", "code"}, body
            assert isinstance(error["message"], str) and error["message"], body


def assert_idle_soon(srv: ServerThread, timeout: float = 10.0) -> None:
    """Idle, no KV block in use, invariants whole (a stream's end may lag its answer)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            assert_idle_and_clean(srv)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.slow
def test_fuzz_every_route_and_field(smollm2_server):
    srv = smollm2_server
    client = httpx.Client(base_url=srv.url, timeout=60)

    statuses: dict[int, int] = {}

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(requests())
    def one(req):
        path, body, headers = req
        r = client.post(path, content=body, headers=headers)
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        check_response(r)

    one()
    print("fuzz statuses:", statuses)
    assert statuses.get(200) and statuses.get(400), statuses  # both paths were exercised
    assert client.get("/health").status_code == 200
    assert_idle_soon(srv)
    out = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 20}).json()
    assert out["choices"][0]["message"]["content"] == "The capital of France is Paris."
    client.close()


@pytest.mark.slow
def test_fuzz_nested_messages_tools_grammars_and_templates(smollm2_server):
    srv = smollm2_server
    client = httpx.Client(base_url=srv.url, timeout=60)
    statuses: dict[int, int] = {}

    @settings(max_examples=2 * EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(nested_requests())
    def one(req):
        path, body = req
        r = client.post(path, content=json.dumps(body).encode(),  # escapes lone surrogates
                        headers={"content-type": "application/json"})
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
        check_response(r)
        if r.status_code == 400:
            param = str(r.json()["error"]["param"]).split(".")[0]
            refused[param] = refused.get(param, 0) + 1

    refused: dict[str, int] = {}
    one()
    print("nested fuzz statuses:", statuses, "400s by field:", refused)
    assert statuses.get(200) and statuses.get(400), statuses  # both paths were exercised
    assert client.get("/health").status_code == 200
    assert_idle_soon(srv)
    client.close()
