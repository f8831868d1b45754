"""The GIL convoy: a thread that waits with the GIL released (the model thread waiting
on the device) gets it back only after the busy thread's switch interval.

Python's default interval is 5 ms: beside a busy event loop each wait costs up to that
much. The worker lowers the interval when it starts (`gpu/worker.py`); this measures
the effect with short `time.sleep` waits standing in for device syncs.
"""

from __future__ import annotations

import sys
import threading
import time

import pytest

from gpu.worker import SWITCH_INTERVAL_S, shorten_switch_interval

WAITS = 30


def waits_beside_busy_python(interval: float) -> float:
    """Seconds for WAITS short GIL-releasing waits on a thread while this one spins."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval)
    elapsed: list[float] = []

    def model_thread():
        t0 = time.perf_counter()
        for _ in range(WAITS):
            time.sleep(0.0001)  # releases the GIL, like a wait on the device
        elapsed.append(time.perf_counter() - t0)

    try:
        thread = threading.Thread(target=model_thread)
        thread.start()
        spin = {}
        while thread.is_alive():  # the event loop's Python: never waits, never yields
            for i in range(100):
                spin[i % 10] = i
        thread.join()
    finally:
        sys.setswitchinterval(previous)
    return elapsed[0]


def test_a_short_switch_interval_ends_the_convoy():
    # The fastest of three: a loaded host (other processes on the cores) only adds time.
    default = min(waits_beside_busy_python(0.005) for _ in range(3))
    short = min(waits_beside_busy_python(SWITCH_INTERVAL_S) for _ in range(3))
    # Each wait costs about one interval beside the busy thread: 30 x 5 ms vs 30 x 0.5 ms,
    # a tenth; a host busy with other work stretches the short waits most, so half.
    assert default > WAITS * 0.002, default
    assert short < default / 2, (short, default)


def test_the_worker_only_ever_shortens_the_interval():
    previous = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.0001)
        assert shorten_switch_interval() == pytest.approx(0.0001)  # a shorter one stays
        sys.setswitchinterval(0.005)
        assert shorten_switch_interval() == pytest.approx(SWITCH_INTERVAL_S)
    finally:
        sys.setswitchinterval(previous)
