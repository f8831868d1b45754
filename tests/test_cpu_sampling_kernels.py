"""The C++ sampling kernels against the sampler's torch paths: `sample_rows`, then
`argmax_rows`, `apply_penalties_` and `apply_token_bitmask_` (exactly) at the end, and
that the model thread's sampler takes them all.

Both samplers get the same rows (seeded, so both draw the same uniforms) and must pick
the same tokens: temperature, top-k, top-p, min-p and their mixes in one batch, banned
tokens, vocabularies that are not a multiple of 16, rows flat enough that top-p needs
thousands of candidates. Then what the torch path leaves open: ties at a cut (the
kernel keeps the lowest ids), the extreme uniforms, and the draw's frequencies.
"""

from __future__ import annotations

import math

import pytest
import torch

from gpu.batch import SamplingRow
from gpu.cpu.kernels.build import cpu_kernels
from gpu.penalties import PenaltyCounts
from gpu.sampler import UNIFORM_BITS, Sampler, shape_logits

KERNELS = cpu_kernels() if not torch.cuda.is_available() else None
pytestmark = pytest.mark.skipif(KERNELS is None, reason="C++ CPU kernels not built here")
CPU = torch.device("cpu")

CONFIGS = [dict(), dict(temperature=0.7), dict(top_p=0.9), dict(temperature=1.3, top_p=0.95),
           dict(top_k=50), dict(top_k=20, top_p=0.8, temperature=0.7), dict(min_p=0.05),
           dict(top_k=40, top_p=0.9, min_p=0.1), dict(top_k=5000), dict(top_p=0.3, min_p=0.2)]


def both(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[list[int], list[int]]:
    return Sampler(CPU)(logits, rows)[0], Sampler(CPU, kernels=KERNELS)(logits, rows)[0]


@pytest.mark.parametrize("vocab", [1007, 6000])
def test_the_kernel_draws_what_the_torch_path_draws(vocab):
    torch.manual_seed(0)
    # Peaked to flat rows; each config on every kind of row, all in one batch.
    scale = torch.tensor([8.0, 4.0, 2.0, 1.0, 0.3]).repeat(len(CONFIGS))[:, None]
    logits = torch.randn(len(scale), vocab) * scale
    logits[::3, :40] = float("-inf")  # banned (or grammar-masked) tokens
    for trial in range(6):
        rows = [SamplingRow(seed=100 * trial + i, **CONFIGS[i // 5])
                for i in range(len(scale))]
        reference, kernel = both(logits, rows)
        assert kernel == reference, trial
        assert all(t >= 40 for t in kernel[::3])


def test_top_k_keeps_the_k_heaviest_for_every_k():
    """Whatever k, and however the weights fall around the kernel's collection floors
    (1/64, then 16x lower): here exactly 5 weigh >= 1/64 (a cut there once dropped
    top-k), the rest fall from 0.012 to 1e-6. Token ids are in weight order."""
    logits = torch.cat([torch.zeros(5), torch.linspace(math.log(0.012), math.log(1e-6),
                                                       995)])[None]
    n = 2000
    bits = torch.randint(0, 2**UNIFORM_BITS, (n,), generator=torch.Generator().manual_seed(1))
    ones = torch.ones(n)
    for k in (1, 4, 5, 6, 60, 61, 300):
        drawn = KERNELS.sample_rows(logits.expand(n, -1).contiguous(), ones,
                                    torch.full((n,), k, dtype=torch.long), ones,
                                    torch.zeros(n), bits)
        got = set(drawn.tolist())
        assert got <= set(range(k)), k
        assert k > 6 or got == set(range(k)), k


def test_ties_at_a_cut_keep_the_lowest_ids():
    logits = torch.zeros(1, 100)
    sampler = Sampler(CPU, kernels=KERNELS)
    drawn = {sampler(logits, [SamplingRow(top_k=3)])[0][0] for _ in range(200)}
    assert drawn == {0, 1, 2}
    drawn = {sampler(logits, [SamplingRow(top_p=0.05)])[0][0] for _ in range(200)}
    assert drawn == {0, 1, 2, 3, 4, 5}  # the weight before each of 0..5 is at most 5 %


def test_the_draw_follows_the_distribution_at_the_extremes_too():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
    logits = torch.cat([torch.tensor([float("-inf")]), probs.log(), torch.tensor([-1e9])])
    n = 20_000
    gen = torch.Generator().manual_seed(0)
    bits = torch.randint(0, 2**UNIFORM_BITS, (n,), generator=gen)
    ones = torch.ones(n)
    drawn = KERNELS.sample_rows(logits.expand(n, -1).contiguous(), ones,
                                torch.zeros(n, dtype=torch.long), ones, torch.zeros(n), bits)
    counts = torch.bincount(drawn, minlength=len(logits)).tolist()
    assert counts[0] == counts[-1] == 0  # banned, and too unlikely to weigh anything
    for p, c in zip(probs.tolist(), counts[1:-1]):
        assert abs(c - n * p) < 4 * math.sqrt(n * p * (1 - p)) + 1, (p, c)
    edges = torch.tensor([0, 2**UNIFORM_BITS - 1])
    two = torch.ones(2)
    assert KERNELS.sample_rows(logits.expand(2, -1).contiguous(), two,
                               torch.zeros(2, dtype=torch.long), two, torch.zeros(2),
                               edges).tolist() == [1, len(probs)]


def test_the_penalty_kernel_matches_the_torch_penalties_bit_for_bit():
    torch.manual_seed(1)
    vocab = 1003
    counts = PenaltyCounts(CPU)
    counts.counts = torch.randint(0, 4, (8, vocab)).float() * (torch.rand(8, vocab) < 0.05)
    counts.in_prompt = torch.rand(8, vocab) < 0.05
    logits = torch.randn(6, vocab) * 3
    logits[0, :5] = float("-inf")
    rows, slots = torch.tensor([0, 2, 3, 5]), torch.tensor([1, 4, 4, 7])
    rep, pres, freq = torch.rand(4) + 0.8, torch.rand(4) - 0.5, torch.rand(4) - 0.5
    raw, expected = logits.clone(), logits.clone()
    expected[rows] = counts.penalize(expected[rows], slots, rep, pres, freq)
    KERNELS.apply_penalties_(logits, rows, counts.counts, counts.in_prompt, slots, rep, pres,
                             freq)
    assert torch.equal(logits, expected)
    assert (logits[rows] != raw[rows]).sum() > 50  # penalized...
    assert torch.equal(logits[[1, 4]], raw[[1, 4]])  # ... only the rows asked for


@pytest.mark.parametrize("vocab", [64, 1003])
def test_the_bitmask_kernel_masks_what_the_torch_unpacking_masks(vocab):
    """xgrammar's layout, rows in any order, a vocabulary that ends inside a word."""
    torch.manual_seed(2)
    logits = torch.randn(5, vocab)
    words = torch.randint(-2**31, 2**31 - 1, (3, (vocab + 31) // 32), dtype=torch.int32)
    rows = [(4, SamplingRow(allowed=words[0])), (1, SamplingRow(allowed=words[1])),
            (2, SamplingRow(allowed=words[2], logit_bias=((3, 2.5),)))]
    expected, got = logits.clone(), logits.clone()
    shape_logits(expected, rows)
    shape_logits(got, rows, KERNELS.apply_token_bitmask_)
    assert torch.equal(got, expected)
    assert torch.equal(got[[0, 3]], logits[[0, 3]])  # rows without a grammar untouched
    assert 0.3 < got[[1, 2, 4]].isinf().float().mean() < 0.7


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 100, 49152])
def test_argmax_rows_is_torch_argmax_with_ties_nans_and_empty_rows(vocab):
    """The first index of the largest value (ties are everywhere: small integers), the
    first NaN if there is one, 0 for a row of -inf."""
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(20):
        x = torch.randint(-3, 3, (4, vocab), generator=gen).float()
        if trial % 3 == 0:
            x[1, torch.randint(0, vocab, (2,), generator=gen)] = float("nan")
        if trial % 4 == 0:
            x[2] = float("-inf")
        assert torch.equal(KERNELS.argmax_rows(x), x.argmax(dim=-1)), trial
        # A bf16 model's logits are read as they are: the widened row's answer.
        assert torch.equal(KERNELS.argmax_rows(x.bfloat16()), x.argmax(dim=-1)), trial
    # More rows than one thread takes, values that differ only in bf16's last bit.
    x = (1 + torch.randint(0, 64, (40, vocab), generator=gen) / 128).bfloat16()
    assert torch.equal(KERNELS.argmax_rows(x), x.float().argmax(dim=-1))


def test_a_greedy_bf16_batch_is_sampled_without_widening_its_logits():
    """The fast path (every row greedy, nothing else asked) argmaxes the bf16 logits as
    they come; any other batch is widened first, and both give torch's answers."""
    from gpu.sampler import Sampler

    sampler = Sampler(torch.device("cpu"), kernels=KERNELS)
    logits = (torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    greedy = [SamplingRow(temperature=0.0) for _ in range(6)]
    tokens, _ = sampler(logits, greedy)
    assert tokens == logits.float().argmax(dim=-1).tolist()
    with_logprobs = [SamplingRow(temperature=0.0, logprobs=2) for _ in range(6)]
    tokens, lps = sampler(logits, with_logprobs)
    assert tokens == logits.float().argmax(dim=-1).tolist()
    want = torch.log_softmax(logits.float(), dim=-1)
    for i, (token_logprob, _top) in enumerate(lps):
        assert token_logprob == pytest.approx(want[i, tokens[i]].item(), abs=1e-5)


def test_the_model_thread_samples_with_the_kernels(tiny_dir):
    """Wired, not only built: a regression to the torch paths would be silent otherwise."""
    from app import LLM

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=64)
    try:
        sampler = llm.engine.worker.wait_ready().sampler
        assert None not in (sampler.sample_rows, sampler.argmax_rows, sampler.apply_bitmask,
                            sampler.penalties.kernel)
    finally:
        llm.shutdown()
