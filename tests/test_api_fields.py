"""Nothing silently ignored: walk the field table of docs/api.md against the server.

Every field the table lists is checked for what the table says: an ignored field
changes nothing (the greedy output is the same with and without it); a field accepted
only at its "off" value takes that value and refuses another with a 400 naming it; a
refused field is a 400 naming it; an honoured field is one the body model declares.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

from app.server.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from tests.server_harness import ServerThread, tiny_config

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"
ENDPOINTS = {"completions": ("/v1/completions", CompletionRequest),
             "chat": ("/v1/chat/completions", ChatCompletionRequest)}
BASE = {"completions": {"prompt": "Hello there", "max_tokens": 6, "temperature": 0,
                        "ignore_eos": True},
        "chat": {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 6,
                 "temperature": 0, "ignore_eos": True}}
# A value for each field the table says is ignored, and a non-"off" value for each
# field accepted only at its "off" value.
SOME_VALUE = {"user": "u-1", "store": True, "metadata": {"k": "v"}, "service_tier": "auto",
              "prediction": {"type": "content", "content": "x"}, "include_reasoning": True,
              "separate_reasoning": True, "stream_reasoning": True}
NOT_OFF = {"best_of": 2, "return_hidden_states": True, "guided_decoding_backend": "outlines",
           "spaces_between_special_tokens": False, "use_beam_search": True,
           "length_penalty": 2.0, "truncate_prompt_tokens": 5, "reasoning_effort": "high",
           "stream_options.continuous_usage_stats": True, "suffix": "tail", "echo": True}
REFUSED = ["functions", "function_call", "modalities", "audio"]


def table_rows():
    """(field, endpoints, treatment, off values) from the first table of docs/api.md."""
    text = DOC.read_text()
    table = text[text.index("| field | treatment |"):].split("\n\n")[0]
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        names, treatment = cells[0], cells[1]
        scope = ("completions",) if "(completions)" in names else (
            ("chat",) if "(chat)" in names else ("completions", "chat"))
        offs = [_value(v) for v in re.findall(r"`([^`]+)`", treatment)]
        for name in re.findall(r"`([^`]+)`", names):
            yield name, scope, treatment.split(" ")[0], offs


def _value(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


ROWS = list(table_rows())


def test_the_table_covers_the_fields_the_code_declares():
    documented = {name.split(".")[0] for name, *_ in ROWS}
    for _, model in ENDPOINTS.values():
        declared = {model.model_fields[f].alias or f for f in model.model_fields}
        declared |= set(model.IGNORED) | set(model.ONLY_DEFAULT)
        assert declared <= documented | {"prompt"}, declared - documented


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir)).start()
    yield srv
    srv.stop()


def post(srv, endpoint: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + ENDPOINTS[endpoint][0], json=body, timeout=60)


def with_field(body: dict, name: str, value) -> dict:
    body = json.loads(json.dumps(body))
    if name == "stream_options.continuous_usage_stats":
        body.update(stream=True, stream_options={"continuous_usage_stats": value})
    else:
        body[name] = value
    return body


def text_of(r: httpx.Response, endpoint: str) -> str:
    choice = r.json()["choices"][0]
    return choice["text"] if endpoint == "completions" else choice["message"]["content"]


@pytest.mark.parametrize("name,scope,treatment,offs",
                         [r for r in ROWS if r[2] in ("ignored", "only")], ids=lambda x: str(x))
def test_ignored_and_off_only_fields(server, name, scope, treatment, offs):
    for endpoint in scope:
        base = BASE[endpoint]
        if treatment == "ignored":
            r = post(server, endpoint, with_field(base, name, SOME_VALUE[name]))
            assert r.status_code == 200, r.text
            assert text_of(r, endpoint) == text_of(post(server, endpoint, base), endpoint)
            continue
        for off in offs:
            r = post(server, endpoint, with_field(base, name, off))
            assert r.status_code == 200, (name, off, r.text)
        r = post(server, endpoint, with_field(base, name, NOT_OFF[name]))
        assert r.status_code == 400, (name, r.text)
        assert r.json()["error"]["param"] == name


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_unknown_and_refused_fields_are_400s_naming_them(server, endpoint):
    for name in [*REFUSED, "no_such_field"]:
        r = post(server, endpoint, with_field(BASE[endpoint], name, "x"))
        assert r.status_code == 400
        assert name in r.json()["error"]["message"]


def test_honoured_fields_are_declared():
    for name, scope, treatment, _ in ROWS:
        if treatment != "honoured":
            continue
        for endpoint in scope:
            model = ENDPOINTS[endpoint][1]
            names = {model.model_fields[f].alias or f for f in model.model_fields}
            top = name.split(".")[0]
            assert top in names or (top == "stream_options" and
                                    "include_usage" in StreamOptions.model_fields), \
                (endpoint, name)
