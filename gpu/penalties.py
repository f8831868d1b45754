"""Running token counts for repetition, presence and frequency penalties, batched.

Each penalized request owns one row ("slot") of a `[slots, vocab]` count matrix kept on
the device by the sampler. A step folds in only the tokens the request produced since
its last step (usually one), so a penalty costs O(1) per token rather than a rescan of
the output, and all penalized rows of a batch are then penalized by a handful of
kernels over the stacked `[rows, vocab]` slice, not a loop over rows.

The repetition penalty, as in HF and vLLM, also applies to tokens of the prompt: a
slot's row of a second `[slots, vocab]` matrix marks them, once, when the slot is
taken (presence and frequency count the output alone, as OpenAI defines them).

The request's `SamplingRow.penalty_state` remembers its slot and how many of its
tokens are counted. The slot comes back when the row is garbage-collected (its request
is gone): the last reference usually drops on the event loop, so the slot travels back
through a thread-safe queue and is reused on the model thread.
"""

from __future__ import annotations

import queue
import weakref
from dataclasses import dataclass
from typing import NamedTuple

import torch

from gpu.batch import SamplingRow
from gpu.cpu.capabilities import CpuCapabilities


@dataclass(eq=False)
class _Slot:
    owner: PenaltyCounts
    index: int
    counted: int = 0  # tokens of the row's output already in the counts


class Folds(NamedTuple):
    """What `prepare` found for the penalized rows of a step."""

    slots: list[int]  # each row's slot
    fold_slots: list[int]  # (slot, token) pairs to count once more now
    fold_tokens: list[int]
    mark_slots: list[int]  # (slot, token) pairs of prompts to mark, for new slots
    mark_tokens: list[int]
    progress: list[tuple[_Slot, int]]  # to record once counted (`fold`)


class PenaltyCounts:
    def __init__(self, device: torch.device, capabilities: CpuCapabilities | None = None):
        """`capabilities`: the CPU's, where the C++ kernels may serve; their op
        `apply_penalties_`, when built, penalizes the rows in one pass each (`penalize`
        is its reference)."""
        self.device = device
        self.kernel = capabilities.op("apply_penalties_") if capabilities is not None else None
        self.counts: torch.Tensor | None = None  # [capacity, vocab] float32, made on first use
        self.in_prompt: torch.Tensor | None = None  # [capacity, vocab] bool, beside it
        self._free: list[int] = []
        self._returned: queue.SimpleQueue[int] = queue.SimpleQueue()

    def prepare(self, rows: list[SamplingRow], vocab: int) -> Folds:
        """For penalized rows: each one's slot, the (slot, token) pairs to count or mark
        now, and the progress to record once they are counted (`fold`)."""
        while not self._returned.empty():
            self._free.append(self._returned.get_nowait())
        f = Folds([], [], [], [], [], [])
        for row in rows:
            state = row.penalty_state
            if not isinstance(state, _Slot) or state.owner is not self:
                state = row.penalty_state = self._new_slot(row, vocab)
                f.mark_slots.extend([state.index] * len(row.prompt_token_ids))
                f.mark_tokens.extend(row.prompt_token_ids)
            new = row.output_token_ids[state.counted:]
            f.fold_slots.extend([state.index] * len(new))
            f.fold_tokens.extend(new)
            f.progress.append((state, state.counted + len(new)))
            f.slots.append(state.index)
        return f

    def _new_slot(self, row: SamplingRow, vocab: int) -> _Slot:
        if not self._free:
            self._grow(vocab)
        index = self._free.pop()
        self.counts[index].zero_()
        self.in_prompt[index].zero_()
        slot = _Slot(self, index)
        weakref.finalize(row, self._returned.put, index)
        return slot

    def _grow(self, vocab: int) -> None:
        old = self.counts
        capacity = 8 if old is None else 2 * old.shape[0]
        self.counts = torch.zeros(capacity, vocab, device=self.device)
        in_prompt, self.in_prompt = self.in_prompt, torch.zeros_like(self.counts, dtype=torch.bool)
        if old is not None:
            self.counts[: old.shape[0]] = old
            self.in_prompt[: old.shape[0]] = in_prompt
        start = 0 if old is None else old.shape[0]
        self._free += range(capacity - 1, start - 1, -1)

    def fold(self, slots: torch.Tensor, tokens: torch.Tensor, mark_slots: torch.Tensor,
             mark_tokens: torch.Tensor, progress: list[tuple[_Slot, int]]) -> None:
        """Count `tokens[i]` once more in slot `slots[i]`, mark `mark_tokens[i]` as in the
        prompt of slot `mark_slots[i]`, then record the progress."""
        if slots.numel():
            ones = torch.ones(slots.shape[0], device=self.device)
            self.counts.index_put_((slots, tokens), ones, accumulate=True)
        if mark_slots.numel():
            self.in_prompt[mark_slots, mark_tokens] = True
        for state, counted in progress:
            state.counted = counted

    def apply_(self, logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
               repetition: torch.Tensor, presence: torch.Tensor,
               frequency: torch.Tensor) -> None:
        """Penalize `logits[rows]` in place; `slots` and the penalties line up with `rows`."""
        if self.kernel is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            self.kernel(logits, rows, self.counts, self.in_prompt, slots, repetition,
                        presence, frequency)
        else:
            logits[rows] = self.penalize(logits[rows], slots, repetition, presence, frequency)

    def penalize(self, logits: torch.Tensor, slots: torch.Tensor, repetition: torch.Tensor,
                 presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
        """Penalized copies of `logits` rows ([rows, vocab]); `slots` and the per-row
        penalties ([rows]) line up with them. OpenAI presence and frequency penalties,
        and the CTRL-style repetition penalty of HF and vLLM (over prompt and output)."""
        counts = self.counts[slots]
        seen = counts > 0
        repeated = seen | self.in_prompt[slots]
        rep = repetition[:, None]
        logits = torch.where(repeated, torch.where(logits > 0, logits / rep, logits * rep),
                             logits)
        return logits - (presence[:, None] * seen + frequency[:, None] * counts)

    def counts_of(self, row: SamplingRow) -> tuple[list[float], int]:
        """(counts, tokens counted) of one row: for tests."""
        state = row.penalty_state
        assert isinstance(state, _Slot) and state.owner is self
        return self.counts[state.index].tolist(), state.counted
