"""What a proposer is: draft tokens for running requests, from what the engine has.

A proposer sees each request's tokens (prompt and output so far) and how many drafts it
may propose for it this step, and returns its guesses (possibly none). It never sees a
draft's fate: the speculator verifies drafts against the target and keeps the
acceptance counts. Model-free proposers (n-gram here; suffix trees later) run on the
event loop; a draft model would post its own small steps to the model thread.
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


def make_proposer(config: SpeculativeConfig) -> Proposer:
    if config.method == "ngram":
        from app.engine.spec.ngram import NgramProposer

        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    raise ValueError(f"no proposer for method {config.method!r}")
