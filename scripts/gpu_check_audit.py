"""Host-side sections of the GPU check: syncs per step, every bucket against eager,
where a step's time goes, and the GIL beside a busy event loop.

Each takes the `Check` of `gpu_check.py` and returns a dict of figures (with "ok" where
there is a pass/fail goal). In `--cpu-smoke` mode they run the same code on the CPU
runner; the figures mean nothing there, the code paths are what is checked.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
import warnings
from functools import partial

import torch
from gpu_check_common import capture_logits, decode_batch, wall_time

import gpu.sampler
from gpu.batch import Batch, SamplingRow
from gpu.worker import SWITCH_INTERVAL_S

SYNC_GOAL = 1
SWEEP_TOLERANCE = 3e-2
IDLE_GOAL = 0.15
GIL_GOAL = 0.10


def count_syncs(check, fn) -> dict:
    """Host waits during `fn()`: CUDA's sync debug mode where there is a GPU, and the
    sampler's result copies (its one planned wait) everywhere."""
    waits = []
    real = gpu.sampler.to_host
    gpu.sampler.to_host = lambda *t: waits.append(len(t)) or real(*t)
    try:
        if check.device.type != "cuda":
            fn()
            return {"syncs": None, "result_waits": len(waits)}
        check.sync()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode(0)
        messages = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
        return {"syncs": len(messages), "result_waits": len(waits), "where": messages[:8]}
    finally:
        gpu.sampler.to_host = real


def with_prefill_chunk(batch: Batch, chunk: int) -> Batch:
    """`batch` with its first row computing its last `chunk` tokens (a mixed step)."""
    ctx, table = batch.context_lens[0], batch.block_tables[0]
    positions = list(range(ctx - chunk, ctx))
    return Batch([1] * chunk + batch.token_ids[1:], positions + batch.positions[1:],
                 [table[p // 16] * 16 + p % 16 for p in positions] + batch.slot_mapping[1:],
                 [chunk] + batch.query_lens[1:], batch.context_lens, batch.block_tables,
                 batch.sample_indices, batch.sampling)


def sync_audit(check) -> dict:
    runner, ctx = check.runner, check.size["decode_context"]
    cases = {
        "graph_greedy_b8": decode_batch(8, ctx, first_block=1),
        "graph_sampled_logprobs_b8": decode_batch(
            8, ctx, first_block=1, row=SamplingRow(top_p=0.9, top_k=40, logprobs=2, seed=1)),
        "graph_penalized_b8": decode_batch(8, ctx, first_block=1, row=SamplingRow(
            temperature=0.0, frequency_penalty=0.5, output_token_ids=[1, 2, 3])),
        "eager_mixed": with_prefill_chunk(decode_batch(3, [ctx, 40, 300], first_block=1), 17),
    }
    out = {}
    for name, batch in cases.items():
        runner.execute(batch)  # warm: compiles, allocations
        out[name] = count_syncs(check, partial(runner.execute, batch))
    greedy = out["graph_greedy_b8"]
    out["ok"] = greedy["result_waits"] == 1 and (greedy["syncs"] is None
                                                  or greedy["syncs"] <= SYNC_GOAL)
    return out


def _blocks_of(slots: list[int]) -> set[int]:
    return {s // 16 for s in slots if s >= 0}


def _block_sums(caches: list[torch.Tensor], ranges: list[range], chunk: int = 4096
                ) -> torch.Tensor:
    """Per-block checksums (sum and sum of |x|, fp32) of the blocks in `ranges`, for every
    cache: [caches, blocks, 2]. In chunks: the pool is most of the GPU, and a copy of the
    blocks a large bucket uses would not fit beside it."""
    out = []
    for c in caches:
        flat, sums = c.view(c.shape[0], -1), []
        for r in ranges:
            for lo in range(r.start, r.stop, chunk):
                part = flat[lo:min(lo + chunk, r.stop)]
                sums.append(torch.stack([torch.sum(part, 1, dtype=torch.float32),
                                         torch.sum(part.abs(), 1, dtype=torch.float32)], 1))
        out.append(torch.cat(sums))
    return torch.stack(out)


def bucket_sweep(check) -> dict:
    """Each bucket with one row fewer than its size (mixed contexts) against eager."""
    runner, graphs = check.runner, check.runner.graphs
    caches = [runner.k_caches[0], runner.v_caches[0], runner.k_caches[-1], runner.v_caches[-1]]
    num_blocks = caches[0].shape[0]
    rows, failures = [], []
    for bucket in graphs.sizes:
        n = max(1, bucket - 1)
        contexts = [17 + (i * 389) % (check.size["max_model_len"] - 17) for i in range(n)]
        batch = decode_batch(n, contexts, first_block=1)
        used = max(b for t in batch.block_tables for b in t) + 1
        ranges = [range(0, min(used + 32, num_blocks)),
                  range(max(used + 32, num_blocks - 32), num_blocks)]
        ids = [b for r in ranges for b in r]
        before = _block_sums(caches, ranges)
        logits, replays = capture_logits(runner), graphs.replays
        runner.execute(batch)
        after = _block_sums(caches, ranges)
        runner.graphs = None
        try:
            runner.execute(batch)
        finally:
            runner.graphs = graphs
            del runner._sample  # back to the class's method
        graph_lg, eager_lg = logits
        moved = (before != after).any(-1).any(0).nonzero().flatten().tolist()
        changed = {ids[i] for i in moved}
        rel = ((graph_lg - eager_lg).abs().max() / eager_lg.abs().max().clamp_min(1e-6)).item()
        row = {"bucket": bucket, "rows": n, "rel_max_dlogits": rel,
               "nan": bool(torch.isnan(graph_lg).any()),
               "changed_outside_step": sorted(changed - _blocks_of(batch.slot_mapping)),
               "replayed": graphs.replays > replays}
        if (row["nan"] or rel > SWEEP_TOLERANCE or row["changed_outside_step"]
                or not row["replayed"]):
            failures.append(bucket)
        rows.append(row)
    return {"ok": not failures, "failed_buckets": failures, "rows": rows,
            "tolerance": SWEEP_TOLERANCE}


def anatomy(check) -> dict:
    """Kernels per step and how much of a step the GPU is busy, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    runner, ctx, steps = check.runner, check.size["decode_context"], 3
    cuda = check.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    rows = []
    for n in check.size["anatomy"]:
        batch = decode_batch(n, ctx, first_block=1)
        wall = wall_time(partial(runner.execute, batch), check.iters)
        with profile(activities=activities) as prof:
            for _ in range(steps):
                runner.execute(batch)
        events = prof.events()
        if cuda:
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
            spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
            busy, end = 0.0, float("-inf")
            for start, stop in spans:  # the union of kernel intervals, in microseconds
                busy += max(0.0, stop - max(start, end))
                end = max(end, stop)
            busy_s = busy / 1e6 / steps
        else:
            kernels = [e for e in events if e.cpu_parent is None]  # top-level ops
            busy_s = None
        row = {"batch": n, "kernels_per_step": len(kernels) / steps, "wall_ms": wall * 1e3,
               "gpu_busy_ms": busy_s * 1e3 if busy_s is not None else None}
        if busy_s is not None and kernels:  # no kernels seen: graph nodes were not traced
            row["idle_fraction"] = max(0.0, 1 - busy_s / wall)
        rows.append(row)
    big = [r for r in rows if r["batch"] >= 64 and "idle_fraction" in r]
    return {"ok": all(r["idle_fraction"] <= IDLE_GOAL for r in big), "rows": rows,
            "goal_idle_at_batch_64_plus": IDLE_GOAL}


def _steps_beside_busy_python(step, iters: int) -> float:
    """Median seconds of `step` on a thread while this thread runs pure Python."""
    times: list[float] = []

    def worker():
        for _ in range(iters):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)

    thread = threading.Thread(target=worker)
    thread.start()
    spin = {}
    while thread.is_alive():  # an event loop's work: small allocations, dict traffic
        for i in range(200):
            spin[i % 50] = str(i)
    thread.join()
    return statistics.median(times)


def gil(check) -> dict:
    runner = check.runner
    batch = decode_batch(check.size["gil_batch"], check.size["decode_context"], first_block=1)
    step = partial(runner.execute, batch)
    iters = check.iters if check.smoke else max(5, check.iters)
    previous = sys.getswitchinterval()
    out = {"alone_ms": wall_time(step, iters) * 1e3}
    try:
        for name, interval in (("default_5ms", 0.005), ("ridgeline", SWITCH_INTERVAL_S)):
            sys.setswitchinterval(interval)
            ms = _steps_beside_busy_python(step, iters) * 1e3
            out[name] = {"interval_s": interval, "step_ms": ms,
                         "slowdown": ms / out["alone_ms"] - 1}
    finally:
        sys.setswitchinterval(previous)
    out["ok"] = check.smoke or out["ridgeline"]["slowdown"] <= GIL_GOAL
    out["goal"] = GIL_GOAL
    return out

