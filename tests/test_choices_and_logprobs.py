"""`n > 1`, prompt logprobs and `echo` (scored as lm-evaluation-harness scores), and
`logit_bias`, through the real server; prefix-cache metrics and endpoints.

The tiny random Llama in fp32, so HF transformers is an exact reference."""

from __future__ import annotations

import json
import logging
import math

import httpx
import openai
import pytest
import torch

from app.config import ServerSettings
from tests.server_harness import ServerThread, assert_idle_and_clean, metric, tiny_config


@pytest.fixture(scope="module")
def server(tiny_dir):
    srv = ServerThread(tiny_config(tiny_dir, max_num_seqs=16),
                       ServerSettings(log_stats_interval=0.05)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def hf_tiny(tiny_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


def post(srv, path, body):
    r = httpx.post(srv.url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


# -- n > 1 ------------------------------------------------------------------------------------


def test_n_choices_with_seeds_are_reproducible_and_usage_sums(server):
    body = {"prompt": "Once upon a time", "max_tokens": 8, "n": 3, "seed": 11,
            "temperature": 1.0, "ignore_eos": True}
    a, b = post(server, "/v1/completions", body), post(server, "/v1/completions", body)
    texts = [c["text"] for c in sorted(a["choices"], key=lambda c: c["index"])]
    assert [c["index"] for c in a["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in sorted(b["choices"], key=lambda c: c["index"])]
    assert len(set(texts)) > 1  # each choice samples with its own stream
    prompt_tokens = len(post(server, "/tokenize", {"prompt": "Once upon a time"})["tokens"])
    assert a["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 24,
                          "total_tokens": prompt_tokens + 24}
    two = post(server, "/v1/completions", {**body, "prompt": ["a b", "c d"], "n": 2})
    assert sorted(c["index"] for c in two["choices"]) == [0, 1, 2, 3]
    assert_idle_and_clean(server)


def test_n_choices_stream_with_their_index_through_the_openai_sdk(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2,
        temperature=1.0, seed=3, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}))
    by_index: dict[int, str] = {}
    for ch in chunks:
        for c in ch.choices:
            by_index[c.index] = by_index.get(c.index, "") + (c.delta.content or "")
    assert sorted(by_index) == [0, 1]
    assert chunks[-1].usage.completion_tokens == 10
    full = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=5, n=2,
        temperature=1.0, seed=3, extra_body={"ignore_eos": True})
    assert [c.message.content for c in full.choices] == [by_index[0], by_index[1]]
    assert_idle_and_clean(server)


def test_n_is_bounded(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "n": 65})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


# -- prompt logprobs and echo ----------------------------------------------------------------------


@torch.inference_mode()
def hf_prompt_logprobs(model, ids: list[int]) -> list[float]:
    logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [float(lp[i, ids[i + 1]]) for i in range(len(ids) - 1)]


@pytest.mark.parametrize("ids", [[5, 17, 2049, 300, 12, 9, 4400, 31], list(range(100, 141))])
def test_echoed_prompt_logprobs_equal_transformers(server, hf_tiny, ids):
    out = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True,
                                           "logprobs": 2, "temperature": 0})
    lp = out["choices"][0]["logprobs"]
    assert lp["token_logprobs"][0] is None and len(lp["token_logprobs"]) == len(ids) + 1
    got = lp["token_logprobs"][1:len(ids)]
    assert got == pytest.approx(hf_prompt_logprobs(hf_tiny, ids), abs=1e-3)
    assert lp["top_logprobs"][0] is None and all(len(t) >= 1 for t in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert out["choices"][0]["text"].startswith(
        post(server, "/detokenize", {"tokens": ids})["prompt"])


def test_vllm_prompt_logprobs_field_and_max_tokens_zero(server, hf_tiny):
    ids = [42, 7, 1999, 64, 3]
    out = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 1,
                                           "temperature": 0})
    pl = out["choices"][0]["prompt_logprobs"]
    assert pl[0] is None and len(pl) == len(ids)
    expected = hf_prompt_logprobs(hf_tiny, ids)
    for i, entry in enumerate(pl[1:]):
        own = entry[str(ids[i + 1])]
        assert own["logprob"] == pytest.approx(expected[i], abs=1e-3) and own["rank"] >= 1
    zero = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 0, "echo": True,
                                            "logprobs": 0})
    lp = zero["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(ids)  # the prompt only: no generated token shown
    assert zero["usage"]["completion_tokens"] == 1  # vLLM's count: one was generated
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"


def test_multiple_choice_scored_the_way_lm_eval_scores_matches_transformers(server, hf_tiny):
    """lm-eval's local-completions loglikelihood: token-id prompts, echo, logprobs 1,
    max_tokens 1; it sums token_logprobs[ctxlen:-1] per choice and picks the highest."""
    questions = [([11, 305, 77, 12], [[900], [4021, 5], [88, 88, 88], [3]]),
                 ([5000, 6000], [[1], [2], [7000, 7001]])]
    for context, choices in questions:
        prompts = [context + c for c in choices]
        out = post(server, "/v1/completions", {"prompt": prompts, "max_tokens": 1, "echo": True,
                                               "logprobs": 1, "temperature": 0, "seed": 1234})
        ours = []
        for choice in sorted(out["choices"], key=lambda c: c["index"]):
            ours.append(sum(choice["logprobs"]["token_logprobs"][len(context):-1]))
        theirs = [sum(hf_prompt_logprobs(hf_tiny, p)[len(context) - 1:]) for p in prompts]
        assert ours == pytest.approx(theirs, abs=2e-3)
        assert max(range(len(ours)), key=ours.__getitem__) == \
            max(range(len(theirs)), key=theirs.__getitem__)
    assert_idle_and_clean(server)


def test_tokenizer_info_lets_lm_eval_use_the_server_tokenizer(server):
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] and info["tokenizer_class"] and info["model_max_length"] == 256
    assert "chat_template" in info
    ids = post(server, "/tokenize", {"prompt": "test", "add_special_tokens": False})["tokens"]
    assert isinstance(ids, list) and ids


# -- logit_bias ---------------------------------------------------------------------------------


def test_logit_bias_is_honoured_and_checked(server):
    def generate(**sampling):
        return post(server, "/generate", {"text": "The cat", "sampling_params": {
            "max_new_tokens": 3, "temperature": 0, "ignore_eos": True, **sampling}})

    greedy = generate()["output_ids"]
    banned = generate(logit_bias={str(greedy[0]): -100})["output_ids"]
    assert banned[0] != greedy[0]
    assert generate(logit_bias={"1000": 100})["output_ids"] == [1000] * 3
    body = {"prompt": "The cat", "max_tokens": 1, "temperature": 0}
    chosen = post(server, "/v1/completions", {**body, "logit_bias": {"1000": 100}})
    assert chosen["choices"][0]["text"] == post(server, "/detokenize",
                                                {"tokens": [1000]})["prompt"]
    for bias in ({"99999999": 1}, {"5": 101}, {"x": 1}):
        r = httpx.post(server.url + "/v1/completions", json={**body, "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", bias


# -- the prefix cache, seen from outside --------------------------------------------------------


def test_prefix_cache_metrics_stats_line_health_and_reset(server, caplog):
    caplog.set_level(logging.INFO, logger="ridgeline.stats")
    system = "You are a careful assistant who answers briefly. " * 6
    text0 = httpx.get(server.url + "/metrics").text
    for q in ("What is one?", "What is two?", "What is three?"):
        post(server, "/v1/completions", {"prompt": system + q, "max_tokens": 2})
    text = httpx.get(server.url + "/metrics").text
    queries = metric(text, "prefix_cache_queries_total") - metric(text0,
                                                                  "prefix_cache_queries_total")
    hits = metric(text, "prefix_cache_hits_total") - metric(text0, "prefix_cache_hits_total")
    block = 16
    n_system = len(post(server, "/tokenize", {"prompt": system})["tokens"])
    # The 2nd and 3rd requests find the system prompt's whole blocks (at least).
    assert hits >= 2 * (n_system // block - 1) * block and queries > hits
    assert metric(text, "kv_blocks_consistent") == 1
    assert any("Prefix cache hit rate" in r.getMessage() for r in caplog.records)
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["kv_blocks"]["consistent"]
    assert health["kv_blocks"]["cached"] > 0
    dropped = httpx.post(server.url + "/reset_prefix_cache").json()["dropped_blocks"]
    assert dropped == health["kv_blocks"]["cached"]
    assert httpx.get(server.url + "/health").json()["kv_blocks"]["cached"] == 0
    assert_idle_and_clean(server)


def test_prompt_logprobs_answers_are_bounded(server, monkeypatch):
    """The answer's entries (prompt tokens x (k + 1)) are capped: over the cap a 400
    naming prompt_logprobs before anything runs; at it, the answer, built off the loop."""
    from app.engine import sampling_params

    monkeypatch.setattr(sampling_params, "MAX_PROMPT_LOGPROB_ENTRIES", 50)
    ids = list(range(100, 110))  # 10 tokens
    over = httpx.post(server.url + "/v1/completions", json={
        "prompt": ids, "max_tokens": 1, "prompt_logprobs": 5})
    assert over.status_code == 400 and over.json()["error"]["param"] == "prompt_logprobs"
    assert "60 entries" in over.json()["error"]["message"]
    chat = httpx.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi " * 20}], "max_tokens": 1,
        "prompt_logprobs": 20})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_logprobs"
    at = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 4})
    assert len(at["choices"][0]["prompt_logprobs"]) == 10
    assert_idle_and_clean(server)


def test_prompt_logprobs_never_skip_computation_through_the_cache(server, hf_tiny):
    ids = list(range(300, 340))
    post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1})  # now cached
    out = post(server, "/v1/completions", {"prompt": ids, "max_tokens": 1, "echo": True,
                                           "logprobs": 0})
    got = out["choices"][0]["logprobs"]["token_logprobs"][1:len(ids)]
    assert got == pytest.approx(hf_prompt_logprobs(hf_tiny, ids), abs=1e-3)
    assert all(math.isfinite(x) for x in got)
    json.dumps(out)
