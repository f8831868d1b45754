"""A request's sampling rows on their way to the model thread, and the picks coming back.

The row is built once, at admission (`sampling_row`); before each step only what
changes is brought up to date (`step_rows`: the output index, the bans, a grammar's
fresh mask). A speculating request sends one row per position it is scored at: its
own, then one per draft (`app/engine/spec/speculator.py` `draft_rows`), each with the
grammar's mask after the drafts before it (`GrammarService.fill_drafts`). The model
thread answers one token per row, in order; `sampled_rows` hands each sampled
sequence its share.
"""

from __future__ import annotations

from collections.abc import Iterator

from app.engine.grammar import GrammarService
from app.engine.request import Request
from app.engine.scheduler import ScheduledSeq
from app.engine.spec.speculator import draft_rows
from gpu.batch import SamplingRow, StepResult


def sampling_row(req: Request, vocab_size: int) -> SamplingRow:
    """The request's sampling row, built once at admission (see `SamplingRow`).

    Until `min_tokens` are out, the tokens that would end the request are banned.
    A top_k beyond the vocabulary keeps every token: it is clamped here, so the
    model thread only ever sees values that fit its tensors."""
    p = req.params
    banned = set(req.eos_token_ids) | set(p.stop_token_ids) if p.min_tokens else ()
    return SamplingRow(
        temperature=p.temperature, top_p=p.top_p, top_k=min(p.top_k, vocab_size), min_p=p.min_p,
        seed=p.seed,
        presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty, output_token_ids=req.output_token_ids,
        prompt_token_ids=req.prompt_token_ids if p.repetition_penalty != 1.0 else (),
        logprobs=p.logprobs, banned_token_ids=tuple(sorted(banned)),
        logit_bias=tuple((p.logit_bias or {}).items()),
    )


def step_rows(req: Request, drafts: list[int], grammars: GrammarService) -> list[SamplingRow]:
    """The request's rows for this step: its own, brought up to date (only the output
    index and the bans change; no step is in flight while this runs, so the model
    thread is not reading), then one per draft."""
    row = req.sampling
    row.output_index = req.num_output_tokens
    if row.banned_token_ids and req.num_output_tokens >= req.params.min_tokens:
        row.banned_token_ids = ()  # for good: the output never shrinks
    if not drafts:
        if req.grammar is not None:  # a fresh tensor: the last step's may still be read
            row.allowed = grammars.fill(req.grammar)
        return [row]
    masks = None
    if req.grammar is not None:
        masks = grammars.fill_drafts(req.grammar, drafts)
        row.allowed = masks[0]
    return [row, *draft_rows(row, req, drafts, masks)]


def sampled_rows(seqs: list[ScheduledSeq], result: StepResult
                 ) -> Iterator[tuple[ScheduledSeq, tuple[list[int], list, str | None]]]:
    """Per sampled sequence, in order: it, and (its rows' tokens, their logprobs, the
    error of a row of it whose sampling failed, or None)."""
    at = 0
    for seq in seqs:
        if not seq.samples:
            continue
        n = 1 + len(seq.drafts)
        logprobs = result.logprobs[at:at + n] if result.logprobs else [None] * n
        error = next((result.failed[i] for i in range(at, at + n) if i in result.failed), None)
        yield seq, (result.token_ids[at:at + n], logprobs, error)
        at += n
