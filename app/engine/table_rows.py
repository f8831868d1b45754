"""Which row of the model thread's block table each scheduled request owns, and what
that row has not been sent yet.

The model thread keeps every scheduled request's block table on the device, one row
each (`gpu/block_table.py`), so a step ships only the entries added since the request's
last step — one block id every `block_size` tokens — instead of every table in full.

Rules, all decided here on the event loop:
- A request gets a row when it is scheduled without one; a request that is not in a
  step gives its row back at that step (finished, aborted, preempted, or simply not
  scheduled this time). Rows in use never outnumber a step's sequences, so
  `max_num_seqs` rows suffice. Reusing a row at once is safe: the model thread applies
  a step's updates after the previous step's kernels, in stream order.
- A row is resent from column 0 when the request's table is a new list (its blocks were
  freed and allocated again: `BlockManager.block_table` returns the live list, whose
  identity lasts until `free`), or shrank. Cached prefix blocks at the start of a table
  are ordinary entries.
- A table cut at its tail (`BlockManager.trim`: the blocks of rejected drafts) is
  reported with `trim`: the entries before the cut stand, and whatever grows there
  again is sent, even when the table is back to its old length by the next step.
- Whoever rewrites entries already sent (say, a sliding window that swaps freed blocks
  for a null block) calls `invalidate`, and the next step resends the row whole.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class _Held:
    row: int
    table: list[int]  # the request's live block table (identity matters, see above)
    sent: int  # entries of it the model thread has


class TableRows:
    def __init__(self, num_rows: int):
        self.num_rows = num_rows
        self._free = list(range(num_rows - 1, -1, -1))
        self._held: dict[str, _Held] = {}

    def assign(self, seqs: list[tuple[str, list[int]]]
               ) -> tuple[list[int], list[tuple[int, int, list[int]]]]:
        """For a step's `(request id, live block table)` pairs: each one's row, in order,
        and the `(row, first column, block ids)` updates the model thread must apply."""
        scheduled = {rid for rid, _ in seqs}
        for rid in [rid for rid in self._held if rid not in scheduled]:
            self._free.append(self._held.pop(rid).row)
        rows, updates = [], []
        for rid, table in seqs:
            held = self._held.get(rid)
            if held is None:
                held = self._held[rid] = _Held(self._free.pop(), table, 0)
            elif held.table is not table or len(table) < held.sent:
                held.table, held.sent = table, 0
            if len(table) > held.sent:
                updates.append((held.row, held.sent, table[held.sent:]))
                held.sent = len(table)
            rows.append(held.row)
        return rows, updates

    def trim(self, request_id: str, length: int) -> None:
        """The request's table was cut to `length` entries: send anything past them."""
        held = self._held.get(request_id)
        if held is not None:
            held.sent = min(held.sent, length)

    def invalidate(self, request_id: str) -> None:
        """Entries already sent for this request changed: resend its row whole."""
        held = self._held.get(request_id)
        if held is not None:
            held.sent = 0

    def check(self) -> None:
        rows = [h.row for h in self._held.values()]
        assert len(set(rows)) == len(rows), "a row is held twice"
        assert not set(rows) & set(self._free), "a row is both free and held"
        assert len(rows) + len(self._free) == self.num_rows
