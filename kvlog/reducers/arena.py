"""The live requests' block tables as arrays: one int32 arena, a region per request row.

A request's table is the logical ids ``ids[starts[row] : starts[row] + lengths[row]]`` of
its row (the running digest's slot, ``running.py``), in a region of ``capacities[row]``
ids. Appending past the capacity moves the table to a region twice as large (and half as
large again as it holds, ``kernels.grown_capacity``) at the arena's top (amortized O(1)
an id); a table that leaves turns its region into garbage,
and when the top would pass the arena's end the live regions are packed into the other of
two arenas (four times what they need, ``kernels.pack_rows``): O(live ids), compiled,
amortized over the ids appended since.

So a whole scheduler step's tables change inside its one compiled commit
(``kernels.step_commit`` appends each allocation's ids and drops the released tables'
references straight from here), with no Python int per id; the rest of the reducers read
a table as a list (``table``) and append through ``append``. Each array is a numpy view of
an ``array.array`` buffer (``buffers.py``): Python loops index the buffer, compiled code the
view. Pure bookkeeping: no I/O, no clock, no randomness.
"""

from __future__ import annotations

from array import array

import numpy as np

from kvlog.reducers import kernels
from kvlog.reducers.buffers import Int32Array, int64_buffer
from kvlog.reducers.kernels import grown_capacity

__all__ = ["TableArena"]

_FIRST_IDS = 4096
"""Ids a fresh arena holds before it first grows."""


class TableArena:
    """The ids of every live table and, per row, where its region starts, how many ids it
    holds and how many it has room for. Rows are the running digest's slots; a free row
    has length and capacity 0."""

    __slots__ = (
        "_spare",
        "_spare_buffer",
        "capacities",
        "capacities_buffer",
        "garbage",
        "ids",
        "ids_buffer",
        "lengths",
        "lengths_buffer",
        "starts",
        "starts_buffer",
        "top",
    )

    def __init__(self, rows: int) -> None:
        self.ids_buffer = array("i", bytes(4 * _FIRST_IDS))
        self.ids: Int32Array = np.frombuffer(self.ids_buffer, dtype=np.int32)
        self.starts_buffer, self.starts = int64_buffer(rows)
        self.lengths_buffer, self.lengths = int64_buffer(rows)
        self.capacities_buffer, self.capacities = int64_buffer(rows)
        self._spare_buffer, self._spare = self.ids_buffer, self.ids[:0]
        """The arena the next compaction packs into (the one before the last: its memory
        is already mapped, so packing costs the copy alone)."""
        self.top = 0
        """Where the next region starts (ids past it are unused)."""
        self.garbage = 0
        """Ids below ``top`` that no live table's region covers."""

    def grow_rows(self, rows: int) -> None:
        """Room for ``rows`` rows (the running digest doubled its slots); the new ones free."""
        for name in ("starts", "lengths", "capacities"):
            buffer, view = int64_buffer(rows)
            old = getattr(self, name)
            view[: old.size] = old
            setattr(self, name + "_buffer", buffer)
            setattr(self, name, view)

    def table(self, row: int) -> list[int]:
        """Row ``row``'s table as a new list."""
        start = self.starts_buffer[row]
        return self.ids_buffer[start : start + self.lengths_buffer[row]].tolist()

    def ids_of(self, row: int) -> Int32Array:
        """Row ``row``'s table as a view of the arena (valid until the arena next changes)."""
        start = self.starts_buffer[row]
        return self.ids[start : start + self.lengths_buffer[row]]

    def append(self, row: int, block_ids: list[int]) -> None:
        """Append ``block_ids`` to row ``row``'s table (a free row: a new table)."""
        count = len(block_ids)
        length = self.lengths_buffer[row]
        if length + count > self.capacities_buffer[row]:
            self._relocate(row, grown_capacity(self.capacities_buffer[row], length + count))
        at = self.starts_buffer[row] + length
        if count == 1:
            self.ids_buffer[at] = block_ids[0]
        elif count:  # (an empty slice assignment would count as a resize: refused)
            self.ids_buffer[at : at + count] = array("i", block_ids)
        self.lengths_buffer[row] = length + count

    def close(self, row: int) -> None:
        """Row ``row``'s table left: its region is garbage, the row free."""
        self.garbage += self.capacities_buffer[row]
        self.lengths_buffer[row] = self.capacities_buffer[row] = 0

    def _relocate(self, row: int, capacity: int) -> None:
        """Move row ``row``'s table to a new region of ``capacity`` ids at the top."""
        self.reserve(capacity)
        start, length = self.starts_buffer[row], self.lengths_buffer[row]
        top = self.top
        if length:
            self.ids_buffer[top : top + length] = self.ids_buffer[start : start + length]
        self.garbage += self.capacities_buffer[row]
        self.starts_buffer[row], self.capacities_buffer[row] = top, capacity
        self.top = top + capacity

    def reserve(self, need: int) -> None:
        """Room for ``need`` more ids at the top: the live regions packed into a fresh
        arena when they would not fit (four times what the live regions and ``need`` take,
        at least the current size: O(live ids), amortized over the appends that made the
        garbage). The arrays are new objects then: read them again."""
        if self.top + need <= self.ids.size:
            return
        live = self.top - self.garbage
        size = self.ids.size
        while size < 4 * (live + need):
            size *= 2
        if self._spare.size != size:  # a first compaction at this size: a fresh arena
            self._spare_buffer = array("i", bytes(4 * size))
            self._spare = np.frombuffer(self._spare_buffer, dtype=np.int32)
        buffer, view = self._spare_buffer, self._spare
        self.top = kernels.pack_rows(self.ids, view, self.starts, self.lengths, self.capacities)
        self.garbage = 0
        self._spare_buffer, self._spare = self.ids_buffer, self.ids  # the next one's target
        self.ids_buffer, self.ids = buffer, view
