"""CUDA-graph buckets, padding and replay; memory profiling.

Bucket choice, padding and the static buffers are plain Python and run on CPU.
So does replay itself: off CUDA `GraphRunner` records a closure over the same
static buffers instead of a graph, which checks the padding end to end (Triton
kernels interpreted) against the eager path; on the GPU machine the same test
captures real graphs. Tests marked `needs_cuda` are skipped on CPU and run on
the GPU machine (scripts/gpu_check.py runs this file there).
"""

from __future__ import annotations

import pytest
import torch

import gpu.graphs
from app.config import EngineConfig
from gpu.batch import Batch, SamplingRow
from gpu.graphs import (
    DecodeBuffers,
    GraphRunner,
    bucket_for,
    capture_sizes,
    graph_sizes,
    pad_decode_batch,
)
from gpu.profiling import GRAPH_OVERHEAD_BYTES, profile_memory, profile_query_lens
from gpu.runner import ModelRunner, RunnerSpec
from models.tiny import make_tiny_llama
from tests.graph_replay import assert_same_step, replay_and_eager

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA: runs on the GPU machine")
# conftest turns the Triton interpreter on only where there is no GPU.
TRITON_ON_CPU = pytest.param("triton", marks=pytest.mark.skipif(
    CUDA, reason="Triton on CPU tensors needs the interpreter (off on the GPU machine)"))
BLOCK = 16
GREEDY = SamplingRow(temperature=0.0, logprobs=2)


class Sequences:
    """Hands out pages and builds scheduler-like batches for a few sequences."""

    def __init__(self, prompts: list[list[int]], block_size: int = BLOCK, first_block: int = 1,
                 rows: bool = False):
        """`rows`: send block tables as the engine does, as deltas to persistent rows
        (sequence i on row i); else whole tables, as a hand-made batch."""
        self.tokens = [list(p) for p in prompts]
        self.block_size, self.next_block = block_size, first_block
        self.tables: list[list[int]] = [[] for _ in prompts]
        self.computed = [0] * len(prompts)
        self.rows, self.sent = rows, [0] * len(prompts)

    def _slots(self, i: int, start: int, end: int) -> list[int]:
        while len(self.tables[i]) * self.block_size < end:
            self.tables[i].append(self.next_block)
            self.next_block += 1
        return [self.tables[i][p // self.block_size] * self.block_size + p % self.block_size
                for p in range(start, end)]

    def batch(self, rows: list[int] | None = None) -> Batch:
        """Every uncomputed token of the given sequences (all by default)."""
        rows = list(range(len(self.tokens))) if rows is None else rows
        ids, pos, slots, qlens, ctx, tables = [], [], [], [], [], []
        for i in rows:
            start, end = self.computed[i], len(self.tokens[i])
            ids += self.tokens[i][start:end]
            pos += range(start, end)
            slots += self._slots(i, start, end)
            qlens.append(end - start)
            ctx.append(end)
            tables.append(list(self.tables[i]))
        if not self.rows:
            return Batch(ids, pos, slots, qlens, ctx, tables, list(range(len(rows))),
                         [GREEDY] * len(rows))
        updates = []
        for i in rows:
            if len(self.tables[i]) > self.sent[i]:
                updates.append((i, self.sent[i], self.tables[i][self.sent[i]:]))
                self.sent[i] = len(self.tables[i])
        return Batch(ids, pos, slots, qlens, ctx, None, list(range(len(rows))),
                     [GREEDY] * len(rows), table_rows=list(rows), table_updates=updates)

    def advance(self, rows: list[int], tokens: list[int]) -> None:
        for i, t in zip(rows, tokens):
            self.computed[i] = len(self.tokens[i])
            self.tokens[i].append(t)


# --- buckets ------------------------------------------------------------------------


def test_capture_sizes_exact_lists() -> None:
    assert capture_sizes(8) == [1, 2, 4, 8, 16]
    assert capture_sizes(128) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8), *range(272, 513, 16)]
    assert capture_sizes(1000)[-1] == 512 and capture_sizes(1) == [1, 2]


def test_graph_sizes_stop_at_the_bucket_holding_max_num_seqs() -> None:
    assert graph_sizes(8) == [1, 2, 4, 8]
    assert graph_sizes(5) == [1, 2, 4, 8]
    assert graph_sizes(256)[-1] == 256
    assert graph_sizes(300)[-1] == 304
    assert graph_sizes(1000) == capture_sizes(1000)


@pytest.mark.parametrize(("num_seqs", "bucket"),
                         [(1, 1), (2, 2), (3, 4), (8, 8), (9, 16), (256, 256), (257, 272),
                          (500, 512), (513, None)])
def test_bucket_for(num_seqs: int, bucket: int | None) -> None:
    assert bucket_for(num_seqs, capture_sizes(256)) == bucket


def test_bucket_above_the_largest_is_none() -> None:
    assert bucket_for(17, capture_sizes(8)) is None


# --- padding -----------------------------------------------------------------------


def decode_batch() -> Batch:
    return Batch(token_ids=[11, 12, 13], positions=[4, 20, 0], slot_mapping=[36, 101, 48],
                 query_lens=[1, 1, 1], context_lens=[5, 21, 1],
                 block_tables=[[2], [5, 6], [3]], sample_indices=[0, 1, 2],
                 sampling=[GREEDY] * 3)


def test_padding_copies_real_rows_and_adds_dummies() -> None:
    batch = decode_batch()
    padded = pad_decode_batch(batch, 8, padding_row=99)
    assert padded.token_ids == [11, 12, 13] + [0] * 5
    assert padded.positions == [4, 20, 0] + [0] * 5
    assert padded.slot_mapping == [36, 101, 48] + [-1] * 5
    assert padded.context_lens == [5, 21, 1] + [0] * 5
    assert padded.table_rows == [99] * 8  # whole tables: the graph's own buffer holds them
    assert batch.slot_mapping == [36, 101, 48]  # the batch itself is left alone
    rows = Batch([11, 12], [4, 20], [36, 101], [1, 1], [5, 21], None, [0, 1], [GREEDY] * 2,
                 table_rows=[7, 3])
    assert pad_decode_batch(rows, 4, padding_row=99).table_rows == [7, 3, 99, 99]


def test_buffers_clear_stale_rows_of_a_larger_batch() -> None:
    buffers = DecodeBuffers(max_size=8, max_blocks_per_seq=4, device=torch.device("cpu"))
    full = Batch([1] * 4, [30] * 4, [60, 61, 62, 63], [1] * 4, [31] * 4, None,
                 [0, 1, 2, 3], [GREEDY] * 4, table_rows=[0, 1, 2, 3])
    buffers.load(pad_decode_batch(full, 4, padding_row=8))
    buffers.load(pad_decode_batch(decode_batch(), 4, padding_row=8))
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [4, 20, 0, 0]
    assert buffers.slot_mapping[:4].tolist() == [36, 101, 48, -1]
    assert buffers.context_lens[:4].tolist() == [5, 21, 1, 0]
    assert buffers.table_rows[:4].tolist() == [8] * 4
    assert buffers.query_start_loc[:5].tolist() == [0, 1, 2, 3, 4]
    assert buffers.slot_mapping[4:].tolist() == [-1] * 4  # never loaded: still padding


# --- the runner on CPU ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("graphs")
    return make_tiny_llama(root / "model", root / "no-tokenizer", vocab_size=512,
                           max_position_embeddings=1024)


def tiny_runner(tiny_dir, backend: str, max_model_len: int = 128, device: str = "cpu",
                **kw) -> ModelRunner:
    return ModelRunner(runner_spec(tiny_dir, dtype="float32", device=device,
                                   max_model_len=max_model_len, block_size=BLOCK,
                                   num_blocks=max_model_len // BLOCK + 8,
                                   attention_backend=backend, **kw))


def runner_spec(tiny_dir, **settings) -> RunnerSpec:
    """The spec the engine would build from these settings (defaults from app/config.py)."""
    return RunnerSpec.from_config(EngineConfig.from_kwargs(**settings).flat(),
                                  model_dir=str(tiny_dir))


@pytest.mark.parametrize("backend", ["torch", TRITON_ON_CPU])
def test_runner_never_captures_on_cpu(tiny_dir, backend, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("tried to capture a CUDA graph on CPU")

    monkeypatch.setattr(gpu.graphs.GraphRunner, "capture", refuse)
    monkeypatch.setattr(torch.cuda, "graph", refuse)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", refuse)
    runner = tiny_runner(tiny_dir, backend, enforce_eager=False)
    assert runner.graphs is None and runner.graph_sizes == []
    seqs = Sequences([[5, 6, 7], [8, 9]])
    result = runner.execute(seqs.batch())
    assert len(result.token_ids) == 2


@pytest.mark.parametrize(("max_model_len", "engine_rows"),
                         [(128, False), (1024, False), (128, True)],
                         ids=["unsplit", "split", "engine-rows"])
def test_replay_on_static_buffers_matches_eager(tiny_dir, max_model_len, engine_rows) -> None:
    """Padding rows store nothing, and real rows get the eager path's tokens."""
    runner = tiny_runner(tiny_dir, "triton", max_model_len, DEVICE, enforce_eager=True)
    graphs = GraphRunner(runner.model, runner.backend, runner.k_caches, runner.v_caches,
                         sizes=[1, 2, 4], max_model_len=max_model_len, tables=runner.tables)
    assert (graphs.num_splits(1) > 1) == (max_model_len == 1024)
    graphs.capture()
    seqs = Sequences([list(range(3, 8)), list(range(40, 49)), list(range(100, 120))],
                     rows=engine_rows)
    seqs.advance([0, 1, 2], runner.execute(seqs.batch()).token_ids)  # eager prefill
    for rows in ([0, 1, 2], [1], [0, 2]):  # buckets 4 (one padding row), 1, 2
        batch = seqs.batch(rows)
        replayed, eager, before, after = replay_and_eager(runner, graphs, batch)
        assert_same_step(runner, replayed, eager, before, after, batch.slot_mapping)
        assert torch.isfinite(graphs.hidden).all()
        seqs.advance(rows, eager.token_ids)
    assert graphs.replays == 3


def test_can_run_refuses_what_the_graphs_cannot_hold(tiny_dir) -> None:
    """Too many rows, a prefill, or a block table wider than the static buffer (which
    would index past it and kill the model thread) run eagerly instead."""
    runner = tiny_runner(tiny_dir, "triton", 128, DEVICE, enforce_eager=True)
    graphs = GraphRunner(runner.model, runner.backend, runner.k_caches, runner.v_caches,
                         sizes=[1, 2], max_model_len=128, tables=runner.tables)
    width = 128 // BLOCK

    def one(table: list[int], qlen: int = 1) -> Batch:
        return Batch([1] * qlen, list(range(qlen)), [16] * qlen, [qlen], [qlen], [table], [0],
                     [GREEDY])

    assert graphs.can_run(one([1] * width))
    assert not graphs.can_run(one([1] * (width + 1)))
    assert not graphs.can_run(one([1], qlen=2))
    three = Batch([1] * 3, [0] * 3, [16] * 3, [1] * 3, [1] * 3, [[1]] * 3, [0, 1, 2], [GREEDY] * 3)
    assert not graphs.can_run(three)


def test_profile_query_lens() -> None:
    assert profile_query_lens(2048, 256, 4096) == [8] * 256
    assert profile_query_lens(10, 4, 100) == [3, 3, 2, 2]
    assert profile_query_lens(2048, 1, 1024) == [1024]
    assert profile_query_lens(4, 256, 100) == [1] * 4


@pytest.mark.parametrize("backend", ["torch", TRITON_ON_CPU])
def test_profile_steps_run_off_cuda(tiny_dir, backend) -> None:
    runner = tiny_runner(tiny_dir, backend)
    profile = profile_memory(runner.model, runner.backend, device=runner.device,
                             dtype=runner.dtype, max_num_batched_tokens=40, max_num_seqs=3,
                             max_model_len=128, graph_sizes=[1, 2, 4])
    # Only CUDA measures; what is left is the fixed allowance per graph.
    assert profile.peak_activation_bytes == 0
    assert profile.graph_bytes == 3 * GRAPH_OVERHEAD_BYTES


# --- on the GPU machine ------------------------------------------------------------------


def cuda_runner(tiny_dir, **kw) -> ModelRunner:
    kw.setdefault("num_blocks", 64)
    return ModelRunner(runner_spec(tiny_dir, dtype="float32", device="cuda", max_model_len=256,
                                   block_size=BLOCK, max_num_seqs=8, **kw))


@needs_cuda
def test_cuda_graph_decode_matches_eager(tiny_dir) -> None:
    runner = cuda_runner(tiny_dir)
    assert runner.graphs is not None and runner.graph_sizes == [1, 2, 4, 8]
    graphs = runner.graphs
    seqs = Sequences([list(range(3, 3 + n)) for n in (5, 9, 20)])
    seqs.advance([0, 1, 2], runner.execute(seqs.batch()).token_ids)
    for _ in range(4):
        batch = seqs.batch()
        before = [c.clone() for c in runner.k_caches + runner.v_caches]
        runner.graphs = graphs
        replayed = runner.execute(batch)
        for cache, old in zip(runner.k_caches + runner.v_caches, before):
            cache.copy_(old)
        runner.graphs = None
        eager = runner.execute(batch)
        assert replayed.token_ids == eager.token_ids
        seqs.advance([0, 1, 2], eager.token_ids)
    assert graphs.replays == 4


@needs_cuda
def test_cuda_enforce_eager_and_profiled_pool(tiny_dir) -> None:
    assert cuda_runner(tiny_dir, enforce_eager=True).graphs is None
    runner = cuda_runner(tiny_dir, num_blocks=None, gpu_memory_utilization=0.05)
    assert runner.graphs is not None and runner.plan.num_blocks > 64
