"""Speculative decoding with a grammar, on a tiny random Llama: the same tokens as plain
decoding, output that the grammar accepts, and a matcher that ends every step at the
request's real output; offline and through the real server.

The scripted proposer drafts the plain run's own continuation with about one token in
three changed: a changed token is either outside the grammar (the speculator cuts the
draft there) or inside it and rejected by the target. Each position is scored with the
grammar's mask after the drafts before it; a wrong mask would change a pick.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest

from app import SamplingParams
from app.engine.grammar import StructuredOutput
from app.engine.spec.speculator import grammar_prefix
from tests.server_harness import ServerThread, tiny_config
from tests.test_spec_decode import SPEC, ScriptedProposer, assert_clean, make_llm

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 4},
    "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "tags", "age"]}
REGEX = r"[a-z]{2,6}-[0-9]{3}( [a-z]{2,5}){1,3}"
PROMPTS = [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10] * 3, [11, 12, 13] * 5]


def structured():
    return [StructuredOutput.json_schema(SCHEMA), StructuredOutput("regex", REGEX),
            StructuredOutput("choice", json.dumps(["alpha beta gamma", "delta epsilon"]))]


def params(temperature: float) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=80, temperature=temperature, seed=7 + i, structured=so)
            for i, so in enumerate(structured())]


def check_valid(texts: list[str]) -> None:
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    assert re.fullmatch(REGEX, texts[1]), texts[1]
    assert texts[2] in ("alpha beta gamma", "delta epsilon")


@pytest.fixture(scope="module")
def plain(tiny_dir):
    llm = make_llm(tiny_dir, max_model_len=256)
    want = {t: llm.generate(PROMPTS, params(t), use_tqdm=False) for t in (0.0, 0.9)}
    llm.shutdown()
    return want


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_grammar_requests_speculate_and_give_plain_output(tiny_dir, plain, temperature):
    want = plain[temperature]
    llm = make_llm(tiny_dir, SPEC, max_model_len=256)
    llm.engine.speculator.proposer = ScriptedProposer(
        {tuple(p): o.token_ids for p, o in zip(PROMPTS, want)})
    for _ in range(2):  # again with the prefix cache hot
        got = llm.generate(PROMPTS, params(temperature), use_tqdm=False)
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.finish_reason for o in got] == [o.finish_reason for o in want]
    check_valid([o.text for o in got])
    total = llm.engine.speculator.total
    assert 0 < total.num_accepted_tokens < total.num_draft_tokens
    assert_clean(llm)
    llm.shutdown()


def test_grammar_requests_with_ngram_give_plain_output(tiny_dir, plain):
    llm = make_llm(tiny_dir, SPEC, max_model_len=256)
    got = llm.generate(PROMPTS, params(0.0), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain[0.0]]
    check_valid([o.text for o in got])
    assert llm.engine.speculator.total.num_drafts > 0  # the output repeats itself
    assert_clean(llm)
    llm.shutdown()


class OffGrammarProposer:
    """Drafts that every grammar here rejects at once (token 0 is an added token)."""

    def propose(self, requests, num_tokens):
        return [[0] * k for k in num_tokens]

    def finish(self, request):
        pass


def test_drafts_outside_the_grammar_are_never_scored(tiny_dir, plain):
    llm = make_llm(tiny_dir, SPEC, max_model_len=256)
    llm.engine.speculator.proposer = OffGrammarProposer()
    got = llm.generate(PROMPTS, params(0.0), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain[0.0]]
    assert llm.engine.speculator.total.num_drafts == 0
    assert_clean(llm)
    llm.shutdown()


def test_grammar_prefix_and_draft_masks_leave_the_matcher_as_it_was(tiny_dir):
    llm = make_llm(tiny_dir, max_model_len=256)
    grammars, tok = llm.engine.grammars, llm.tokenizer
    compiled = grammars.compile_now(StructuredOutput("choice", json.dumps(["abc def", "xyz"])))
    text = tok.encode("abc def", add_special_tokens=False)
    stop = llm.engine.eos_token_ids[0]
    matcher = grammars.matcher(compiled)
    assert matcher.accept_token(text[0])
    before = grammars.fill(matcher).clone()
    rest = text[1:]
    assert grammar_prefix(matcher, rest + [stop, 5]) == len(rest)  # not the stop token
    assert grammar_prefix(matcher, [0, *rest]) == 0
    assert grammar_prefix(matcher, rest[:1] + [0]) == 1
    assert bool((grammars.fill(matcher) == before).all())
    masks = grammars.fill_drafts(matcher, rest)
    assert bool((grammars.fill(matcher) == before).all())
    assert bool((masks[0] == before).all())
    for j, token in enumerate(rest):  # position j + 1: the state after drafts 1..j + 1
        assert matcher.accept_token(token)
        assert bool((grammars.fill(matcher) == masks[j + 1]).all())
    assert matcher.accept_token(stop) and matcher.is_terminated()
    llm.shutdown()


def test_server_speculates_under_response_format(tiny_dir, plain):
    srv = ServerThread(tiny_config(tiny_dir, speculative_config=SPEC)).start()
    try:
        srv.engine.core.speculator.proposer = ScriptedProposer(
            {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain[0.0])})
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPTS[0], "max_tokens": 80, "temperature": 0,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "x", "schema": SCHEMA}}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == plain[0.0][0].text
        assert srv.engine.core.speculator.total.num_accepted_tokens > 0
        srv.engine.core.check_invariants()
    finally:
        srv.stop()
