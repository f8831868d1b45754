"""The thread governor: torch's thread count follows the cores the rest of the host
leaves free (fed fake clocks and CPU counters; no sleeping, no real load)."""

from __future__ import annotations

from gpu.cpu.threads import ThreadGovernor, host_busy_ticks, own_ticks


class Host:
    """A fake host: advance time, say how many cores others and we kept busy."""

    def __init__(self, hz: int = 100):
        self.t, self.host, self.own, self.hz = 0.0, 0, 0, hz

    def run(self, seconds: float, others: float, ours: float) -> None:
        self.t += seconds
        self.own += int(ours * seconds * self.hz)
        self.host += int((others + ours) * seconds * self.hz)


def governor(host: Host, cores: int = 2, calls: list | None = None) -> ThreadGovernor:
    g = ThreadGovernor(cores, interval=2.0, clock=lambda: host.t, host=lambda: host.host,
                       own=lambda: host.own,
                       set_threads=calls.append if calls is not None else (lambda n: None))
    g._hz = host.hz
    return g


def test_threads_follow_the_cores_others_leave_free():
    host, calls = Host(), []
    g = governor(host, cores=2, calls=calls)
    host.run(2.5, others=0.0, ours=2.0)
    g.step_done()  # stepping up to now
    g.tick()
    assert g.threads == 2 and calls == []  # idle host: every core
    host.run(2.5, others=1.0, ours=1.0)  # another tenant took a core
    g.step_done()
    g.tick()
    assert g.threads == 1 and calls == [1]
    host.run(1.0, others=0.0, ours=2.0)
    g.step_done()
    g.tick()  # too soon to look again
    assert g.threads == 1
    host.run(2.0, others=0.1, ours=1.0)  # it left
    g.step_done()
    g.tick()
    assert g.threads == 2 and calls == [1, 2]
    host.run(2.5, others=2.0, ours=1.0)  # a busy host never leaves us with none
    g.step_done()
    g.tick()
    assert g.threads == 1


def test_a_bigger_host_keeps_what_is_free():
    host, calls = Host(), []
    g = governor(host, cores=8, calls=calls)
    host.run(3.0, others=2.6, ours=5.0)
    g.step_done()
    g.tick()
    assert g.threads == 5 and calls == [5]


def test_the_real_counters_read():
    assert host_busy_ticks() >= 0 and own_ticks() >= 0
    assert ThreadGovernor.for_this_host() is None or ThreadGovernor.for_this_host().threads >= 1


def test_an_idle_gap_does_not_count():
    """While the engine idles, a client starting up on the other core is no tenant: the
    first step after the gap starts a fresh window, and only steps are measured."""
    host, calls = Host(), []
    g = governor(host, cores=2, calls=calls)
    host.run(16.0, others=0.9, ours=0.0)  # idle; a benchmark client starts meanwhile
    g.tick()
    assert g.threads == 2 and calls == []
    host.run(2.5, others=0.1, ours=2.0)  # then it only waits on the stream
    g.step_done()
    g.tick()
    assert g.threads == 2 and calls == []
    for _ in range(25):  # steps back to back beside a tenant: it is seen
        host.run(0.1, others=1.0, ours=1.0)
        g.step_done()
        g.tick()
    assert g.threads == 1 and calls == [1]
