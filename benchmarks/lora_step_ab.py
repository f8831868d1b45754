"""The decode step with LoRA rows against the same step on the base model, on CPU, in one
process, interleaved: where the LoRA delta's time goes (gpu/lora.py).

    python benchmarks/lora_step_ab.py [--model smollm2|tiny|DIR] [--dtype bfloat16]
        [--rows 8,32] [--adapters 1,4,16] [--rounds 3] [--profile N] [OUT.json]

One `LLM` with `--enable-lora --max-loras` the most adapters asked for. Each round runs,
for every (rows, adapters) and for the base, `rows` requests (short prompts, fixed
output length), the adapters spread round-robin over the requests (a decode step then
interleaves them, the hard case for slices), and keeps the model thread's time of every
step whose rows are all decodes. Reports median step times and ratios to the base.
`--profile N`: a torch.profiler table of the decode steps with N adapters instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from host import describe
from lora_adapters_make import make_adapters

from app import LLM, SamplingParams
from models.resolve import resolve_model


def model_dir(name: str, dtype: str, tmp: Path) -> Path:
    if name == "smollm2":
        return resolve_model(None, dtype)
    if name == "tiny":  # a few layers of SmolLM2's widths: tiny-ish, fast to build
        from models.tiny import make_tiny_llama

        return make_tiny_llama(tmp / "tiny", resolve_model(None), hidden_size=576,
                               intermediate_size=1536, num_hidden_layers=4,
                               num_attention_heads=9, num_key_value_heads=3, head_dim=64)
    return Path(name)


class StepTimer:
    """Wraps the runner's `_execute` (on the model thread): the time of each decode step."""

    def __init__(self, runner):
        self.times: list[float] = []
        self.profile_steps = 0  # profile this many decode steps (on the model thread)
        self.profile: torch.profiler.profile | None = None
        inner = runner._execute

        def timed(batch):
            decode = all(n == 1 for n in batch.query_lens)
            if decode and self.profile_steps:
                if self.profile is None:
                    self.profile = torch.profiler.profile(
                        activities=[torch.profiler.ProfilerActivity.CPU])
                    self.profile.start()
                self.profile_steps -= 1
                out = inner(batch)
                if not self.profile_steps:
                    self.profile.stop()
                return out
            t0 = time.perf_counter()
            out = inner(batch)
            if decode:
                self.times.append(time.perf_counter() - t0)
            return out

        runner._execute = timed


def run(llm: LLM, timer: StepTimer, rows: int, names: list[str | None], tokens: int) -> float:
    timer.times.clear()
    prompts = [[1 + (7 * i + j) % 5000 for j in range(16)] for i in range(rows)]
    params = [SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True,
                             lora_name=names[i % len(names)]) for i in range(rows)]
    llm.generate(prompts, params, use_tqdm=False)
    return statistics.median(timer.times) if timer.times else 0.0


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rows", default="8,32")
    p.add_argument("--adapters", default="1,4,16")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--tokens", type=int, default=24, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--profile", type=int, default=0)
    p.add_argument("out", nargs="?")
    a = p.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    counts = [int(n) for n in a.adapters.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="lora-step-"))
    base_dir = model_dir(a.model, a.dtype, tmp)
    paths = make_adapters(base_dir, tmp / "adapters", max(counts), a.rank)
    llm = LLM(str(base_dir), dtype=a.dtype, max_model_len=256, enable_lora=True,
              max_loras=max(counts), max_lora_rank=a.rank, max_num_seqs=max(rows),
              lora_modules=[f"lora{i}={path}" for i, path in enumerate(paths)])
    timer = StepTimer(llm.engine.worker.wait_ready())
    try:
        if a.profile:
            names = [f"lora{i}" for i in range(a.profile)]
            run(llm, timer, max(rows), names, a.tokens)  # warm
            timer.profile_steps = a.tokens - 2
            run(llm, timer, max(rows), names, a.tokens)
            print(timer.profile.key_averages().table(sort_by="self_cpu_time_total",
                                                     row_limit=25))
            return
        configs = [(r, n) for r in rows for n in [0, *counts]]
        times: dict[tuple[int, int], list[float]] = {c: [] for c in configs}
        for rnd in range(a.rounds + 1):
            for r, n in configs[rnd % len(configs):] + configs[:rnd % len(configs)]:
                names = [None] if n == 0 else [f"lora{i}" for i in range(n)]
                t = run(llm, timer, r, names, a.tokens)
                if rnd:  # the first round warms every shape
                    times[(r, n)].append(t)
    finally:
        llm.shutdown()
    host = describe()
    print(f"{a.model} {a.dtype}, rank {a.rank}, torch threads {torch.get_num_threads()}, "
          f"{host['cpu']} ({host['cpus']} CPUs)")
    print("| rows | adapters | decode step ms | x base |\n| --- | --- | --- | --- |")
    results = []
    for (r, n), ts in times.items():
        ms = statistics.median(ts) * 1e3
        base = statistics.median(times[(r, 0)]) * 1e3
        results.append({"rows": r, "adapters": n, "step_ms": ms, "ratio": ms / base})
        print(f"| {r} | {n or 'base'} | {ms:.2f} | {ms / base:.2f} |")
    if a.out:
        Path(a.out).write_text(json.dumps({"host": host, "model": a.model, "dtype": a.dtype,
                                           "rank": a.rank, "results": results}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
