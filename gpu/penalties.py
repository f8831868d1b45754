"""Running token counts for repetition, presence and frequency penalties, batched.

Each penalized request owns one row ("slot") of a `[slots, vocab]` count matrix kept on
the device by the sampler. A step folds in only the tokens the request produced since
its last step (usually one), so a penalty costs O(1) per token rather than a rescan of
the output, and all penalized rows of a batch are then penalized by a handful of
kernels over the stacked `[rows, vocab]` slice, not a loop over rows.

The request's `SamplingRow.penalty_state` remembers its slot and how many of its
tokens are counted. The slot comes back when the row is garbage-collected (its request
is gone): the last reference usually drops on the event loop, so the slot travels back
through a thread-safe queue and is reused on the model thread.
"""

from __future__ import annotations

import queue
import weakref
from dataclasses import dataclass

import torch

from gpu.batch import SamplingRow


@dataclass(eq=False)
class _Slot:
    owner: PenaltyCounts
    index: int
    counted: int = 0  # tokens of the row's output already in the counts


class PenaltyCounts:
    def __init__(self, device: torch.device):
        self.device = device
        self.counts: torch.Tensor | None = None  # [capacity, vocab] float32, made on first use
        self._free: list[int] = []
        self._returned: queue.SimpleQueue[int] = queue.SimpleQueue()

    def prepare(self, rows: list[SamplingRow], vocab: int
                ) -> tuple[list[int], list[int], list[int], list[tuple[_Slot, int]]]:
        """For penalized rows: each one's slot, the (slot, token) pairs to count now, and
        the progress to record once they are counted (`commit`)."""
        while not self._returned.empty():
            self._free.append(self._returned.get_nowait())
        slots, fold_slots, fold_tokens, progress = [], [], [], []
        for row in rows:
            state = row.penalty_state
            if not isinstance(state, _Slot) or state.owner is not self:
                state = row.penalty_state = self._new_slot(row, vocab)
            new = row.output_token_ids[state.counted:]
            fold_slots += [state.index] * len(new)
            fold_tokens += new
            progress.append((state, state.counted + len(new)))
            slots.append(state.index)
        return slots, fold_slots, fold_tokens, progress

    def _new_slot(self, row: SamplingRow, vocab: int) -> _Slot:
        if not self._free:
            self._grow(vocab)
        index = self._free.pop()
        self.counts[index].zero_()
        slot = _Slot(self, index)
        weakref.finalize(row, self._returned.put, index)
        return slot

    def _grow(self, vocab: int) -> None:
        old = self.counts
        capacity = 8 if old is None else 2 * old.shape[0]
        self.counts = torch.zeros(capacity, vocab, device=self.device)
        if old is not None:
            self.counts[: old.shape[0]] = old
        start = 0 if old is None else old.shape[0]
        self._free += range(capacity - 1, start - 1, -1)

    def fold(self, slots: torch.Tensor, tokens: torch.Tensor,
             progress: list[tuple[_Slot, int]]) -> None:
        """Count `tokens[i]` once more in slot `slots[i]`, then record the progress."""
        if slots.numel():
            ones = torch.ones(slots.shape[0], device=self.device)
            self.counts.index_put_((slots, tokens), ones, accumulate=True)
        for state, counted in progress:
            state.counted = counted

    def penalize(self, logits: torch.Tensor, slots: torch.Tensor, repetition: torch.Tensor,
                 presence: torch.Tensor, frequency: torch.Tensor) -> torch.Tensor:
        """Penalized copies of `logits` rows ([rows, vocab]); `slots` and the per-row
        penalties ([rows]) line up with them. OpenAI presence and frequency penalties,
        and the CTRL-style repetition penalty of HF and vLLM."""
        counts = self.counts[slots]
        seen = counts > 0
        rep = repetition[:, None]
        logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
        return logits - (presence[:, None] * seen + frequency[:, None] * counts)

    def counts_of(self, row: SamplingRow) -> tuple[list[float], int]:
        """(counts, tokens counted) of one row: for tests."""
        state = row.penalty_state
        assert isinstance(state, _Slot) and state.owner is self
        return self.counts[state.index].tolist(), state.counted
