"""CUDA-graph capture and replay of decode-only steps.

A decode step of a small batch is a few hundred short kernels; launching them
one by one from Python costs more than running them. Captured once into a CUDA
graph, the whole forward is one launch. A graph bakes in every address and
launch grid, so:

- inputs live in static buffers (`DecodeBuffers`) that every graph reads;
- a batch is padded up to the next captured size (its bucket) with dummy rows:
  slot -1 (the KV store skips it) and context length 0 (the decode kernel
  writes zeros) — no branch anywhere in the hot path;
- the split-K decode's `num_splits` is pinned per bucket, chosen for
  max_model_len, since its grid and workspace cannot change after capture;
- with LoRA adapters (per-row kernels, `gpu/lora.py`) each bucket is captured twice:
  with the LoRA kernels reading each row's slot from a static buffer (padding: -1,
  no delta), replayed when a row has an adapter, and without them, so that a step
  of the base model alone pays nothing for LoRA.

The graph covers the model forward up to the final hidden states; logits and
sampling run eagerly on the real rows only. Speculative decoding's verify steps
(several query tokens per row) replay graphs of their own (`gpu/verify_graphs.py`).
Prefill, other mixed steps and batches above the largest bucket run eagerly. All
graphs share one memory pool, captured largest first so that the smaller ones reuse
its blocks.

Bucket choice and padding are plain Python, testable without CUDA. Off CUDA,
`GraphRunner` "captures" a closure that re-runs the forward on the same static
buffers, so the padding and buffer logic runs on CPU too (tests, smoke check).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from gpu.attention.base import AttentionInputs, StepContext
from gpu.attention.triton_backend import TritonAttentionBackend
from gpu.batch import Batch
from gpu.block_table import DeviceBlockTable
from gpu.staging import Staging
from gpu.step_inputs import whole_tables
from gpu.triton.paged_decode import choose_num_splits, num_sms

if TYPE_CHECKING:
    from gpu.lora import LoRASlots

log = logging.getLogger("ridgeline.graphs")

MAX_CAPTURE_SIZE = 512
GiB = 1 << 30


def capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM's bucket list: 1, 2, 4, steps of 8 to 256, steps of 16 beyond,
    up to min(2 * max_num_seqs, 512)."""
    cap = min(2 * max_num_seqs, MAX_CAPTURE_SIZE)
    sizes = [1, 2, 4, *range(8, 257, 8), *range(272, MAX_CAPTURE_SIZE + 1, 16)]
    return [s for s in sizes if s <= cap]


def graph_sizes(max_num_seqs: int) -> list[int]:
    """The buckets worth capturing: up to the first that holds max_num_seqs rows.

    A decode step has at most max_num_seqs sequences (the scheduler's cap), so
    larger buckets could never be replayed; skipping them saves capture time
    and graph memory.
    """
    sizes = capture_sizes(max_num_seqs)
    return sizes[: bisect.bisect_left(sizes, max_num_seqs) + 1]


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= num_seqs; None when the batch is too large."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class PaddedDecode:
    """A decode-only batch padded to its bucket, as host lists (one entry per row)."""

    token_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    context_lens: list[int]
    table_rows: list[int]  # rows of the persistent block table; padding: its zero row
    lora_slots: list[int]  # each row's LoRA slot; -1: none (the base model, padding)


def pad_decode_batch(batch: Batch, bucket: int, padding_row: int,
                     lora_slots: list[int] | None = None) -> PaddedDecode:
    """Real rows copied as they are, then dummy rows: token 0 at position 0, slot -1
    (nothing stored), context 0 (attention output 0), the block table's zero row, LoRA
    slot -1 (no delta).

    A batch with whole block tables (made by hand) reads rows 0.. of the graph's own
    table buffer instead, which `GraphRunner.run` fills."""
    assert batch.is_decode_only and batch.num_seqs <= bucket
    pad = bucket - batch.num_seqs
    rows = batch.table_rows if batch.table_rows is not None else []
    return PaddedDecode(
        token_ids=batch.token_ids + [0] * pad,
        positions=batch.positions + [0] * pad,
        slot_mapping=batch.slot_mapping + [-1] * pad,
        context_lens=batch.context_lens + [0] * pad,
        table_rows=rows + [padding_row] * (bucket - len(rows)),
        lora_slots=(lora_slots or [-1] * batch.num_seqs) + [-1] * pad,
    )


# (buffer, PaddedDecode field, dtype) of each static input that arrives by the one copy.
_FIELDS = (("input_ids", "token_ids", torch.long), ("positions", "positions", torch.long),
           ("slot_mapping", "slot_mapping", torch.long), ("table_rows", "table_rows", torch.long),
           ("context_lens", "context_lens", torch.int32),
           ("lora_slots", "lora_slots", torch.int32))


class DecodeBuffers:
    """Static device inputs read by every captured graph (fixed addresses).

    Graph for bucket b reads rows [:b]. Token ids, positions, slots, context lengths
    and block-table rows sit in one device buffer with a pinned host twin: a step
    writes its padded rows into the twin and sends it whole, in one asynchronous copy
    of a few KiB. Block-table columns past a batch's widest table keep older values:
    always valid block ids, never read, since the kernels stop at each row's context
    length.
    """

    def __init__(self, max_size: int, max_blocks_per_seq: int, device: torch.device):
        self.device = device
        self._cuda = device.type == "cuda"
        sizes = [-(-max_size * dtype.itemsize // 16) * 16 for _, _, dtype in _FIELDS]
        self._dev = torch.zeros(sum(sizes), dtype=torch.uint8, device=device)
        # Off CUDA the "device" buffer is host memory already: write it directly.
        self._host = (torch.zeros_like(self._dev, device="cpu").pin_memory() if self._cuda
                      else self._dev)
        self._host_views: dict[str, torch.Tensor] = {}
        offset = 0
        for (name, _, dtype), size in zip(_FIELDS, sizes):
            span = slice(offset, offset + max_size * dtype.itemsize)
            setattr(self, name, self._dev[span].view(dtype))
            self._host_views[name] = self._host[span].view(dtype)
            offset += size
        for name in ("slot_mapping", "lora_slots"):
            self._host_views[name].fill_(-1)
            getattr(self, name).fill_(-1)
        self.block_tables = torch.zeros(max_size, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)
        # One token per row, so the query offsets never change.
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        self._copied: torch.cuda.Event | None = None

    def load(self, padded: PaddedDecode) -> None:
        """Per-token fields fill their first len(token_ids) entries, per-row fields their
        first len(context_lens) (the same number here; a verify step's rows hold several
        tokens, `gpu/verify_graphs.py`)."""
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the last copy still reads the twin (no sync since)
        for name, field, dtype in _FIELDS:
            values = getattr(padded, field)
            self._host_views[name][:len(values)].copy_(torch.as_tensor(values, dtype=dtype))
        if self._cuda:
            self._dev.copy_(self._host, non_blocking=True)
            if self._copied is None:
                self._copied = torch.cuda.Event()
            self._copied.record()

    def attention_inputs(self, bs: int, max_context_len: int) -> AttentionInputs:
        """Views of the first `bs` rows; the host lists describe capture time only."""
        return AttentionInputs(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[: bs + 1],
            context_lens=self.context_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_context_len=max_context_len,
            query_lens_list=[1] * bs,
            context_lens_list=[0] * bs,
        )


class GraphRunner:
    """Captures one graph per bucket and replays the right one for a decode batch."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: TritonAttentionBackend,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        *,
        sizes: list[int],
        max_model_len: int,
        tables: DeviceBlockTable,
        loras: LoRASlots | None = None,
    ):
        """`loras`: the adapters' slots when LoRA is on (per-row kernels only)."""
        assert loras is None or loras.per_row, "graphs capture the per-row LoRA kernels only"
        self.model, self.backend = model, backend
        self.loras = loras
        self.k_caches, self.v_caches = k_caches, v_caches
        self.sizes = sorted(sizes)
        self.max_model_len = max_model_len
        self.device = k_caches[0].device
        self.tables = tables  # the persistent block table the engine's rows live in
        assert tables.width == -(-max_model_len // backend.block_size)
        self.buffers = DecodeBuffers(self.sizes[-1], tables.width, self.device)
        self._staging = Staging(self.device)  # whole tables of hand-made batches
        hidden = model.config.hidden_size
        dtype = model.embed_tokens.weight.dtype
        # One output buffer for all graphs, outside the graph pool.
        self.hidden = torch.zeros(self.sizes[-1], hidden, dtype=dtype, device=self.device)
        self._replay: dict[int, Callable[[], object]] = {}
        # Speculative decoding's verify steps: a `gpu/verify_graphs.VerifyGraphs`, or None.
        self.verify = None
        self._replay_lora: dict[int, Callable[[], object]] = {}  # with the LoRA kernels
        self._keep: list[object] = []  # per-bucket metadata (split workspaces) must outlive graphs
        self._pool = None
        self.replays = 0
        self.capture_seconds = 0.0
        self.memory_bytes = 0  # device memory the capture took (CUDA only)

    def num_splits(self, bs: int) -> int:
        """Pinned per bucket for the longest context a row may reach."""
        return choose_num_splits(bs, self.backend.num_kv_heads, self.max_model_len,
                                 num_sms(self.device))

    @torch.inference_mode()
    def capture(self) -> None:
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            free_before = torch.cuda.mem_get_info(self.device)[0]
            self._pool = torch.cuda.graph_pool_handle()
        t0 = time.perf_counter()
        for bs in reversed(self.sizes):  # largest first: smaller graphs reuse its pool blocks
            self._replay[bs] = self._capture_one(bs)
            if self.loras is not None:
                self._replay_lora[bs] = self._capture_one(bs, lora=True)
        if self.verify is not None:  # in the same pool (steps replay one at a time)
            self.verify.capture()
        if cuda:
            torch.cuda.synchronize(self.device)
            self.memory_bytes = free_before - torch.cuda.mem_get_info(self.device)[0]
        self.capture_seconds = time.perf_counter() - t0
        log.info("Captured %d CUDA graphs for decode batch sizes %s in %.1f s; "
                 "they take %.2f GiB of GPU memory",
                 len(self._replay) + len(self._replay_lora), _span(self.sizes),
                 self.capture_seconds, self.memory_bytes / GiB)

    def _capture_one(self, bs: int, lora: bool = False) -> Callable[[], object]:
        inputs = self.buffers.attention_inputs(bs, self.max_model_len)
        meta = self.backend.prepare(inputs, num_splits=self.num_splits(bs))
        self._keep.append(meta)
        ctx = StepContext(self.backend, meta, self.k_caches, self.v_caches)
        ids, positions = self.buffers.input_ids[:bs], self.buffers.positions[:bs]
        out = self.hidden[:bs]
        rows = self.buffers.lora_slots[:bs]

        def forward() -> None:
            with self.loras.rows(rows) if lora else contextlib.nullcontext():
                out.copy_(self.model(ids, positions, ctx))

        return self._record(forward)

    def _record(self, forward: Callable[[], None]) -> Callable[[], object]:
        if self.device.type != "cuda":
            return forward  # same buffers, same contract, no graph
        # Warm-up outside capture: Triton compiles and cuBLAS picks algorithms here.
        forward()
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            forward()
        return graph.replay

    def can_run(self, batch: Batch) -> bool:
        """A decode-only batch that fits a bucket (or a verify step that fits the verify
        graphs), with tables no wider than the graphs' (a wider one would index past the
        static buffer: it runs eagerly instead)."""
        if not batch.is_decode_only:
            return self.verify is not None and self.verify.can_run(batch)
        return batch.num_seqs <= self.sizes[-1] and self.tables_fit(batch)

    def tables_fit(self, batch: Batch) -> bool:
        if batch.block_tables is not None:
            return max(len(t) for t in batch.block_tables) <= self.tables.width
        return -(-max(batch.context_lens) // self.backend.block_size) <= self.tables.width

    @torch.inference_mode()
    def run(self, batch: Batch) -> torch.Tensor:
        """Final hidden states [num_seqs, hidden] of a decode-only batch, by replay; of a
        verify step, the rows that get logits, in sampling order (`gpu/verify_graphs.py`).

        The batch's block-table updates must be applied already (`ModelRunner`). The
        result is a view of the shared output buffer: use it before the next replay.
        """
        if not batch.is_decode_only:
            return self.verify.run(batch)
        bucket = bucket_for(batch.num_seqs, self.sizes)
        lora = self.loras is not None and any(batch.lora_ids)
        slots = self.loras.row_slots(batch.lora_ids) if lora else None
        self.buffers.load(pad_decode_batch(batch, bucket, self.tables.padding_row, slots))
        self.fill_tables(batch, self.buffers, bucket)
        (self._replay_lora if lora else self._replay)[bucket]()
        self.replays += 1
        return self.hidden[: batch.num_seqs]

    def fill_tables(self, batch: Batch, buffers: DecodeBuffers, bucket: int) -> None:
        """The block tables of `buffers`' first `bucket` rows, from the persistent table
        (the rows `buffers.load` just wrote) or from a hand-made batch's whole tables."""
        if batch.block_tables is None:
            self.tables.gather(buffers.table_rows[:bucket], out=buffers.block_tables[:bucket])
        else:
            flat, width = whole_tables(batch)
            (staged,) = self._staging.stage((flat, torch.int32))
            buffers.block_tables[: batch.num_seqs, :width].copy_(
                staged.view(batch.num_seqs, width))


def _span(sizes: list[int]) -> str:
    return f"{sizes[0]}..{sizes[-1]}" if len(sizes) > 2 else str(sizes)
