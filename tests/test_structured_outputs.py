"""Structured outputs through the real server: whatever the model (a tiny random one
here), the output parses and validates against the schema; regex, choice, grammar;
every spelling of the fields; bad specs are 400s naming their field."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from app import LLM, SamplingParams
from app.engine.grammar import StructuredOutput
from tests.server_harness import ServerThread, assert_idle_and_clean, tiny_config

pytest.importorskip("xgrammar")

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 18, "maximum": 99}},
     "required": ["name", "age"]},
    {"type": "object", "properties": {
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                 "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            "floor": {"type": "integer", "minimum": -2, "maximum": 40}},
            "required": ["zip", "floor"]}},
     "required": ["role", "tags", "address"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"},
                                      "score": {"type": "integer", "minimum": 0,
                                                "maximum": 100}},
     "required": ["ok", "score"]},
]


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_model_len=512, max_num_seqs=16)).start()
    yield srv
    srv.stop()


def chat(srv, **body):
    return httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Give me JSON."}], "max_tokens": 200, **body})


def sse_text(raw: str, chat_endpoint: bool = True) -> str:
    events = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    key = ("delta", "content") if chat_endpoint else ("text",)
    out = ""
    for ev in events:
        for c in ev.get("choices", []):
            value = c
            for k in key:
                value = (value or {}).get(k)
            out += value or ""
    return out


@pytest.mark.parametrize("schema", SCHEMAS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("stream", [False, True])
def test_output_validates_against_the_schema(server, schema, temperature, stream):
    r = chat(server, temperature=temperature, seed=7, stream=stream, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    assert r.status_code == 200, r.text
    if stream:
        text = sse_text(r.text)
        assert '"finish_reason":"stop"' in r.text
    else:
        choice = r.json()["choices"][0]
        text = choice["message"]["content"]
        assert choice["finish_reason"] == "stop"  # the end of the grammar ended it
    jsonschema.validate(json.loads(text), schema)


def test_every_spelling_of_a_structured_output(server):
    schema = SCHEMAS[2]
    for extra in ({"structured_outputs": {"json": schema}}, {"guided_json": schema},
                  {"guided_json": json.dumps(schema)}):
        r = chat(server, temperature=0, **extra)
        assert r.status_code == 200, (extra, r.text)
        jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), schema)
    obj = chat(server, temperature=0.8, seed=3, max_tokens=60,
               response_format={"type": "json_object"}).json()["choices"][0]
    if obj["finish_reason"] == "stop":
        assert isinstance(json.loads(obj["message"]["content"]), dict)
    for extra in ({"structured_outputs": {"regex": r"[0-9]{3}-[a-z]{2}"}},
                  {"guided_regex": r"[0-9]{3}-[a-z]{2}"}):
        text = chat(server, temperature=1.0, seed=1, **extra).json()["choices"][0]
        assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text["message"]["content"])
    for extra in ({"structured_outputs": {"choice": ["red", "green", "blue"]}},
                  {"guided_choice": ["red", "green", "blue"]}):
        text = chat(server, temperature=1.0, **extra).json()["choices"][0]["message"]["content"]
        assert text in ("red", "green", "blue")
    ebnf = 'root ::= "yes" | "no" | "maybe"'
    text = chat(server, structured_outputs={"grammar": ebnf}).json()["choices"][0]["message"]
    assert text["content"] in ("yes", "no", "maybe")
    completion = httpx.post(server.url + "/v1/completions", json={
        "prompt": "JSON:", "max_tokens": 100, "response_format": {
            "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}).json()
    jsonschema.validate(json.loads(completion["choices"][0]["text"]), schema)
    generated = httpx.post(server.url + "/generate", json={"text": "JSON:", "sampling_params": {
        "max_new_tokens": 100, "json_schema": json.dumps(schema)}}).json()
    jsonschema.validate(json.loads(generated["text"]), schema)
    assert_idle_and_clean(server)


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objekt"}}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "array", "uniqueItems": True}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex"),
    ({"guided_grammar": 'root ::= "a" |'}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
])
def test_bad_specs_are_400s_naming_their_field(server, extra, param):
    r = chat(server, **extra)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


def test_offline_llm_takes_a_structured_output(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256)
    try:
        sp = SamplingParams(max_tokens=100, temperature=0.9, seed=5,
                            structured=StructuredOutput.json_schema(SCHEMAS[0]))
        outs = llm.generate(["a", "b", "c"], sp, use_tqdm=False)
        for out in outs:
            jsonschema.validate(json.loads(out.text), SCHEMAS[0])
            assert out.finish_reason == "stop"
        llm.engine.check_invariants()
    finally:
        llm.shutdown()
