"""Property-based fuzzing of every route and field, against the real SmolLM2 server.

Each example takes a valid body and replaces or adds fields with arbitrary JSON
(wrong types, huge and non-finite numbers, huge strings, odd Unicode), or sends a
body that is not JSON at all. Properties, per example: never a 5xx (there is no
shutdown here), always a JSON body (or, for a stream, SSE events that parse). After
all of them: the engine is healthy, the block invariant holds, and the next greedy
request still answers "The capital of France is Paris."

CI runs a bounded number of examples; a nightly run sets RIDGELINE_FUZZ_EXAMPLES
(e.g. 2000) for more.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.config import EngineConfig, ServerSettings
from tests.server_harness import ServerThread

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


@pytest.fixture(scope="module")
def smollm2_server():
    config = EngineConfig.from_kwargs(dtype="float32", max_model_len=96, max_num_seqs=8,
                                      kv_cache_memory="256MiB")
    srv = ServerThread(config, ServerSettings(log_stats_interval=0, header_timeout=5.0))
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
        json.loads(r.text)  # every answer is JSON, errors included


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
    srv.call(srv.engine.core.check_invariants)
    out = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0, "max_tokens": 20}).json()
    assert out["choices"][0]["message"]["content"] == "The capital of France is Paris."
    client.close()
