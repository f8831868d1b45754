"""Paired A/B of a GGUF's load and decode step with its blocks on huge pages and on
ordinary pages (`gpu/cpu/weight_arena.py`): one engine per process, the second variant
with `RIDGELINE_HUGE_PAGES=0`, the processes alternated round by round so host noise
hits both alike.

    python benchmarks/cpu_huge_pages_ab.py GGUF [--rows 1,16] [--rounds 5] [--out OUT.json]

Per variant: the load's seconds and the bytes it put on huge pages (AnonHugePages); per
row count (sequences of 128-token prompts decoding together), the median step in ms;
each the median over the rounds, with the ratio huge / ordinary. Load times depend on
how the host backs fresh memory (a VM that returns freed pages to its host faults huge
pages in again), so they are this host's figures, not the advice's alone.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from host import describe

ROOT = Path(__file__).resolve().parents[1]
PROMPT = 128
VARIANTS = {"ordinary": "0", "huge": "1"}  # RIDGELINE_HUGE_PAGES


def measure(gguf: str, rows: list[int], steps: int) -> dict:
    """In a child process: load `gguf`, then per row count the median decode step (ms)."""
    sys.path.insert(0, str(ROOT))
    from app.engine.sampling_params import SamplingParams
    from app.llm import LLM
    from gpu.cpu.weight_arena import huge_page_bytes

    start = time.perf_counter()
    engine = LLM(model=gguf, max_model_len=1024).engine
    result = {"load_s": time.perf_counter() - start, "huge_page_bytes": huge_page_bytes() or 0}
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 3, temperature=0, ignore_eos=True)
    for n in rows:
        for i in range(n):
            engine.add_request(f"{n}-{i}", [rng.randrange(100, 40000) for _ in range(PROMPT)],
                               params)
        for _ in range(3):  # the prompts, then two steps to settle
            engine.step()
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t)
        while engine.has_work:
            engine.step()
        result[f"step_ms_{n}"] = statistics.median(times) * 1e3
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--out", default="bench_results/cpu_huge_pages_ab.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    if a.child:
        print(json.dumps(measure(a.gguf, rows, a.steps)))
        return
    samples: dict[str, list[dict]] = {v: [] for v in VARIANTS}
    for r in range(a.rounds):
        for name in (list(VARIANTS) if r % 2 == 0 else list(VARIANTS)[::-1]):
            env = os.environ | {"RIDGELINE_HUGE_PAGES": VARIANTS[name]}
            out = subprocess.run([sys.executable, __file__, a.gguf, "--rows", a.rows,
                                  "--steps", str(a.steps), "--child"], env=env, check=True,
                                 capture_output=True, text=True).stdout
            samples[name].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {r} {name}: {samples[name][-1]}", flush=True)
    keys = ["load_s", "huge_page_bytes", *(f"step_ms_{n}" for n in rows)]
    median = {v: {k: statistics.median(s[k] for s in samples[v]) for k in keys}
              for v in VARIANTS}
    ratios = {k: median["huge"][k] / median["ordinary"][k] for k in keys[2:]}
    for k in keys:
        ratio = f"  huge/ordinary {ratios[k]:.2f}" if k in ratios else ""
        print(f"{k:16s} ordinary {median['ordinary'][k]:10.2f}  huge {median['huge'][k]:10.2f}"
              + ratio)
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "host": describe(), "isa_cap": os.environ.get("RIDGELINE_CPU_ISA", "native"),
        "gguf": Path(a.gguf).name, "rounds": a.rounds, "steps": a.steps, "median": median,
        "huge_over_ordinary": ratios, "samples": samples}, indent=1))


if __name__ == "__main__":
    main()
