"""Block tables as deltas to persistent device rows, and the one-copy staging of a step.

The event-loop side (`TableRows`) is plain Python: every transition is tested without
a model. The model-thread side (`DeviceBlockTable`) is checked by replaying random
engine-like histories and comparing the gathered tables with the live lists.
"""

from __future__ import annotations

import random

import torch

from app.engine.table_rows import TableRows
from gpu.block_table import DeviceBlockTable, flatten_updates
from gpu.staging import Staging, to_host


def test_rows_send_only_new_entries_and_come_back_when_unscheduled():
    rows = TableRows(num_rows=3)
    a, b = [5, 6], [9]
    got, updates = rows.assign([("a", a), ("b", b)])
    assert got == [0, 1] and updates == [(0, 0, [5, 6]), (1, 0, [9])]
    a.append(7)  # a grew by a block; b did not
    got, updates = rows.assign([("a", a), ("b", b)])
    assert got == [0, 1] and updates == [(0, 2, [7])]
    got, updates = rows.assign([("b", b), ("c", [1, 2])])  # a finished: its row is reused
    assert got == [1, 0] and updates == [(0, 0, [1, 2])]
    rows.check()


def test_a_new_table_for_the_same_request_is_sent_whole():
    """Preempted and re-admitted, or freed and allocated again: a new list."""
    rows = TableRows(num_rows=2)
    rows.assign([("a", [1, 2, 3])])
    got, updates = rows.assign([("a", [8])])
    assert got == [0] and updates == [(0, 0, [8])]
    table = [4, 5]
    rows.assign([("a", table)])
    rows.invalidate("a")  # entries already sent changed (say, a null block swapped in)
    table[0] = 0
    assert rows.assign([("a", table)])[1] == [(0, 0, [0, 5])]
    rows.check()


def test_device_rows_follow_random_engine_histories():
    rng = random.Random(0)
    num_rows, width = 6, 10
    rows = TableRows(num_rows)
    device = DeviceBlockTable(num_rows, width, torch.device("cpu"))
    staging = Staging(torch.device("cpu"))
    live: dict[str, list[int]] = {}
    for step in range(200):
        for rid in list(live):
            if rng.random() < 0.1:
                del live[rid]  # finished
            elif rng.random() < 0.05:
                live[rid] = [rng.randrange(100) for _ in range(rng.randint(1, 3))]  # preempted
            elif len(live[rid]) < width and rng.random() < 0.3:
                live[rid].append(rng.randrange(100))
        while len(live) < num_rows and rng.random() < 0.5:
            live[f"r{step}-{len(live)}"] = [rng.randrange(100)]
        scheduled = [(rid, t) for rid, t in live.items() if rng.random() < 0.9]
        got, updates = rows.assign(scheduled)
        rows.check()
        r, c, b = flatten_updates(updates)
        device.update(*staging.stage((r, torch.long), (c, torch.long), (b, torch.int32)))
        gathered = device.gather(torch.tensor(got, dtype=torch.long))
        for (_, table), row in zip(scheduled, gathered.tolist()):
            assert row[: len(table)] == table
    assert device.table[device.padding_row].eq(0).all()


def test_staging_off_cuda_is_plain_tensors():
    staging = Staging(torch.device("cpu"))
    ids, scales = staging.stage(([1, 2, 3], torch.long), ([0.5], torch.float32))
    assert ids.tolist() == [1, 2, 3] and ids.dtype == torch.long
    assert scales.tolist() == [0.5] and staging.copies == 0
    t = torch.arange(3)
    assert to_host(t)[0] is t
