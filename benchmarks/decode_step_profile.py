"""Where a decode step goes at a given batch: SmolLM2 (or `--model`, a GGUF or HF
directory) offline, one step timed and profiled.

    python benchmarks/decode_step_profile.py [--model PATH] [--dtype auto] [--batch 1,32]
        [--prompt 128] [--steps 40] [--shared-prefix 0] [--cascade-ab 0] [--layercall-ab 0]

For each batch size: that many requests of PROMPT random tokens, prefilled and run ten
steps, then STEPS decode steps timed one by one (the median is printed: the engine's
whole step, scheduling and output processing included), then another run profiled on
the model thread (where the step runs: a profiler started on the caller's thread sees
none of it) and torch.profiler's table by self time, with the host's CPU and ISA. The
gap between the step and the table's total per step is what no op accounts for: Python
between the ops, the engine's host work.

`--shared-prefix N` puts the same N random tokens before every request's PROMPT (a chat's
system prompt), run once first so that the prefix cache holds it and the batch's block
tables share its blocks. `--cascade-ab R` then times R runs each with cascade decode
attention (gpu/attention/shared_prefix.py) on and off, alternated, before the profiled
run (cascade on). `--layercall-ab R` likewise times R runs each with the one-call decode
layers (gpu/cpu/layer_call.py) on and off, alternated (on for the profiled run).
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
    ap.add_argument("--model", default=None, help="the embedded SmolLM2 when not given")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch", default="1,32")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--shared-prefix", type=int, default=0)
    ap.add_argument("--cascade-ab", type=int, default=0)
    ap.add_argument("--layercall-ab", type=int, default=0)
    a = ap.parse_args()
    engine = (LLM(dtype=a.dtype) if a.model is None
              else LLM(model=a.model, dtype=a.dtype, max_model_len=2048)).engine
    rng = random.Random(0)
    runs = 0
    prefix = [rng.randrange(100, 40000) for _ in range(a.shared_prefix)]
    if prefix:  # into the prefix cache
        engine.add_request("prefix", prefix + [100], SamplingParams(max_tokens=1))
        while engine.has_work:
            engine.step()

    def cascade(on: bool) -> None:
        def set_on(runner) -> None:
            if hasattr(runner.backend, "cascades"):
                runner.backend.cascades = on and runner.backend.cascade_built
        engine.worker.call(set_on).result()

    def layercall(on: bool) -> None:
        def set_on(runner) -> None:
            ops = runner.model.ops
            if hasattr(ops, "fuses_layers"):
                ops.fuses_layers = on and ops.layer_call_built
        engine.worker.call(set_on).result()

    def fused_steps() -> int:
        return engine.worker.call(lambda r: getattr(r.model.ops, "layer_calls", 0)).result()

    def ab(batch: int, reps: int, switch, name: str) -> None:
        """`reps` runs each with `switch` on and off, alternated; it is left on."""
        laps: dict[bool, list[float]] = {True: [], False: []}
        for rep in range(reps):
            for on in ((True, False) if rep % 2 == 0 else (False, True)):
                switch(on)
                laps[on].append(statistics.median(run(batch)))
        switch(True)
        on, off = (statistics.median(laps[k]) * 1e3 for k in (True, False))
        print(f"batch {batch}, shared prefix {a.shared_prefix} + prompt {a.prompt}: "
              f"step with {name} {on:.2f} ms, without {off:.2f} ms, ratio "
              f"{on / off:.3f} (medians of {reps} runs each, alternated)")

    def run(batch: int, prof: profile | None = None) -> list[float]:
        """Seconds of each of `a.steps` decode steps of `batch` requests."""
        nonlocal runs
        runs += 1
        params = SamplingParams(max_tokens=a.steps + 10, temperature=0, ignore_eos=True)
        for i in range(batch):
            prompt = prefix + [rng.randrange(100, 40000) for _ in range(a.prompt)]
            engine.add_request(f"r{runs}-{i}", prompt, params)
        for _ in range(10):  # the prefill, then decode steps to warm every path
            engine.step()
        if prof is not None:
            engine.worker.call(lambda runner: prof.__enter__()).result()
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        if prof is not None:
            engine.worker.call(lambda runner: prof.__exit__(None, None, None)).result()
        while engine.has_work:
            engine.step()
        return times

    print(describe())
    for batch in (int(b) for b in a.batch.split(",")):
        run(batch)
        if a.cascade_ab:
            ab(batch, a.cascade_ab, cascade, "cascade")
        if a.layercall_ab:
            before = fused_steps()
            ab(batch, a.layercall_ab, layercall, "one-call layers")
            print(f"  decode steps that took the one-call layers: {fused_steps() - before}")
        step = statistics.median(run(batch))
        prof = profile(activities=[ProfilerActivity.CPU])
        run(batch, prof)
        events = prof.key_averages()
        ops_ms = sum(e.self_cpu_time_total for e in events) / 1e3 / a.steps
        print(f"\nbatch {batch}, prompt {a.prompt}: step {step * 1e3:.2f} ms (median of "
              f"{a.steps}); ops' self time {ops_ms:.2f} ms a step (profiled run)")
        print(events.table(sort_by="self_cpu_time_total", row_limit=15,
                           max_name_column_width=40))


if __name__ == "__main__":
    main()
