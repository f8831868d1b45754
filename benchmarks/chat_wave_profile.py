"""Where a chat wave's prefill step goes: `run_peers.sh`'s chat load, one step of it.

    python benchmarks/chat_wave_profile.py [--dtype auto] [--seqs 15] [--new 64]
        [--prefix 768] [--rounds 3]

The chat load's later waves are SEQS requests arriving together, each a cached
PREFIX-token system prompt and NEW tokens of its own: one step prefills their new
tokens over the cached keys. This times that step (the median of ROUNDS waves) beside
the same tokens without the prefix, then profiles one wave on the model thread (where
the step runs: a profiler started on the event loop's thread sees none of it) and
prints torch.profiler's table by self time, with the host's CPU and ISA.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from host import describe
from torch.profiler import ProfilerActivity, profile

from app.engine.sampling_params import SamplingParams
from app.llm import LLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seqs", type=int, default=15)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    engine = LLM(dtype=a.dtype).engine
    rng = random.Random(0)
    prefix = [rng.randrange(100, 40000) for _ in range(a.prefix)]
    one_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    waves = 0

    def wave(cached: bool) -> float:
        """Seconds of the step that prefills a wave (then the wave is run out)."""
        nonlocal waves
        waves += 1
        for i in range(a.seqs):
            tokens = [rng.randrange(100, 40000) for _ in range(a.new)]
            engine.add_request(f"w{waves}-{i}", (prefix if cached else []) + tokens, one_token)
        t0 = time.perf_counter()
        engine.step()
        seconds = time.perf_counter() - t0
        while engine.has_work:
            engine.step()
        return seconds

    wave(True)  # caches the prefix, warms every path
    cached = [wave(True) for _ in range(a.rounds)]
    fresh = [wave(False) for _ in range(a.rounds)]
    print(describe())
    print(f"{a.seqs} x {a.new} new tokens: after a cached {a.prefix}-token prefix "
          f"{statistics.median(cached) * 1e3:.0f} ms, without it "
          f"{statistics.median(fresh) * 1e3:.0f} ms (medians of {a.rounds})")
    prof = profile(activities=[ProfilerActivity.CPU])
    engine.worker.call(lambda runner: prof.__enter__()).result()
    wave(True)
    engine.worker.call(lambda runner: prof.__exit__(None, None, None)).result()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                    max_name_column_width=40))


if __name__ == "__main__":
    main()
