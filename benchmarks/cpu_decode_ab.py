"""Paired A/B of one SmolLM2 decode step on CPU: plain torch attention against the C++
paged decode kernel, in one process, interleaved, so host noise hits both alike.

    python benchmarks/cpu_decode_ab.py [--threads 2] [--reps 7] [OUT.json]

For each (dtype, batch, context): a pool with every row's context already written
(values do not change the cost), shuffled pages as a scheduler leaves them, then
`reps` rounds of every variant (the order rotated each round), each the median of `steps`
forwards plus the LM head for the batch's rows. Reports medians and ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from gpu.attention.base import AttentionInputs, StepContext
from gpu.attention.torch_backend import TorchAttentionBackend
from gpu.cpu.kernels.build import cpu_kernels
from models.config import ModelConfig
from models.decoder import DecoderForCausalLM
from models.ops import DecoderOps
from models.resolve import resolve_model
from models.weights import iter_safetensors

BLOCK = 16
SHAPES = [(16, 900), (64, 160)]  # (batch, context): chat-like long, and many short


def load(dtype: torch.dtype, max_len: int):
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    model_dir = resolve_model(None, name)
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = DecoderForCausalLM(cfg, max_positions=max_len, ops=DecoderOps())
    model = model.to(dtype).to_empty(device="cpu")
    model.rotary = model.make_rotary(max_len)
    model.load_weights(iter_safetensors(model_dir, dtype))
    if dtype == torch.bfloat16:
        from gpu.cpu.packing import pack_linears

        pack_linears(model)
    return model.eval(), cfg


def decode_step(batch: int, context: int, num_blocks: int) -> AttentionInputs:
    per_row = -(-context // BLOCK)
    order = torch.randperm(num_blocks)[: batch * per_row].view(batch, per_row)
    tables = order.to(torch.int32)
    slots = [int(tables[i, (context - 1) // BLOCK]) * BLOCK + (context - 1) % BLOCK
             for i in range(batch)]
    return AttentionInputs(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(batch + 1,
                                                                       dtype=torch.int32),
        context_lens=torch.full((batch,), context, dtype=torch.int32), block_tables=tables,
        max_query_len=1, max_context_len=context, query_lens_list=[1] * batch,
        context_lens_list=[context] * batch)


def time_steps(model, backend, inputs, pools, steps: int) -> float:
    ids = torch.randint(0, 1000, (inputs.slot_mapping.shape[0],))
    positions = (inputs.context_lens - 1).long()
    times = []
    with torch.inference_mode():
        for _ in range(steps + 1):  # the first warms up
            t = time.perf_counter()
            ctx = StepContext(backend, backend.prepare(inputs), *pools)
            model.compute_logits(model(ids, positions, ctx))
            times.append(time.perf_counter() - t)
    return statistics.median(times[1:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("out", nargs="?", default="bench_results/cpu_decode_ab.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    kernels = cpu_kernels()
    assert kernels is not None, "the C++ kernels did not build"
    rows = []
    for name in a.dtypes.split(","):
        dtype = getattr(torch, name)
        model, cfg = load(dtype, 2048)
        args = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, BLOCK)
        plain = TorchAttentionBackend(*args)
        variants = {"torch": plain, "kernel": TorchAttentionBackend(*args, kernels=kernels)}
        for batch, context in SHAPES:
            num_blocks = batch * -(-context // BLOCK) + 8
            shape = plain.kv_cache_shape(num_blocks)
            pools = ([torch.randn(shape).to(dtype) for _ in range(cfg.num_layers)],
                     [torch.randn(shape).to(dtype) for _ in range(cfg.num_layers)])
            inputs = decode_step(batch, context, num_blocks)
            ms: dict[str, list[float]] = {v: [] for v in variants}
            names = list(variants)
            for rep in range(a.reps):
                first = rep % len(names)  # rotate who goes first
                for v in names[first:] + names[:first]:
                    ms[v].append(time_steps(model, variants[v], inputs, pools, a.steps))
            row = {"dtype": name, "threads": a.threads, "batch": batch, "context": context,
                   **{f"{v}_ms": statistics.median(t) for v, t in ms.items()},
                   "samples_ms": ms}
            for v in names[1:]:
                row[f"{v}_ratio"] = row[f"{v}_ms"] / row["torch_ms"]
            rows.append(row)
            print(f"{name} threads={a.threads} B={batch} ctx={context}: " + ", ".join(
                f"{v} {row[f'{v}_ms']:.1f} ms" for v in names) + " | " + ", ".join(
                f"{v}/torch {row[f'{v}_ratio']:.3f}" for v in names[1:]), flush=True)
            del pools
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
