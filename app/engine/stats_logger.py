"""The periodic stats line operators grep for, in vLLM's words.

`Preemptions: N` appears only when N > 0 in the interval, so a quiet log means
a pool that is big enough.
"""

from __future__ import annotations

import logging
import time

from app.engine.outputs import StepStats

log = logging.getLogger("ridgeline.stats")


class StatsLogger:
    def __init__(self, interval: float):
        self.interval = interval
        self._last = time.monotonic()
        self._prompt = self._gen = self._preempt = self._queries = self._hits = 0

    def record(self, stats: StepStats, force: bool = False) -> str | None:
        """Add one step's counts; log the line when the interval has passed."""
        self._prompt += stats.prompt_tokens
        self._gen += stats.generation_tokens
        self._preempt += stats.preemptions
        self._queries += stats.prefix_cache_queries
        self._hits += stats.prefix_cache_hits
        now = time.monotonic()
        elapsed = now - self._last
        if not force and (self.interval <= 0 or elapsed < self.interval):
            return None
        hit_rate = self._hits / self._queries if self._queries else None
        line = format_stats(self._prompt / elapsed, self._gen / elapsed, stats.num_running,
                            stats.num_waiting, self._preempt, stats.kv_cache_usage, hit_rate)
        self._last = now
        self._prompt = self._gen = self._preempt = self._queries = self._hits = 0
        log.info(line)
        return line


def format_stats(prompt_tps: float, gen_tps: float, running: int, waiting: int,
                 preemptions: int, kv_usage: float, prefix_hit_rate: float | None = None) -> str:
    parts = [
        f"Avg prompt throughput: {prompt_tps:.1f} tokens/s",
        f"Avg generation throughput: {gen_tps:.1f} tokens/s",
        f"Running: {running} reqs",
        f"Waiting: {waiting} reqs",
    ]
    if preemptions > 0:
        parts.append(f"Preemptions: {preemptions}")
    parts.append(f"KV cache usage: {kv_usage * 100:.1f}%")
    if prefix_hit_rate is not None:  # vLLM's words; shown when requests started
        parts.append(f"Prefix cache hit rate: {prefix_hit_rate * 100:.1f}%")
    return ", ".join(parts)
