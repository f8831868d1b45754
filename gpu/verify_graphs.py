"""CUDA graphs for speculative decoding's verify steps: every row 1 + k query tokens.

A verify step scores each speculating request's last token and its drafts in one
forward (`docs/speculative.md`): rows of 1 + d query tokens, d <= k
(`num_speculative_tokens`), beside plain decode rows (d = 0) and at times a short
prefill chunk. Its token count changes with every step's drafts, and a graph bakes in
its shapes, so the shape is fixed instead: a bucket of rows (the decode graphs' bucket
list), each exactly `row_len` = 1 + k tokens.

- A row's real tokens sit at its end, dummies in front of them: token 0 at position 0,
  slot -1 (the KV store skips it). The prefill kernel puts query j of a row at position
  context_len - row_len + j, so the real tokens keep their positions; the dummies take
  the positions just before them, read keys that are already cached (or, before
  position 0, none: output 0), and nobody reads their output.
- Dummy rows: all dummies, context 0, the block table's zero row.
- Every row goes through the prefill kernel (query length row_len everywhere), with
  query offsets a fixed stride; its grid depends on the bucket alone.

One shape per bucket keeps the capture count that of the decode graphs and the padding
plain, where buckets over (rows, tokens) would multiply captures. The price is the
dummies' rows in the matmuls, small while few requests run (from
`disable_by_batch_size` running requests nobody drafts, and the buckets stop there).
The forward ends at the final hidden states, as the decode graphs' does; the rows that
get logits are gathered after the replay, in sampling order.

Padding is plain Python, testable without CUDA; off CUDA the "graph" is a closure over
the same static buffers (`GraphRunner._record`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gpu.attention.base import AttentionInputs, StepContext
from gpu.batch import Batch
from gpu.graphs import DecodeBuffers, GraphRunner, bucket_for, graph_sizes
from gpu.step_inputs import logit_rows

log = logging.getLogger("ridgeline.graphs")


def verify_sizes(max_num_seqs: int, disable_by_batch_size: int | None) -> list[int]:
    """The verify buckets: up to the first that holds the most rows a step with drafts
    can have (drafts stop from `disable_by_batch_size` running requests)."""
    return graph_sizes(min(max_num_seqs, disable_by_batch_size or max_num_seqs))


def graph_token_counts(decode_sizes: list[int], verify: list[int], row_len: int) -> list[int]:
    """Every graph's token count, sorted: what the memory profile sizes the graphs by
    (one allowance each, and the shared pool of the largest step's activations)."""
    return sorted(decode_sizes + [bs * row_len for bs in verify])


@dataclass
class PaddedVerify:
    """A verify step padded to its bucket: per-token lists of bucket * row_len entries,
    per-row lists of bucket, and the padded rows that get logits, in sampling order."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    context_lens: list[int]
    table_rows: list[int]
    logit_rows: list[int]
    lora_slots: list[int]  # per token, all -1: a batch with an adapter runs eagerly


def pad_verify_batch(batch: Batch, bucket: int, row_len: int, padding_row: int
                     ) -> PaddedVerify:
    """Each sequence's tokens at the end of its row of `row_len`, dummies in front; then
    dummy rows up to `bucket` (module docstring)."""
    assert batch.num_seqs <= bucket and max(batch.query_lens) <= row_len
    ids, positions, slots = [], [], []
    start = 0
    for q in batch.query_lens:
        pad = row_len - q
        ids += [0] * pad + batch.token_ids[start:start + q]
        positions += [0] * pad + batch.positions[start:start + q]
        slots += [-1] * pad + batch.slot_mapping[start:start + q]
        start += q
    dummies = (bucket - batch.num_seqs) * row_len
    rows = batch.table_rows if batch.table_rows is not None else []
    ends = list(range(0, (batch.num_seqs + 1) * row_len, row_len))
    return PaddedVerify(
        token_ids=ids + [0] * dummies,
        positions=positions + [0] * dummies,
        slot_mapping=slots + [-1] * dummies,
        context_lens=batch.context_lens + [0] * (bucket - batch.num_seqs),
        table_rows=rows + [padding_row] * (bucket - len(rows)),
        logit_rows=logit_rows(batch, ends) or [],
        lora_slots=[-1] * (bucket * row_len),
    )


class VerifyGraphs:
    """One graph per bucket of `row_len`-token rows, in the decode graphs' memory pool."""

    def __init__(self, decode: GraphRunner, sizes: list[int], row_len: int):
        assert row_len > 1
        self.decode, self.sizes, self.row_len = decode, sorted(sizes), row_len
        max_tokens = self.sizes[-1] * row_len
        self.buffers = DecodeBuffers(max_tokens, decode.tables.width, decode.device)
        self.query_start_loc = torch.arange(0, (self.sizes[-1] + 1) * row_len, row_len,
                                            dtype=torch.int32, device=decode.device)
        model = decode.model
        self.hidden = torch.zeros(max_tokens, model.config.hidden_size,
                                  dtype=model.embed_tokens.weight.dtype, device=decode.device)
        self._replay: dict[int, Callable[[], object]] = {}
        self._keep: list[object] = []
        self.replays = 0

    def attention_inputs(self, bs: int) -> AttentionInputs:
        n, buffers = bs * self.row_len, self.buffers
        return AttentionInputs(
            slot_mapping=buffers.slot_mapping[:n],
            query_start_loc=self.query_start_loc[: bs + 1],
            context_lens=buffers.context_lens[:bs],
            block_tables=buffers.block_tables[:bs],
            max_query_len=self.row_len,
            max_context_len=self.decode.max_model_len,
            query_lens_list=[self.row_len] * bs,  # no one-token row: no decode kernel
            context_lens_list=[0] * bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        for bs in reversed(self.sizes):
            self._replay[bs] = self._capture_one(bs)
        log.info("Captured %d CUDA graphs for verify steps of %d tokens per row at batch "
                 "sizes %s in %.1f s", len(self.sizes), self.row_len, self.sizes,
                 time.perf_counter() - t0)

    def _capture_one(self, bs: int) -> Callable[[], object]:
        decode = self.decode
        meta = decode.backend.prepare(self.attention_inputs(bs), num_splits=1)
        self._keep.append(meta)
        ctx = StepContext(decode.backend, meta, decode.k_caches, decode.v_caches)
        n = bs * self.row_len
        ids, positions = self.buffers.input_ids[:n], self.buffers.positions[:n]
        out = self.hidden[:n]

        def forward() -> None:
            out.copy_(decode.model(ids, positions, ctx))

        return decode._record(forward)

    def can_run(self, batch: Batch) -> bool:
        """Rows of at most `row_len` tokens that fit a bucket; no prompt logprobs (they
        want every row's hidden state) and no LoRA adapter (the eager path applies it)."""
        return (batch.num_seqs <= self.sizes[-1] and max(batch.query_lens) <= self.row_len
                and bool(batch.sample_indices) and not batch.prompt_logprobs
                and not any(batch.lora_ids) and self.decode.tables_fit(batch))

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """The hidden states of the rows that get logits, in sampling order."""
        bucket = bucket_for(batch.num_seqs, self.sizes)
        padded = pad_verify_batch(batch, bucket, self.row_len, self.decode.tables.padding_row)
        self.buffers.load(padded)
        self.decode.fill_tables(batch, self.buffers, bucket)
        self._replay[bucket]()
        self.replays += 1
        (rows,) = self.decode._staging.stage((padded.logit_rows, torch.long))
        return self.hidden[rows]
