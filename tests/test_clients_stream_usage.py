"""vLLM's `stream_options.continuous_usage_stats`: the usage so far in every streamed chunk.

guidellm sends `{"include_usage": true, "continuous_usage_stats": true}` on every
streamed request and keeps the last `usage` it sees in any chunk; each chunk's usage
is that chunk's choice's counts so far (vLLM's `serving_completion.py`/`serving_chat.py`).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server_harness import ServerThread, assert_idle_and_clean, tiny_config

CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_num_seqs=8)).start()
    yield srv
    srv.stop()


def events(srv, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.url + path, json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[5:].strip() for ln in r.iter_lines() if ln.startswith("data:")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def prompt_tokens(srv, text: str) -> int:
    return len(httpx.post(srv.url + "/tokenize", json={"prompt": text}).json()["tokens"])


def test_completions_every_chunk_carries_its_choice_usage_so_far(server):
    body = {"prompt": "Hello there", "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 1,
            "ignore_eos": True, "stream": True, "stream_options": CONTINUOUS}
    chunks = events(server, "/v1/completions", body)
    n_prompt = prompt_tokens(server, "Hello there")
    *per_choice, final = chunks
    assert final["choices"] == [] and final["usage"] == {
        "prompt_tokens": n_prompt, "completion_tokens": 12, "total_tokens": n_prompt + 12}
    seen = {0: [], 1: []}
    for ch in per_choice:
        (choice,) = ch["choices"]
        u = ch["usage"]
        assert u["prompt_tokens"] == n_prompt
        assert u["total_tokens"] == n_prompt + u["completion_tokens"]
        seen[choice["index"]].append(u["completion_tokens"])
    # one event per token here: the count so far rises by one per chunk, to max_tokens
    assert seen == {0: [1, 2, 3, 4, 5, 6], 1: [1, 2, 3, 4, 5, 6]}
    assert_idle_and_clean(server)


def test_chat_role_chunk_counts_zero_then_every_chunk_counts_so_far(server):
    messages = [{"role": "user", "content": "Say something"}]
    body = {"messages": messages, "max_tokens": 5, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": CONTINUOUS}
    chunks = events(server, "/v1/chat/completions", body)
    n_prompt = chunks[0]["usage"]["prompt_tokens"]
    assert n_prompt > prompt_tokens(server, "Say something")  # the template's tokens too
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[0]["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 0,
                                  "total_tokens": n_prompt}
    counts = [ch["usage"]["completion_tokens"] for ch in chunks[1:-1]]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    assert all(ch["usage"]["prompt_tokens"] == n_prompt for ch in chunks)


def test_without_include_usage_the_flag_adds_nothing(server):
    """vLLM's rule: continuous usage rides on include_usage."""
    body = {"prompt": "Hello", "max_tokens": 3, "ignore_eos": True, "stream": True,
            "stream_options": {"continuous_usage_stats": True}}
    chunks = events(server, "/v1/completions", body)
    assert all("usage" not in ch for ch in chunks) and len(chunks) == 3
    bad = dict(body, stream_options={"continuous_usage_stats": "yes"})
    r = httpx.post(server.url + "/v1/completions", json=bad)
    assert r.status_code == 400 and "continuous_usage_stats" in r.json()["error"]["param"]


def test_guidellm_reads_every_request(server):
    """guidellm's own parser where it installs, else the same reading: text from
    `choices[0].text`, usage from the last chunk that has one."""
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 8, "stop": None,
            "ignore_eos": True, "stream": True, "stream_options": CONTINUOUS}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = list(r.iter_lines())
    try:
        from guidellm.backends.openai.request_handlers import TextCompletionsResponseHandler
    except ImportError:
        texts, usage = [], None
        for line in lines:
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            data = json.loads(line[5:])
            if data.get("choices") and data["choices"][0].get("text"):
                texts.append(data["choices"][0]["text"])
            usage = data.get("usage") or usage
    else:
        handler = TextCompletionsResponseHandler()
        for line in lines:
            handler.add_streaming_line(line)
        texts, usage = handler.streaming_texts, handler.streaming_usage
    assert texts and usage["completion_tokens"] == 8
    assert usage["prompt_tokens"] == prompt_tokens(server, "one two three")
