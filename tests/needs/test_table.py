"""NeedsTable: complete replacement, arrival preservation, ordering, generations."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.needs import Need, NeedsTable, Profile, Resources, snapshot_sort_key

from .strategies import needs_for


def need(cluster: str, prio: int, cpu: str = "1", group: str = "", arrival: int = 0) -> Need:
    return Need(cluster, Profile(priority=prio, group=group), Resources.parse({"cpu": cpu}), Resources.parse({"cpu": "1"}),
                arrival)


def test_replace_is_complete_not_a_merge() -> None:
    t = NeedsTable()
    assert t.replace("c1", [need("c1", 10), need("c1", 5)], 100)
    assert len(t.cluster("c1")) == 2
    assert t.replace("c1", [need("c1", 5)], 200)
    assert [n.priority for n in t.cluster("c1")] == [5]  # priority 10 withdrawn by absence


def test_empty_replace_removes_cluster() -> None:
    t = NeedsTable()
    t.replace("c1", [need("c1", 1)], 1)
    assert "c1" in t
    assert t.replace("c1", [], 2)
    assert "c1" not in t and t.clusters() == [] and t.snapshot() == ()
    assert not t.replace("c1", [], 3)  # nothing to remove: no change


def test_surviving_need_keeps_arrival() -> None:
    t = NeedsTable()
    t.replace("c1", [need("c1", 1, "1")], 100)
    assert t.cluster("c1")[0].arrival_unix_nanos == 100
    # same profile, different size: still the same row, age preserved
    assert t.replace("c1", [need("c1", 1, "3"), need("c1", 2)], 200)
    rows = {n.priority: n for n in t.cluster("c1")}
    assert rows[1].arrival_unix_nanos == 100 and rows[1].aggregate_resources.get("cpu") == 3000
    assert rows[2].arrival_unix_nanos == 200
    # withdrawn then re-added: a new arrival
    t.replace("c1", [need("c1", 2)], 300)
    t.replace("c1", [need("c1", 2), need("c1", 1)], 400)
    assert {n.priority: n.arrival_unix_nanos for n in t.cluster("c1")} == {1: 400, 2: 200}


def test_explicit_arrival_on_new_rows_is_kept() -> None:
    t = NeedsTable()
    t.replace("c1", [need("c1", 1, arrival=42)], 100)
    assert t.cluster("c1")[0].arrival_unix_nanos == 42


def test_no_op_replace_reports_no_change_and_keeps_generation() -> None:
    t = NeedsTable()
    assert t.replace("c1", [need("c1", 1), need("c1", 2)], 100)
    g, cg = t.generation, t.cluster_generation("c1")
    assert not t.replace("c1", [need("c1", 2), need("c1", 1)], 999)  # same demand, other order, later time
    assert t.generation == g and t.cluster_generation("c1") == cg


def test_generations() -> None:
    t = NeedsTable()
    assert t.generation == 0 and t.cluster_generation("c1") == 0
    t.replace("c1", [need("c1", 1)], 1)
    t.replace("c2", [need("c2", 1)], 1)
    assert t.generation == 2
    assert t.cluster_generation("c1") == 1 and t.cluster_generation("c2") == 2
    t.remove("c1")
    assert t.generation == 3 and t.cluster_generation("c1") == 3  # removal is visible too
    assert not t.remove("c1")
    assert t.cluster_generations() == {"c1": 3, "c2": 2}


def test_snapshot_order() -> None:
    t = NeedsTable()
    t.replace("b", [need("b", 5, group="x")], 10)
    t.replace("a", [need("a", 5, group="y")], 10)
    t.replace("c", [need("c", 5)], 5)
    t.replace("d", [need("d", 9)], 50)
    snap = t.snapshot()
    assert [(n.cluster_id, n.priority) for n in snap] == [("d", 9), ("c", 5), ("a", 5), ("b", 5)]
    assert snap is t.snapshot()  # cached until a change
    t.replace("e", [need("e", 1)], 60)
    assert snap is not t.snapshot() and len(t.snapshot()) == 5
    assert len(t) == 5


def test_duplicate_profiles_merge_into_one_row() -> None:
    t = NeedsTable()
    t.replace("c1", [need("c1", 1, "1"), need("c1", 1, "2")], 5)
    (row,) = t.cluster("c1")
    assert row.aggregate_resources.get("cpu") == 3000
    assert t.get("c1", row.fingerprint) is row and t.get("c1", "nope") is None


def test_rejects_foreign_or_empty_cluster() -> None:
    t = NeedsTable()
    with pytest.raises(ValueError):
        t.replace("c1", [need("c2", 1)], 1)
    with pytest.raises(ValueError):
        t.replace("", [], 1)
    assert t.generation == 0


def test_pickle_round_trip() -> None:
    t = NeedsTable()
    t.replace("c1", [need("c1", 1)], 1)
    u = pickle.loads(pickle.dumps(t))
    assert u.snapshot() == t.snapshot() and u.generation == t.generation
    assert u.cluster_generation("c1") == 1


@settings(deadline=None, max_examples=25)
@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(0, 3)), max_size=12), st.data())
def test_model(ops: list[tuple[str, int]], data: st.DataObject) -> None:
    """Against a dict model: the table always holds exactly the last roll-up of each cluster."""
    t = NeedsTable()
    model: dict[str, dict[str, Need]] = {}
    for now, (cluster, count) in enumerate(ops, start=1):
        needs = data.draw(st.lists(needs_for(cluster), max_size=count))
        before = t.generation
        changed = t.replace(cluster, needs, now)
        assert changed == (t.generation == before + 1)
        merged: dict[str, Need] = {}
        for n in needs:
            if n.fingerprint in merged:
                p = merged[n.fingerprint]
                merged[n.fingerprint] = Need(cluster, p.profile, p.aggregate_resources + n.aggregate_resources,
                                             p.min_unit.max(n.min_unit), 0)
            else:
                merged[n.fingerprint] = n
        if merged:
            model[cluster] = merged
        else:
            model.pop(cluster, None)
        assert sorted(t.clusters()) == sorted(model)
        for c, rows in model.items():
            held = {n.fingerprint: n for n in t.cluster(c)}
            assert set(held) == set(rows)
            for fp, n in rows.items():
                assert held[fp].aggregate_resources == n.aggregate_resources
                assert held[fp].min_unit == n.min_unit
        snap = t.snapshot()
        assert list(snap) == sorted(snap, key=snapshot_sort_key)
        assert len(snap) == sum(len(r) for r in model.values())
