"""Where the engine's steps sit on the roofline, live, for /plan, metrics and the stats line.

Each step's stats carry its FLOPs, bytes and model time (computed on the model thread
from the batch's shape, `gpu/roofline.py`); here they are set against the device's
measured peaks. A step that computed any prompt tokens is a prefill step (compute-bound
when its chunk is long), any other a decode step (memory-bound below the ridge).
Utilisations over several steps are time-weighted: Σ bytes / Σ seconds / peak, not an
average of per-step ratios. Per step this is a handful of additions and divisions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from app.engine.outputs import StepStats
from gpu.roofline import DevicePeaks


@dataclass
class PhaseTotals:
    """Steps of one kind added up."""

    steps: int = 0
    seconds: float = 0.0
    flops: int = 0
    bytes: int = 0

    def add(self, stats: StepStats) -> None:
        self.steps += 1
        self.seconds += stats.model_seconds
        self.flops += stats.flops
        self.bytes += stats.bytes_read + stats.bytes_written

    def mbu(self, peaks: DevicePeaks) -> float | None:
        return self.bytes / self.seconds / peaks.bandwidth if self.seconds else None

    def mfu(self, peaks: DevicePeaks) -> float | None:
        return self.flops / self.seconds / peaks.flops if self.seconds else None

    def intensity(self) -> float | None:
        return self.flops / self.bytes if self.bytes else None

    def as_dict(self, peaks: DevicePeaks | None) -> dict:
        out = {"steps": self.steps, "model_seconds": round(self.seconds, 4),
               "arithmetic_intensity": _round(self.intensity())}
        if self.seconds:
            out["achieved_gb_per_s"] = round(self.bytes / self.seconds / 1e9, 3)
            out["achieved_tflop_per_s"] = round(self.flops / self.seconds / 1e12, 5)
        if peaks is not None:
            out["mbu"], out["mfu"] = _round(self.mbu(peaks)), _round(self.mfu(peaks))
        return out


@dataclass(frozen=True)
class StepPosition:
    """One step against the peaks."""

    prefill: bool
    mbu: float
    mfu: float
    intensity: float


def is_prefill(stats: StepStats) -> bool:
    return stats.prompt_tokens > 0


def position(stats: StepStats, peaks: DevicePeaks | None) -> StepPosition | None:
    """The step's place on the roofline; None for a step that did not run the model."""
    if stats.model_seconds <= 0 or peaks is None:
        return None
    moved = stats.bytes_read + stats.bytes_written
    return StepPosition(is_prefill(stats), moved / stats.model_seconds / peaks.bandwidth,
                        stats.flops / stats.model_seconds / peaks.flops,
                        stats.flops / moved if moved else 0.0)


class RooflineTracker:
    """Totals per kind of step, since start and over the recent window (the live position
    in /plan): the window is the current period plus the previous one. `peaks` are the
    measured ones, raised to what a step achieved where it did better (the home of the
    peaks the stats line, /plan and the metrics read)."""

    def __init__(self, peaks: DevicePeaks | None, period: float = 10.0):
        self.peaks = peaks
        self.period = period
        self.total, self._recent, self._previous = self._empty(), self._empty(), self._empty()
        self._period_start = time.monotonic()
        self.last: dict[str, StepPosition] = {}

    @staticmethod
    def _empty() -> dict[str, PhaseTotals]:
        return {"decode": PhaseTotals(), "prefill": PhaseTotals()}

    def record(self, stats: StepStats) -> StepPosition | None:
        if stats.model_seconds <= 0:
            return None
        now = time.monotonic()
        if now - self._period_start >= self.period:  # after a long idle, nothing is recent
            stale = now - self._period_start >= 2 * self.period
            self._previous = self._empty() if stale else self._recent
            self._recent, self._period_start = self._empty(), now
        kind = "prefill" if is_prefill(stats) else "decode"
        self.total[kind].add(stats)
        self._recent[kind].add(stats)
        if self.peaks is not None:  # never a utilisation past 100 %
            moved = stats.bytes_read + stats.bytes_written
            self.peaks = self.peaks.raised_to(moved / stats.model_seconds,
                                              stats.flops / stats.model_seconds)
        pos = position(stats, self.peaks)
        if pos is not None:
            self.last[kind] = pos
        return pos

    def snapshot(self) -> dict:
        """The live position, as JSON: recent window, since start, and the last steps."""
        recent = {}
        for kind in ("decode", "prefill"):
            both = PhaseTotals()
            for part in (self._previous[kind], self._recent[kind]):
                both.steps += part.steps
                both.seconds += part.seconds
                both.flops += part.flops
                both.bytes += part.bytes
            recent[kind] = both.as_dict(self.peaks)
        return {
            "recent": recent,
            "recent_window_seconds": round(time.monotonic() - self._period_start + self.period,
                                           1),
            "since_start": {k: v.as_dict(self.peaks) for k, v in self.total.items()},
            "last_step": {k: {"mbu": round(p.mbu, 4), "mfu": round(p.mfu, 4),
                              "arithmetic_intensity": round(p.intensity, 2)}
                          for k, p in self.last.items()},
        }


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)
