"""`/v1/responses` with `--reasoning-parser`: the thinking is a `reasoning` item ahead of
the answer, streamed as `reasoning_text` events, carried to the next turn, and cut off
as an incomplete item. The tiny model's output is forced to a known text by a regex
that covers the whole output (the after-thinking wrap turned off), as in
tests/test_reasoning.py."""

from __future__ import annotations

import hashlib

import openai
import pytest

from app.config import ServerSettings
from app.engine.grammar import StructuredOutput
from app.server import responses as responses_routes
from app.server.structured import compiled
from tests.server_harness import ServerThread, assert_idle_and_clean, tiny_config
from tests.test_reasoning import _literal

TEXT = "<think>two plus two\nis four</think>\n\nThe answer is 4."


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir), ServerSettings(
        log_stats_interval=0, reasoning_parser="qwen3")).start()
    yield srv
    srv.stop()


@pytest.fixture
def client(server, monkeypatch):
    pytest.importorskip("xgrammar")
    literal = _literal(TEXT)
    monkeypatch.setattr(responses_routes, "_text_format",
                        lambda req: (StructuredOutput("regex", literal), "text.format"))

    async def whole_output(request, wanted, parser):
        return await compiled(request, wanted)
    monkeypatch.setattr(responses_routes, "compiled_for_answer", whole_output)
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_the_thinking_is_a_reasoning_item_streamed_and_not(server, client):
    body = dict(model="tiny", input="2+2?", temperature=0, max_output_tokens=60)
    whole = client.responses.create(**body)
    assert [o.type for o in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == "two plus two\nis four"
    assert whole.output_text == "The answer is 4."
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert "".join(deltas) == "two plus two\nis four" and len(deltas) > 1
    assert [o.type for o in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == whole.output[0].content[0].text
    assert final.output_text == whole.output_text
    # The next turn gets the thinking back as the assistant turn's reasoning_content.
    owner = hashlib.sha256(b"unused").hexdigest()  # the client's key, as the store keys it
    stored = server.app.state.response_store.get(whole.id, owner)
    assert stored.conversation[-1]["reasoning_content"] == "two plus two\nis four"
    assert stored.conversation[-1]["content"] == "The answer is 4."
    assert_idle_and_clean(server)


def test_thinking_cut_off_is_an_incomplete_reasoning_item(server, client):
    out = client.responses.create(model="tiny", input="2+2?", temperature=0,
                                  max_output_tokens=4)
    assert out.status == "incomplete"
    assert [(o.type, o.status) for o in out.output] == [("reasoning", "incomplete")]
    assert out.output_text == ""
