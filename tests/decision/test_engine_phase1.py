"""Phase 1 scenarios (decision-engine.md §17, 1-28) with the expected actions spelled out."""

from __future__ import annotations

import math

import pytest

from bigfleet.decision import EngineConfig, drain_grace_seconds, effective_cost, victim_score
from bigfleet.machine import CapacityType
from bigfleet.needs import Operator, PenaltyBucket, Requirement, TopologySpread

from .fx import (
    ZONE_KEY,
    S,
    configures,
    cpu,
    creates,
    gpu,
    machine,
    need,
    profile,
    run,
    same_zone,
    unsat,
)

OD = CapacityType.ON_DEMAND
SPOT = CapacityType.SPOT


# --- formulas (1-7) ----------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("price", "p", "penalty", "want"),
    [(6.0, 0.0, 100.0, 6.0), (1.8, 0.1, 5.0, 2.3), (1.8, 0.1, 50.0, 6.8), (6.0, 0.0, math.inf, 6.0),
     (1.0, 0.5, math.inf, math.inf), (2.0, 0.0, 0.0, 2.0)],
)
def test_effective_cost(price: float, p: float, penalty: float, want: float) -> None:
    got = effective_cost(price, p, penalty)
    assert not math.isnan(got)
    assert got == pytest.approx(want)


@pytest.mark.parametrize(
    ("victim", "want"),
    [(0, 10), (99_999, 10), (100_001, 30), (499_999, 30), (500_001, 120), (899_999, 120),
     (900_001, 600), (1_000_000, 600)],
)
def test_drain_grace_by_gap(victim: int, want: int) -> None:
    assert drain_grace_seconds(1_000_000, victim) == want
    assert drain_grace_seconds(0, 0) == 600


def test_victim_score_seeds_formula() -> None:
    assert victim_score(1, 1, 0, 5) < victim_score(10_000, 10_000, 0, 5)
    assert victim_score(0, 0, 60, 6) == pytest.approx(0.1)  # 60 s of a $6/h machine
    assert victim_score(math.inf, 0, 0, 1) == math.inf       # pinned: last, never NaN
    assert not math.isnan(victim_score(0, 0, 0, 0))


# --- basics (8-18) -----------------------------------------------------------------------------

def test_8_idle_bootstraps_exactly_the_need() -> None:
    d = run([need("cluster-a", 3)], [machine(f"i{i}") for i in range(4)])
    assert [(a.machine_id, a.cluster_id) for a in configures(d)] == [("i0", "cluster-a"), ("i1", "cluster-a"),
                                                                      ("i2", "cluster-a")]
    assert unsat(d) == []
    assert d.actions == tuple(configures(d))


def test_9_speculative_cheapest_first() -> None:
    ms = [machine("spec-cheap", S.SPECULATIVE, ctype=SPOT, price=1.0),
          machine("spec-expensive", S.SPECULATIVE, ctype=OD, price=6.0)]
    d = run([need("c", 1)], ms)
    assert [a.machine_id for a in creates(d)] == ["spec-cheap"]


def test_10_effective_cost_with_huge_penalty_prefers_on_demand() -> None:
    ms = [machine("spot", S.SPECULATIVE, ctype=SPOT, price=1.8, prob=0.1),
          machine("od", S.SPECULATIVE, ctype=OD, price=6.0)]
    d = run([need("c", 1, profile(ib=PenaltyBucket.B8388608))], ms)
    assert [a.machine_id for a in creates(d)] == ["od"]
    d = run([need("c", 1, profile(ib=PenaltyBucket.B4))], ms)
    assert [a.machine_id for a in creates(d)] == ["spot"]


def test_idle_pool_also_ordered_by_effective_cost() -> None:
    # Decision 3: effective cost orders Idle too (upstream used price only).
    ms = [machine("spot", ctype=SPOT, price=1.0, prob=0.1), machine("od", ctype=OD, price=1.2)]
    d = run([need("c", 1, profile(ib=PenaltyBucket.B8))], ms)
    assert [a.machine_id for a in configures(d)] == ["od"]


def test_equal_cost_prefers_lower_reclamation_then_id() -> None:
    ms = [machine("b", ctype=OD, price=2.0), machine("a", ctype=OD, price=2.0, zone="z2"),
          machine("c", ctype=OD, price=1.0, zone="z3")]
    d = run([need("c", 2)], ms)
    assert [a.machine_id for a in configures(d)] == ["c", "a"]


def test_11_idle_before_speculative() -> None:
    ms = [machine("idle-od", ctype=OD, price=6.0), machine("spec-spot", S.SPECULATIVE, ctype=SPOT, price=1.0, prob=0.05)]
    d = run([need("c", 1)], ms)
    assert [a.machine_id for a in d.actions] == ["idle-od"]


def test_12_bound_supply_is_credited() -> None:
    ms = [machine(f"c{i}", S.CONFIGURED, cluster="cluster-a") for i in range(2)] + [machine("i0")]
    d = run([need("cluster-a", 2)], ms)
    assert d.actions == ()
    assert d.verdicts[0].satisfied and d.verdicts[0].claimed_count == 2


def test_13_short_need_reports_deficit() -> None:
    d = run([need("c", 5)], [machine("i0"), machine("i1")])
    assert len(configures(d)) == 2
    assert unsat(d) == [("c", gpu(3))]
    assert d.shortfalls[0].deficit == gpu(3)


@pytest.mark.parametrize("order", [0, 1])
def test_14_higher_priority_wins_regardless_of_input_order(order: int) -> None:
    lo = need("cluster-low", 2, profile(0))
    hi = need("cluster-high", 2, profile(1_000_000))
    d = run([lo, hi] if order else [hi, lo], [machine("i0"), machine("i1")])
    assert {a.cluster_id for a in configures(d)} == {"cluster-high"}
    assert [c for c, _ in unsat(d)] == ["cluster-low"]


def test_15_many_single_unit_needs() -> None:
    conf = [machine(f"c{i}", S.CONFIGURED, cluster="cluster-a") for i in range(5)]
    idle = [machine(f"i{i:02d}") for i in range(25)]
    needs = [need("cluster-a", 1, profile(group=f"g{i}")) for i in range(30)]
    d = run(needs, conf + idle)
    assert len(configures(d)) == 25 and unsat(d) == []


def test_16_deficit_only_in_short_dimension() -> None:
    m = machine("c0", S.CONFIGURED, cluster="a", res=cpu(16, 32), itype="x")
    n = need("a", cpu(10, 40), profile(reqs=[]), min_unit=cpu(1, 4))
    d = run([n], [m])
    assert d.actions == ()
    assert unsat(d) == [("a", cpu(0, 8))]


def test_17_single_pod_needs_claim_whole_machines_but_aggregate_does_not() -> None:
    idle = [machine(f"i{i:02d}", res=cpu(10, 40), itype="x") for i in range(50)]
    pods = [need("a", cpu(1, 4), profile(reqs=[], group=f"g{i}"), min_unit=cpu(1, 4)) for i in range(100)]
    d = run(pods, idle)
    assert len(configures(d)) == 50 and len(unsat(d)) == 50
    agg = need("a", cpu(100, 400), profile(reqs=[]), min_unit=cpu(1, 4))
    d = run([agg], idle)
    assert len(configures(d)) == 10 and unsat(d) == []


def test_18_occ_equivalents() -> None:
    four = cpu(4)
    p = profile(reqs=[])
    assert run([need("a", four, p, min_unit=four)], [machine("c", S.CONFIGURED, cluster="a", res=four)]).actions == ()
    d = run([need("a", four, p, min_unit=four)], [machine("x2", res=four, price=2.0, ctype=OD),
                                                    machine("x1", res=four, price=1.0, ctype=OD)])
    assert [a.machine_id for a in d.actions] == ["x1"]
    d = run([need("a", cpu(8), p, min_unit=four)], [machine("x", res=four)])
    assert unsat(d) == [("a", cpu(4))]
    assert d.shortfalls[0].min_unit == four  # what cross-shard rebalancing moves must hold one
    d = run([need("a", cpu(8), p, min_unit=four), need("b", cpu(8), p, min_unit=cpu(2, 8))], [])
    assert d.shortfalls[0].min_unit == cpu(4, 8)  # summed over clusters: the per-dimension max
    d = run([need("a", four, profile(100, reqs=[]), min_unit=four), need("b", four, profile(500, reqs=[]), min_unit=four)],
            [machine("x", res=four)])
    assert [a.cluster_id for a in d.actions] == ["b"]
    idle = [machine(f"m{i:03d}", res=four) for i in range(100)]
    d = run([need("a", four, profile(reqs=[], group=f"g{i}"), min_unit=four) for i in range(100)], idle)
    assert len(configures(d)) == 100 and len({a.machine_id for a in d.actions}) == 100


def test_min_unit_floor() -> None:
    small = machine("small", res=gpu(1) , itype="x")
    big = machine("big", res=gpu(2), itype="x", price=5.0, ctype=OD)
    d = run([need("a", gpu(2), profile(reqs=[]), min_unit=gpu(2))], [small, big])
    assert [a.machine_id for a in d.actions] == ["big"]


# --- Same / spread (19-28) ---------------------------------------------------------------------

def _zoned(n_a: int, n_b: int, n_c: int = 0, **kw: object) -> list:
    out = []
    for z, n in (("a", n_a), ("b", n_b), ("c", n_c)):
        out += [machine(f"{z}{i}", zone=z, **kw) for i in range(n)]  # type: ignore[arg-type]
    return out


def test_19_same_zone_all_in_one_zone() -> None:
    d = run([need("c", 3, same_zone())], _zoned(3, 3))
    zones = {a.machine_id[0] for a in configures(d)}
    assert len(configures(d)) == 3 and len(zones) == 1
    assert d.verdicts[0].same_domain in ("a", "b")


def test_20_same_zone_picks_the_satisfiable_zone() -> None:
    d = run([need("c", 4, same_zone())], _zoned(4, 2))
    assert sorted(a.machine_id for a in d.actions) == ["a0", "a1", "a2", "a3"]


def test_21_same_zone_partial_assembly() -> None:
    d = run([need("c", 5, same_zone())], _zoned(3, 3))
    assert len(configures(d)) == 3 and len({a.machine_id[0] for a in d.actions}) == 1
    assert unsat(d) == [("c", gpu(2))]
    v = d.verdicts[0]
    assert not v.same_satisfiable


def test_22_two_gangs_take_a_zone_each() -> None:
    d = run([need("c", 3, same_zone(2_000_000, "A")), need("c", 3, same_zone(1_000_000, "B"))], _zoned(3, 3))
    by_need: dict[str, set[str]] = {}
    for a in configures(d):
        by_need.setdefault(a.group, set()).add(a.machine_id[0])
    assert len(by_need["A"]) == 1 and len(by_need["B"]) == 1 and by_need["A"] != by_need["B"]
    assert unsat(d) == []


def test_23_sub_machine_gang_folds_to_one_machine() -> None:
    ms = [machine(f"m{i}", res=gpu(100)) for i in range(8)]
    d = run([need("c", 8, same_zone(), min_unit=gpu(1))], ms)
    assert len(d.actions) == 1 and d.stats.needs_folded == 1


@pytest.mark.parametrize(
    ("supply", "units", "skew", "want"),
    [((4, 4, 4), 6, 1, {"a": 2, "b": 2, "c": 2}),
     ((1, 5, 5), 6, 1, {"a": 1, "b": 2, "c": 2}),
     ((5, 5, 0), 8, 2, None)],
)
def test_24_26_strict_spread(supply: tuple[int, int, int], units: int, skew: int, want: dict[str, int] | None) -> None:
    sp = TopologySpread(ZONE_KEY, skew)
    d = run([need("c", units, profile(spread=[sp]))], _zoned(*supply))
    counts: dict[str, int] = {}
    for a in d.actions:
        counts[a.machine_id[0]] = counts.get(a.machine_id[0], 0) + 1
    if want is not None:
        assert counts == want
    else:
        assert sum(counts.values()) == units and max(counts.values()) - min(counts.values()) <= skew
    picked = sum(counts.values())
    assert (unsat(d) == []) == (picked == units)


def test_27_schedule_anyway_is_cheapest_first() -> None:
    sp = TopologySpread(ZONE_KEY, 1, 2)
    ms = [machine(f"a{i}", zone="a", price=1.0, ctype=OD) for i in range(6)] + \
         [machine(f"b{i}", zone="b", price=5.0, ctype=OD) for i in range(2)]
    d = run([need("c", 4, profile(spread=[sp]))], ms)
    assert {a.machine_id[0] for a in d.actions} == {"a"}


def test_28_strict_spread_beats_price() -> None:
    sp = TopologySpread(ZONE_KEY, 1)
    ms = [machine(f"a{i}", zone="a", price=1.0, ctype=OD) for i in range(3)] + \
         [machine(f"b{i}", zone="b", price=5.0, ctype=OD) for i in range(3)]
    d = run([need("c", 4, profile(spread=[sp]))], ms)
    counts = {z: sum(1 for a in d.actions if a.machine_id[0] == z) for z in "ab"}
    assert counts == {"a": 2, "b": 2}


def test_same_values_restrict_domains() -> None:
    reqs = [Requirement(ZONE_KEY, Operator.SAME, ("b",))]
    d = run([need("c", 2, profile(reqs=reqs, group="g"))], _zoned(3, 3))
    assert sorted(a.machine_id for a in d.actions) == ["b0", "b1"]


def test_same_domain_is_sticky_across_cycles() -> None:
    # cycle 1 picks zone a (lexicographic tie-break); a new equal zone appears: the gang stays
    d1 = run([need("c", 2, same_zone())], _zoned(0, 2, 2))
    dom = d1.verdicts[0].same_domain
    assert dom == "b"
    d2 = run([need("c", 2, same_zone())], _zoned(2, 2, 2), state=d1.state)
    assert {a.machine_id[0] for a in d2.actions} == {"b"}


def test_speculative_creates_carry_need_identity_and_are_credited_next_cycle() -> None:
    spec = [machine(f"s{i}", S.SPECULATIVE, ctype=OD, price=3.0) for i in range(4)]
    n = need("c", 2)
    d = run([n], spec)
    assert [a.machine_id for a in creates(d)] == ["s0", "s1"]
    a0 = creates(d)[0]
    assert a0.need_fingerprint == n.fingerprint and a0.priority == n.priority
    # next cycle: the two are CREATING with the fingerprint stamped → nothing new is created
    creating = [machine(f"s{i}", S.CREATING, ctype=OD, price=3.0, fp=n.fingerprint) for i in range(2)]
    d2 = run([n], creating + spec[2:], state=d.state)
    assert d2.actions == () and d2.verdicts[0].satisfied
    # and once Idle with the stamp they are configured for that need, not re-acquired
    idle = [machine(f"s{i}", S.IDLE, ctype=OD, price=3.0, fp=n.fingerprint) for i in range(2)]
    other = need("d", 2, profile(2_000_000))
    d3 = run([n, other], idle, state=d2.state)
    assert {(a.machine_id, a.cluster_id) for a in configures(d3)} == {("s0", "c"), ("s1", "c")}


def test_reservations_keep_clusters_with_equal_profiles_apart() -> None:
    n_c, n_d = need("c", 1), need("d", 1)
    creating = [machine("s0", S.CREATING, fp=n_c.fingerprint)]
    spare = [machine("s1", S.SPECULATIVE, ctype=OD, price=1.0)]
    from bigfleet.decision import EngineState, decide
    from bigfleet.machine import Inventory

    d = decide([n_c, n_d], Inventory(creating + spare), 0, EngineState(), EngineConfig(), reservations={"s0": "c"})
    assert [(a.machine_id, a.cluster_id) for a in d.actions] == [("s1", "d")]


def test_in_flight_and_failed_machines_are_never_touched() -> None:
    ms = [machine("dr", S.DRAINING, cluster="x"), machine("de", S.DELETING),
          machine("f", S.FAILED), machine("cg", S.CONFIGURING, cluster="x")]
    d = run([need("c", 4)], ms, ready=["x"])
    assert d.actions == ()
