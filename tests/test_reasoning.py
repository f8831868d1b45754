"""`--reasoning-parser`: `<think>…</think>` split from the answer.

The parser fed known text (whole, and in every chunking: a tag split across deltas), the
grammar that moves a structured output after the thinking (checked with xgrammar), and
the chat route end to end: the tiny model's output is forced to a known text by a regex
(with the after-thinking wrap turned off, so that the regex covers the thinking too), and
the server splits it, streamed and not.
"""

from __future__ import annotations

import json

import httpx
import pytest

from app.config import ServerSettings
from app.engine.grammar import StructuredOutput
from app.server import openai_chat as openai_routes
from app.server.reasoning import ReasoningStream, structured_after_reasoning
from app.server.structured import compiled
from tests.server_harness import ServerThread, assert_idle_and_clean, tiny_config

CASES = {  # text: (qwen3's split, deepseek_r1's split)
    "<think>abc</think>\n\nhello": (("abc", "hello"), ("abc", "hello")),
    "abc</think>hi": ((None, "abc</think>hi"), ("abc", "hi")),
    "no thinking here": ((None, "no thinking here"), ("no thinking here", None)),
    "<think>cut off by max_tokens": (("cut off by max_tokens", None),) * 2,
    "<think></think>answer": (("", "answer"),) * 2,
    "a < b, </thi": ((None, "a < b, </thi"), ("a < b, </thi", None)),
    "<think>x</think>y <think>z": (("x", "y <think>z"),) * 2,
}


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
@pytest.mark.parametrize("text", sorted(CASES))
def test_the_split_is_the_same_whole_and_in_any_chunking(parser, text):
    want = CASES[text][0 if parser == "qwen3" else 1]
    assert ReasoningStream(parser).split(text) == want
    for size in (1, 2, 3, 5):
        s, reasoning, content = ReasoningStream(parser), "", ""
        for k in range(0, len(text), size):
            r, c = s.feed(text[k:k + size])
            reasoning, content = reasoning + r, content + c
        r, c = s.finish()
        assert (reasoning + r, content + c) == (want[0] or "", want[1] or "")


def test_no_tag_text_leaks_while_a_tag_is_split_across_deltas():
    s = ReasoningStream("qwen3")
    assert s.feed("<th") == ("", "")
    assert s.feed("ink>ab</") == ("ab", "")
    assert s.feed("think>\n") == ("", "")
    assert s.feed("\nok") == ("", "ok")


def test_structured_output_is_moved_after_the_thinking():
    xgr = pytest.importorskip("xgrammar")
    schema = StructuredOutput.json_schema({"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]})

    def accepts(so: StructuredOutput, text: str) -> bool:
        grammar = xgr.Grammar.from_structural_tag(so.spec)
        return xgr.testing._is_grammar_accept_string(grammar, text)

    qwen = structured_after_reasoning(schema, "qwen3")
    assert accepts(qwen, '<think>let me see {not json</think>\n\n{"a":1}')
    assert accepts(qwen, '{"a":1}')  # qwen3 may skip thinking
    assert not accepts(qwen, '<think>x</think>hello')
    assert not accepts(qwen, 'hello')
    r1 = structured_after_reasoning(schema, "deepseek_r1")
    assert accepts(r1, 'thinking, no opening tag</think>{"a":2}')
    assert not accepts(r1, '{"a":2}')  # deepseek_r1 always thinks first


def _literal(text: str) -> str:
    """A regex matching `text` exactly."""
    return "".join("\\" + ch if ch in "\\.^$*+?()[]{}|/" else ch for ch in text)


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir), ServerSettings(
        log_stats_interval=0, reasoning_parser="qwen3")).start()
    yield srv
    srv.stop()


@pytest.fixture
def forced(monkeypatch):
    """Regexes cover the whole output (thinking included), to force a known text."""
    pytest.importorskip("xgrammar")

    async def whole_output(request, wanted, parser):
        return await compiled(request, wanted)
    monkeypatch.setattr(openai_routes, "compiled_for_answer", whole_output)


def chat(srv, text: str, **extra) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
            "temperature": 0, "structured_outputs": {"regex": _literal(text)}, **extra}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=60)


def streamed(srv, text: str, **extra) -> tuple[list[str], list[str], str]:
    reasoning, content, finish = [], [], None
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 60,
            "temperature": 0, "structured_outputs": {"regex": _literal(text)}, "stream": True,
            **extra}
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            if delta.get("reasoning_content"):
                reasoning.append(delta["reasoning_content"])
            if delta.get("content"):
                content.append(delta["content"])
            finish = choice["finish_reason"] or finish
    return reasoning, content, finish


def test_chat_splits_reasoning_streamed_and_not(server, forced):
    text = "<think>two plus two\nis four</think>\n\nThe answer is 4."
    message = chat(server, text).json()["choices"][0]["message"]
    assert message["reasoning_content"] == "two plus two\nis four"
    assert message["content"] == "The answer is 4."
    reasoning, content, finish = streamed(server, text)
    assert "".join(reasoning) == "two plus two\nis four" and len(reasoning) > 1
    assert "".join(content) == "The answer is 4." and finish == "stop"
    assert_idle_and_clean(server)


def test_reasoning_switches_are_honoured(server, forced):
    text = "<think>hmm, let me think</think>ok"
    plain = chat(server, text, include_reasoning=False).json()["choices"][0]["message"]
    assert "reasoning_content" not in plain and plain["content"] == "ok"
    raw = chat(server, text, separate_reasoning=False).json()["choices"][0]["message"]
    assert raw["content"] == text and "reasoning_content" not in raw
    reasoning, content, _ = streamed(server, text, stream_reasoning=False)
    assert reasoning == ["hmm, let me think"] and "".join(content) == "ok"


def test_tool_calls_are_parsed_from_the_answer_only(server, forced):
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    thought = chat(server, f"<think>{call}</think>no call", tools=tools).json()["choices"][0]
    assert thought["message"]["content"] == "no call" and not thought["message"].get(
        "tool_calls") and thought["finish_reason"] == "stop"
    assert call in thought["message"]["reasoning_content"]
    answered = chat(server, f"<think>x</think>{call}", tools=tools).json()["choices"][0]
    assert answered["finish_reason"] == "tool_calls"
    assert answered["message"]["tool_calls"][0]["function"]["name"] == "f"
