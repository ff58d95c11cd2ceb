"""`Baseline`: the engine's id → record table, with journal-synced writes queued until read."""

from __future__ import annotations

from bigfleet.decision.baseline import Baseline
from bigfleet.machine import Machine

from .fx import S, machine


def test_queued_writes_are_filed_on_read_and_a_long_queue_becomes_a_copy() -> None:
    ms = {f"m{i}": machine(f"m{i}", S.IDLE) for i in range(16)}
    base = Baseline(dict(ms))
    copies: list[int] = []

    def snapshot() -> dict[str, Machine]:
        copies.append(1)
        return dict(ms)

    new0 = machine("m0", S.IDLE, zone="z9")
    ms["m0"] = new0
    base.written([new0], 0, snapshot)
    added = machine("x1", S.IDLE)
    ms["x1"] = added
    base.written([added], 1, snapshot)
    assert len(base) == 17 and not copies  # 2 queued of 16: below the copy ratio
    table = base.table()
    assert table == ms and table["m0"] is new0 and table["x1"] is added
    more = [machine(f"m{i}", S.IDLE, zone="z8") for i in range(1, 4)]
    for m in more:
        ms[m.id] = m
    base.written(more, 0, snapshot)
    assert copies == [1]  # 3 queued of 17: the table is replaced by the source's copy
    assert base.table() == ms and len(base) == 17
