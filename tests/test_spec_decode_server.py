"""Speculative decoding through the real HTTP server on loopback (tiny model): the
same tokens as the offline engine without it, streamed and whole, and its metrics."""

from __future__ import annotations

import json

import httpx
import pytest

from app import LLM, SamplingParams
from tests.server_harness import ServerThread, metric, tiny_config
from tests.test_spec_decode import SPEC, ScriptedProposer

PROMPT = [901, 902, 903, 904, 905] * 3


@pytest.fixture(scope="module")
def want(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256)
    ids = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0,
                                                ignore_eos=True), use_tqdm=False)[0].token_ids
    llm.shutdown()
    return ids


def test_server_streams_the_plain_tokens_and_counts_drafts(tiny_dir, want):
    srv = ServerThread(tiny_config(tiny_dir, speculative_config=SPEC)).start()
    try:
        srv.engine.core.speculator.proposer = ScriptedProposer({tuple(PROMPT): want})
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            whole = client.post("/v1/completions", json=body).json()
            text = whole["choices"][0]["text"]
            streamed = ""
            with client.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[6:])
                        if chunk["choices"]:
                            streamed += chunk["choices"][0]["text"]
            metrics = client.get("/metrics").text
        assert text == srv.engine.core.tokenizer.decode(want)
        assert streamed == text
        assert whole["usage"]["completion_tokens"] == 24
        drafts = metric(metrics, "spec_decode_num_drafts_total")
        accepted = metric(metrics, "spec_decode_num_accepted_tokens_total")
        assert drafts > 0 and 0 < accepted < metric(metrics,
                                                    "spec_decode_num_draft_tokens_total")
        assert metric(metrics, "spec_decode_num_accepted_tokens_per_pos_total",
                      'position="0"') > 0
        srv.engine.core.check_invariants()
    finally:
        srv.stop()
