"""The sampler's masks, penalties, seeds and logprobs, on hand-made logits."""

import math

import torch

from gpu.batch import SamplingRow
from gpu.sampler import Sampler

V = 8


def logits_from_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) if p > 0 else -1e9 for p in probs])[None, :]


def draw(row: SamplingRow, logits: torch.Tensor, n: int = 300) -> set[int]:
    sampler = Sampler(torch.device("cpu"), seed=0)
    return {sampler(logits, [row])[0][0] for _ in range(n)}


PROBS = [0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005]


def test_greedy_picks_argmax_and_bans_apply():
    s = Sampler(torch.device("cpu"))
    lg = logits_from_probs(PROBS)
    assert s(lg, [SamplingRow(temperature=0.0)])[0] == [0]
    assert s(lg, [SamplingRow(temperature=0.0, banned_token_ids=(0, 1))])[0] == [2]


def test_top_k_top_p_min_p_restrict_the_support():
    lg = logits_from_probs(PROBS)
    assert draw(SamplingRow(top_k=2), lg) == {0, 1}
    assert draw(SamplingRow(top_p=0.6), lg) == {0, 1}  # 0.4 + 0.25 covers 0.6
    assert draw(SamplingRow(min_p=0.5), lg) == {0, 1}  # >= 0.5 * 0.4
    assert draw(SamplingRow(), lg, 2000) >= {0, 1, 2, 3, 4}  # unrestricted reaches the tail
    assert draw(SamplingRow(banned_token_ids=(0,), top_k=1), lg) == {1}


def test_seed_and_output_index_determine_the_draw():
    lg = torch.zeros(1, 1000)  # uniform: every draw is informative
    s = Sampler(torch.device("cpu"), seed=1)
    row = SamplingRow(seed=42, output_index=3)
    first = s(lg, [row])[0][0]
    assert all(s(lg, [row])[0][0] == first for _ in range(5))
    # Same row inside a batch with other rows, at another position: same token.
    batch = torch.zeros(3, 1000)
    assert s(batch, [SamplingRow(), row, SamplingRow(seed=7)])[0][1] == first
    others = {s(lg, [SamplingRow(seed=42, output_index=i)])[0][0] for i in range(10)}
    assert len(others) > 5


def test_penalties_change_the_greedy_choice():
    s = Sampler(torch.device("cpu"))
    lg = torch.tensor([[2.0, 1.9, 0.0, 0.0]])
    assert s(lg, [SamplingRow(temperature=0.0)])[0] == [0]
    assert s(lg, [SamplingRow(temperature=0.0, presence_penalty=0.5,
                              output_token_ids=(0,))])[0] == [1]
    assert s(lg, [SamplingRow(temperature=0.0, frequency_penalty=0.06,
                              output_token_ids=(0, 0))])[0] == [1]
    assert s(lg, [SamplingRow(temperature=0.0, repetition_penalty=1.2,
                              output_token_ids=(0,))])[0] == [1]
    assert lg[0, 0] == 2.0  # the caller's logits are not modified


def test_logprobs_are_the_raw_distribution():
    s = Sampler(torch.device("cpu"))
    lg = logits_from_probs(PROBS)
    tokens, lps = s(lg, [SamplingRow(temperature=0.0, logprobs=2)])
    sampled_lp, top = lps[0]
    assert tokens == [0] and math.isclose(sampled_lp, math.log(0.4), rel_tol=1e-4)
    assert [t for t, _ in top] == [0, 1]
    assert math.isclose(top[1][1], math.log(0.25), rel_tol=1e-4)


def test_penalty_counts_follow_a_growing_output_without_rescanning():
    """The row shares the request's output list; each call folds in only the new tokens,
    and the result equals a fresh row given the whole history at once."""
    s = Sampler(torch.device("cpu"))
    lg = torch.tensor([[2.0, 1.95, 1.9, 0.0]])
    output: list[int] = []
    row = SamplingRow(temperature=0.0, frequency_penalty=0.04, output_token_ids=output)
    picks = []
    for _ in range(6):
        token = s(lg, [row])[0][0]
        picks.append(token)
        output.append(token)  # what the scheduler does with the sampled token
        fresh = SamplingRow(temperature=0.0, frequency_penalty=0.04,
                            output_token_ids=tuple(output))
        assert s(lg, [fresh])[0] == s(lg, [row])[0]
    assert picks == [0, 0, 1, 0, 1, 2]  # frequency penalties rotate the greedy choice
    counts, counted = row.penalty_state
    assert counted == len(output) and counts.tolist() == [3.0, 2.0, 1.0, 0.0]
