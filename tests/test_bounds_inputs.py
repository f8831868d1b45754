"""Malformed inputs are 400s naming their field, and every sampling number has a range.

A client's mistake in a nested structure (a message's `tool_calls`, a tool call's
`function`) or a field a route does not support (`n` on /generate) is a 400 naming the
field's path before anything is queued, never a 500 after. Each sampling number is
refused past its documented range (`app/engine/sampling_params.py`), accepted at its
edge, and at its edges the sampler's float32 arithmetic stays finite and meaningful.

The real server on loopback with the tiny random Llama (real SmolLM2 tokenizer).
"""

from __future__ import annotations

import httpx
import pytest
import torch

from app.config import ServerSettings
from gpu.batch import SamplingRow
from gpu.sampler import Sampler
from tests.server_harness import ServerThread, assert_idle_and_clean, tiny_config

USER = {"role": "user", "content": "Hello"}
CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_num_seqs=8),
                       ServerSettings(log_stats_interval=0)).start()
    yield srv
    srv.stop()


@pytest.fixture
def queued(server, monkeypatch):
    """How many sequences the engine was asked to run."""
    calls = []
    real = server.engine.add_request
    monkeypatch.setattr(server.engine, "add_request",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    return calls


def chat(*history: dict, **extra) -> dict:
    return {"messages": [USER, *history, USER], "max_tokens": 2, **extra}


def assert_400(r: httpx.Response, param: str, words: str = "") -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    assert set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error


# -- /generate: n -------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [2, 0, 64])
def test_generate_refuses_n_before_anything_runs(server, queued, n, stream):
    r = httpx.post(server.url + "/generate", json={
        "text": "Hello", "stream": stream, "sampling_params": {"max_new_tokens": 4, "n": n}})
    assert_400(r, "sampling_params.n", "n must be 1")
    assert queued == []
    assert_idle_and_clean(server)


def test_generate_with_n_1_runs_one_sequence(server, queued):
    r = httpx.post(server.url + "/generate", json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 4, "n": 1}})
    assert r.status_code == 200, r.text
    assert len(queued) == 1


# -- messages and tool calls ---------------------------------------------------------------


MALFORMED = [
    ({"role": "assistant", "tool_calls": "x"}, "messages.1.tool_calls"),
    ({"role": "assistant", "tool_calls": {"function": {}}}, "messages.1.tool_calls"),
    ({"role": "assistant", "tool_calls": [3]}, "messages.1.tool_calls.0"),
    ({"role": "assistant", "tool_calls": [None]}, "messages.1.tool_calls.0"),
    ({"role": "assistant", "tool_calls": [{"function": None}]},
     "messages.1.tool_calls.0.function"),
    ({"role": "assistant", "tool_calls": [{"function": "x"}]},
     "messages.1.tool_calls.0.function"),
    ({"role": "assistant", "tool_calls": [{"id": "a"}]}, "messages.1.tool_calls.0.function"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"arguments": "{}"}}]},
     "messages.1.tool_calls.0.function.name"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": 5, "arguments": ""}}]},
     "messages.1.tool_calls.0.function.name"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": 3}}]},
     "messages.1.tool_calls.0.function.arguments"),
    ({"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]},
     "messages.1.tool_calls.0.type"),
    ({"role": "assistant", "tool_calls": [{**CALL, "id": 7}]}, "messages.1.tool_calls.0.id"),
    ({"role": "assistant", "tool_calls": [CALL, "x"]}, "messages.1.tool_calls.1"),
    ({"role": "tool", "content": "18 C", "tool_call_id": 5}, "messages.1.tool_call_id"),
    ({"role": "tool", "content": "18 C", "name": ["f"]}, "messages.1.name"),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/chat/completions/render",
                                  "/tokenize"])
@pytest.mark.parametrize("message,param", MALFORMED)
def test_a_malformed_message_is_a_400_naming_its_path(server, queued, path, message, param):
    body = chat(message)
    if path == "/tokenize":
        body = {"messages": body["messages"]}
    assert_400(httpx.post(server.url + path, json=body), param)
    assert queued == []


@pytest.mark.parametrize("tools", [None, [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}]])
@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}, "not json"])
def test_a_well_formed_tool_history_still_runs(server, tools, arguments):
    """An assistant's calls (arguments as OpenAI's string, or as an object) and the
    tool's answer, with and without tools in the request."""
    call = {**CALL, "index": 0, "function": {**CALL["function"], "arguments": arguments}}
    body = chat({"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}, tools=tools)
    r = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert_idle_and_clean(server)


@pytest.mark.parametrize("key", ["messages", "add_generation_prompt", "param", "tools",
                                 "conversation", "tokenizer"])
def test_chat_template_kwargs_cannot_set_what_the_render_takes(server, queued, key):
    """Either a TypeError (two values for one argument: was a 500) or a way around the
    request's own typed fields."""
    r = httpx.post(server.url + "/v1/chat/completions",
                   json=chat(chat_template_kwargs={key: "{{ 'x' }}"}))
    assert_400(r, "chat_template_kwargs", repr(key))
    assert queued == []


def test_other_chat_template_kwargs_still_reach_the_template(server):
    r = httpx.post(server.url + "/v1/chat/completions",
                   json=chat(chat_template_kwargs={"enable_thinking": False, "x": [1]}))
    assert r.status_code == 200, r.text


# -- ranges of the sampling numbers ---------------------------------------------------------

# (field, values accepted at the edges, values refused just past them and far past them)
RANGES = [
    ("temperature", [0.0, 2.0], [-1e-9, 2.0001, 1e9, 1e300]),
    ("top_p", [0.0, 1.0], [-1e-9, 1.0001]),
    ("min_p", [0.0, 1.0], [-1e-9, 1.0001]),
    ("presence_penalty", [-2.0, 2.0], [-2.0001, 2.0001]),
    ("frequency_penalty", [-2.0, 2.0], [-2.0001, 2.0001]),
    ("repetition_penalty", [0.01, 10.0], [0.0, 1e-300, 0.0099, 10.001]),
]
ROUTES = ["/v1/completions", "/v1/chat/completions", "/generate"]


def body_for(path: str, **sampling) -> dict:
    if path == "/v1/completions":
        return {"prompt": "Hello", "max_tokens": 4, **sampling}
    if path == "/v1/chat/completions":
        return {"messages": [USER], "max_tokens": 4, **sampling}
    return {"text": "Hello", "sampling_params": {"max_new_tokens": 4, **sampling}}


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("field,value", [(f, v) for f, ok, _ in RANGES for v in ok])
def test_each_sampling_number_is_accepted_at_its_edge(server, path, field, value):
    r = httpx.post(server.url + path, json=body_for(path, **{field: value}))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("path", ROUTES)
@pytest.mark.parametrize("field,value", [(f, v) for f, _, bad in RANGES for v in bad])
def test_each_sampling_number_is_refused_past_its_edge(server, queued, path, field, value):
    r = httpx.post(server.url + path, json=body_for(path, **{field: value}))
    param = field if path != "/generate" else f"sampling_params.{field}"
    assert_400(r, param, f"{field} must be in [")
    assert queued == []


@pytest.mark.parametrize("path", ["/v1/completions", "/generate"])
def test_logit_bias_values_have_openais_range(server, path):
    param = "logit_bias" if path != "/generate" else "sampling_params.logit_bias"
    for value in (-100.0, 100.0):
        r = httpx.post(server.url + path, json=body_for(path, logit_bias={"5": value}))
        assert r.status_code == 200, r.text
    for value in (-100.5, 100.5, 1e300):
        r = httpx.post(server.url + path, json=body_for(path, logit_bias={"5": value}))
        assert_400(r, param, "[-100, 100]")


# -- the arithmetic at the edges ------------------------------------------------------------


def test_the_sampler_stays_finite_and_meaningful_at_every_edge():
    """Every bound at its edge in one row: the repetition floor (0.01), the most negative
    presence and frequency penalties, the largest bias, the smallest temperature that
    samples and the largest. A repeated token then outweighs every other, so it is drawn:
    not NaN's token 0, not noise. Past the floor (1e-300, 0 in float32) it was token 0."""
    from gpu.cpu.kernels.build import cpu_kernels

    torch.manual_seed(0)
    vocab = 1000
    logits = torch.randn(4, vocab) * 8 + 20  # all positive: divided by the penalty
    prompt, biased = [7, 11, 13], 500
    kernels = [None, cpu_kernels() if not torch.cuda.is_available() else None]
    for kernel in kernels:
        rows = [SamplingRow(temperature=t, top_p=p, repetition_penalty=0.01,
                            presence_penalty=-2.0, frequency_penalty=-2.0,
                            logit_bias=((biased, 100.0),), prompt_token_ids=prompt,
                            output_token_ids=[7, 7], seed=i)
                for i, (t, p) in enumerate([(1e-5, 1.0), (2.0, 1.0), (2.0, 0.0), (1.0, 0.5)])]
        sampler = Sampler(torch.device("cpu"), kernels=kernel)
        tokens, _ = sampler(logits.clone(), rows)
        # A prompt token is 100x its logit (~2000) against the biased one (~120).
        assert all(t in prompt for t in tokens), (kernel, tokens)
        adjusted = logits.clone()
        sampler.penalties.apply_(adjusted, torch.arange(4), torch.tensor(
            [r.penalty_state.index for r in rows]), torch.full((4,), 0.01),
            torch.full((4,), -2.0), torch.full((4,), -2.0))
        assert torch.isfinite(adjusted / 1e-5).all()


def test_a_checkpoints_out_of_range_defaults_are_not_used(caplog):
    """Else every request that leaves temperature unset would be a 400 for a value the
    client never sent."""
    from app.engine.core import _usable
    from models.generation_config import parse_generation_config

    defaults = parse_generation_config({"temperature": 3.0, "top_p": 0.8, "top_k": 20,
                                        "repetition_penalty": 0.0, "max_new_tokens": 512})
    with caplog.at_level("WARNING"):
        usable = _usable(defaults)
    assert dict(usable.sampling) == {"top_p": 0.8, "top_k": 20, "max_tokens": 512}
    assert "temperature" in caplog.text and "repetition_penalty" in caplog.text
