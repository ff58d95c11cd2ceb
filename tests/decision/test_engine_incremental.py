"""The long-lived `Engine`: index maintenance from inventory diffs and per-cluster caches."""

from __future__ import annotations

from bigfleet.decision import Drain, Engine, EngineConfig, EngineState, decide
from bigfleet.machine import Inventory
from bigfleet.needs import NeedsTable

from .fx import NOW, S, machine, need, profile


def _check(eng: Engine, table: NeedsTable, inv: Inventory, state: EngineState, cfg: EngineConfig):  # type: ignore[no-untyped-def]
    got = eng.decide(table, inv, NOW, state, cfg)
    want = decide(table, Inventory(list(inv)), NOW, state, cfg)
    assert got.actions == want.actions
    assert got.verdicts == want.verdicts
    assert got.state == want.state
    return got


def test_cached_cluster_follows_inventory_and_demand_changes() -> None:
    cfg = EngineConfig(reclaim_cap_fraction=0)
    inv = Inventory([machine(f"a{i}", S.CONFIGURED, cluster="a") for i in range(4)]
                    + [machine(f"b{i}", S.CONFIGURED, cluster="b") for i in range(2)]
                    + [machine("i0"), machine("i1")])
    table = NeedsTable()
    table.replace("a", [need("a", 3)], NOW)
    table.replace("b", [need("b", 2)], NOW)
    state = EngineState(first_rollup=frozenset({"a", "b"}))
    eng = Engine()
    d1 = _check(eng, table, inv, state, cfg)
    assert [a.machine_id for a in d1.actions if isinstance(a, Drain)] == ["a3"]
    assert d1.stats.clusters_recomputed == 2
    d2 = _check(eng, table, inv, d1.state, cfg)
    assert d2.stats.clusters_reused == 2 and d2.actions == d1.actions
    # the drain starts: a3 was held by no need, so cluster a's credit stands (only its drains are redone)
    inv.transition("a3", S.DRAINING, NOW)
    d3 = _check(eng, table, inv, d2.state, cfg)
    assert d3.actions == ()
    assert d3.stats.clusters_reused == 2
    # a machine of cluster b fails: b is short and acquires an idle machine
    inv.transition("b1", S.DRAINING, NOW)
    d4 = _check(eng, table, inv, d3.state, cfg)
    assert [(a.machine_id, a.cluster_id) for a in d4.actions] == [("i0", "b")]
    # demand of a grows by one: recomputed, acquires
    table.replace("a", [need("a", 4)], NOW)
    d5 = _check(eng, table, inv, d4.state, cfg)
    assert {a.machine_id for a in d5.actions} == {"i0", "i1"}
    # a cluster disappears from the table: its machines become excess
    table.remove("b")
    d6 = _check(eng, table, inv, d5.state, cfg)
    assert ("b0", "reclaim") in {(a.machine_id, getattr(a, "reason", "")) for a in d6.actions}


def test_new_machine_shape_and_removed_machines() -> None:
    cfg = EngineConfig()
    inv = Inventory([machine("c0", S.CONFIGURED, cluster="a")])
    table = NeedsTable()
    table.replace("a", [need("a", 2, profile(reqs=[]))], NOW)
    state = EngineState(first_rollup=frozenset({"a"}))
    eng = Engine()
    d = _check(eng, table, inv, state, cfg)
    assert d.actions == ()
    inv.add(machine("new", itype="other-type", zone="zz"))
    d = _check(eng, table, inv, d.state, cfg)
    assert [a.machine_id for a in d.actions] == ["new"]
    inv.remove("new")
    d = _check(eng, table, inv, d.state, cfg)
    assert d.actions == ()


def test_replaced_state_invalidates_cached_gangs() -> None:
    from .fx import same_zone

    cfg = EngineConfig()
    inv = Inventory([machine(f"a{i}", S.CONFIGURED, cluster="c", zone="a") for i in range(2)]
                    + [machine(f"b{i}", S.CONFIGURED, cluster="c", zone="b") for i in range(2)])
    table = NeedsTable()
    table.replace("c", [need("c", 2, same_zone())], NOW)
    eng = Engine()
    st = EngineState(first_rollup=frozenset({"c"}))
    d1 = _check(eng, table, inv, st, cfg)
    d2 = _check(eng, table, inv, d1.state, cfg)
    assert d2.stats.clusters_reused == 1
    # a failover hands over a state whose sticky domain differs: no stale reuse
    key = next(iter(d1.state.same_domains))
    other = "b" if d1.state.same_domains[key] == "a" else "a"
    st3 = EngineState.from_dict({**d2.state.to_dict(), "same_domains": {key: other}})
    d3 = _check(eng, table, inv, st3, cfg)
    assert d3.stats.clusters_reused == 0


def test_steady_cycles_sync_the_inventory_by_its_tail_not_a_full_diff() -> None:
    """A full inventory diff is O(fleet) (~0.5-1 s at 500 000 machines): cycles whose machines only
    changed state must sync by the changed tail, with the full diff a rare safety net."""
    cfg = EngineConfig(reclaim_cap_fraction=0)
    inv = Inventory([machine(f"a{i}", S.CONFIGURED, cluster="a") for i in range(40)] + [machine(f"i{i}") for i in range(40)])
    table = NeedsTable()
    table.replace("a", [need("a", 40)], NOW)
    state = EngineState(first_rollup=frozenset({"a"}))
    eng = Engine()
    full_diffs = 0
    real_rebuild = eng._rebuild

    def counting_rebuild(*a, **k):  # type: ignore[no-untyped-def]
        nonlocal full_diffs
        full_diffs += 1
        return real_rebuild(*a, **k)

    eng._rebuild = counting_rebuild  # type: ignore[method-assign]
    d = _check(eng, table, inv, state, cfg)
    for cycle in range(80):  # a machine changes every cycle: drained, then back to the idle pool
        if cycle < 40:
            inv.transition(f"a{cycle}", S.DRAINING, NOW)
        else:
            inv.transition(f"a{cycle - 40}", S.IDLE, NOW, cluster="")
        d = _check(eng, table, inv, d.state, cfg)
    assert eng._since_full == 80  # (no full diff since the first sync)
    assert full_diffs == 1  # the first cycle builds the index; none since


def test_syncs_read_the_inventorys_journal_and_fall_back_when_it_cannot_tell() -> None:
    """Random writes between cycles: every cycle decides as a fresh `decide()`. The index follows the
    inventory's write journal when it is whole; a machine written twice falls back to the changed
    tail, a removal to the full diff."""
    import random

    rnd = random.Random(11)
    cfg = EngineConfig(reclaim_cap_fraction=0.2)
    inv = Inventory([machine(f"a{i:02d}", S.CONFIGURED, cluster="a") for i in range(30)]
                    + [machine(f"i{i:02d}") for i in range(30)])
    table = NeedsTable()
    table.replace("a", [need("a", 20)], NOW)
    state = EngineState(first_rollup=frozenset({"a"}))
    eng = Engine()
    d = _check(eng, table, inv, state, cfg)
    kinds: list[str] = []
    for cycle in range(60):
        for a in d.actions:
            if isinstance(a, Drain):
                inv.transition(a.machine_id, S.DRAINING, NOW)
        draining = [m for m in inv if m.state is S.DRAINING]
        if draining and rnd.random() < 0.5:
            inv.transition(rnd.choice(draining).id, S.IDLE, NOW, cluster="")
        for m in [m for m in inv if m.state is S.CONFIGURING]:
            inv.transition(m.id, S.CONFIGURED, NOW)
        idle = [m for m in inv if m.state is S.IDLE]
        if idle and rnd.random() < 0.4:
            m = rnd.choice(idle)
            inv.transition(m.id, S.CONFIGURING, NOW, cluster="a", host_provider="fake", host_ref=m.id)
            if rnd.random() < 0.3:  # written twice since the last sync
                inv.update(m.id, assigned_priority=rnd.randint(1, 9))
        if cycle % 13 == 12 and idle:
            inv.remove(idle[0].id)
        if cycle % 17 == 16:
            inv.add(machine(f"n{cycle:02d}"))
        d = _check(eng, table, inv, d.state, cfg)
        kinds.append(eng.last_sync)
        fresh = Engine()
        fresh.decide(table, Inventory(list(inv)), NOW, d.state, cfg)
        busy = {m.id for m in inv if rnd.random() < 0.2}
        hints = eng.free_supply(busy)
        assert hints == fresh.free_supply(busy)
        idle_now = [m for m in inv if m.state is S.IDLE]
        if idle_now:  # the inventory moves on: the hints stay those of the last decide
            inv.update(idle_now[-1].id, labels={"moved": str(cycle)})
            assert eng.free_supply(busy) == hints
    assert {"journal", "tail", "diff"} <= set(kinds), kinds
    assert kinds.count("journal") > kinds.count("tail") + kinds.count("diff"), kinds


def test_a_write_that_skipped_the_journal_is_caught_by_the_generation() -> None:
    """The journal must hold one entry per generation step; a subclass writing past it (as a mirror
    that skips the checks might) makes the engine look the changes up instead of trusting it."""

    class RawWrites(Inventory):
        __slots__ = ()

        def raw_put(self, m):  # type: ignore[no-untyped-def]
            old = self._machines.get(m.id)
            if old is not None:
                self._unindex(old)
            self._index(m)
            self._generation += 1

    cfg = EngineConfig(reclaim_cap_fraction=1.0)
    inv = RawWrites([machine(f"a{i}", S.CONFIGURED, cluster="a") for i in range(6)])
    table = NeedsTable()
    table.replace("a", [need("a", 6)], NOW)
    state = EngineState(first_rollup=frozenset({"a"}))
    eng = Engine()
    d = _check(eng, table, inv, state, cfg)
    assert eng.last_sync == "rebuild"
    inv.transition("a0", S.DRAINING, NOW)
    d = _check(eng, table, inv, d.state, cfg)
    assert eng.last_sync == "tail"  # (the journal starts at the first sync after the rebuild)
    inv.transition("a0", S.IDLE, NOW, cluster="")
    d = _check(eng, table, inv, d.state, cfg)
    assert eng.last_sync == "journal"
    table.replace("a", [need("a", 3)], NOW)
    inv.raw_put(inv["a1"].replace(state=S.DRAINING))
    d = _check(eng, table, inv, d.state, cfg)
    assert eng.last_sync == "tail"


def test_a_one_shot_engine_starts_no_journal() -> None:
    """`decide()`, a what-if or a consolidation plan syncs once: the inventory must not journal (and
    keep replaced records alive) for a consumer that never comes back."""
    inv = Inventory([machine(f"a{i}", S.CONFIGURED, cluster="a") for i in range(3)])
    table = NeedsTable()
    table.replace("a", [need("a", 3)], NOW)
    g0 = inv.generation
    decide(table, inv, NOW, EngineState(first_rollup=frozenset({"a"})), EngineConfig())
    inv.transition("a0", S.DRAINING, NOW)
    assert inv.replaced_since(g0) is None
