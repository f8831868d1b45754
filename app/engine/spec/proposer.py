"""What a proposer is: draft tokens for running requests, from what the engine has.

A proposer sees each request's tokens (prompt and output so far) and how many drafts it
may propose for it this step, and returns its guesses (possibly none). It never sees a
draft's fate: the speculator verifies drafts against the target and keeps the
acceptance counts. Model-free proposers (n-gram, suffix trees) run on the event loop;
the draft model's forward runs on the model thread (`draft_model.py`). A proposer that
keeps state per request frees it in `finish`, which the scheduler calls once for every
request that ends (finished, aborted, failed, shed).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from app.engine.request import Request
from app.engine.spec.config import SpeculativeConfig


class Proposer(Protocol):
    def propose(self, requests: Sequence[Request], num_tokens: Sequence[int]
                ) -> list[list[int]]:
        """Per request, up to `num_tokens[i]` draft tokens to follow its last token."""
        ...

    def finish(self, request: Request) -> None:
        """`request` ended: drop what is kept for it."""
        ...


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        from app.engine.spec.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.method == "suffix":
        from app.engine.spec.suffix import SuffixProposer

        return SuffixProposer(config.suffix_decoding_max_tree_depth,
                              config.suffix_decoding_max_cached_requests,
                              config.suffix_decoding_max_spec_factor,
                              config.suffix_decoding_min_token_prob)
    raise ValueError(f"no proposer for method {config.method!r}")
