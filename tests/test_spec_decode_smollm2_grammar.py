"""Speculative decoding with a JSON schema on the real SmolLM2: a request that asks to
return records given in the prompt (the answer copies them, so n-gram and suffix drafts
are mostly accepted) gives plain decoding's tokens, valid under the schema, and leaves
no block behind. In float32 (docs/speculative.md says why)."""

from __future__ import annotations

import json

import jsonschema
import pytest

from app import LLM, SamplingParams
from app.engine.grammar import StructuredOutput

pytestmark = pytest.mark.slow
pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": {
    "type": "object", "properties": {
        "name": {"type": "string"}, "city": {"type": "string"},
        "age": {"type": "integer"}, "languages": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "city", "age", "languages"]}}}, "required": ["people"]}
RECORDS = {"people": [
    {"name": "Ada Lovelace", "city": "London", "age": 36, "languages": ["English", "French"]},
    {"name": "Grace Hopper", "city": "New York", "age": 85, "languages": ["English"]},
    {"name": "Alan Turing", "city": "Manchester", "age": 41, "languages": ["English", "German"]},
]}
PARAMS = SamplingParams(max_tokens=160, temperature=0.0,
                        structured=StructuredOutput.json_schema(SCHEMA))


@pytest.fixture(scope="module")
def case(smollm2_dir):
    llm = LLM(str(smollm2_dir), max_model_len=1024, dtype="float32")
    ask = ("Return these records as JSON, exactly as given:\n"
           + json.dumps(RECORDS, separators=(", ", ": ")))
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": ask}],
                                               add_generation_prompt=True, tokenize=True)
    want = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
    llm.shutdown()
    return prompt, want


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
     "prompt_lookup_max": 5},
    {"method": "suffix", "num_speculative_tokens": 8}], ids=["ngram", "suffix"])
def test_smollm2_json_schema_with_speculation_equals_plain(smollm2_dir, case, spec):
    prompt, want = case
    jsonschema.validate(json.loads(want.text), SCHEMA)
    llm = LLM(str(smollm2_dir), max_model_len=1024, dtype="float32", speculative_config=spec)
    for _ in range(2):  # cold, then hot (suffix: drafted from its global tree too)
        got = llm.generate([prompt], PARAMS, use_tqdm=False)[0]
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    jsonschema.validate(json.loads(got.text), SCHEMA)
    total = llm.engine.speculator.total
    assert total.num_accepted_tokens > 0.3 * len(want.token_ids)  # the answer copies
    llm.engine.check_invariants()
    assert llm.engine.blocks.num_free_blocks == llm.engine.blocks.num_blocks
    llm.shutdown()
