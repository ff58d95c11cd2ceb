"""The engine's diff baseline: the id → record table its index reflects.

A sync that follows the inventory's write journal looks nothing up in it, so the records such syncs
wrote are queued and filed only when something reads the table (a tail sync, a full diff, a lookup
for availability hints while the inventory has moved on), or replaced by one copy of the
inventory's own table once many are queued. Filing 25 000 records a drain wave was ~15 % of it.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from bigfleet.machine.record import Machine

_MACHINE_ID = attrgetter("id")


class Baseline:
    """The table, and the records written since it was last brought up to date."""

    __slots__ = ("_adds", "_queued", "_size", "_table")

    def __init__(self, table: dict[str, Machine]) -> None:
        # Holding every baseline record also keeps its id() from being reused by a new record
        # (the full diff compares records by identity).
        self._table = table
        self._queued: list[list[Machine]] = []
        self._size = 0  # records queued
        self._adds = 0  # of which new ids

    def __len__(self) -> int:
        return len(self._table) + self._adds

    def table(self) -> dict[str, Machine]:
        """The table, up to date."""
        if self._queued:
            table = self._table
            for written in self._queued:
                table.update(zip(map(_MACHINE_ID, written), written, strict=True))
            self._queued.clear()
            self._size = self._adds = 0
        return self._table

    def written(self, records: list[Machine], adds: int, snapshot: Callable[[], dict[str, Machine]]) -> None:
        """`records` (`adds` of them new ids) are now what the index holds for their ids; `snapshot`
        copies the source's whole table, which is exactly the baseline right after a sync."""
        self._queued.append(records)
        self._size += len(records)
        self._adds += adds
        if self._size * _COPY_RATIO > len(self._table):
            self._table = snapshot()
            self._queued.clear()
            self._size = self._adds = 0


#: the queue is replaced by a copy of the source's table once it holds more than 1/this of the
#: table (a C-level copy of 500 000 entries costs about what filing ~40 000 records one by one does)
_COPY_RATIO = 8
