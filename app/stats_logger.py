"""The periodic stats line operators grep for, in vLLM's words.

`Preemptions: N` appears only when N > 0 in the interval, so a quiet log means
a pool that is big enough.
"""

from __future__ import annotations

import logging
import time

log = logging.getLogger("ridgeline.stats")


class StatsLogger:
    def __init__(self, interval: float):
        self.interval = interval
        self._last = time.monotonic()
        self._prompt = self._gen = self._preempt = 0

    def record(self, prompt_tokens: int, generation_tokens: int, preemptions: int) -> None:
        self._prompt += prompt_tokens
        self._gen += generation_tokens
        self._preempt += preemptions

    def maybe_log(self, running: int, waiting: int, kv_usage: float,
                  force: bool = False) -> str | None:
        now = time.monotonic()
        elapsed = now - self._last
        if not force and (self.interval <= 0 or elapsed < self.interval):
            return None
        line = format_stats(self._prompt / elapsed, self._gen / elapsed, running, waiting,
                            self._preempt, kv_usage)
        self._last, self._prompt, self._gen, self._preempt = now, 0, 0, 0
        log.info(line)
        return line


def format_stats(prompt_tps: float, gen_tps: float, running: int, waiting: int,
                 preemptions: int, kv_usage: float) -> str:
    parts = [
        f"Avg prompt throughput: {prompt_tps:.1f} tokens/s",
        f"Avg generation throughput: {gen_tps:.1f} tokens/s",
        f"Running: {running} reqs",
        f"Waiting: {waiting} reqs",
    ]
    if preemptions > 0:
        parts.append(f"Preemptions: {preemptions}")
    parts.append(f"KV cache usage: {kv_usage * 100:.1f}%")
    return ", ".join(parts)
