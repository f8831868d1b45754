"""Paired A/B of the bf16 dot-product route in whole one-row decode steps of SmolLM2.

    python benchmarks/decode_dot_ab.py [--steps 300] [--prompt 128]

One engine (`--dtype auto`: bf16 where the CPU multiplies bf16), one request, so every
step's linears have one row; the layers that plan `blocks_bf16` for one row
(`gpu/cpu/routing.py`) take it in odd steps and the float32 blocks kernel in even ones,
so host noise hits both alike. The two give the same bits (`quant_linear_bf16.cpp`), so
the request's tokens do not depend on the alternation. Prints each side's median step.
Where no layer plans the route (a CPU without AVX512-BF16), it says so and stops.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from app.engine.sampling_params import SamplingParams
from app.llm import LLM
from gpu.cpu.linear import PackedLinear


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--prompt", type=int, default=128)
    a = ap.parse_args()
    engine = LLM(dtype="auto").engine

    def routed(runner) -> list[PackedLinear]:
        return [m for m in runner.model.modules()
                if isinstance(m, PackedLinear) and m.plan.dot_max_rows]

    layers = engine.worker.call(routed).result()
    if not layers:
        print("no layer takes the bf16 dot-product route on this CPU")
        return
    rows = layers[0].plan.dot_max_rows
    rng = random.Random(0)
    params = SamplingParams(max_tokens=a.steps + 20, temperature=0, ignore_eos=True)
    engine.add_request("r", [rng.randrange(100, 40000) for _ in range(a.prompt)], params)
    for _ in range(10):  # the prefill, then warm steps
        engine.step()
    times: dict[str, list[float]] = {"blocks": [], "blocks_bf16": []}
    for i in range(a.steps):
        side = "blocks_bf16" if i % 2 else "blocks"
        for m in layers:  # the step runs on the model thread after this returns
            m._dot_max_rows = rows if i % 2 else 0
        t = time.perf_counter()
        engine.step()
        times[side].append(time.perf_counter() - t)
    for m in layers:
        m._dot_max_rows = rows
    while engine.has_work:
        engine.step()
    med = {side: statistics.median(t) * 1e3 for side, t in times.items()}
    print(f"{len(layers)} layers, one-row steps: " + ", ".join(
        f"{side} {ms:.3f} ms" for side, ms in med.items())
        + f" (median of {a.steps // 2} each); blocks_bf16 / blocks "
        f"{med['blocks_bf16'] / med['blocks']:.3f}")


if __name__ == "__main__":
    main()
