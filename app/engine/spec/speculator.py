"""The speculator: who drafts this step, the rows that score the drafts, what is kept.

Each step, before the scheduler forms the batch, `propose` asks the proposer for
drafts for the running requests that are decoding (one known token past their cache)
and may speculate:
- not when `disable_by_batch_size` or more requests run (decode is no longer
  memory-bound there: the drafts' extra rows would cost real compute);
- a request with a grammar keeps its drafts up to the first one its matcher rejects,
  or the one that would complete the grammar (the target picks that one itself): the
  drafts walk the matcher and roll it back (`grammar_prefix`), so between steps the
  matcher is always at the request's real output;
- not for a request whose recent drafts were mostly rejected: a running average of
  the accepted share below `min_acceptance_rate` pauses it for a number of steps that
  doubles each time it falls below again;
- never past `max_tokens` or `max_model_len`: a step emits at most drafts + 1 tokens.

The target scores position j of a speculating request (its last token, then draft 1..k)
with `draft_rows`: the request's own sampling row as it would be with drafts 1..j
already output — the output index (so a seeded row draws what plain decoding would
draw there), the output tokens the penalties count, the `min_tokens` bans. The model
thread samples each position as it samples any row, and `verify` keeps the drafts up to
the first one the target did not pick, then the target's own pick. Each kept token is
therefore the token plain decoding would have produced at that position from the same
logits and the same draw; for a sampled row, the first rejected position yields a token
drawn from the target with the draft excluded — the rejection sampling of Leviathan et
al. for a proposer whose draft distribution is a point mass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from app.engine.outputs import RequestSpecDecodeMetrics
from app.engine.request import Request
from app.engine.spec.config import SpeculativeConfig
from app.engine.spec.proposer import Proposer, make_proposer
from gpu.batch import SamplingRow

EMA = 0.3  # weight of the newest verification in a request's acceptance average
FIRST_PAUSE, MAX_PAUSE = 8, 256  # steps a low-acceptance request stops drafting


@dataclass
class SpecProgress:
    """One request's drafting record (on `Request.spec`)."""

    rate: float = 1.0  # running average of accepted / drafted
    paused_until: int = 0  # the speculator's step at which it may draft again
    pause: int = FIRST_PAUSE
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    metrics: RequestSpecDecodeMetrics | None = None  # --per-request-spec-decode-metrics


@dataclass
class SpecCounts:
    """A step's verifications, for metrics (vLLM's spec_decode_* families)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 proposer: Proposer | None = None, metrics_level: str = "none"):
        self.config = config
        self.max_model_len = max_model_len
        self.proposer = proposer or make_proposer(config)
        self.metrics_level = metrics_level  # --per-request-spec-decode-metrics
        self.step = 0
        self.counts = SpecCounts(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.total = SpecCounts(accepted_per_pos=[0] * config.num_speculative_tokens)

    def propose(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts for this step, by request id (requests without drafts left out)."""
        self.step += 1
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) >= limit:
            return {}
        asking, room = [], []
        for req in running:
            k = self._room(req)
            if k > 0:
                asking.append(req)
                room.append(k)
        if not asking:
            return {}
        drafts = self.proposer.propose(asking, room)
        out = {}
        for req, draft, k in zip(asking, drafts, room):
            draft = draft[:k]
            if req.grammar is not None:
                draft = draft[:grammar_prefix(req.grammar, draft)]
            if draft:
                out[req.request_id] = draft
        return out

    def admit(self, req: Request) -> None:
        """`req` arrived: with per-request metrics on, its record starts here, so that a
        request that never drafts reports zero steps (as vLLM's does)."""
        if self.metrics_level != "none":
            req.spec = SpecProgress(metrics=RequestSpecDecodeMetrics.new(
                self.config.num_speculative_tokens, self.metrics_level == "detailed"))

    def finish(self, req: Request) -> None:
        """`req` ended: the proposer lets go of what it kept for it."""
        self.proposer.finish(req)

    def _room(self, req: Request) -> int:
        """How many drafts `req` may have this step (0: it decodes plainly)."""
        if req.num_tokens - req.num_computed_tokens != 1:
            return 0
        progress = req.spec
        if progress is not None and self.step < progress.paused_until:
            return 0
        left = min(req.params.max_tokens - req.num_output_tokens,
                   self.max_model_len - req.num_tokens)
        return max(0, min(self.config.num_speculative_tokens, left - 1))

    def verify(self, req: Request, drafts: Sequence[int], targets: Sequence[int]) -> list[int]:
        """The tokens to keep: the drafts the target picked too, then the target's own
        pick after them (`targets[j]`: the target's token at position j)."""
        accepted = 0
        while accepted < len(drafts) and targets[accepted] == drafts[accepted]:
            accepted += 1
        self._record(req, len(drafts), accepted)
        return list(targets[:accepted + 1])

    def _record(self, req: Request, drafted: int, accepted: int) -> None:
        for c in (self.counts, self.total):
            c.num_drafts += 1
            c.num_draft_tokens += drafted
            c.num_accepted_tokens += accepted
            for i in range(accepted):
                c.accepted_per_pos[i] += 1
        p = req.spec = req.spec or SpecProgress()
        p.num_drafts += 1
        p.num_draft_tokens += drafted
        p.num_accepted_tokens += accepted
        if p.metrics is not None:
            p.metrics.observe(drafted, accepted)
        p.rate = (1 - EMA) * p.rate + EMA * accepted / drafted
        if p.rate < self.config.min_acceptance_rate:
            p.paused_until = self.step + p.pause
            p.pause = min(2 * p.pause, MAX_PAUSE)
            p.rate = 1.0  # after the pause, a fresh start
        elif accepted:
            p.pause = max(FIRST_PAUSE, p.pause // 2)

    def take_counts(self) -> SpecCounts:
        """The verifications since the last call (`total`: since the start)."""
        counts = self.counts
        self.counts = SpecCounts(accepted_per_pos=[0] * self.config.num_speculative_tokens)
        return counts


def grammar_prefix(matcher, drafts: Sequence[int]) -> int:
    """How many of `drafts` to keep under the request's grammar: up to the first token
    the matcher rejects, or the first that terminates it (a stop token: a terminated
    matcher has no mask for the position after it, and the target's own pick at that
    position may be the stop token). The matcher ends where it started."""
    accepted = 0
    try:
        for token in drafts:
            if not matcher.accept_token(token):
                break
            accepted += 1
            if matcher.is_terminated():
                break
        return accepted - 1 if matcher.is_terminated() else accepted
    finally:  # also when the matcher raises: it must stay at the request's real output
        if accepted:
            matcher.rollback(accepted)


def draft_rows(row: SamplingRow, req: Request, drafts: Sequence[int],
               allowed: Sequence | None = None) -> list[SamplingRow]:
    """The sampling rows of draft positions 1..k: `row` (the request's, brought up to
    this step) as it would be with drafts 1..j already output. Each is a new row: its
    penalty counts are its own (counted afresh on the model thread). `allowed`: with a
    grammar, the bitmask of each position 0..k (the grammar's state after drafts 1..j)."""
    n, min_tokens = req.num_output_tokens, req.params.min_tokens
    return [replace(row, output_index=n + j,
                    output_token_ids=req.output_token_ids + list(drafts[:j]),
                    banned_token_ids=row.banned_token_ids if n + j < min_tokens else (),
                    penalty_state=None,
                    allowed=row.allowed if allowed is None else allowed[j])
            for j in range(1, len(drafts) + 1)]
