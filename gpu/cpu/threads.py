"""torch's CPU thread count, fitted to the cores the rest of the host leaves free.

torch's CPU kernels run on OpenMP threads that spin at every barrier. With the host
otherwise idle, more threads decode faster; beside a busy process, a thread per core
decodes *slower* than fewer — each barrier waits for a thread the kernel has
descheduled (`benchmarks/threads.py` measures both). No fixed number is right for a
shared host, so by default the model thread asks, every few
seconds, how much CPU everything else on the host used (/proc/stat, less this
process's own /proc/self/stat), and runs on the cores left. `--torch-threads N` fixes
the number instead. Off Linux (no /proc) it keeps torch's default.

Only time the engine spent stepping counts. What the host did while the engine sat idle
says little about the next steps: before a benchmark's first request its client starts
up (imports, a tokenizer, prompts) on a core we were not using, and counting that would
drop a benchmark's first long prefill to one thread. So the first step after an idle gap
starts a fresh window instead of deciding on one that spans the gap.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import torch

log = logging.getLogger("ridgeline.threads")

CHECK_EVERY_S = 2.0
# A core counts as taken when others used at least this much of one over a check.
TAKEN = 0.5
# Longer than this between one step's end and the next one's start: the engine was idle.
IDLE_GAP_S = 0.5


def host_busy_ticks() -> int:
    """Busy time since boot, in clock ticks, of the CPUs this process may run on (the
    `cpuN` lines of /proc/stat): in a container on a big host, only ours count."""
    mine = os.sched_getaffinity(0)
    busy = 0
    with open("/proc/stat") as f:
        for line in f:
            name, *values = line.split()
            if not name.startswith("cpu") or name == "cpu":
                if busy or not name.startswith("cpu"):
                    break
                continue
            if int(name[3:]) in mine:
                fields = [int(x) for x in values[:8]]  # user nice system idle iowait ...
                busy += sum(fields) - fields[3] - fields[4]
    return busy


def own_ticks() -> int:
    """This process's CPU time, every thread, in clock ticks."""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime, stime


class ThreadGovernor:
    def __init__(self, max_threads: int, interval: float = CHECK_EVERY_S,
                 clock: Callable[[], float] = time.monotonic,
                 host: Callable[[], int] = host_busy_ticks, own: Callable[[], int] = own_ticks,
                 set_threads: Callable[[int], None] = torch.set_num_threads):
        self.max_threads = max_threads
        self.threads = max_threads
        self._interval, self._clock, self._host, self._own = interval, clock, host, own
        self._set = set_threads
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = (clock(), host(), own())
        self._step_end = clock()  # idle until the first step

    @classmethod
    def for_this_host(cls) -> ThreadGovernor | None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0
        if cores < 2 or not os.path.exists("/proc/stat"):
            return None
        return cls(cores)

    def others_busy(self) -> float | None:
        """Cores the rest of the host used since the last look (None: too soon)."""
        now = self._clock()
        last_t, last_host, last_own = self._last
        if now - last_t < self._interval:
            return None
        host, own = self._host(), self._own()
        self._last = (now, host, own)
        return max(0.0, (host - last_host) - (own - last_own)) / self._hz / (now - last_t)

    def step_done(self) -> None:
        """After each step, on the model thread: when the engine went idle, if it does."""
        self._step_end = self._clock()

    def tick(self) -> None:
        """Before each step, on the model thread: adjust the thread count if the host
        changed; after an idle gap, only start a new window."""
        if self._clock() - self._step_end > IDLE_GAP_S:
            self._last = (self._clock(), self._host(), self._own())
            return
        busy = self.others_busy()
        if busy is None:
            return
        taken = int(busy + (1 - TAKEN))  # 0.5 of a core or more counts as a core
        threads = max(1, min(self.max_threads, self.max_threads - taken))
        if threads != self.threads:
            log.info("torch threads %d -> %d (the rest of the host used %.1f cores)",
                     self.threads, threads, busy)
            self.threads = threads
            self._set(threads)
