"""The message between the event loop and the model thread.

`app/` builds a `Batch` from plain Python lists (no tensors: the event loop
never touches a device), posts it to the worker, and receives a `StepResult`.
The model thread never sees a Request object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from gpu.roofline import StepCost


@dataclass(eq=False)
class SamplingRow:
    """How to pick the next token for one request; built once, when it is admitted.

    The event loop updates only what changes between steps (`output_index`,
    `banned_token_ids`), and only while no step is in flight; everything else is
    fixed for the request's life. `seed` plus `output_index` (how many tokens the
    request has produced so far) fully determine the random draw, so a seeded
    request samples the same tokens alone or in any batch, and again after
    preemption and recompute.

    `output_token_ids` is the request's own output list, shared, not copied (and so is
    `prompt_token_ids`, read once when the row first needs its penalty counts): the
    sampler folds only the tokens added since the last step into its running
    counts (`penalty_state`, owned by the model thread), so penalties cost O(1)
    per token instead of rescanning the history.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    output_index: int = 0
    # Token ids that must not be sampled this step (EOS and stop ids until
    # min_tokens is reached).
    banned_token_ids: tuple[int, ...] = ()
    # Repetition control: presence and frequency over the tokens generated so far
    # (OpenAI semantics); the repetition penalty over the prompt's tokens too (HF, vLLM).
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    output_token_ids: Sequence[int] = ()
    prompt_token_ids: Sequence[int] = ()
    logprobs: int | None = None  # None: none; k: the sampled token's logprob and top-k
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    # With a grammar: this step's bitmask of allowed tokens (a CPU int32 tensor,
    # ceil(vocab / 32) words, bit j of word i = token 32·i + j), refilled every step.
    allowed: Any = field(default=None, repr=False)
    penalty_state: Any = field(default=None, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether a penalty changes this step's logits: one is set, and some token it
        counts is there already."""
        if self.repetition_penalty != 1.0 and self.prompt_token_ids:
            return True
        return bool((self.presence_penalty or self.frequency_penalty
                     or self.repetition_penalty != 1.0) and self.output_token_ids)


@dataclass(frozen=True)
class PromptLogprobsRequest:
    """Score the prompt tokens that follow this sequence's new positions.

    Position j of the sequence's chunk predicts `targets[j]`, the prompt token after
    it; the chunk's last position predicts the next chunk's first token while the
    prompt goes on, and nothing at the prompt's end (that one is sampled)."""

    seq_index: int
    targets: list[int]
    top_k: int


@dataclass
class Batch:
    """One scheduler step, flattened.

    Tokens of all sequences are concatenated (`token_ids`, `positions`,
    `slot_mapping` have one entry per token). Sequence i owns the next
    `query_lens[i]` of them, in order; after this step its KV cache
    holds `context_lens[i]` tokens, laid out along its block table.
    Rows listed in `sample_indices` (sequence indices) get a sampled token;
    a sequence in the middle of a chunked prefill gets none. Under speculative
    decoding, `spec_lens` (one per entry of `sample_indices`, or empty for none) says
    how many draft tokens end that sequence's new tokens: each of its last
    `1 + spec_lens[e]` positions is sampled, in order, with its own row of `sampling`
    (the event loop compares the picks with the drafts).

    Block tables come one of two ways. The engine sends deltas: sequence i reads row
    `table_rows[i]` of the model thread's persistent table, and `table_updates` holds
    the entries those rows have not received yet (`gpu/block_table.py`). A batch made
    by hand (tests, the GPU check) may instead give whole tables in `block_tables`.
    """

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: list[list[int]] | None  # whole tables, or None with table_rows
    sample_indices: list[int]
    sampling: list[SamplingRow]  # one per sampled position (see spec_lens)
    table_rows: list[int] | None = None
    # (row, first column, block ids): entries to write before this step runs.
    table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # Sequences that want the logprobs of their prompt tokens (echo, prompt_logprobs).
    prompt_logprobs: list[PromptLogprobsRequest] = field(default_factory=list)
    spec_lens: list[int] = field(default_factory=list)
    # Per sequence, its LoRA adapter's id (0: the base model); empty when no sequence of
    # the step has one (`gpu/lora.py`).
    lora_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        # Invariants the model thread relies on; cheap to check, costly to debug.
        n = len(self.token_ids)
        assert len(self.positions) == n and len(self.slot_mapping) == n
        assert sum(self.query_lens) == n
        tables = self.block_tables if self.table_rows is None else self.table_rows
        assert (self.block_tables is None) != (self.table_rows is None), "one kind of table"
        assert len(self.context_lens) == len(self.query_lens) == len(tables)
        assert len(self.spec_lens) in (0, len(self.sample_indices))
        assert len(self.lora_ids) in (0, len(self.query_lens))
        assert len(self.sample_indices) + sum(self.spec_lens) == len(self.sampling)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def is_decode_only(self) -> bool:
        return all(q == 1 for q in self.query_lens)

    @property
    def samples_every_row(self) -> bool:
        """Decode-only and every sequence sampled: the hidden states are the logits' rows."""
        n = self.num_seqs
        return len(self.token_ids) == n and self.sample_indices == list(range(n))


@dataclass
class StepResult:
    """Sampled token per entry of `Batch.sample_indices`, plus optional logprobs."""

    token_ids: list[int]  # one per row of `Batch.sampling`; -1 for a row in `failed`
    # Per sampled row: (logprob of the sampled token, [(token_id, logprob), ...]) or None.
    logprobs: list[tuple[float, list[tuple[int, float]]] | None] = field(default_factory=list)
    # Sampled rows (positions in `token_ids`) whose sampling failed alone, with the error.
    failed: dict[int, str] = field(default_factory=dict)
    # Per `Batch.prompt_logprobs` entry (by seq index): one (logprob, rank, top pairs)
    # per target, `rank` being 1 + how many tokens scored higher than the target.
    prompt_logprobs: dict[int, list[tuple[float, int, list[tuple[int, float]]]]] = field(
        default_factory=dict)
    # The step's FLOPs and bytes from its shape, and the model thread's time for it.
    cost: StepCost | None = None
