"""The hermes tool-call parser, whole and streamed, the default tool prompt's rendering
of a tool-using conversation, and the grammars that force calls."""

from __future__ import annotations

import json
import random

import pytest

from app.server.tools import ToolCallStream, grammar_for, parse, render

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CALC = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}

TEXTS = [
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    "</tool_call>",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon \\"x\\" {}"}}\n</tool_call>'
    '\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": 3}]}}\n</tool_call>',
    "No tools needed: 3 < 4 and <tool_ is not a tag.",
    "<tool_call>not json</tool_call> after",
    # A forced call's grammar lets an argument's string hold anything, the end tag too.
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris</tool_call>x"}}\n'
    "</tool_call>",
]


def test_whole_output_parsing():
    content, calls = parse(TEXTS[0])
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("call_") and calls[0]["type"] == "function"
    content, calls = parse(TEXTS[1])
    assert content is None and len(calls) == 2
    assert json.loads(calls[1]["function"]["arguments"]) == {"a": 1, "b": [2, {"c": 3}]}
    assert parse(TEXTS[1], parallel=False)[1][0]["function"]["name"] == "get_weather"
    assert len(parse(TEXTS[1], parallel=False)[1]) == 1
    assert parse(TEXTS[2]) == (TEXTS[2], [])
    assert parse(TEXTS[3]) == (TEXTS[3], [])  # not a call: stays text
    content, calls = parse(TEXTS[4])  # the tag inside the string does not close the block
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {
        "city": "Paris</tool_call>x"}
    # A block whose JSON never closes, in an output that ended on its own: text.
    broken = '<tool_call>{"name": "f", "arguments": {oops</tool_call> after'
    assert parse(broken) == (broken, [])


@pytest.mark.parametrize("text", TEXTS[:3] + TEXTS[4:])
@pytest.mark.parametrize("seed", range(5))
def test_streamed_parsing_matches_whole_parsing_however_it_is_split(text, seed):
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    stream, content, args, names = ToolCallStream(), "", {}, {}
    for piece in pieces:
        c, deltas = stream.feed(piece)
        content += c
        assert len({d["index"] for d in deltas}) == len(deltas)  # one entry an index
        for d in deltas:
            if "id" in d:
                names[d["index"]] = d["function"]["name"]
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    content += stream.finish()
    whole_content, whole_calls = parse(text)
    assert content.strip() == (whole_content or "").strip()
    assert [names[i] for i in sorted(names)] == [c["function"]["name"] for c in whole_calls]
    assert [json.loads(args[i]) for i in sorted(args)] == \
        [json.loads(c["function"]["arguments"]) for c in whole_calls]


def test_a_tool_using_conversation_renders_for_a_template_without_tools():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    out, kwargs = render(messages, [WEATHER], native=False)
    assert kwargs == {}
    assert out[0]["role"] == "system" and "Be brief." in out[0]["content"]
    assert "<tools>" in out[0]["content"] and '"get_weather"' in out[0]["content"]
    assert out[2]["role"] == "assistant" and out[2]["content"].startswith("<tool_call>")
    assert json.loads(out[2]["content"].split("\n")[1]) == {
        "name": "get_weather", "arguments": {"city": "Paris"}}
    assert out[3] == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    assert all(isinstance(m["content"], str) for m in out)
    native, kw = render(messages, [WEATHER], native=True)
    assert kw == {"tools": [WEATHER]}
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}


def test_forcing_grammars_compile_and_accept_only_calls():
    xgr = pytest.importorskip("xgrammar")
    from models.resolve import resolve_model
    from models.tokenizer import load_tokenizer, transformers_tokenizer

    tok = transformers_tokenizer(load_tokenizer(resolve_model(None)))
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152))

    def accepts(so, text):
        m = xgr.GrammarMatcher(compiler.compile_structural_tag(so.spec))
        return m.accept_string(text) and m.is_completed()

    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    add = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    required = grammar_for([WEATHER, CALC], "required", parallel=True)
    assert accepts(required, call) and accepts(required, call + "\n" + add)
    assert not accepts(required, "Sure! " + call)
    single = grammar_for([WEATHER, CALC], "required", parallel=False)
    assert accepts(single, add) and not accepts(single, call + "\n" + add)
    named = grammar_for([WEATHER, CALC], {"type": "function", "function": {"name": "add"}},
                        parallel=True)
    assert accepts(named, add) and not accepts(named, call)
    assert grammar_for([WEATHER], "auto", parallel=True) is None
    with pytest.raises(ValueError, match="not among the tools"):
        grammar_for([WEATHER], {"type": "function", "function": {"name": "nope"}}, True)
