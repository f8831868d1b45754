"""`ridgeline bench overhead`: what the server costs beyond the model itself.

A tiny random-weight Llama (SmolLM2's tokenizer, two small layers) makes the
forward nearly free, so what remains is the server: HTTP, SSE encoding,
scheduling, detokenizing, queues. The server runs in this process on its own
uvloop thread, exactly as `ridgeline serve` builds it; the load — N concurrent
SSE streams with `ignore_eos` — comes from a separate process, so that the
client's Python does not share the server's GIL and inflate what we measure.

Two numbers are read from the server's own /metrics, as the difference between
a scrape just before and just after the load:

- event-loop lag p99 (`ridgeline:event_loop_lag_seconds`, estimated from the
  histogram's buckets the way Prometheus' histogram_quantile does) — goal < 10 ms;
- step time outside the model forward per generated token
  (`ridgeline:step_overhead_seconds_total` / `ridgeline:generation_tokens_total`)
  — goal < 100 µs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import re
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from multiprocessing import get_context
from pathlib import Path

GOAL_LAG_P99_MS = 10.0
GOAL_US_PER_TOKEN = 100.0


# -- the model and the server ------------------------------------------------------------


class InProcessServer:
    """`ridgeline serve`'s app on a loopback port, on a uvloop thread of this process."""

    def __init__(self, config, port: int = 0):
        import socket

        import uvicorn

        from app.server import ServerSettings, build_app, uvicorn_config

        if not port:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
        settings = ServerSettings(host="127.0.0.1", port=port, log_stats_interval=3600.0)
        self.app = build_app(config, settings)
        self.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn_config(self.app, settings, loop="none",
                                                    log_level="warning",
                                                    timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self._run, daemon=True, name="server")

    def _run(self) -> None:
        import uvloop

        loop = uvloop.new_event_loop()
        asyncio.set_event_loop(loop)
        loop.run_until_complete(self.server.serve())

    def start(self, timeout: float = 180.0) -> InProcessServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.app.state.ridgeline.load_error is not None:
                raise RuntimeError("model failed to load") from self.app.state.ridgeline.load_error
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            time.sleep(0.05)
        raise TimeoutError("the server did not become healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


# -- the load (runs in a child process) ----------------------------------------------------


def drive_load(url: str, num_streams: int, max_tokens: int, prompt_len: int, seed: int) -> dict:
    """Open every stream at once, read each to the end; runs in a spawned process."""
    import uvloop

    return uvloop.run(_load(url, num_streams, max_tokens, prompt_len, seed))


async def _load(url: str, n: int, max_tokens: int, prompt_len: int, seed: int) -> dict:
    from app.bench.workload import WORDS
    from app.client import AsyncClient

    rng = random.Random(seed)
    prompts = [f"{i} " + " ".join(rng.choice(WORDS) for _ in range(prompt_len - 1))
               for i in range(n)]
    async with AsyncClient(url, max_retries=0) as client:
        async def one(prompt: str) -> int:
            tokens = 0
            async for d in await client.completions(prompt, max_tokens=max_tokens, stream=True,
                                                    temperature=0, ignore_eos=True):
                tokens = d.usage.completion_tokens if d.usage else tokens
            return tokens

        t0 = time.perf_counter()
        outs = await asyncio.gather(*(one(p) for p in prompts), return_exceptions=True)
        wall = time.perf_counter() - t0
    errors = [repr(o) for o in outs if isinstance(o, BaseException)]
    return {"streams": n, "completed": n - len(errors), "errors": errors[:3],
            "tokens_received": sum(o for o in outs if isinstance(o, int)), "wall_s": wall}


# -- reading /metrics ------------------------------------------------------------------------


def scrape(url: str) -> str:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return r.read().decode()


def counter(text: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^ridgeline:{name}(?:{{[^}}]*}})? (\S+)$", text,
                                             re.M))


def buckets(text: str, name: str) -> list[tuple[float, float]]:
    """[(upper bound, cumulative count)] of a histogram, +Inf last."""
    out = [(float(le), float(v)) for le, v in re.findall(
        rf'^ridgeline:{name}_bucket{{[^}}]*le="([^"]+)"[^}}]*}} (\S+)$', text, re.M)]
    return sorted(out)


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float:
    """Prometheus' estimate: linear within the bucket where the rank falls."""
    total = cumulative[-1][1] if cumulative else 0.0
    if total <= 0:
        return math.nan
    rank, lower, below = q * total, 0.0, 0.0
    for upper, count in cumulative:
        if count >= rank:
            if math.isinf(upper):  # beyond the last finite bound: report that bound
                return lower
            return lower + (upper - lower) * (rank - below) / max(count - below, 1e-12)
        lower, below = upper, count
    return lower


def overhead_numbers(before: str, after: str) -> dict:
    """The load's share of each metric: `after` minus `before`."""
    lag = [(ub, a - b) for (ub, a), (_, b) in zip(buckets(after, "event_loop_lag_seconds"),
                                                  buckets(before, "event_loop_lag_seconds"))]
    d = {n: counter(after, n) - counter(before, n) for n in (
        "event_loop_lag_seconds_sum", "event_loop_lag_seconds_count",
        "step_overhead_seconds_total", "generation_tokens_total", "prompt_tokens_total")}
    tokens = d["generation_tokens_total"]
    return {
        "lag_p50_ms": histogram_quantile(0.50, lag) * 1e3,
        "lag_p99_ms": histogram_quantile(0.99, lag) * 1e3,
        "lag_mean_ms": d["event_loop_lag_seconds_sum"] / max(1, d["event_loop_lag_seconds_count"])
        * 1e3,
        "lag_samples": int(d["event_loop_lag_seconds_count"]),
        "step_overhead_s": d["step_overhead_seconds_total"],
        "generation_tokens": int(tokens), "prompt_tokens": int(d["prompt_tokens_total"]),
        "us_per_token_outside_model": d["step_overhead_seconds_total"] / max(1, tokens) * 1e6,
    }


# -- the command -----------------------------------------------------------------------------


def run(a: argparse.Namespace) -> int:
    import torch

    from app.config import EngineConfig
    from models.resolve import resolve_model
    from models.tiny import make_tiny_llama

    with tempfile.TemporaryDirectory(prefix="ridgeline-overhead-") as tmp:
        model = a.model or str(make_tiny_llama(
            Path(tmp) / "tiny", resolve_model(None), tie_word_embeddings=True,
            max_position_embeddings=2048))
        config = EngineConfig.from_kwargs(
            model=model, served_model_name="overhead", dtype="float32",
            max_model_len=max(256, 2 * a.prompt_len + a.max_tokens),
            max_num_seqs=a.num_streams, max_num_batched_tokens=max(2048, a.num_streams),
            kv_cache_memory=None if a.model else 256 << 20)
        server = InProcessServer(config).start()
        try:
            with ProcessPoolExecutor(1, mp_context=get_context("spawn")) as pool:
                pool.submit(drive_load, server.url, 4, 4, a.prompt_len, 1).result()  # warm up
                before = scrape(server.url)
                load = pool.submit(drive_load, server.url, a.num_streams, a.max_tokens,
                                   a.prompt_len, 0).result()
                after = scrape(server.url)
        finally:
            server.stop()
    nums = overhead_numbers(before, after)
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        "model": a.model or "tiny random Llama (2 layers, hidden 64)",
        "workload": {"num_streams": a.num_streams, "max_tokens": a.max_tokens,
                     "prompt_len": a.prompt_len},
        "load": load, **nums,
        "output_tokens_per_s": load["tokens_received"] / load["wall_s"],
        "goals": {"lag_p99_ms": GOAL_LAG_P99_MS, "us_per_token": GOAL_US_PER_TOKEN},
    }
    rows = [
        ("streams completed", f"{load['completed']}/{load['streams']}", ""),
        ("tokens received", str(load["tokens_received"]), ""),
        ("wall (s)", f"{load['wall_s']:.2f}", ""),
        ("output tokens/s", f"{result['output_tokens_per_s']:.0f}", ""),
        ("event-loop lag p50 (ms)", f"{nums['lag_p50_ms']:.2f}", ""),
        ("event-loop lag p99 (ms)", f"{nums['lag_p99_ms']:.2f}",
         _goal(nums["lag_p99_ms"], GOAL_LAG_P99_MS, "ms")),
        ("event-loop lag mean (ms)", f"{nums['lag_mean_ms']:.2f}", ""),
        ("time outside the model per token (µs)", f"{nums['us_per_token_outside_model']:.1f}",
         _goal(nums["us_per_token_outside_model"], GOAL_US_PER_TOKEN, "µs")),
    ]
    print(f"\n{'server overhead':40} {'value':>12}   goal")
    for name, value, goal in rows:
        print(f"{name:40} {value:>12}   {goal}")
    if load["errors"]:
        print("errors:", *load["errors"], sep="\n  ")
    path = Path(a.output_json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    return 0 if load["completed"] == load["streams"] else 1


def _goal(value: float, limit: float, unit: str) -> str:
    return f"< {limit:g} {unit}  {'met' if value < limit else 'MISSED'}"
