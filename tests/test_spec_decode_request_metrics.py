"""Per-request acceptance (`--per-request-spec-decode-metrics`, vLLM's flag and shape):
on the offline engine's final outputs, and in the response's `metrics.speculative_decoding`
through the real server (whole and streamed, one sequence only). The requests' counts add
up to the engine's totals, which `/metrics` exports."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest

from app import LLM, SamplingParams
from tests.server_harness import ServerThread, metric, tiny_config
from tests.test_spec_decode import SPEC, ScriptedProposer, make_llm

PROMPTS = [[901, 902, 903, 904, 905] * 3, [11, 12, 13, 14] * 4, [70, 71, 72] * 5]
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
KEYS = {"mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram",
        "num_spec_steps", "num_accepted_draft_tokens", "num_draft_tokens", "num_spec_tokens"}


@pytest.fixture(scope="module")
def want(tiny_dir):
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=256)
    ids = {tuple(p): o.token_ids for p, o in zip(PROMPTS, llm.generate(PROMPTS, GREEDY,
                                                                         use_tqdm=False))}
    llm.shutdown()
    return ids


def check(d: dict) -> None:
    """The summary's own arithmetic (vLLM's definitions)."""
    assert KEYS <= set(d)
    hist, steps = d["acceptance_histogram"], d["num_spec_steps"]
    assert len(hist) == d["num_spec_tokens"] + 1 == SPEC["num_speculative_tokens"] + 1
    assert sum(hist) == steps
    assert sum(j * c for j, c in enumerate(hist)) == d["num_accepted_draft_tokens"]
    assert d["num_accepted_draft_tokens"] <= d["num_draft_tokens"] <= steps * d["num_spec_tokens"]
    if steps:
        assert d["mean_acceptance_length"] == pytest.approx(
            1 + d["num_accepted_draft_tokens"] / steps)
        assert d["draft_acceptance_rate"] == pytest.approx(
            d["num_accepted_draft_tokens"] / d["num_draft_tokens"])


@pytest.mark.parametrize("level", ["none", "summary", "detailed"])
def test_offline_outputs_carry_each_requests_acceptance(tiny_dir, want, level):
    llm = make_llm(tiny_dir, SPEC, max_model_len=256, per_request_spec_decode_metrics=level)
    llm.engine.speculator.proposer = ScriptedProposer(want)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    one = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1), use_tqdm=False)[0]
    total = llm.engine.speculator.total
    llm.shutdown()
    assert [o.token_ids for o in outs] == [want[tuple(p)] for p in PROMPTS]
    if level == "none":
        assert all(o.spec_decode_metrics is None for o in outs)
        return
    got = [o.spec_decode_metrics.to_dict() for o in outs]
    for d in got:
        check(d)
        assert d["num_spec_steps"] > 0
        assert ("per_step_accepted" in d) == (level == "detailed")
        if level == "detailed":
            assert len(d["per_step_accepted"]) == d["num_spec_steps"]
            assert sum(d["per_step_accepted"]) == d["num_accepted_draft_tokens"]
            assert sum(d["per_step_drafted"]) == d["num_draft_tokens"]
    assert sum(d["num_spec_steps"] for d in got) == total.num_drafts
    assert sum(d["num_draft_tokens"] for d in got) == total.num_draft_tokens
    assert sum(d["num_accepted_draft_tokens"] for d in got) == total.num_accepted_tokens
    # A request that never drafted reports zero steps, as vLLM's does.
    d = one.spec_decode_metrics.to_dict()
    assert d["num_spec_steps"] == 0 and d["mean_acceptance_length"] == 1.0
    assert d["draft_acceptance_rate"] == 0.0


def test_server_reports_acceptance_for_one_sequence(tiny_dir, want):
    srv = ServerThread(tiny_config(tiny_dir, speculative_config=SPEC,
                                   per_request_spec_decode_metrics="summary")).start()
    try:
        # Drafts for the known prompts; none for the chat prompt.
        srv.engine.core.speculator.proposer = ScriptedProposer(defaultdict(list, want))
        body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0,
                "ignore_eos": True}
        with httpx.Client(base_url=srv.url, timeout=60) as client:
            whole = client.post("/v1/completions", json=body).json()
            check(whole["metrics"]["speculative_decoding"])
            last = None
            with client.stream("POST", "/v1/completions", json=body | {
                    "stream": True, "stream_options": {"include_usage": True}}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        last = json.loads(line[6:])
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 24
            assert last["metrics"]["speculative_decoding"] == whole["metrics"][
                "speculative_decoding"]  # the same request, the same drafts
            # Several sequences: the field would describe one of them; it is left out.
            two = client.post("/v1/completions", json=body | {"n": 2}).json()
            assert "metrics" not in two and len(two["choices"]) == 2
            chat = client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 8}).json()
            check(chat["metrics"]["speculative_decoding"])
            text = client.get("/metrics").text
        assert metric(text, "spec_decode_num_drafts_total") >= 2 * whole["metrics"][
            "speculative_decoding"]["num_spec_steps"]
        srv.engine.core.check_invariants()
    finally:
        srv.stop()


def test_the_flag_refuses_an_unknown_level_and_a_plain_engine(tiny_dir):
    with pytest.raises(ValueError, match="per_request_spec_decode_metrics"):
        tiny_config(tiny_dir, speculative_config=SPEC, per_request_spec_decode_metrics="full")
    with pytest.raises(ValueError, match="requires speculative decoding"):
        tiny_config(tiny_dir, per_request_spec_decode_metrics="summary")
