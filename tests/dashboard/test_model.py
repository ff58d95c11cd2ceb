"""The dashboard's pure pieces: history ring, shortfall first-seen clock, action log, sums."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from bigfleet.dashboard.model import ActionLog, History, Sample, ShortfallAges, needs_vs_bound, sum_quantities


def sample(t: float, total: int = 1) -> Sample:
    return Sample(t, total, 0, total, 0, 0, 0)


def test_history_is_bounded_and_coalesces_close_samples() -> None:
    h = History(capacity=3, min_gap=1.0)
    h.add(sample(0.0, 1))
    h.add(sample(0.5, 2))  # within min_gap: replaces the previous point
    assert [p["total"] for p in h.to_json()] == [2]
    for t in (2.0, 4.0, 6.0):
        h.add(sample(t, int(t)))
    assert [p["t"] for p in h.to_json()] == [2.0, 4.0, 6.0]
    with pytest.raises(ValueError):
        History(capacity=1)


def test_shortfall_ages_keep_first_seen_and_forget_resolved() -> None:
    ages = ShortfallAges()
    assert ages.update(["a"], 10.0) == {"a": 10.0}
    assert ages.update(["a", "b"], 15.0) == {"a": 10.0, "b": 15.0}
    assert ages.update(["b"], 20.0) == {"b": 15.0}
    # "a" came back: a new episode, aged from now.
    assert ages.update(["a", "b"], 30.0) == {"a": 30.0, "b": 15.0}


@dataclass
class Configure:
    machine_id: str
    cluster_id: str
    priority: int


@dataclass
class Delete:
    machine_id: str
    reason: str = "release"


def test_action_log_records_each_cycle_once_newest_first() -> None:
    log = ActionLog(capacity=3)
    assert log.add_cycle(1, 100.0, [Configure("m1", "c1", 50)]) == 1
    assert log.add_cycle(1, 101.0, [Configure("m1", "c1", 50)]) == 0  # same cycle seen again
    assert log.add_cycle(2, 102.0, [Delete("m2")], suppressed=[Configure("m3", "c2", 7)], mode="paused") == 2
    rows = log.to_json()
    assert [r["machine_id"] for r in rows] == ["m3", "m2", "m1"]
    assert rows[0]["detail"] == "priority 7 [not executed: paused]"
    assert rows[1]["kind"] == "Delete" and rows[1]["detail"] == "release" and rows[1]["cluster_id"] == ""
    assert rows[2]["detail"] == "priority 50" and rows[2]["cycle"] == 1
    log.add_cycle(3, 103.0, [Delete("m4")])
    assert [r["machine_id"] for r in log.to_json()] == ["m4", "m3", "m2"]  # capacity 3
    assert len(log.to_json(limit=1)) == 1


def test_sums_are_milli_units_and_skip_garbage() -> None:
    got = sum_quantities([{"cpu": "500m", "memory": "1Gi"}, {"cpu": "2", "pods": "10"}, {"cpu": "bogus"}])
    assert got == {"cpu": 2500, "memory": 1024**3 * 1000}
    rows = needs_vs_bound({"c1": [{"cpu": "4"}]}, {"c1": [{"cpu": "2"}], "c2": [{"cpu": "1"}]})
    assert rows == [
        {"cluster_id": "c1", "need": {"cpu": 4000}, "bound": {"cpu": 2000}},
        {"cluster_id": "c2", "need": {}, "bound": {"cpu": 1000}},
    ]
