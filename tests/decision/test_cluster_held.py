"""`ClusterHeld`: bulk credits are filed into the id map only when someone reads it, and what is read
is exactly what a machine-by-machine credit would have held."""

from __future__ import annotations

from bigfleet.decision import Drain, Engine, EngineConfig, EngineState, decide
from bigfleet.decision.scratch import ClusterHeld, NeedRow
from bigfleet.machine import Inventory
from bigfleet.needs import NeedsTable

from .fx import NOW, S, machine, need


def test_runs_are_filed_on_the_first_read_and_writes_merge() -> None:
    ms = [machine(f"m{i}", S.CONFIGURED, cluster="a") for i in range(5)]
    rows = [object.__new__(NeedRow) for _ in range(2)]
    h = ClusterHeld()
    h.add_run(rows[0], ms[:2])
    h.add_run(rows[1], ms[2:3])
    assert h.pending == 2
    got = h.ids()
    assert got == {"m0": rows[0], "m1": rows[0], "m2": rows[1]}
    assert h.pending == 0
    got["m3"] = rows[1]  # a machine-by-machine credit writes to the map itself
    h.add_run(rows[0], ms[4:])
    assert h.ids() == {"m0": rows[0], "m1": rows[0], "m2": rows[1], "m3": rows[1], "m4": rows[0]}
    assert h.ids() is got


def _fleet() -> tuple[NeedsTable, Inventory]:
    """Clusters a and b exactly met by their Configured machines; c holds two more than it needs."""
    ms = []
    table = NeedsTable()
    for c, have, want in (("a", 6, 6), ("b", 4, 4), ("c", 5, 3)):
        ms += [machine(f"{c}{i}", S.CONFIGURED, cluster=c, prio=1_000_000) for i in range(have)]
        table.replace(c, [need(c, want)], 1)
    return table, Inventory(ms)


def test_met_clusters_never_file_their_held_map() -> None:
    """A cold cycle builds no per-machine map for a cluster nothing reads (every machine held, nothing
    to reclaim or preempt); one with excess files it to find its unheld machines."""
    table, inv = _fleet()
    eng = Engine()
    got = eng.decide(table, inv, NOW, EngineState(first_rollup=frozenset("abc")), EngineConfig(reclaim_cap_fraction=1.0))
    drained = sorted(a.machine_id for a in got.actions if isinstance(a, Drain))
    assert len(drained) == 2 and all(m.startswith("c") for m in drained)
    cache = eng._cache
    assert set(cache) == {"a", "b", "c"}
    assert cache["a"].held.pending == 1 and cache["b"].held.pending == 1
    assert cache["c"].held.pending == 0
    for c, want in (("a", 6), ("b", 4), ("c", 3)):
        ids = cache[c].held.ids()
        (row,) = cache[c].rows
        assert len(ids) == want
        assert set(ids.values()) == {row}
        assert set(ids) == {m.id for m in row.claimed}
    assert not set(drained) & set(cache["c"].held.ids())


def test_cached_clusters_read_their_map_when_machines_leave() -> None:
    """A met cluster losing a held machine is decided again (and asks for a replacement); one losing
    only a machine nobody held stays cached (its map filed to tell). Both as a fresh `decide`."""
    table, inv = _fleet()
    cfg = EngineConfig(reclaim_cap_fraction=1.0)
    eng = Engine()
    st = eng.decide(table, inv, NOW, EngineState(first_rollup=frozenset("abc")), cfg).state
    excess = sorted(set(m.id for m in inv if m.cluster == "c") - set(eng._cache["c"].held.ids()))
    inv.transition("a0", S.DRAINING, NOW)
    inv.transition(excess[0], S.DRAINING, NOW)
    got = eng.decide(table, inv, NOW, st, cfg)
    want = decide(table, Inventory(list(inv)), NOW, st, cfg)
    assert got.actions == want.actions and got.verdicts == want.verdicts
    (va,) = [v for v in got.verdicts if v.cluster_id == "a"]
    assert not va.satisfied and va.claimed_configured == 5
    assert got.stats.clusters_reused == 2  # b untouched, c kept after losing an unheld machine
    assert eng._cache["b"].held.pending == 1 and eng._cache["c"].held.pending == 0
    assert [a.machine_id for a in got.actions if isinstance(a, Drain)] == excess[1:]
