"""The pieces of speculative decoding without a model: the config, the n-gram proposer,
trimming a table's tail, the block-table deltas after a trim, the scheduler's drafts."""

from __future__ import annotations

import pytest

from app.config import EngineConfig, SchedulerConfig
from app.engine.kv_blocks import BlockManager
from app.engine.request import Request
from app.engine.sampling_params import SamplingParams
from app.engine.scheduler import Scheduler
from app.engine.spec.config import SpeculativeConfig
from app.engine.spec.ngram import find_drafts
from app.engine.spec.speculator import Speculator
from app.engine.stats_logger import format_spec
from app.engine.table_rows import TableRows


def test_config_parses_vllm_keys_and_refuses_bad_ones():
    c = EngineConfig.from_kwargs(speculative_config='{"method": "ngram", '
                                 '"num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert c.speculative_config == SpeculativeConfig(num_speculative_tokens=3,
                                                     prompt_lookup_min=4, prompt_lookup_max=4)
    assert SpeculativeConfig.parse({"num_speculative_tokens": 2}).prompt_lookup_min == 5
    assert EngineConfig().speculative_config is None
    for bad, why in [('{"method": "eagle", "num_speculative_tokens": 2}', "method"),
                     ('{"num_speculative_tokens": 0}', "num_speculative_tokens"),
                     ('{"num_speculative_tokens": 2, "bogus": 1}', "unknown keys"),
                     ('{"method": "ngram"}', "required"),
                     ('[1]', "JSON object"), ("{", "not JSON"),
                     ('{"num_speculative_tokens": 2, "prompt_lookup_min": 3, '
                      '"prompt_lookup_max": 2}', "prompt_lookup_min"),
                     ('{"num_speculative_tokens": 2, "disable_by_batch_size": 0}',
                      "disable_by_batch_size")]:
        with pytest.raises(ValueError, match=why):
            EngineConfig.from_kwargs(speculative_config=bad)


def test_ngram_drafts_follow_the_most_recent_longest_match():
    seq = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # "2 3" last appeared before "4 5"; the longest match (n=2) wins over "3" alone.
    assert find_drafts(seq, 1, 3, 3) == [4, 5, 7]
    assert find_drafts(seq, 3, 3, 3) == []  # "7 2 3" never appeared before
    assert find_drafts([5, 6, 5, 6], 1, 2, 5) == [5, 6, 5, 6, 5]  # a loop copies over itself
    assert find_drafts([8, 8, 8], 1, 2, 2) == [8, 8]
    assert find_drafts([1, 2, 3], 1, 3, 4) == []
    assert find_drafts([1, 2, 1], 1, 3, 0) == []
    # A match must sit on token boundaries, not straddle two packed tokens.
    # (0x01000000, 0) packs as 00 00 00 01 00 00 00 00: it holds 0x100's 00 01 00 00.
    assert find_drafts([0x01000000, 0, 0x100], 1, 1, 1) == []
    assert find_drafts([0x100, 9, 0x01000000, 0, 0x100], 1, 1, 1) == [9]
    assert find_drafts([70000, 5, 70000], 1, 1, 2) == [5, 70000]


def test_trim_frees_the_tail_and_keeps_the_invariant():
    blocks = BlockManager(8, 4)
    blocks.allocate("a", 14)  # 4 blocks
    table = blocks.block_table("a")
    tail = table[2:]
    assert blocks.trim("a", 6) == 2 and blocks.block_table("a") is table and len(table) == 2
    assert blocks.num_free_blocks == 6 and set(tail) <= set(blocks._free)
    blocks.check()
    assert blocks.trim("a", 8) == 0 and blocks.trim("gone", 1) == 0
    blocks.free("a")
    blocks.check()
    assert blocks.num_free_blocks == 8


def test_table_rows_resend_what_regrows_after_a_trim():
    blocks, rows = BlockManager(8, 4), TableRows(2)
    blocks.allocate("a", 12)
    table = blocks.block_table("a")
    (row,), updates = rows.assign([("a", table)])
    assert updates == [(row, 0, table[:3])]
    blocks.trim("a", 5)
    rows.trim("a", len(table))
    blocks.allocate("a", 12)  # back to three entries, the last one maybe another block
    assert rows.assign([("a", table)])[1] == [(row, 2, table[2:3])]
    rows.check()


def test_scheduler_gives_drafts_budget_and_blocks_and_returns_the_rejected():
    config = SchedulerConfig(max_model_len=64, max_num_batched_tokens=64)
    blocks = BlockManager(16, 4)
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                        prompt_lookup_max=2), 64)
    s = Scheduler(config, blocks, speculator=spec)
    req = Request("r", [1, 2, 3, 1, 2], SamplingParams(max_tokens=20, temperature=0))
    s.add(req)
    s.update(s.schedule(), [3])  # prefill: "... 1 2" then 3
    out = s.schedule()
    (seq,) = out.seqs
    assert seq.drafts == [1, 2, 3, 1] and seq.num_new_tokens == 5 and not seq.is_prefill
    assert len(blocks.block_table("r")) == 3  # 10 positions
    s.update(out, [[1, 2, 7]])  # drafts 1, 2 accepted; 7 instead of 3
    assert req.output_token_ids == [3, 1, 2, 7]
    assert req.num_computed_tokens == 8 and req.num_tokens == 9
    assert len(blocks.block_table("r")) == 3  # 9 positions still need 3 blocks
    blocks.check()
    assert spec.total.num_drafts == 0  # the core verifies; the scheduler only applies
    # Over the batch-size threshold nobody drafts.
    spec.config = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=1)
    assert s.schedule().seqs[0].drafts == []


def test_speculator_bounds_drafts_and_backs_off():
    spec = Speculator(SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_min=1,
                                        prompt_lookup_max=1, min_acceptance_rate=0.5), 32)
    req = Request("r", [5, 5, 5, 5], SamplingParams(max_tokens=3))
    req.num_computed_tokens = 3
    assert spec.propose([req]) == {"r": [5, 5]}  # 3 tokens left: 2 drafts and the bonus
    req.params = SamplingParams(max_tokens=30)
    assert spec.propose([req]) == {"r": [5, 5, 5, 5]}
    for _ in range(3):  # rejected every time: the average falls below 0.5
        assert spec.verify(req, [5, 5, 5, 5], [6, 0, 0, 0, 0]) == [6]
    assert spec.propose([req]) == {}  # paused
    assert spec.total.num_drafts == 3 and spec.total.num_accepted_tokens == 0
    assert spec.verify(req, [5, 5], [5, 5, 9]) == [5, 5, 9]
    assert spec.total.accepted_per_pos[:2] == [1, 1]


def test_stats_line_words():
    assert format_spec(4, 20, 10) == (", Draft acceptance rate: 50.0%, "
                                      "Mean acceptance length: 3.50")
