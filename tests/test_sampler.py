"""The sampler's masks, penalties, seeds and logprobs, on hand-made logits."""

import gc
import math

import pytest
import torch

from gpu.batch import SamplingRow
from gpu.sampler import UNIFORM_BITS, Sampler, inverse_transform, keep_top

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


def test_the_repetition_penalty_counts_the_prompt_as_hf_and_vllm_do():
    """Repetition: over prompt and output (HF's processor, vLLM); presence and frequency:
    over the output alone (OpenAI). Checked against transformers' own processor."""
    from transformers import RepetitionPenaltyLogitsProcessor

    s = Sampler(torch.device("cpu"))
    lg = torch.tensor([[0.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 1.8]])
    assert s(lg, [SamplingRow(temperature=0.0, prompt_token_ids=(4,))])[0] == [4]
    row = SamplingRow(temperature=0.0, repetition_penalty=1.2, prompt_token_ids=(4,))
    assert s(lg, [row])[0] == [7]  # 2.0 / 1.2 < 1.8: the prompt's token 4 is penalized

    torch.manual_seed(3)
    logits = torch.randn(1, 50) * 3
    prompt, output = [1, 4, 4, 9, 30], [9, 17, 17]
    row = SamplingRow(repetition_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1,
                      prompt_token_ids=prompt, output_token_ids=output)
    expected = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([prompt + output]),
                                                     logits.clone())
    expected[0, 9] -= 0.2 + 0.1
    expected[0, 17] -= 0.2 + 2 * 0.1
    s = Sampler(torch.device("cpu"))  # a sampler serves one vocabulary
    folds = s.penalties.prepare([row], 50)
    s.penalties.fold(*(torch.tensor(f) for f in folds[1:5]), folds.progress)
    got = s.penalties.penalize(logits, torch.tensor(folds.slots), torch.tensor([1.3]),
                               torch.tensor([0.2]), torch.tensor([0.1]))
    torch.testing.assert_close(got, expected)


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
    counts, counted = s.penalties.counts_of(row)
    assert counted == len(output) and counts == [3.0, 2.0, 1.0, 0.0]


# --- batched: a row samples the same alone or in any batch ---------------------------


def mixed_rows(output: list[int]) -> list[SamplingRow]:
    return [
        SamplingRow(temperature=0.0),
        SamplingRow(temperature=0.0, banned_token_ids=(0, 1), logprobs=3),
        SamplingRow(seed=5, top_k=3, output_index=2),
        SamplingRow(seed=6, top_p=0.5, logprobs=0),
        SamplingRow(seed=7, min_p=0.3, top_k=5, top_p=0.9),
        SamplingRow(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.1,
                    repetition_penalty=1.3, output_token_ids=output, logprobs=2),
        SamplingRow(seed=8, temperature=0.7, repetition_penalty=1.5, output_token_ids=output),
    ]


def test_every_row_of_a_mixed_batch_samples_as_it_would_alone():
    torch.manual_seed(0)
    logits = torch.randn(7, 50) * 3
    output = [0, 3, 3, 7]
    batched = Sampler(torch.device("cpu"), seed=0)(logits, mixed_rows(output))
    for i, row in enumerate(mixed_rows(output)):
        alone = Sampler(torch.device("cpu"), seed=0)(logits[i : i + 1], [row])
        assert batched[0][i] == alone[0][0], i
        if alone[1][0] is None:
            assert batched[1][i] is None
        else:
            lp, top = batched[1][i]
            assert lp == pytest.approx(alone[1][0][0], abs=1e-6)
            assert [t for t, _ in top] == [t for t, _ in alone[1][0][1]]
    assert batched[0][1] not in (0, 1)  # banned
    assert len(batched[1][1][1]) == 3 and batched[1][3] == (batched[1][3][0], [])


def test_top_k_and_top_p_keep_the_same_tokens_as_a_full_sort():
    torch.manual_seed(1)
    probs = torch.softmax(torch.randn(6, 40) * 2, dim=-1)
    k = torch.tensor([1, 3, 5, 8, 2, 7])
    p = torch.tensor([1.0, 0.5, 0.9, 0.3, 1.0, 0.7])
    by_topk = keep_top(probs, k, p, k_max=8)
    by_sort = keep_top(probs, k, p, k_max=40)
    assert torch.equal(by_topk, by_sort)
    kept = by_sort.sum(-1)
    assert kept[0] == 1 and kept[4] == 2 and (kept >= 1).all() and (kept <= k).all()


def test_penalty_slots_are_reused_and_grow():
    s = Sampler(torch.device("cpu"))
    lg = torch.zeros(1, 4)
    rows = [SamplingRow(temperature=0.0, frequency_penalty=1.0, output_token_ids=[i % 4])
            for i in range(12)]  # more than the first 8 slots
    s(torch.zeros(12, 4), rows)
    assert s.penalties.counts.shape[0] == 16
    assert [s.penalties.counts_of(r)[0] for r in rows[:2]] == [[1, 0, 0, 0], [0, 1, 0, 0]]
    del rows
    gc.collect()
    fresh = SamplingRow(temperature=0.0, presence_penalty=1.0, output_token_ids=[2])
    assert s(lg, [fresh])[0] == [0]
    assert s.penalties.counts_of(fresh)[0] == [0, 0, 1, 0]  # a reused slot starts at zero
    assert s.penalties.counts.shape[0] == 16


def test_a_greedy_batch_is_one_argmax_and_one_wait(monkeypatch):
    import gpu.sampler

    waits = []
    real = gpu.sampler.to_host
    monkeypatch.setattr(gpu.sampler, "to_host", lambda *t: waits.append(len(t)) or real(*t))
    s = Sampler(torch.device("cpu"))
    s.staging.stage = None  # nothing to stage: calling it would fail
    tokens, _ = s(torch.eye(3, 5), [SamplingRow(temperature=0.0)] * 3)
    assert tokens == [0, 1, 2] and waits == [1]


# --- the draw -----------------------------------------------------------------------------


def test_the_draw_follows_the_distribution_and_never_picks_a_zero():
    """Inverse transform sampling: each token's share of many draws is its probability
    (within 4 standard deviations), and tokens of probability zero (masked by top-k, top-p,
    min-p) are never drawn, even at the extreme uniforms 0 and just below 1."""
    probs = torch.tensor([0.0, *PROBS, 0.0])  # zeros at both ends, unnormalised below
    n = 40_000
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**UNIFORM_BITS, (n,), generator=gen)
    drawn = inverse_transform(3.0 * probs.expand(n, -1), bits)
    counts = torch.bincount(drawn, minlength=len(probs)).tolist()
    assert counts[0] == counts[-1] == 0
    for p, c in zip(PROBS, counts[1:-1]):
        assert abs(c - n * p) < 4 * math.sqrt(n * p * (1 - p)) + 1, (p, c)
    edges = torch.tensor([0, 2**UNIFORM_BITS - 1])
    assert inverse_transform(probs.expand(2, -1), edges).tolist() == [1, len(PROBS)]
