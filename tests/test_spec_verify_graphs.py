"""CUDA graphs for speculative decoding's verify steps (`gpu/verify_graphs.py`).

The padding and the routing are plain Python. Replay runs on CPU too: off CUDA the
"graph" is a closure over the same static buffers (Triton kernels interpreted), so the
padded verify step is checked against the eager one, step by step with rollbacks, and
through the engine: greedy output with speculation through the graphs is plain
decoding's, token for token, in float32. On the GPU machine the same tests capture
real graphs where they build their runner through `ModelRunner` (scripts/gpu_check.py
also checks the engine case there).
"""

from __future__ import annotations

import pytest
import torch

from app.engine.sampling_params import SamplingParams
from gpu.batch import Batch, PromptLogprobsRequest, SamplingRow
from gpu.graphs import GraphRunner
from gpu.verify_graphs import VerifyGraphs, graph_token_counts, pad_verify_batch, verify_sizes
from models.tiny import make_tiny_llama
from tests.graph_replay import assert_same_step, replay_and_eager
from tests.test_graphs import tiny_runner
from tests.test_spec_decode import SPEC, ScriptedProposer, assert_clean, make_llm

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
BLOCK = 16
GREEDY = SamplingRow(temperature=0.0, logprobs=2)


# --- padding and routing ------------------------------------------------------------


def test_verify_sizes_stop_where_drafting_stops() -> None:
    assert verify_sizes(256, 8) == [1, 2, 4, 8]
    assert verify_sizes(4, 8) == [1, 2, 4]
    assert verify_sizes(20, None) == [1, 2, 4, 8, 16, 24]


def test_memory_profile_sees_every_graphs_tokens() -> None:
    """One allowance per graph, the shared pool sized by the most tokens any one runs."""
    assert graph_token_counts([1, 2, 4, 8], [1, 2, 4], 5) == [1, 2, 4, 5, 8, 10, 20]


def test_padding_puts_real_tokens_at_each_rows_end() -> None:
    # A row with 2 drafts, a decode row, a row with 1 draft; rows of 4, bucket 4.
    batch = Batch([11, 12, 13, 21, 31, 32], [7, 8, 9, 30, 2, 3], [107, 108, 109, 230, 52, 53],
                  [3, 1, 2], [10, 31, 4], None, [0, 1, 2], [GREEDY] * 6,
                  table_rows=[5, 0, 2], spec_lens=[2, 0, 1])
    p = pad_verify_batch(batch, 4, 4, padding_row=99)
    assert p.token_ids == [0, 11, 12, 13, 0, 0, 0, 21, 0, 0, 31, 32] + [0] * 4
    assert p.positions == [0, 7, 8, 9, 0, 0, 0, 30, 0, 0, 2, 3] + [0] * 4
    assert p.slot_mapping == [-1, 107, 108, 109, -1, -1, -1, 230, -1, -1, 52, 53] + [-1] * 4
    assert p.context_lens == [10, 31, 4, 0]
    assert p.table_rows == [5, 0, 2, 99]
    assert p.logit_rows == [1, 2, 3, 7, 10, 11]  # sampling order: each row's last 1 + d


@pytest.fixture(scope="module")
def graph_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("verify-graphs")
    return make_tiny_llama(root / "model", root / "no-tokenizer", vocab_size=512,
                           max_position_embeddings=1024)


def graph_runner(runner, sizes=(1, 2, 4), row_len: int = 4) -> GraphRunner:
    graphs = GraphRunner(runner.model, runner.backend, runner.k_caches, runner.v_caches,
                         sizes=list(sizes), max_model_len=runner.spec.max_model_len,
                         tables=runner.tables)
    graphs.verify = VerifyGraphs(graphs, list(sizes), row_len)
    graphs.capture()
    return graphs


def test_can_run_routes_verify_steps(graph_dir) -> None:
    """Decode steps take the decode graphs, verify steps the verify graphs; rows longer
    than 1 + k, too many rows, prompt logprobs or a LoRA adapter run eagerly."""
    runner = tiny_runner(graph_dir, "triton", 128, DEVICE, enforce_eager=True)
    graphs = graph_runner(runner, sizes=(1, 2), row_len=4)

    def step(qlens: list[int], **kw) -> Batch:
        n = sum(qlens)
        return Batch([1] * n, list(range(n)), [16] * n, qlens, [8] * len(qlens),
                     [[1]] * len(qlens), list(range(len(qlens))),
                     [GREEDY] * (len(qlens) + sum(q - 1 for q in qlens)),
                     spec_lens=[q - 1 for q in qlens], **kw)

    assert graphs.can_run(step([1, 1])) and graphs.can_run(step([4, 1]))
    assert not graphs.can_run(step([5]))
    assert not graphs.can_run(step([2, 2, 2]))
    assert not graphs.can_run(step([2], prompt_logprobs=[PromptLogprobsRequest(0, [1], 0)]))
    assert not graphs.can_run(step([2], lora_ids=[1]))
    graphs.verify = None
    assert not graphs.can_run(step([2]))


# --- replay against the eager path ------------------------------------------------------


class Drafting:
    """Sequences that verify drafts as the engine does: block tables as deltas to the
    persistent rows, blocks from a free list, and after each step the blocks that held
    only rejected drafts given back (and soon reused by another sequence)."""

    def __init__(self, prompts: list[list[int]], num_blocks: int):
        self.tokens = [list(p) for p in prompts]
        self.computed = [0] * len(prompts)
        self.tables: list[list[int]] = [[] for _ in prompts]
        self.sent = [0] * len(prompts)
        self.free = list(range(1, num_blocks))

    def batch(self, drafts: list[list[int]]) -> Batch:
        ids, pos, slots, qlens, ctx, updates = [], [], [], [], [], []
        for i, d in enumerate(drafts):
            new = self.tokens[i][self.computed[i]:] + d
            start, end = self.computed[i], self.computed[i] + len(new)
            while len(self.tables[i]) * BLOCK < end:
                self.tables[i].append(self.free.pop(0))
            ids += new
            pos += range(start, end)
            slots += [self.tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in range(start, end)]
            qlens.append(end - start)
            ctx.append(end)
            if len(self.tables[i]) > self.sent[i]:
                updates.append((i, self.sent[i], self.tables[i][self.sent[i]:]))
                self.sent[i] = len(self.tables[i])
        spec = [len(d) for d in drafts]
        return Batch(ids, pos, slots, qlens, ctx, None, list(range(len(drafts))),
                     [GREEDY] * (len(drafts) + sum(spec)), table_rows=list(range(len(drafts))),
                     table_updates=updates, spec_lens=spec if any(spec) else [])

    def advance(self, drafts: list[list[int]], picks: list[int]) -> int:
        """Keep the agreed drafts and the target's pick after them; roll back the rest."""
        accepted, at = 0, 0
        for i, d in enumerate(drafts):
            mine = picks[at:at + 1 + len(d)]
            at += 1 + len(d)
            n = next((j for j, (a, b) in enumerate(zip(d, mine)) if a != b), len(d))
            accepted += n
            self.computed[i] = len(self.tokens[i])
            self.tokens[i] += d[:n] + [mine[n]]
            self.computed[i] += n  # the kept drafts' K/V are in the cache already
            keep = -(-self.computed[i] // BLOCK)
            self.free[:0] = self.tables[i][keep:]  # first to be handed out again
            del self.tables[i][keep:]
            self.sent[i] = min(self.sent[i], keep)
        return accepted


def test_verify_replay_matches_eager_with_rollbacks(graph_dir) -> None:
    runner = tiny_runner(graph_dir, "triton", 128, DEVICE, enforce_eager=True)
    graphs = graph_runner(runner)
    # Long enough that drafts cross page boundaries; a short one: context < row length.
    seqs = Drafting([list(range(3, 17)), list(range(40, 69)), [7, 8]], runner.plan.num_blocks)
    drafts = [[], [], []]
    seqs.advance(drafts, runner.execute(seqs.batch(drafts)).token_ids)  # eager prefill
    # Drafts per sequence and step: rows of 1 to 4 tokens beside decode rows, and one
    # decode-only step (the decode graphs take it).
    counts = [(2, 0, 3), (0, 1, 0), (0, 0, 0), (3, 3, 1), (1, 0, 2), (3, 2, 0)]
    for step, ns in enumerate(counts):
        drafts = [[(17 * step + 5 * i + j) % 500 + 3 for j in range(n)]
                  for i, n in enumerate(ns)]
        batch = seqs.batch(drafts)
        replayed, eager, before, after = replay_and_eager(runner, graphs, batch)
        assert_same_step(runner, replayed, eager, before, after, batch.slot_mapping)
        seqs.advance(drafts, eager.token_ids)
    assert graphs.verify.replays == 5 and graphs.replays == 1
    assert torch.isfinite(graphs.verify.hidden).all()


# --- through the engine -----------------------------------------------------------------


def test_engine_spec_decode_through_verify_graphs_equals_plain(graph_dir) -> None:
    """Greedy ids with speculation, steps replayed through the decode and verify graphs,
    are plain decoding's (eager, same backend); the runner wires the verify shape from
    the speculative config (`RunnerSpec.num_speculative_tokens`). Drafts come from a
    proposer that knows the plain run's output and gets one draft in three wrong."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (n,), generator=g).tolist() * 3 for n in (1, 5, 13)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    kw = dict(attention_backend="triton", max_num_seqs=4, device=DEVICE,
              skip_tokenizer_init=True, enforce_eager=True, num_blocks=64, block_size=BLOCK)
    plain = make_llm(graph_dir, **kw)
    want = {tuple(p): o.token_ids for p, o in
            zip(prompts, plain.generate(prompts, params, use_tqdm=False))}
    plain.shutdown()

    llm = make_llm(graph_dir, SPEC, **kw)
    llm.engine.speculator.proposer = ScriptedProposer(want)
    runner = llm.engine.worker.wait_ready()
    assert runner.spec.num_speculative_tokens == SPEC["num_speculative_tokens"]
    runner.graph_sizes = [1, 2, 4]  # off CUDA the runner captures nothing by itself
    runner.graphs = runner._capture_graphs()
    verify = runner.graphs.verify
    assert verify.row_len == 5 and verify.sizes == [1, 2, 4]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [want[tuple(p)] for p in prompts]
    total = llm.engine.speculator.total
    assert 0 < total.num_accepted_tokens < total.num_draft_tokens
    assert verify.replays > 0
    assert_clean(llm)
    llm.shutdown()
