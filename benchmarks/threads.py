"""Decode speed against torch's thread count, on an idle host and beside busy processes.

    python benchmarks/threads.py [OUT.json]

Each cell runs the offline engine (SmolLM2 bf16, 16 prompts of 32 tokens, 24 greedy
tokens each) in a fresh process with `torch.set_num_threads(T)`, while H processes
spin a core each (`while True: pass`) — the host another tenant is using. The
numbers chose `--torch-threads`' serving default (docs/robustness.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ENGINE = """
import time, torch
torch.set_num_threads({threads})
from app import LLM, SamplingParams
llm = LLM(dtype="bfloat16", max_model_len=512, kv_cache_memory="256MiB", torch_threads={threads})
prompts = [[1000 + i] * 32 for i in range(16)]
llm.generate(prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
t = time.perf_counter()
llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
             use_tqdm=False)
print("RESULT", 16 * 24 / (time.perf_counter() - t))
llm.shutdown()
"""


def decode_tokens_per_s(threads: int, busy: int) -> float:
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        out = subprocess.run([sys.executable, "-c", ENGINE.format(threads=threads)],
                             capture_output=True, text=True, timeout=900,
                             env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    finally:
        for h in hogs:
            h.kill()
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT")]
    return float(lines[0].split()[1]) if lines else float("nan")


def main() -> None:
    rows = []
    for busy in (0, 1, 2):
        for threads in (1, 2):
            rows.append({"busy_processes": busy, "torch_threads": threads,
                         "tokens_per_s": decode_tokens_per_s(threads, busy)})
            print(rows[-1], flush=True)
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "bench_results/threads.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
