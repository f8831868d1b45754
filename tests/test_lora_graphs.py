"""LoRA's GPU path, wired end to end and run on CPU: per-row kernels, graphs' row slots.

On CUDA `LoRASlots` takes the per-row Triton kernels (`gpu/triton/lora.py`) and the
decode graphs capture them over a static row-slot buffer. Here the same code runs with
the kernels interpreted (TRITON_INTERPRET=1, conftest.py): the tests patch
`gpu.runner.row_kernel`, which picks the grouped torch ops on CPU, to hand out the
Triton kernel instead. Off CUDA the graph runner "captures" closures over its static
buffers, so a replay here runs the very buffer and padding logic a graph would. The
oracle is PEFT's merged model in transformers, as in `tests/test_lora_offline.py`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import gpu.runner
from app import LLM, SamplingParams
from gpu.graphs import GraphRunner
from gpu.runner import ModelRunner
from gpu.triton.lora import add_lora
from tests.hf_reference import hf_greedy
from tests.lora_adapters import ATTENTION, MLP, make_adapter
from tests.test_graphs import BLOCK, Sequences, runner_spec

pytest.importorskip("peft")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="runs the GPU path on CPU "
                                "tensors with the interpreter (the GPU check covers CUDA)")

NUM_TOKENS = 6
ADAPTERS = {"all": (ATTENTION + MLP, 8, 16), "qv": (["q_proj", "v_proj"], 4, 8)}


@pytest.fixture
def kernel_calls(monkeypatch) -> list[int]:
    """The runner takes the per-row kernel on CPU; each call appends its row count."""
    calls: list[int] = []

    def counted(y, x, *rest):
        calls.append(x.shape[0])
        return add_lora(y, x, *rest)

    monkeypatch.setattr(gpu.runner, "row_kernel", lambda device: counted)
    return calls


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_dir):
    """(base dir, {name: adapter dir}, {None or name: expected ids per prompt}, prompts)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-rows")
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49000, (n,), generator=g).tolist() for n in (4, 11, 19)]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    expected = {None: [hf_greedy(hf, p, NUM_TOKENS) for p in prompts]}
    dirs = {}
    for i, (name, (targets, r, alpha)) in enumerate(ADAPTERS.items()):
        dirs[name] = root / name
        merged = make_adapter(tiny_dir, dirs[name], targets, r, alpha, seed=i)
        expected[name] = [hf_greedy(merged, p, NUM_TOKENS) for p in prompts]
        assert expected[name] != expected[None], f"{name} changes nothing"
    return tiny_dir, dirs, expected, prompts


def test_per_row_kernels_match_peft_merged_in_a_mixed_batch(adapters, kernel_calls):
    """Both adapters and the base, every prompt under each, chunked prefill in a small
    budget: each request gets the ids of its adapter merged by PEFT."""
    base, dirs, expected, prompts = adapters
    llm = LLM(str(base), dtype="float32", max_model_len=64, enable_lora=True, max_loras=2,
              lora_modules=[f"{n}={p}" for n, p in dirs.items()], max_num_batched_tokens=24)
    try:
        assert llm.engine.worker.wait_ready().loras.per_row
        names = [None, *dirs]
        jobs = [(i, n) for i in range(len(prompts)) for n in names[i % 3:] + names[:i % 3]]
        outs = llm.generate([prompts[i] for i, _ in jobs],
                            [SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0,
                                            ignore_eos=True, lora_name=n) for _, n in jobs],
                            use_tqdm=False)
        for (i, n), o in zip(jobs, outs):
            assert o.token_ids == expected[n][i], (i, n)
        assert kernel_calls
        llm.engine.check_invariants()
    finally:
        llm.shutdown()


def test_graph_replay_with_lora_rows_matches_eager_and_peft(adapters, kernel_calls):
    """Decode steps through the graph runner (buckets padded with slot -1 rows) give the
    eager path's ids and logprobs, which are PEFT's merged ids; a step of the base model
    alone replays the graph without the LoRA kernels."""
    base, dirs, expected, prompts = adapters
    runner = ModelRunner(runner_spec(
        base, dtype="float32", device="cpu", max_model_len=64, block_size=BLOCK,
        num_blocks=64 // BLOCK * 4, attention_backend="triton", enforce_eager=True,
        enable_lora=True, max_loras=2))
    loras = runner.loras
    assert loras.per_row and runner.graphs is None
    names = {1: "all", 2: "qv"}
    for lora_id, name in names.items():
        loras.add(lora_id, str(dirs[name]))
    graphs = GraphRunner(runner.model, runner.backend, runner.k_caches, runner.v_caches,
                         sizes=[1, 2, 4], max_model_len=64, tables=runner.tables, loras=loras)
    graphs.capture()
    lora_replays = {"n": 0}
    for bucket, replay in list(graphs._replay_lora.items()):
        def counted(replay=replay):
            lora_replays["n"] += 1
            return replay()
        graphs._replay_lora[bucket] = counted

    seq_ids = [1, 0, 2]  # sequence i runs under adapter seq_ids[i] (0: the base model)
    seqs = Sequences(prompts)

    def batch(rows):
        return dataclasses.replace(seqs.batch(rows), lora_ids=[seq_ids[i] for i in rows])

    seqs.advance([0, 1, 2], runner.execute(batch([0, 1, 2])).token_ids)  # eager prefill
    steps = [([0, 1, 2], True), ([1], False), ([0, 2], True), ([2, 1, 0], True),
             ([0, 1, 2], True)]  # buckets 4 (a padding row), 1 (the base alone), 2
    for rows, has_lora in steps:
        step = batch(rows)
        before = [c.clone() for c in runner.k_caches + runner.v_caches]
        replays, calls = lora_replays["n"], len(kernel_calls)
        runner.graphs = graphs
        replayed = runner.execute(step)
        assert lora_replays["n"] - replays == has_lora
        assert (len(kernel_calls) > calls) == has_lora  # the base step launched nothing
        for cache, old in zip(runner.k_caches + runner.v_caches, before):
            cache.copy_(old)
        runner.graphs = None
        eager = runner.execute(step)
        assert replayed.token_ids == eager.token_ids
        for (lp_g, _), (lp_e, _) in zip(replayed.logprobs, eager.logprobs):
            assert lp_g == pytest.approx(lp_e, abs=1e-4)
        seqs.advance(rows, eager.token_ids)
    assert graphs.replays == len(steps)
    qkv = loras.layers["layers.0.self_attn.qkv_proj"]
    gate_up = loras.layers["layers.0.mlp.gate_up_proj"]
    assert qkv.slices == [(0, 64), (64, 32), (96, 32)]
    assert gate_up.slices == [(0, 128), (128, 128)]
    qv = loras.slot_of[2]  # rank 4 on q and v: k reads nothing, v its own four ranks
    assert qkv.spans[qv].tolist() == [[0, 4], [0, 0], [4, 8]]
    assert gate_up.rank_table[qv] == 0 and qkv.rank_table[qv] == 8
    for i, lora_id in enumerate(seq_ids):
        made = seqs.tokens[i][len(prompts[i]):]
        assert made == expected[names.get(lora_id)][i][:len(made)], i
