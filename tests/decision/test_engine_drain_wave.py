"""Reclaim waves through a long-lived `Engine`: the per-list index update equals a cold build, a cached
cluster that only lost unheld machines decides as a fresh `decide()`, and the bucketed reclaim order
equals the plain sort by (reclamation asc, price desc, id desc)."""

from __future__ import annotations

import math
import random
from types import SimpleNamespace

import pytest

from bigfleet.decision import Configure, Create, Drain, Engine, EngineConfig, EngineState, decide
from bigfleet.decision.index import CONFIGURED, Index, build_index, m_reclamation
from bigfleet.decision.reclaim import excess_drains, held_prefixes
from bigfleet.decision.scratch import CycleScratch
from bigfleet.machine import Inventory, Machine
from bigfleet.needs import NeedsTable, Operator, Profile, Requirement

from .fx import NOW, TYPE_KEY, S, cpu, machine

CLUSTERS = ("a", "b", "c")
TYPES = (("t1", 1.0), ("t2", 2.0), ("t3", 2.0))
STAMPS = (0.0, 0.0, 1.0, 3.0, 7.0, math.nan, -2.0)


def _view(ix: Index) -> dict[str, object]:
    """The index by class shape and machine id (incremental class numbering differs from a cold
    build's; an emptied list may linger where a cold build has none)."""
    sh = [c.shape for c in ix.classes]

    def ids(lst: list[Machine]) -> list[str]:
        return [m.id for m in lst]

    return {
        "pool": {(st, sh[ci]): ids(v) for (st, ci), v in ix.pool.items() if v},
        "bound": {(c, st, sh[ci]): ids(v) for c, sb in ix.bound.items() for st, by in sb.items()
                  for ci, v in by.items() if v},
        "configured_by_class": {sh[ci]: ids(v) for ci, v in ix.configured_by_class.items() if v},
        "draining_by_class": {sh[ci]: ids(v) for ci, v in ix.draining_by_class.items() if v},
        "idle_by_type": {k: ids(v) for k, v in ix.idle_by_type.items() if v},
        "creating": {k: ids(v) for k, v in ix.creating.items() if v},
        "reserved_idle": {k: ids(v) for k, v in ix.reserved_idle.items() if v},
        "configured_count": ix.configured_count,
        "free_count": {sh[ci]: n for ci, n in ix.free_count.items() if n},
        "total": ix.total,
    }


def _machine(rnd: random.Random, i: int) -> Machine:
    itype, price = rnd.choice(TYPES)
    st = rnd.choice((S.CONFIGURED, S.CONFIGURED, S.CONFIGURED, S.CONFIGURING, S.IDLE, S.DRAINING))
    cluster = rnd.choice(CLUSTERS) if st in (S.CONFIGURED, S.CONFIGURING, S.DRAINING) else ""
    return machine(f"m{i:03d}", st, cluster=cluster, itype=itype, price=price, res=cpu(4),
                   zone=rnd.choice(("z1", "z2")), prio=100, rpd=rnd.choice(STAMPS))


def _demand(rnd: random.Random, table: NeedsTable) -> None:
    from bigfleet.needs import Need, PenaltyBucket

    for c in CLUSTERS:
        ns = []
        for j, (itype, _) in enumerate(TYPES):
            if rnd.random() < 0.7:
                p = Profile.build([Requirement(TYPE_KEY, Operator.IN, (itype,))], (), 100, PenaltyBucket.B64,
                                  PenaltyBucket.ZERO, f"g{j}")
                ns.append(Need(c, p, cpu(4 * rnd.randint(1, 8)), cpu(4), 1 + j))
        table.replace(c, ns, NOW)


def _land(rnd: random.Random, inv: Inventory, actions: tuple[object, ...]) -> None:
    """Most drains start (the wave), some binds land; sometimes a held machine fails or is re-stamped."""
    for a in actions:
        if isinstance(a, Drain) and rnd.random() < 0.9:
            inv.transition(a.machine_id, S.DRAINING, NOW)
        elif isinstance(a, (Configure, Create)) and rnd.random() < 0.5:
            m = inv[a.machine_id]
            inv.upsert(m.replace(state=S.CONFIGURED, cluster=a.cluster_id, host_provider="fake", host_ref=m.id,
                                 assigned_priority=a.priority, assigned_need_fingerprint=a.need_fingerprint))
    bound = [m for m in inv if m.state is S.CONFIGURED]
    r = rnd.random()
    if bound and r < 0.2:
        inv.transition(rnd.choice(bound).id, S.DRAINING, NOW)
    elif bound and r < 0.3:
        m = rnd.choice(bound)
        inv.upsert(m.replace(assigned_reclamation_penalty_dollars=rnd.choice(STAMPS)))
    idle = [m for m in inv if m.state is S.IDLE]
    if idle and rnd.random() < 0.3:  # bound outside the engine, stamped to be kept first
        m = rnd.choice(idle)
        inv.upsert(m.replace(state=S.CONFIGURED, cluster=rnd.choice(CLUSTERS), host_provider="fake", host_ref=m.id,
                             assigned_priority=100, assigned_reclamation_penalty_dollars=9.0))
    draining = [m for m in inv if m.state is S.DRAINING]
    if draining and rnd.random() < 0.3:
        inv.upsert(rnd.choice(draining).unassigned(S.IDLE, NOW))


REUSED_AFTER_DRAINS: list[int] = []


@pytest.mark.parametrize("seed", range(40))
def test_drain_waves_through_a_reused_engine_equal_fresh_decide(seed: int) -> None:
    rnd = random.Random(7000 + seed)
    inv = Inventory([_machine(rnd, i) for i in range(rnd.randint(30, 90))])
    table = NeedsTable()
    _demand(rnd, table)
    cfg = EngineConfig(reclaim_cap_fraction=rnd.choice((0.1, 0.3, 1.0)))
    state = EngineState(first_rollup=frozenset(CLUSTERS))
    eng = Engine()
    reused = 0
    for cycle in range(12):
        got = eng.decide(table, inv, NOW, state, cfg)
        want = decide(table, Inventory(list(inv)), NOW, state, cfg)
        assert got.actions == want.actions
        assert got.verdicts == want.verdicts
        assert got.shortfalls == want.shortfalls
        assert got.state == want.state
        assert eng._ix is not None
        assert _view(eng._ix) == _view(build_index(list(inv)))
        if cycle:
            reused += got.stats.clusters_reused
        state = got.state
        _land(rnd, inv, got.actions)
        if rnd.random() < 0.15:
            _demand(rnd, table)
    REUSED_AFTER_DRAINS.append(reused)


def test_the_drain_sequences_above_reuse_clusters() -> None:
    if len(REUSED_AFTER_DRAINS) < 40:
        pytest.skip("runs after the parametrized sequences")
    assert sum(1 for r in REUSED_AFTER_DRAINS if r) >= 20, REUSED_AFTER_DRAINS


@pytest.mark.parametrize("seed", range(40))
def test_reclaim_order_equals_the_plain_sort(seed: int) -> None:
    rnd = random.Random(9000 + seed)
    ms = [machine(f"m{i:03d}", S.CONFIGURED, cluster="a", itype=rnd.choice(TYPES)[0], price=rnd.choice((1.0, 2.0)),
                  zone=rnd.choice(("z1", "z2", "z3")), res=cpu(4), rpd=rnd.choice(STAMPS))
          for i in range(rnd.randint(1, 80))]
    ix = build_index(ms)
    cy = CycleScratch(ix, ("cpu",), {})
    held = {m.id: None for m in ms if rnd.random() < 0.3}
    cy.held_in("a").ids().update(held)  # type: ignore[arg-type]
    cy.hconf["a"] = len(held)
    exclude = {m.id for m in ms if rnd.random() < 0.1}
    limit = rnd.randint(1, 90)
    got, total = excess_drains(cy, "a", 30, limit, exclude)
    left = [m for m in ms if m.id not in held and m.id not in exclude]
    left.sort(key=lambda m: (-m_reclamation(m), m.shape.price_per_hour, m.id), reverse=True)
    assert [d.machine_id for d in got] == [m.id for m in left[:limit]]
    assert total == len(left)
    assert all(d.cluster_id == "a" and d.grace_period_seconds == 30 and d.reason == "reclaim" for d in got)
    assert got == [Drain(m.id, "a", 30, 0, "reclaim") for m in left[:limit]]


@pytest.mark.parametrize("seed", range(40))
def test_reclaim_order_with_held_prefixes_equals_the_plain_sort(seed: int) -> None:
    """Held machines leading each class list (as crediting holds them): the walk skips them unread
    when proven; one unheld machine among them (`broken`) must fail the proof, not be skipped."""
    rnd = random.Random(7000 + seed)
    ms = [machine(f"m{i:03d}", S.CONFIGURED, cluster="a", itype=rnd.choice(TYPES)[0], price=rnd.choice((1.0, 2.0)),
                  zone=rnd.choice(("z1", "z2")), res=cpu(4), rpd=rnd.choice(STAMPS))
          for i in range(rnd.randint(2, 80))]
    ix = build_index(ms)
    by_class = ix.bound["a"][CONFIGURED]
    held: dict[str, object] = {}
    for lst in by_class.values():
        held.update((m.id, None) for m in lst[:rnd.randint(0, len(lst))])
    broken = seed % 3 == 0 and 0 < len(held) < len(ms)
    if broken:  # swap one held machine for an unheld one: same count, no longer prefixes
        held.pop(rnd.choice(sorted(held)))
        held[rnd.choice(sorted(m.id for m in ms if m.id not in held))] = None
    unheld = len(ms) - len(held)
    starts = held_prefixes(by_class, held, unheld)
    prefixes = all(not any(m.id in held for m in lst[i + 1:]) for lst in by_class.values()
                   for i, m in enumerate(lst) if m.id not in held)
    assert (starts is not None) == prefixes
    if starts is not None:
        assert sum(starts.values()) == len(held)
    cy = CycleScratch(ix, ("cpu",), {})
    cy.held_in("a").ids().update(held)  # type: ignore[arg-type]
    cy.hconf["a"] = len(held)
    limit = rnd.choice((1, 2, rnd.randint(1, 90)))
    memo = SimpleNamespace(drains=None, walk=None)  # (a cached cluster's: its walk may be resumed)
    got, total = excess_drains(cy, "a", 30, limit, set(), memo)  # type: ignore[arg-type]
    left = [m for m in ms if m.id not in held]
    left.sort(key=lambda m: (-m_reclamation(m), m.shape.price_per_hour, m.id), reverse=True)
    assert [d.machine_id for d in got] == [m.id for m in left[:limit]]
    assert total == len(left)
    tried = len(left) <= 16 * limit  # (the proof's read budget)
    assert memo.walk.starts == (starts if tried else None)


def test_held_prefixes_are_proven_not_guessed() -> None:
    """Two non-prefix classes whose binary-searched boundaries err in opposite directions by one
    each: the counts agree, only the check of every machine past a boundary catches it."""
    a = [machine(f"a{i}", S.CONFIGURED, cluster="c", res=cpu(4), rpd=float(9 - i)) for i in range(2)]
    b = [machine(f"b{i}", S.CONFIGURED, cluster="c", res=cpu(8), rpd=float(9 - i)) for i in range(4)]
    held = {"a1": None, "b0": None, "b2": None}  # a: [U, H]; b: [H, U, H, U]
    by_class = {0: a, 1: b}
    assert held_prefixes(by_class, held, 3) is None
    assert held_prefixes(by_class, {"a0": None, "b0": None, "b1": None}, 3) == {0: 1, 1: 2}
    assert held_prefixes(by_class, {}, 6) == {}
    assert held_prefixes(by_class, {"b0": None}, 4) is None  # (the cluster's unheld count disagrees)


@pytest.mark.parametrize("seed", range(20))
def test_reclaim_walk_resumes_only_while_valid(seed: int) -> None:
    """Stable clusters draining a few machines a cycle, the reclaim walk resumed from the last cycle;
    sometimes a machine the walk never reached leaves (the walk must start over) or a held one does."""
    rnd = random.Random(5000 + seed)
    ms = [machine(f"m{i:04d}", S.CONFIGURED, cluster=rnd.choice(CLUSTERS[:2]), itype=rnd.choice(TYPES)[0],
                  price=rnd.choice((1.0, 2.0)), res=cpu(4), zone=rnd.choice(("z1", "z2", "z3")), prio=100,
                  rpd=rnd.choice(STAMPS)) for i in range(rnd.randint(150, 300))]
    inv = Inventory(ms)
    table = NeedsTable()
    _demand(rnd, table)
    cfg = EngineConfig(reclaim_cap_fraction=rnd.choice((0.02, 0.05)))
    state = EngineState(first_rollup=frozenset(CLUSTERS))
    eng = Engine()
    for _ in range(10):
        got = eng.decide(table, inv, NOW, state, cfg)
        want = decide(table, Inventory(list(inv)), NOW, state, cfg)
        assert got.actions == want.actions
        assert got.state == want.state
        _check_walks(eng)
        state = got.state
        for a in got.actions:
            if isinstance(a, Drain) and rnd.random() < 0.9:
                inv.transition(a.machine_id, S.DRAINING, NOW)
        if rnd.random() < 0.4:
            inv.transition(rnd.choice([m for m in inv if m.state is S.CONFIGURED]).id, S.DRAINING, NOW)


def _check_walks(eng: Engine) -> None:
    """Every kept reclaim walk is a prefix of its cluster's reclaim order as of now."""
    ix = eng._ix
    assert ix is not None
    for c, cc in eng._cache.items():
        walk = cc.walk
        if walk is None or walk.ver != ix.cluster_ver.get(c, 0):
            continue
        left = [m for lst in ix.bound.get(c, {}).get(CONFIGURED, {}).values() for m in lst if m.id not in cc.held.ids()]
        left.sort(key=lambda m: (-m_reclamation(m), m.shape.price_per_hour, m.id), reverse=True)
        assert walk.ids == [m.id for m in left[: len(walk.ids)]]


def test_reclaim_walk_starts_over_when_an_unexplored_machine_left() -> None:
    from bigfleet.decision.index import apply_changes
    from bigfleet.decision.reclaim import ReclaimWalk, _resumed

    ms = [machine(f"m{i:02d}", S.CONFIGURED, cluster="a", res=cpu(4), rpd=float(i % 3)) for i in range(12)]
    ix = build_index(ms)
    by_class = ix.bound["a"][CONFIGURED]
    cy = CycleScratch(ix, ("cpu",), {})
    walk = ReclaimWalk(cy, by_class, {}, False, 12, ix.cluster_ver.get("a", 0))
    first = walk.first(by_class, set(), 2)
    assert first == ["m09", "m06"] and walk.ids == ["m09", "m06", "m03", "m00"]  # (the whole rpd-0 bucket)
    by_id = {m.id: m for m in ms}
    # the two drained machines start draining: the walk resumes without them
    apply_changes(ix, [by_id["m09"], by_id["m06"]], [by_id["m09"].replace(state=S.DRAINING),
                                                    by_id["m06"].replace(state=S.DRAINING)])
    cy = CycleScratch(ix, ("cpu",), {})
    again = _resumed(cy, "a", walk, by_class, {}, False, 10)
    assert again is walk and walk.ids == ["m03", "m00"]
    assert walk.first(by_class, set(), 3) == ["m03", "m00", "m10"]
    # a machine the walk never reached leaves: positions moved, so it starts over
    apply_changes(ix, [by_id["m02"]], [by_id["m02"].replace(state=S.DRAINING)])
    cy = CycleScratch(ix, ("cpu",), {})
    fresh = _resumed(cy, "a", walk, by_class, {}, False, 9)
    assert fresh is not walk
    assert fresh.first(by_class, set(), 4) == ["m03", "m00", "m10", "m07"]
