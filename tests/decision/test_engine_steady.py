"""Steady state: a reused `Engine` over long sequences of small changes decides exactly like a fresh
`decide()` — in particular when the free pool changes under clusters whose cached results do not
depend on it (binds and releases elsewhere), and when it does (Same gangs folded thanks to it)."""

from __future__ import annotations

import random
from dataclasses import fields

import pytest

from bigfleet.decision import Configure, Create, Delete, Drain, Engine, EngineConfig, EngineState, decide
from bigfleet.decision.index import IDLE
from bigfleet.machine import CapacityType, Inventory, Machine
from bigfleet.needs import Need, NeedsTable, Operator, PenaltyBucket, Profile, Requirement, Resources
from bigfleet.shard.availability import supply_by_shape

from .fx import NOW, TYPE_KEY, ZONE_KEY, S, machine

CLUSTERS = tuple(f"c{i}" for i in range(6))
ZONES = ("za", "zb", "zc")
TYPES = ("small", "big")


def _res(units: int) -> Resources:
    return Resources.from_milli({"nvidia.com/gpu": 1000 * units})


def _machine(rnd: random.Random, i: int) -> Machine:
    itype = rnd.choice(TYPES)
    state = rnd.choice((S.SPECULATIVE, S.IDLE, S.CONFIGURED, S.CONFIGURED, S.CONFIGURED))
    cluster = rnd.choice(CLUSTERS) if state is S.CONFIGURED else ""
    return machine(f"m{i:03d}", state, cluster=cluster, zone=rnd.choice(ZONES), itype=itype,
                   res=_res(4 if itype == "big" else 2), ctype=CapacityType.ON_DEMAND,
                   price=2.0 if itype == "big" else 1.0, prio=rnd.choice((0, 100, 1000)) if cluster else 0,
                   rpd=rnd.choice((0.0, 8.0)) if cluster else 0.0, since=NOW - rnd.choice((0, 10**12)))


def _need(rnd: random.Random, cluster: str, k: int) -> Need:
    kind = rnd.choice(("plain", "plain", "same", "same-small", "any"))
    reqs = [Requirement(TYPE_KEY, Operator.IN, (rnd.choice(TYPES),))]
    group = ""
    if kind.startswith("same"):
        reqs.append(Requirement(ZONE_KEY, Operator.SAME, ()))
        group = f"g{k}"
    elif kind == "any":
        reqs = [Requirement(ZONE_KEY, Operator.IN, (rnd.choice(ZONES),))]
    units = 1 if kind == "same-small" else rnd.randint(1, 9)  # a small gang fits one machine: it may fold
    prof = Profile.build(reqs, (), rnd.choice((100, 1000, 5000)), PenaltyBucket.B64, PenaltyBucket.ZERO, group)
    return Need(cluster, prof, _res(units), _res(1), k + 1)


def _demand(rnd: random.Random, table: NeedsTable, cluster: str) -> None:
    ns = {n.key: n for n in (_need(rnd, cluster, k) for k in range(rnd.randint(0, 3)))}
    if ns:
        table.replace(cluster, list(ns.values()), NOW)
    else:
        table.remove(cluster)


def _same(got: object, want: object) -> None:
    assert got.actions == want.actions  # type: ignore[attr-defined]
    assert got.verdicts == want.verdicts  # type: ignore[attr-defined]
    assert got.shortfalls == want.shortfalls  # type: ignore[attr-defined]
    assert got.state == want.state  # type: ignore[attr-defined]
    skip = {"clusters_recomputed", "clusters_reused"}
    for f in fields(got.stats):  # type: ignore[attr-defined]
        if f.name not in skip:
            assert getattr(got.stats, f.name) == getattr(want.stats, f.name), f.name  # type: ignore[attr-defined]


def _small_change(rnd: random.Random, inv: Inventory, table: NeedsTable, now: int) -> None:
    """One thing happens somewhere in the fleet: a machine moves or a cluster's demand changes."""
    ms = list(inv)
    roll = rnd.random()
    if roll < 0.3:
        _demand(rnd, table, rnd.choice(CLUSTERS))
        return
    m = rnd.choice(ms)
    if m.state is S.CONFIGURED and roll < 0.6:
        inv.upsert(m.unassigned(S.IDLE, now))  # released by its cluster (free pool grows)
    elif m.state is S.IDLE and roll < 0.8:
        inv.upsert(m.replace(state=S.SPECULATIVE, host_provider="", host_ref="", state_since_unix_nanos=now))
    elif m.state in (S.IDLE, S.SPECULATIVE):
        # bound elsewhere, e.g. by another shard's decision landing here (free pool shrinks)
        inv.upsert(m.replace(state=S.CONFIGURED, cluster=rnd.choice(CLUSTERS), host_provider="fake", host_ref=m.id,
                             assigned_priority=100, state_since_unix_nanos=now))


def _apply_some(rnd: random.Random, inv: Inventory, actions: tuple[object, ...], now: int) -> None:
    for a in actions:
        if rnd.random() < 0.4:
            continue
        m = inv[a.machine_id]  # type: ignore[attr-defined]
        if isinstance(a, (Configure, Create)):
            inv.upsert(m.replace(state=S.CONFIGURED, cluster=a.cluster_id, host_provider="fake", host_ref=m.id,
                                 assigned_priority=a.priority, assigned_need_fingerprint=a.need_fingerprint,
                                 assigned_group=a.group, state_since_unix_nanos=now))
        elif isinstance(a, Drain):
            inv.upsert(m.unassigned(S.IDLE, now))
        elif isinstance(a, Delete):
            inv.upsert(m.replace(state=S.SPECULATIVE, host_provider="", host_ref="", state_since_unix_nanos=now))


REUSED: list[int] = []


@pytest.mark.parametrize("seed", range(40))
def test_reused_engine_equals_fresh_decide_over_small_changes(seed: int) -> None:
    rnd = random.Random(seed)
    inv = Inventory([_machine(rnd, i) for i in range(rnd.randint(20, 60))])
    table = NeedsTable()
    for c in CLUSTERS:
        _demand(rnd, table, c)
    cfg = EngineConfig(park_after_cycles=rnd.choice((3, 1000)), on_demand_hold_seconds=rnd.choice((0, 600)))
    state = EngineState(first_rollup=frozenset(CLUSTERS))
    eng = Engine()
    now = NOW
    reused = 0
    for _ in range(30):
        got = eng.decide(table, inv, now, state, cfg)
        want = decide(table, Inventory(list(inv)), now, state, cfg)
        _same(got, want)
        reused += got.stats.clusters_reused
        # the index-derived free supply equals the shard's walk over the fleet
        busy = frozenset(rnd.sample([m.id for m in inv], min(3, len(inv))))
        walk = {shape: (s.idle, s.spec) for shape, s in supply_by_shape(list(inv), busy).items()}
        assert eng.free_supply(busy) == walk
        state = got.state
        _apply_some(rnd, inv, got.actions, now)
        for _ in range(rnd.randint(1, 2)):
            _small_change(rnd, inv, table, now)
        now += 10**10
    REUSED.append(reused)


def test_the_sequences_above_exercise_the_cache() -> None:
    """Guards the equivalence test against passing vacuously: cached clusters were reused."""
    if len(REUSED) < 40:
        pytest.skip("runs after the parametrized sequences")
    assert sum(REUSED) > 500


def test_free_pool_changes_recompute_only_clusters_whose_folding_depends_on_them() -> None:
    """A cluster served by its own bound machines stays cached when the free pool changes; a Same
    gang whose fold decision rests on the free pool (no own class fits it whole) is recomputed."""
    small = [Requirement(TYPE_KEY, Operator.IN, ("small",))]
    ms = [machine(f"a{i}", S.CONFIGURED, cluster="a", res=_res(2), itype="small") for i in range(3)]
    ms += [machine(f"b{i}", S.CONFIGURED, cluster="b", res=_res(2), itype="small", zone="za") for i in range(2)]
    ms += [machine("x", S.CONFIGURED, cluster="zz", res=_res(4), itype="big", zone="zb", price=2.0)]
    inv = Inventory(ms)
    table = NeedsTable()
    table.replace("a", [Need("a", Profile.build(small, (), 100, PenaltyBucket.B64, PenaltyBucket.ZERO, ""),
                             _res(6), _res(1), 1)], NOW)
    gang = Profile.build([Requirement(ZONE_KEY, Operator.SAME, ())], (), 100, PenaltyBucket.B64,
                         PenaltyBucket.ZERO, "g")
    table.replace("b", [Need("b", gang, _res(3), _res(1), 1)], NOW)
    state = EngineState(first_rollup=frozenset({"a", "b"}))
    eng = Engine()
    cfg = EngineConfig()
    d1 = eng.decide(table, inv, NOW, state, cfg)
    _same(d1, decide(table, Inventory(list(inv)), NOW, state, cfg))
    assert d1.actions == () and d1.stats.needs_folded == 0  # b's gang sits on its two small machines
    d2 = eng.decide(table, inv, NOW, d1.state, cfg)
    assert d2.stats.clusters_reused == 2
    # a small machine is bound elsewhere and x is released: the free pool changes twice (free_ver)
    inv.add(machine("s-free", S.IDLE, res=_res(2), itype="small", zone="za"))  # an existing class
    d3 = eng.decide(table, inv, NOW, d2.state, cfg)
    _same(d3, decide(table, Inventory(list(inv)), NOW, d2.state, cfg))
    assert d3.stats.clusters_reused == 1  # a; b's fold test looked at the free pool, so it is recomputed
    inv.upsert(inv["s-free"].replace(state=S.CONFIGURED, cluster="zz", assigned_priority=5))
    d4 = eng.decide(table, inv, NOW, d3.state, cfg)
    _same(d4, decide(table, Inventory(list(inv)), NOW, d3.state, cfg))
    inv.upsert(inv["x"].unassigned(S.IDLE, NOW))
    d5 = eng.decide(table, inv, NOW, d4.state, cfg)
    _same(d5, decide(table, Inventory(list(inv)), NOW, d4.state, cfg))
    # now the big machine is free, the gang fits it whole: folded and moved there
    assert d5.stats.needs_folded == 1
    assert [(a.machine_id, a.cluster_id) for a in d5.actions if isinstance(a, Configure)] == [("x", "b")]
    assert d5.stats.clusters_reused == 1  # a, untouched throughout


def _one_at_a_time(cy, n, state, c):  # type: ignore[no-untyped-def]
    """The reference `_bulk_take` replaces: head, take, subtract, per machine."""
    from bigfleet.decision import vec

    key = (state, c.idx)
    while any(n.remaining):
        m = cy.head(key)
        if m is None:
            return
        cy.take(m, n, key)
        (n.acquired_idle if state == IDLE else n.acquired_spec).append(m)
        n.remaining = vec.vsub(n.remaining, cy.alloc[c.idx])


def _bulk_acquire_check(ms: list[Machine], ns: list[Need], ready: frozenset[str]) -> None:
    from unittest import mock

    from bigfleet.decision import acquire as acquire_mod

    from .test_engine_properties import _decide

    fast = _decide(ns, ms, ready)
    with mock.patch.object(acquire_mod, "_bulk_take", _one_at_a_time):
        slow = _decide(ns, ms, ready)
    assert fast == slow


def test_bulk_acquisition_equals_machine_by_machine() -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from .test_engine_properties import CLUSTERS as PCLUSTERS
    from .test_engine_properties import homogeneous_fleet, machines, needs

    cfg = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    cfg(given(machines(), needs(), st.frozensets(st.sampled_from(PCLUSTERS)))(_bulk_acquire_check))()
    cfg(given(homogeneous_fleet(), needs(), st.just(frozenset(PCLUSTERS)))(_bulk_acquire_check))()


def test_fast_built_actions_equal_constructed_ones() -> None:
    import pickle

    from bigfleet.decision import records

    m = machine("x1")
    reqs = (Requirement(TYPE_KEY, Operator.IN, ("t",)),)
    fields_ = {"machine_id": "", "cluster_id": "c", "need_fingerprint": "fp", "priority": 7,
               "interruption_penalty_dollars": 64.0, "reclamation_penalty_dollars": 0.0, "requirements": reqs,
               "group": "g"}
    out: list[object] = []
    records.build_each(Create, [m], {**fields_, "reason": "speculative", "kind": "create"}, out)
    records.build_each(Configure, [m], {**fields_, "reason": "idle", "kind": "configure"}, out)
    want = [Create("x1", "c", "fp", 7, 64.0, 0.0, reqs, "g", "speculative"),
            Configure("x1", "c", "fp", 7, 64.0, 0.0, reqs, "g", "idle")]
    assert out == want
    assert [hash(a) for a in out] == [hash(a) for a in want]
    assert [repr(a) for a in out] == [repr(a) for a in want]
    assert pickle.loads(pickle.dumps(out)) == want


def test_free_supply_skips_busy_and_cluster_stamped_pool_machines() -> None:
    """The shard's worker mirror may hold a pooled machine that still names a cluster (its view
    of an in-flight bind): neither that nor a busy machine is free supply."""
    ms = [machine(f"i{i}", S.IDLE) for i in range(4)] + [machine(f"s{i}", S.SPECULATIVE) for i in range(3)]
    ms.append(machine("i9", S.IDLE).replace(cluster="c0"))
    ms.append(machine("big", S.SPECULATIVE, itype="other", res=_res(9)))
    eng = Engine()
    for fleet in (ms, ms[:-1], ms):  # a plain list: the engine diffs it (no invariant check)
        eng.decide([], fleet, NOW, EngineState(), EngineConfig())
        busy = frozenset({"i0", "s2", "nope"})
        walk = {shape: (s.idle, s.spec) for shape, s in supply_by_shape(fleet, busy).items()}
        assert eng.free_supply(busy) == walk
    assert sorted(eng.free_supply().values()) == [(0, 1), (4, 3)]
    assert Engine().free_supply() == {}


def test_bulk_acquisition_skips_machines_claimed_by_reservations() -> None:
    """Idle machines still reserved for another need (claimed in the credit pass) sit inside the
    pool list a later acquisition sweeps: they are skipped, exactly as one-at-a-time picking does."""
    from unittest import mock

    from bigfleet.decision import acquire as acquire_mod

    from .fx import need, profile

    a = need("a", 2)
    b = need("b", 3, profile(500))
    fp_a = a.profile.fingerprint()
    ms = [machine(f"i{i}", S.IDLE, fp=fp_a if i in (1, 2) else "") for i in range(6)]
    state = EngineState(first_rollup=frozenset({"a", "b"}))
    fast = decide([a, b], Inventory(ms), NOW, state, EngineConfig())
    with mock.patch.object(acquire_mod, "_bulk_take", _one_at_a_time):
        slow = decide([a, b], Inventory(ms), NOW, state, EngineConfig())
    assert fast == slow
    assert [(x.machine_id, x.cluster_id) for x in fast.actions] == [
        ("i1", "a"), ("i2", "a"), ("i0", "b"), ("i3", "b"), ("i4", "b")]


# -- persistent unmet demand: clusters whose short needs cannot get anything are reused too ----------

UNMET_REUSED: list[int] = []


def _scarce_machine(rnd: random.Random, i: int) -> Machine:
    """Mostly bound machines, stamped at or above the demand's priorities (so often no victims)."""
    m = _machine(rnd, i)
    if m.state is S.CONFIGURED or rnd.random() < 0.7:
        itype = m.instance_type
        return machine(m.id, S.CONFIGURED, cluster=rnd.choice(CLUSTERS), zone=m.zone, itype=itype,
                       res=_res(4 if itype == "big" else 2), ctype=CapacityType.ON_DEMAND, price=m.price_per_hour,
                       prio=rnd.choice((100, 1000, 5000, 5000)), rpd=rnd.choice((0.0, 8.0)))
    return m


@pytest.mark.parametrize("seed", range(30))
def test_reused_engine_equals_fresh_decide_under_persistent_unmet_demand(seed: int) -> None:
    """Demand far above supply: most clusters stay short every cycle. Their cached results (an
    `UnmetWatch`) must give exactly what a fresh `decide()` gives as machines move and demand changes."""
    rnd = random.Random(1000 + seed)
    inv = Inventory([_scarce_machine(rnd, i) for i in range(rnd.randint(20, 50))])
    table = NeedsTable()
    for c in CLUSTERS:
        _demand(rnd, table, c)
    cfg = EngineConfig(preempt_after_cycles=rnd.choice((1, 3)), shortfall_report_cap=rnd.choice((2, 100)))
    state = EngineState(first_rollup=frozenset(CLUSTERS))
    eng = Engine()
    now = NOW
    reused = 0
    for _ in range(30):
        got = eng.decide(table, inv, now, state, cfg)
        want = decide(table, Inventory(list(inv)), now, state, cfg)
        _same(got, want)
        reused += eng.last_unmet_reused
        state = got.state
        _apply_some(rnd, inv, got.actions, now)
        if rnd.random() < 0.5:
            _small_change(rnd, inv, table, now)
        now += 10**10
    UNMET_REUSED.append(reused)


def test_the_unmet_sequences_above_exercise_the_unmet_cache() -> None:
    if len(UNMET_REUSED) < 30:
        pytest.skip("runs after the parametrized sequences")
    assert sum(1 for r in UNMET_REUSED if r) >= 10, UNMET_REUSED
