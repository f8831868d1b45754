"""The periodic stats line operators grep for, in vLLM's words, and the roofline in ours.

`Preemptions: N` appears only when N > 0 in the interval, so a quiet log means
a pool that is big enough. With the device's peaks known, the line ends with where
the interval's steps sat on the roofline: decode MBU and prefill MFU (time-weighted
over the interval's steps of each kind) and their arithmetic intensity against the
ridge.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from app.engine.outputs import StepStats
from app.engine.roofline import PhaseTotals, is_prefill
from gpu.roofline import DevicePeaks

log = logging.getLogger("ridgeline.stats")


class StatsLogger:
    def __init__(self, interval: float, peaks: DevicePeaks | None = None):
        self.interval = interval
        self.peaks = peaks
        self._last = time.monotonic()
        self.note: Callable[[], str] | None = None  # more for the line (the LoRA adapters)
        self._reset()

    def _reset(self) -> None:
        self._prompt = self._gen = self._preempt = self._queries = self._hits = 0
        self._decode, self._prefill = PhaseTotals(), PhaseTotals()
        self._drafts = self._drafted = self._accepted = 0

    def record(self, stats: StepStats, force: bool = False) -> str | None:
        """Add one step's counts; log the line when the interval has passed."""
        self._prompt += stats.prompt_tokens
        self._gen += stats.generation_tokens
        self._preempt += stats.preemptions
        self._queries += stats.prefix_cache_queries
        self._hits += stats.prefix_cache_hits
        self._drafts += stats.spec_num_drafts
        self._drafted += stats.spec_num_draft_tokens
        self._accepted += stats.spec_num_accepted_tokens
        if stats.model_seconds > 0:
            (self._prefill if is_prefill(stats) else self._decode).add(stats)
        now = time.monotonic()
        elapsed = now - self._last
        if not force and (self.interval <= 0 or elapsed < self.interval):
            return None
        hit_rate = self._hits / self._queries if self._queries else None
        line = format_stats(self._prompt / elapsed, self._gen / elapsed, stats.num_running,
                            stats.num_waiting, self._preempt, stats.kv_cache_usage, hit_rate)
        if self._drafts:
            line += format_spec(self._drafts, self._drafted, self._accepted)
        if self.peaks is not None:
            line += format_roofline(self._decode, self._prefill, self.peaks)
        if self.note is not None:
            line += self.note()
        self._last = now
        self._reset()
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


def format_spec(drafts: int, drafted: int, accepted: int) -> str:
    """`, Draft acceptance rate: 62.5%, Mean acceptance length: 3.50` (vLLM's words: the
    mean counts the target's own token, so 1.00 means no draft was kept)."""
    return (f", Draft acceptance rate: {accepted / drafted * 100:.1f}%, "
            f"Mean acceptance length: {1 + accepted / drafts:.2f}")


def format_roofline(decode: PhaseTotals, prefill: PhaseTotals, peaks: DevicePeaks) -> str:
    """`, Decode MBU: 21.2% (at 8.4 FLOP/B), Prefill MFU: 66.6% (at 251.0 FLOP/B), ridge
    13.0 FLOP/B`. Decode beyond the ridge (compute-bound: batch 64 on a CPU) shows its MFU
    too, and prefill below it its MBU; a kind of step the interval did not run is left out."""
    parts = []
    if decode.steps:
        ai = decode.intensity() or 0.0
        other = f"MFU {decode.mfu(peaks) * 100:.1f}% " if ai >= peaks.ridge else ""
        parts.append(f"Decode MBU: {decode.mbu(peaks) * 100:.1f}% ({other}at {ai:.1f} FLOP/B)")
    if prefill.steps:
        ai = prefill.intensity() or 0.0
        other = f"MBU {prefill.mbu(peaks) * 100:.1f}% " if ai < peaks.ridge else ""
        parts.append(f"Prefill MFU: {prefill.mfu(peaks) * 100:.1f}% ({other}at {ai:.1f} FLOP/B)")
    if not parts:
        return ""
    return ", " + ", ".join(parts) + f", ridge {peaks.ridge:.1f} FLOP/B"
