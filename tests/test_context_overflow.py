"""A prompt longer than the context, as the clients that classify it read it: OpenAI's
and vLLM's `code: context_length_exceeded` with vLLM's wording on Chat Completions,
Completions and Responses (the openai SDK's `BadRequestError.code`), and Anthropic's own
wording on `/v1/messages` ("prompt is too long: N tokens > M maximum")."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from app.config import ServerSettings
from tests.server_harness import ServerThread, assert_idle_and_clean, tiny_config

LEN = 256
LONG = "word " * 400  # past 256 tokens with any template


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_model_len=LEN),
                       ServerSettings(log_stats_interval=0)).start()
    yield srv
    srv.stop()


def test_openai_routes_say_context_length_exceeded(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    calls = {
        "chat": lambda: client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": LONG}], max_tokens=8),
        "completions": lambda: client.completions.create(model="tiny", prompt=LONG,
                                                         max_tokens=8),
        "responses": lambda: client.responses.create(model="tiny", input=LONG,
                                                     max_output_tokens=8),
    }
    for route, call in calls.items():
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.code == "context_length_exceeded", route
        assert f"This model's maximum context length is {LEN} tokens. However, you " \
               "requested" in e.value.message, route
        assert "in the messages, 8 in the completion" in e.value.message, route
    # Without max_tokens (what most clients send): the same answer, one token asked for.
    bare = httpx.post(server.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": LONG}]})
    assert bare.status_code == 400 and bare.json()["error"]["code"] == "context_length_exceeded"
    assert bare.json()["error"]["param"] == "prompt"
    # The prompt fits, the prompt and max_tokens do not: the same code, param max_tokens.
    fits = httpx.post(server.url + "/v1/completions", json={
        "model": "tiny", "prompt": [5] * 200, "max_tokens": 100})
    assert fits.status_code == 400 and fits.json()["error"]["code"] == "context_length_exceeded"
    assert fits.json()["error"]["param"] == "max_tokens"
    assert "requested 300 tokens (200 in the messages, 100 in the completion)" in \
        fits.json()["error"]["message"]
    assert_idle_and_clean(server)


def test_anthropic_messages_say_the_prompt_is_too_long(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=8,
                               messages=[{"role": "user", "content": LONG}])
    body = e.value.body["error"]
    assert body["type"] == "invalid_request_error"
    assert body["message"].startswith("prompt is too long: ")
    assert body["message"].endswith(f" tokens > {LEN} maximum")
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="tiny", max_tokens=200,
                               messages=[{"role": "user", "content": "word " * 100}])
    assert "input length and `max_tokens` exceed context limit" in e.value.body["error"][
        "message"]
    assert_idle_and_clean(server)
