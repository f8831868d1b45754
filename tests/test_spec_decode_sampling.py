"""Sampled rows under speculation keep the target's distribution.

A tiny random Llama, top-k 3 at temperature 1: the first three tokens take one of 27
values, whose probabilities the model gives (its top-3 logprobs, renormalised). The
first token comes from the prefill; at the first decode step a scripted proposer
always drafts the same second token, so that draft is accepted with its probability
(then the third token is the verification's bonus token) and rejected otherwise (then
the second token is drawn with the draft excluded). Many unseeded samples of the triple
must fit the model's joint distribution (a chi-square bound); the test also checks that
the bound has the power to catch a biased acceptance rule.
"""

from __future__ import annotations

import math
from collections import Counter

from app import LLM, SamplingParams

PROMPT = [1100, 2200, 3300, 4400, 5500]
N = 3000
CHI2_BOUND = 61.7  # 26 degrees of freedom, p = 1e-4


def top3(llm: LLM, prompt: list[int]) -> dict[int, float]:
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, logprobs=3),
                       use_tqdm=False)[0]
    probs = {t: math.exp(lp) for t, lp in out.logprobs[0][1]}
    total = sum(probs.values())
    return {t: p / total for t, p in probs.items()}


class FixedDraft:
    def __init__(self, token: int):
        self.token = token

    def propose(self, requests, num_tokens):
        return [[self.token] if r.num_output_tokens == 1 else [] for r in requests]

    def finish(self, request):
        pass


def test_sampled_tokens_follow_the_target_distribution(tiny_dir):
    ref = LLM(str(tiny_dir), dtype="float32", max_model_len=64)
    first = top3(ref, PROMPT)
    second = {a: top3(ref, PROMPT + [a]) for a in first}
    joint = {(a, b, c): pa * pb * pc for a, pa in first.items()
             for b, pb in second[a].items()
             for c, pc in top3(ref, PROMPT + [a, b]).items()}
    ref.shutdown()
    likely = max(first, key=first.get)
    draft = sorted(second[likely], key=second[likely].get)[1]  # neither sure nor hopeless
    accept = sum(first[a] * second[a].get(draft, 0.0) for a in first)  # P(draft accepted)
    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=64, max_num_seqs=256,
              speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                  "disable_by_batch_size": 1000, "min_acceptance_rate": 0})
    llm.engine.speculator.proposer = FixedDraft(draft)
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)
    outs = llm.generate([PROMPT] * N, params, use_tqdm=False)
    counts = Counter(tuple(o.token_ids) for o in outs)
    assert set(counts) <= set(joint)
    total = llm.engine.speculator.total
    assert total.num_drafts == N and total.num_draft_tokens == N
    # Each draft is accepted with its probability: a Bernoulli per request.
    assert abs(total.num_accepted_tokens - N * accept) < 5 * math.sqrt(N * accept * (1 - accept))
    stat = sum((counts.get(c, 0) - N * p) ** 2 / (N * p) for c, p in joint.items())
    assert stat < CHI2_BOUND
    llm.engine.check_invariants()
    llm.shutdown()

    # The bound catches biased rules: accepting the draft with probability sqrt(p), or
    # resampling from p without removing the rejected draft. The statistic such a rule
    # shows on average (the degrees of freedom plus N times its chi-square divergence)
    # is well past the bound.
    for rule in (math.sqrt, lambda p: p + (1 - p) * p):
        def ratio(a: int, b: int, rule=rule) -> float:
            p = second[a].get(draft, 0.0)
            q = rule(p)  # the biased chance of the draft; the other tokens share the rest
            return q / p if b == draft else (1 - q) / (1 - p)

        divergence = sum(pc * (ratio(a, b) - 1) ** 2 for (a, b, _), pc in joint.items())
        assert 26 + N * divergence > 2 * CHI2_BOUND
