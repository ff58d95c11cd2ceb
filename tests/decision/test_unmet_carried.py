"""Persistent unmet demand, carried between cycles: the reused short clusters' shortfall groups
(`CarriedShort`), their verdicts re-issued with new ages, and the unmet ages taken from the map the
engine emitted last cycle. Each must equal a cold recomputation, whether the state comes back as
emitted, through JSON (a restart), or edited by the caller."""

from __future__ import annotations

import json
import random
from collections import Counter
from dataclasses import replace

import pytest

from bigfleet.decision import Engine, EngineConfig, EngineState, decide
from bigfleet.decision.cycle import ClusterCache
from bigfleet.decision.ledgers import CarriedShort, ShortPart, _key_sorted
from bigfleet.decision.scratch import NeedRow, RowMaker
from bigfleet.machine import Inventory
from bigfleet.needs import Need, NeedsTable, Operator, PenaltyBucket, Profile, Requirement, Resources

from .fx import NOW, TYPE_KEY, ZONE_KEY, S, machine
from .test_engine_steady import CLUSTERS, _apply_some, _demand, _res, _same, _scarce_machine, _small_change

EXERCISED = {"emitted": 0, "looked_up": 0}


def _next_state(rnd: random.Random, got: EngineState) -> tuple[EngineState, bool]:
    """What the caller hands back: mostly the emitted state, else a restored or edited one."""
    roll = rnd.random()
    if roll < 0.6:
        return got, True
    if roll < 0.8:
        return EngineState.from_dict(json.loads(json.dumps(got.to_dict()))), False
    ages = dict(got.unmet_ages)
    for k in rnd.sample(sorted(ages), min(2, len(ages))):
        ages[k] = rnd.choice((0, 1, 7))
    if ages and rnd.random() < 0.5:
        del ages[rnd.choice(sorted(ages))]
    return EngineState(got.cycle, got.shortfall_ages, ages, got.parking, got.same_domains, got.first_rollup), False


def _check_carried(eng: Engine) -> None:
    """The carried groups equal the groups of a fresh `CarriedShort` given the same parts."""
    carried = eng._short
    cold = CarriedShort()
    cold.sync(dict(carried.members), carried.dims)
    assert carried.count == cold.count
    assert carried.groups.keys() == cold.groups.keys()
    for fp, g in carried.groups.items():
        c = cold.groups[fp]
        assert (g.count, g.deficit, g.clusters, g.heads, g.units) == (c.count, c.deficit, c.clusters, c.heads, c.units)
        assert g.first() is c.first()


@pytest.mark.parametrize("seed", range(30))
def test_carried_unmet_equals_cold_decide_over_restores_and_churn(seed: int) -> None:
    rnd = random.Random(5000 + seed)
    inv = Inventory([_scarce_machine(rnd, i) for i in range(rnd.randint(20, 50))])
    table = NeedsTable()
    for c in CLUSTERS:
        _demand(rnd, table, c)
    cfg = EngineConfig(preempt_after_cycles=rnd.choice((1, 3)), shortfall_report_cap=rnd.choice((1, 2, 100)))
    state = EngineState(first_rollup=frozenset(CLUSTERS))
    eng = Engine()
    emitted = False
    for _ in range(30):
        got = eng.decide(table, inv, NOW, state, cfg)
        want = decide(table, Inventory(list(inv)), NOW, state, cfg)
        _same(got, want)
        assert repr(got.state) == repr(want.state)  # same key order too
        _check_carried(eng)
        if eng.last_unmet_reused:
            EXERCISED["emitted" if emitted else "looked_up"] += 1
        state, emitted = _next_state(rnd, got.state)
        _apply_some(rnd, inv, got.actions, NOW)
        if rnd.random() < 0.5:
            _small_change(rnd, inv, table, NOW)


def test_the_sequences_above_exercise_both_age_paths() -> None:
    if EXERCISED["emitted"] + EXERCISED["looked_up"] == 0:
        pytest.skip("runs after the parametrized sequences")
    assert EXERCISED["emitted"] >= 20 and EXERCISED["looked_up"] >= 10, EXERCISED


def _row(cluster: str, job: int, units: int, prio: int, unit: int = 1) -> NeedRow:
    prof = Profile.build([], (), prio, PenaltyBucket.B64, PenaltyBucket.ZERO, f"job-{job}")
    need = Need(cluster, prof, _res(units * unit), _res(unit), 1 + job)
    maker = RowMaker(("nvidia.com/gpu",))
    n = maker.row(need, [need], maker.info(prof))
    n.unmet_age = 1
    return n


def test_carried_short_follows_random_joins_and_leaves() -> None:
    """Clusters join and leave (a recomputed one comes back as a new part) in random order: the
    carried groups always equal a fresh sync of the same parts."""
    rnd = random.Random(7)
    names = [f"c{i:02d}" for i in range(12)]
    carried = CarriedShort()
    live: dict[str, ShortPart] = {}
    rows_of: dict[str, list[NeedRow]] = {}
    for _ in range(300):
        for c in rnd.sample(names, rnd.randint(1, 4)):
            if c in live and rnd.random() < 0.5:
                del live[c], rows_of[c]
            else:
                rows_of[c] = [_row(c, rnd.randint(0, 4), rnd.randint(1, 3), rnd.choice((10, 20)), rnd.choice((1, 1, 2)))
                              for _ in range(rnd.randint(1, 4))]
                live[c] = ShortPart(c, rows_of[c])
        carried.sync(live, ("nvidia.com/gpu",))
        cold = CarriedShort()
        cold.sync(live, ("nvidia.com/gpu",))
        assert carried.count == cold.count == sum(p.count for p in live.values())
        assert carried.groups.keys() == cold.groups.keys()
        for fp, g in carried.groups.items():
            cg = cold.groups[fp]
            assert (g.count, g.deficit, g.clusters) == (cg.count, cg.deficit, cg.clusters)
            assert g.first() is cg.first()
            rows = [n for c in sorted(rows_of) for n in rows_of[c] if n.fp == fp]  # the cold ledgers' order
            assert g.first() is min(rows, key=lambda n: n.order)
            assert g.deficit == (sum(n.remaining[0] for n in rows),)
            assert g.clusters == sorted({n.cluster for n in rows})
            assert g.units == Counter(h.need.min_unit for h in g.heads.values()) == cg.units
    kept = dict(list(live.items())[:3])
    carried.sync(kept, ("cpu",))  # other dimensions: the kept parts are filed again, the rest dropped
    assert carried.dims == ("cpu",) and carried.members == kept
    assert carried.count == sum(p.count for p in kept.values())


def test_key_sorted_falls_back_to_a_sort_when_chunks_interleave() -> None:
    assert list(_key_sorted([("b", ["b\x00x"], [1]), ("a", ["a\x00y", "a\x00z"], [2, 3])])) == [
        "a\x00y", "a\x00z", "b\x00x"]
    odd = _key_sorted([("a", ["a\x00z"], [1]), ("a\x00b", ["a\x00b\x00c"], [2])])  # a NUL in a name
    assert list(odd) == ["a\x00b\x00c", "a\x00z"]


def test_a_reused_short_cluster_keeps_its_verdicts_while_ages_move_in_step() -> None:
    """Verdicts hold where each unmet streak started: a reused short cluster's are the very same
    objects cycle after cycle while the ages they report grow; a state whose cycle did not move in
    step with its ages (here: the same ages, the cycle moved on) re-issues them with new starts."""
    inv = Inventory([])
    table = NeedsTable()
    table.replace("c", [Need("c", Profile.build([], (), 10, PenaltyBucket.B64, PenaltyBucket.ZERO, f"j{i}"),
                             _res(1), _res(1), 1 + i) for i in range(3)], NOW)
    eng = Engine()
    state = EngineState(first_rollup=frozenset({"c"}))
    d1 = eng.decide(table, inv, NOW, state, EngineConfig())
    d2 = eng.decide(table, inv, NOW, d1.state, EngineConfig())
    assert eng.last_unmet_reused == 1
    cc = eng._cache["c"]
    assert isinstance(cc, ClusterCache)
    assert [v.age_at(d1.state.cycle) for v in d1.verdicts] == [1, 1, 1]
    assert [v.age_at(d2.state.cycle) for v in d2.verdicts] == [2, 2, 2]
    assert all(a is b for a, b in zip(d1.verdicts, d2.verdicts, strict=True))
    assert list(d2.state.unmet_ages.values()) == [2, 2, 2]
    jumped = replace(d2.state, cycle=d2.state.cycle + 5)
    d3 = eng.decide(table, inv, NOW, jumped, EngineConfig())
    assert eng.last_unmet_reused == 1
    assert [v.age_at(d3.state.cycle) for v in d3.verdicts] == [3, 3, 3]
    for a, b in zip(d2.verdicts, d3.verdicts, strict=True):
        assert a is not b and {**a.__dict__, "unmet_since": 0} == {**b.__dict__, "unmet_since": 0}
    _same(d3, decide(table, Inventory([]), NOW, jumped, EngineConfig()))


def test_folded_gangs_of_a_reused_short_cluster_age_every_member_verdict() -> None:
    """Two small gangs fold into one short row (two verdicts, one need key): the re-issued verdicts
    map to their row's age, as a cold `decide` gives, carried or restored."""
    small = [Requirement(TYPE_KEY, Operator.IN, ("small",))]
    plain = Profile.build(small, (), 5000, PenaltyBucket.B64, PenaltyBucket.ZERO, "")
    gangs = [Profile.build([*small, Requirement(ZONE_KEY, Operator.SAME, ())], (), 100, PenaltyBucket.B64,
                           PenaltyBucket.ZERO, g) for g in ("g1", "g2")]
    needs = [Need("c", plain, _res(2), _res(1), 1)] + [Need("c", p, _res(1), _res(1), 2) for p in gangs]
    inv = Inventory([machine("m", S.CONFIGURED, cluster="c", itype="small", res=_res(2), prio=5000,
                             fp=plain.fingerprint(), zone="za")])
    table = NeedsTable()
    table.replace("c", needs, NOW)
    cfg = EngineConfig()
    state = EngineState(first_rollup=frozenset({"c"}))
    eng = Engine()
    for i in range(4):
        got = eng.decide(table, inv, NOW, state, cfg)
        _same(got, decide(table, Inventory(list(inv)), NOW, state, cfg))
        assert got.stats.needs_folded == 2
        if i:
            assert eng.last_unmet_reused == 1
            aged = eng._cache["c"].aged
            assert aged is not None and aged.key_pos == [0, 0]
        assert sorted(v.age_at(got.state.cycle) for v in got.verdicts) == [0, i + 1, i + 1]
        state = got.state if i != 2 else EngineState.from_dict(json.loads(json.dumps(got.state.to_dict())))


def test_a_steady_unmet_cycle_does_not_rehash_every_carried_head(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression gate (a count, not a clock): a reported shortfall's min unit comes from its group's
    counted units. Re-deduplicating every carried head's min unit per shortfall hashed ~hundreds of
    `Resources` per shortfall and cost ~70 ms of a 50 000-need steady cycle."""
    clusters = [f"c{i:02d}" for i in range(20)]
    table = NeedsTable()
    for c in clusters:  # 30 single-machine jobs per cluster, nothing to give them
        table.replace(c, [Need(c, Profile.build([], (), 100, PenaltyBucket.B64, PenaltyBucket.ZERO, f"job-{j}"),
                               _res(1), _res(1), 1 + j) for j in range(30)], 1)
    state = EngineState(first_rollup=frozenset(clusters))
    eng = Engine()
    cfg = EngineConfig()
    for _ in range(2):
        state = eng.decide(table, Inventory([]), NOW, state, cfg).state
    calls = [0]
    real_hash, real_eq = Resources.__hash__, Resources.__eq__

    def counted_hash(self: Resources) -> int:
        calls[0] += 1
        return real_hash(self)

    def counted_eq(self: Resources, other: object) -> bool:
        calls[0] += 1
        return real_eq(self, other)

    monkeypatch.setattr(Resources, "__hash__", counted_hash)
    monkeypatch.setattr(Resources, "__eq__", counted_eq)
    d = eng.decide(table, Inventory([]), NOW, state, cfg)
    assert eng.last_unmet_reused == len(clusters) and len(d.shortfalls) == 30
    assert calls[0] <= len(d.shortfalls), calls[0]
