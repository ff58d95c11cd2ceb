"""Normalisation, Phase 2, Phase 3, ledgers and rails (decision-engine.md §17, 29-80)."""

from __future__ import annotations

import json

import pytest

from bigfleet.decision import Drain, EngineConfig, EngineState, UnmetReason, normalize
from bigfleet.decision.index import build_index
from bigfleet.decision.same_domain import DomainBucket as _Bucket
from bigfleet.decision.same_domain import choose_same_bucket
from bigfleet.machine import CapacityType
from bigfleet.needs import Need, PenaltyBucket

from .fx import (
    NOW,
    S,
    configures,
    cpu,
    deletes,
    drains,
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
SEC = 1_000_000_000


# --- ChooseSameBucket (29-38), one dimension --------------------------------------------------

def _b(value: str, count: int, total: int, cred: int = 0, own: int = 0) -> _Bucket:
    b = _Bucket(value, (0,))
    b.count, b.total, b.cred, b.cred_own = count, (total,), (cred,), (own,)
    return b


@pytest.mark.parametrize(
    ("buckets", "deficit", "want"),
    [
        ([_b("rack-a", 1, 4), _b("rack-b", 2, 8)], 8, "rack-b"),                     # 29 satisfiable wins
        ([_b("rack-a", 4, 16), _b("rack-b", 3, 12)], 10, "rack-b"),                  # 30 smallest satisfiable
        ([_b("rack-a", 1, 4), _b("rack-b", 3, 12)], 20, "rack-b"),                   # 31 covers the most
        ([_b("rack-a", 1, 8), _b("rack-b", 2, 8)], 6, "rack-b"),                     # 32 more machines
        ([_b("rack-b", 1, 8), _b("rack-a", 1, 8)], 6, "rack-a"),                     # 33 lexicographic
        ([_b("rack-a", 2, 8, 8), _b("rack-b", 3, 12, 4)], 12, "rack-b"),             # 35 joint totals
        ([_b("Y", 3, 3, 3, 0), _b("X", 6, 6, 6, 3)], 3, "X"),                        # 36 gang-own
        ([_b("X", 6, 6, 6, 3), _b("Y", 3, 3, 3, 0)], 3, "X"),                        # 36 any order
        ([_b("P", 4, 4, 4, 0), _b("Q", 4, 4, 2, 2)], 4, "P"),                        # 37 rule 2 before 2b
        ([_b("small", 3, 3, 3), _b("big", 5, 5, 3)], 3, "small"),                    # 38
    ],
)
def test_choose_same_bucket(buckets: list[_Bucket], deficit: int, want: str) -> None:
    best = choose_same_bucket(buckets, (deficit,))
    assert best is not None and best.value == want


def test_34_two_dimensions_capped_coverage() -> None:
    a = _Bucket("rack-a", (0, 0))
    a.count, a.total = 2, (64, 0)
    b = _Bucket("rack-b", (0, 0))
    b.count, b.total = 2, (16, 32)
    assert choose_same_bucket([a, b], (16, 64)).value == "rack-b"  # type: ignore[union-attr]


def test_40_each_gang_keeps_its_own_rack() -> None:
    ga, gb = same_zone(group="A"), same_zone(group="B")
    na, nb = need("c", 3, ga), need("c", 3, gb)
    ms = [machine(f"a{i}", S.CONFIGURED, cluster="c", zone="a", fp=na.fingerprint, group="A") for i in range(3)]
    ms += [machine(f"b{i}", S.CONFIGURED, cluster="c", zone="b", fp=nb.fingerprint, group="B") for i in range(3)]
    d = run([nb, na], ms, ready=["c"])
    assert d.actions == ()
    doms = {v.fingerprint: v.same_domain for v in d.verdicts}
    assert doms == {na.fingerprint: "a", nb.fingerprint: "b"}


def test_41_gang_follows_supply_and_phase3_reclaims_the_other_domain() -> None:
    prof = same_zone()
    n = need("c", cpu(12), prof, min_unit=cpu(4))
    ms = [machine("conf-a", S.CONFIGURED, cluster="c", zone="rack-a", res=cpu(4)),
          machine("conf-b", S.CONFIGURED, cluster="c", zone="rack-b", res=cpu(4)),
          machine("idle-b0", zone="rack-b", res=cpu(4)), machine("idle-b1", zone="rack-b", res=cpu(4))]
    d = run([n], ms, ready=["c"])
    assert d.verdicts[0].same_domain == "rack-b"
    assert sorted(a.machine_id for a in configures(d)) == ["idle-b0", "idle-b1"]
    assert [a.machine_id for a in drains(d)] == ["conf-a"]


# --- normalisation (42-46) -------------------------------------------------------------------

def test_42_gangs_fold_into_one_plain_need() -> None:
    big = machine("m", S.CONFIGURED, cluster="c1", res=cpu(16, 128))
    gang = same_zone(reqs_ok := 1) if False else same_zone()  # noqa: F841
    needs = [need("c1", cpu(8, 64), same_zone(group=g), min_unit=cpu(2, 16), arrival=a)
             for g, a in (("g1", 300), ("g2", 100), ("g3", 200))]
    rows, folded = normalize(needs, build_index([big]))
    assert folded == 3 and len(rows) == 1
    n, members = rows[0]
    assert n.aggregate_resources == cpu(24, 192)
    assert n.min_unit == cpu(8, 64)
    assert n.arrival_unix_nanos == 100
    assert n.profile.same is None and n.profile.priority == needs[0].profile.priority
    assert len(members) == 3


def test_43_different_gang_sizes_fold_separately() -> None:
    big = machine("m", res=cpu(16))
    needs = [need("c1", cpu(s), same_zone(group=f"g{i}"), min_unit=cpu(1)) for i, s in enumerate((8, 4, 8))]
    rows, _ = normalize(needs, build_index([big]))
    got = sorted((n.aggregate_resources.get("cpu"), n.min_unit.get("cpu")) for n, _ in rows)
    assert got == [(4000, 4000), (16000, 8000)]


def test_44_45_foldability() -> None:
    small = machine("m", res=cpu(16))
    big_gang = need("c1", cpu(24), same_zone(), min_unit=cpu(2))
    rows, folded = normalize([big_gang], build_index([small]))
    assert folded == 0 and rows[0][0] is big_gang
    c2_conf = machine("x", S.CONFIGURED, cluster="c2", res=cpu(16))
    g1 = need("c1", cpu(8), same_zone(group="a"), min_unit=cpu(2))
    g2 = need("c2", cpu(8), same_zone(group="b"), min_unit=cpu(2))
    rows, folded = normalize([g1, g2], build_index([c2_conf]))
    assert folded == 1
    assert rows[0][0] is g1 and rows[1][0].cluster_id == "c2" and rows[1][0].profile.same is None


def test_46_normalisation_is_deterministic() -> None:
    ms = build_index([machine("m", res=cpu(64))])
    needs = [need(c, cpu(4), same_zone(group=g), min_unit=cpu(1)) for c in ("c2", "c1") for g in "ab"]
    needs.insert(1, need("c1", 1))
    a, _ = normalize(needs, ms)
    b, _ = normalize(needs, ms)
    assert a == b
    assert a[0][0] is needs[1]
    assert [n.cluster_id for n, _ in a[1:]] == ["c1", "c2"]


# --- Phase 2 (47-58) -------------------------------------------------------------------------

def _victims(n: int, prio: int, cluster: str = "batch", **kw: object) -> list:
    return [machine(f"v{i}", S.CONFIGURED, cluster=cluster, prio=prio, **kw) for i in range(n)]  # type: ignore[arg-type]


def test_47_preempt_lower_priority_with_grace() -> None:
    d = run([need("train", 4)], _victims(4, 400_000, ipd=5, rpd=1), ready=[])
    ds = drains(d)
    assert [(a.machine_id, a.reason, a.grace_period_seconds, a.preemptor_priority) for a in ds] == \
        [(f"v{i}", "preempt", 30, 1_000_000) for i in range(4)]
    assert d.verdicts[0].victims_found == 4 and d.verdicts[0].satisfied is False  # freed next cycle


def test_48_equal_priority_is_never_preempted() -> None:
    d = run([need("train", 2)], _victims(4, 1_000_000))
    assert drains(d) == [] and unsat(d) == [("train", gpu(2))]


def test_49_lowest_victim_score_first() -> None:
    ms = [machine("v-expensive", S.CONFIGURED, cluster="b", prio=500_000, ipd=100_000),
          machine("v-cheap", S.CONFIGURED, cluster="b", prio=500_000, ipd=1)]
    d = run([need("t", 1)], ms)
    assert [a.machine_id for a in drains(d)] == ["v-cheap"]


def test_50_grace_by_gap_per_victim() -> None:
    ms = [machine(f"v{p}", S.CONFIGURED, cluster="b", prio=p) for p in (0, 499_999, 899_999, 999_999)]
    d = run([need("t", 4)], ms)
    assert {a.machine_id: a.grace_period_seconds for a in drains(d)} == \
        {"v0": 10, "v499999": 30, "v899999": 120, "v999999": 600}


def test_51_contested_victim_goes_to_the_higher_preemptor() -> None:
    d = run([need("mid", 1, profile(500_000)), need("top", 1, profile(1_000_000))], _victims(1, 100_000))
    assert [(a.machine_id, a.preemptor_priority) for a in drains(d)] == [("v0", 1_000_000)]
    assert [c for c, _ in unsat(d)] == ["mid", "top"]
    mid = next(v for v in d.verdicts if v.cluster_id == "mid")
    assert mid.unmet_reason is not UnmetReason.SATISFIED


def test_52_victims_must_cover_min_unit() -> None:
    small = [machine(f"s{i}", S.CONFIGURED, cluster="b", prio=400_000, res=cpu(0) + gpu(0) + _g(4)) for i in range(4)]
    big = machine("v-big", S.CONFIGURED, cluster="b", prio=400_000)
    d = run([need("t", 2)], [*small, big])
    assert [a.machine_id for a in drains(d)] == ["v-big"]
    assert d.shortfalls[0].deficit == gpu(1)


def _g(n: int):  # n gpus (not units)
    from bigfleet.needs import Resources

    return Resources.from_milli({"nvidia.com/gpu": 1000 * n})


def test_53_same_gang_preempts_only_in_its_domain() -> None:
    prof = same_zone(2_000_000)
    n = need("g", 4, prof)
    own = [machine(f"own{i}", S.CONFIGURED, cluster="g", zone="zone-a", prio=2_000_000, fp=n.fingerprint, group="g")
           for i in range(2)]
    holders = [machine(f"ha{i}", S.CONFIGURED, cluster="h", zone="zone-a", prio=1000) for i in range(2)]
    holders += [machine(f"hb{i}", S.CONFIGURED, cluster="h", zone="zone-b", prio=1000) for i in range(4)]
    d = run([n, need("h", 6, profile(1000))], own + holders)
    assert d.verdicts[0].same_domain == "zone-a"
    assert sorted(a.machine_id for a in drains(d)) == ["ha0", "ha1"]


def test_54_same_gang_without_domain_never_preempts() -> None:
    ms = [machine(f"v{i}", S.CONFIGURED, cluster="b", prio=0, zone="") for i in range(4)]
    d = run([need("t", 4, same_zone())], ms)
    assert drains(d) == [] and unsat(d) == [("t", gpu(4))]


def test_55_parked_gang_never_preempts() -> None:
    n = need("t", 4, same_zone())
    st = EngineState(parking={f"t\x00g\x00{n.fingerprint}": 9})
    d = run([n], _victims(4, 0, zone="z"), state=st)
    assert drains(d) == [] and d.verdicts[0].parked


def test_57_integration_preempt_then_bootstrap() -> None:
    batch = _victims(4, 100_000)
    train = need("train", 4)
    d1 = run([train, need("batch", 4, profile(100_000))], batch, ready=["batch", "train"])
    assert len(drains(d1)) == 4 and all(a.grace_period_seconds == 30 for a in drains(d1))
    idle = [machine(f"v{i}") for i in range(4)]
    d2 = run([train, need("batch", 4, profile(100_000))], idle, state=d1.state)
    assert sorted((a.machine_id, a.cluster_id) for a in configures(d2)) == [(f"v{i}", "train") for i in range(4)]


def test_58_stockout() -> None:
    d = run([need("t", 64)], [machine(f"i{i:02d}") for i in range(32)])
    assert len(configures(d)) == 32 and drains(d) == []
    assert d.shortfalls[0].deficit == gpu(32) and len(d.shortfalls) == 1


def test_preempt_waits_for_age_when_configured() -> None:
    cfg = EngineConfig(preempt_after_cycles=2)
    d1 = run([need("t", 1)], _victims(1, 0), config=cfg)
    assert drains(d1) == []
    d2 = run([need("t", 1)], _victims(1, 0), config=cfg, state=d1.state)
    assert len(drains(d2)) == 1


def test_pinned_interruption_victims_are_never_preempted() -> None:
    ms = [machine("pinned", S.CONFIGURED, cluster="b", prio=0, ipd=float("inf"))]
    d = run([need("t", 1)], ms)
    assert drains(d) == []


def test_machines_credited_to_the_preemptor_are_never_its_victims() -> None:
    ms = [machine("mine", S.CONFIGURED, cluster="t", prio=0)]
    d = run([need("t", 2)], ms)
    assert drains(d) == []


# --- Phase 3 (59-73) -------------------------------------------------------------------------

def _conf(n: int, cluster: str = "c", **kw: object) -> list:
    return [machine(f"c{i:02d}", S.CONFIGURED, cluster=cluster, **kw) for i in range(n)]  # type: ignore[arg-type]


def test_59_no_demand_reclaims_everything_capped() -> None:
    d = run([], _conf(4), ready=["c"], config=EngineConfig(reclaim_cap_fraction=0))
    assert [(a.machine_id, a.reason, a.grace_period_seconds, a.preemptor_priority) for a in drains(d)] == \
        [(f"c{i:02d}", "reclaim", 600, 0) for i in (3, 2, 1, 0)]  # equal value to lose: id desc


def test_60_exact_demand_no_actions() -> None:
    assert run([need("c", 4)], _conf(4), ready=["c"]).actions == ()


def test_61_62_reclaim_the_expensive_and_least_valuable() -> None:
    ms = [machine(f"od{i}", S.CONFIGURED, cluster="c", price=6.0, ctype=OD) for i in range(3)]
    ms += [machine(f"bm{i}", S.CONFIGURED, cluster="c", price=0.0) for i in range(2)]
    d = run([need("c", 3)], ms, ready=["c"], config=EngineConfig(reclaim_cap_fraction=0))
    assert sorted(a.machine_id for a in drains(d)) == ["od1", "od2"]
    ms = [machine("r0", S.CONFIGURED, cluster="c", price=6.0, ctype=OD, rpd=0),
          machine("r5000", S.CONFIGURED, cluster="c", price=6.0, ctype=OD, rpd=5000)]
    d = run([need("c", 1)], ms, ready=["c"])
    assert [a.machine_id for a in drains(d)] == ["r0"]


def test_63_stale_fingerprint_does_not_protect_or_exclude() -> None:
    ms = [machine("m", S.CONFIGURED, cluster="c", fp="stale")]
    assert run([need("c", 1)], ms, ready=["c"]).actions == ()
    assert len(drains(run([], ms, ready=["c"]))) == 1


@pytest.mark.parametrize(("have", "want", "reclaims"), [(4, 1, 3), (10, 4, 6)])
def test_64_count_is_conserved(have: int, want: int, reclaims: int) -> None:
    d = run([need("c", want)], _conf(have), ready=["c"], config=EngineConfig(reclaim_cap_fraction=0))
    assert len(drains(d)) == reclaims


def test_65_dense_machines() -> None:
    ms = [machine(f"d{i}", S.CONFIGURED, cluster="c", res=cpu(16, 32)) for i in range(2)]
    d = run([need("c", cpu(8, 32), profile(reqs=[]), min_unit=cpu(1, 4))], ms, ready=["c"])
    assert len(drains(d)) == 1


def test_66_67_same_reclaims_off_domain() -> None:
    ms = _conf(0)
    ms = [machine(f"a{i}", S.CONFIGURED, cluster="c", zone="zone-a") for i in range(3)]
    ms += [machine(f"b{i}", S.CONFIGURED, cluster="c", zone="zone-b") for i in range(2)]
    d = run([need("c", 3, same_zone())], ms, ready=["c"], config=EngineConfig(reclaim_cap_fraction=0))
    assert sorted(a.machine_id for a in drains(d)) == ["b0", "b1"]
    ms = [machine(f"{z}{i}", S.CONFIGURED, cluster="c", zone=z) for z in ("a", "b") for i in range(2)]
    d = run([need("c", 3, same_zone())], ms, ready=["c"], config=EngineConfig(reclaim_cap_fraction=0))
    assert len(drains(d)) == 2 and len({a.machine_id[0] for a in drains(d)}) == 1


def test_68_configuring_counts_and_is_never_reclaimed() -> None:
    ms = [machine(f"ag{i}", S.CONFIGURING, cluster="c", zone="zone-a") for i in range(2)]
    ms += [machine("a-conf", S.CONFIGURED, cluster="c", zone="zone-a")]
    ms += [machine(f"b{i}", S.CONFIGURED, cluster="c", zone="zone-b") for i in range(3)]
    d = run([need("c", 3, same_zone())], ms, ready=["c"], config=EngineConfig(reclaim_cap_fraction=0))
    assert sorted(a.machine_id for a in drains(d)) == ["b0", "b1", "b2"]


def test_71_first_rollup_gate() -> None:
    assert run([], _conf(100)).actions == ()
    d = run([], _conf(50), ready=["c"], config=EngineConfig(reclaim_cap_fraction=0))
    assert len(drains(d)) == 50
    ms = _conf(10, "ready") + [machine(f"p{i}", S.CONFIGURED, cluster="pending") for i in range(10)]
    d = run([], ms, ready=["ready"], config=EngineConfig(reclaim_cap_fraction=0))
    assert {a.cluster_id for a in drains(d)} == {"ready"} and len(drains(d)) == 10


def test_72_release_holds_by_capacity_type() -> None:
    kinds = {"spot": CapacityType.SPOT, "od": CapacityType.ON_DEMAND, "bm": CapacityType.BARE_METAL,
             "res": CapacityType.RESERVED, "un": CapacityType.UNSPECIFIED}
    ms = [machine(k, ctype=t, since=NOW) for k, t in kinds.items()]
    assert [a.machine_id for a in deletes(run([], ms, now=NOW + 2 * 60 * SEC))] == ["spot"]
    assert [a.machine_id for a in deletes(run([], ms, now=NOW + 11 * 60 * SEC))] == ["od", "spot"]
    d = run([], ms, now=NOW + 1000 * 3600 * SEC)
    assert [a.machine_id for a in deletes(d)] == ["od", "spot"]
    assert all(a.reason == "release" for a in deletes(d))


def test_73_claimed_idle_is_never_released() -> None:
    ms = [machine("spot", ctype=SPOT, since=0)]
    d = run([need("c", 1)], ms)
    assert deletes(d) == [] and len(configures(d)) == 1
    cfg = EngineConfig(on_demand_hold_seconds=None, spot_hold_seconds=None)
    assert run([], ms, config=cfg).actions == ()
    ms2 = [*_conf(2), machine("old-spot", ctype=SPOT, since=0)]
    d = run([], ms2, ready=["c"], config=EngineConfig(reclaim_cap_fraction=0))
    assert [a.kind for a in d.actions] == ["drain", "drain", "delete"]


# --- ledgers and rails (77-80) ---------------------------------------------------------------

def test_77_parking_ages_parks_and_reprobes() -> None:
    n = need("c", 4, same_zone())
    ms = [machine(f"a{i}", zone="a", price=1.0, ctype=OD) for i in range(2)]
    # the gang can never be satisfied in one zone but acquires at first; with no free supply it ages
    st = EngineState()
    ages = []
    parked = []
    for _ in range(40):
        d = run([n], [], state=st)
        st = d.state
        ages.append(next(iter(st.parking.values()), 0))
        parked.append(d.verdicts[0].parked)
    assert ages[:3] == [1, 2, 3]
    assert parked[8] and not parked[7]
    assert not parked[32] and parked[33]
    # progress (acquiring something) drops the entry
    d = run([n], ms, state=st)
    assert d.state.parking == {} or d.verdicts[0].parked


def test_78_reclaim_cap() -> None:
    d = run([], _conf(5), ready=["c"])
    assert len(drains(d)) == 1 and d.stats.reclaims_deferred == 4
    d = run([], _conf(100), ready=["c"])
    assert len(drains(d)) == 5 and d.stats.reclaims_deferred == 95
    # preempts are never capped
    d = run([need("t", 10)], _victims(10, 0))
    assert len(drains(d)) == 10


def test_80_shortfall_ledger_sums_ages_and_caps() -> None:
    prof = profile()
    n1 = Need("c1", prof, gpu(1), gpu(1), 1)
    n2 = Need("c2", prof, gpu(2), gpu(1), 1)
    d = run([n1, n2], [])
    assert len(d.shortfalls) == 1
    s = d.shortfalls[0]
    assert (s.deficit, s.age_cycles, s.clusters) == (gpu(3), 1, ("c1", "c2"))
    d2 = run([n1, n2], [], state=d.state)
    assert d2.shortfalls[0].age_cycles == 2
    d3 = run([], [], state=d2.state)
    assert d3.shortfalls == () and d3.state.shortfall_ages == {}
    many = [need(f"c{i:03d}", 1, profile(i)) for i in range(150)]
    d = run(many, [])
    assert len(d.shortfalls) == 100
    assert [s.priority for s in d.shortfalls] == sorted((s.priority for s in d.shortfalls), reverse=True)
    assert d.shortfalls[0].priority == 149


def test_escalation_after_five_cycles() -> None:
    st = EngineState()
    for i in range(7):
        d = run([need("c", 1)], [], state=st)
        st = d.state
        assert d.shortfalls[0].escalated == (i + 1 > 5)


def test_paused_and_dry_run_emit_nothing_but_report() -> None:
    ms = [machine("i0")]
    for cfg, mode in ((EngineConfig(paused=True), "paused"), (EngineConfig(dry_run=True), "dry_run"),
                      (EngineConfig(paused=True, dry_run=True), "paused")):
        d = run([need("c", 1)], ms, config=cfg)
        assert d.actions == () and len(d.suppressed) == 1 and d.mode == mode
        assert d.verdicts[0].bootstrap_count == 1


def test_max_actions_per_cycle_truncates_and_asks_for_follow_up() -> None:
    d = run([need("c", 5)], [machine(f"i{i}") for i in range(5)], config=EngineConfig(max_actions_per_cycle=2))
    assert len(d.actions) == 2 and len(d.deferred) == 3 and d.follow_up


def test_state_round_trips_through_json() -> None:
    n = need("c", 4, same_zone())
    st = EngineState().with_first_rollup("c").with_first_rollup("d")
    d = run([n, need("d", 2)], [machine("a0", zone="a")], state=st)
    blob = json.dumps(d.state.to_dict(), sort_keys=True)
    back = EngineState.from_dict(json.loads(blob))
    assert back == d.state
    assert back.forget_cluster("c").first_rollup == frozenset({"d"})
    with pytest.raises(ValueError):
        EngineState.from_dict({"parking": [1, 2]})


def test_unmet_reasons() -> None:
    d = run([need("c", 1, profile(reqs=[]))], [machine("x", S.CONFIGURED, cluster="other", prio=2_000_000)])
    assert d.verdicts[0].unmet_reason is UnmetReason.PRIORITY_STARVED
    d = run([need("c", 1)], [])
    assert d.verdicts[0].unmet_reason is UnmetReason.NO_MATCHING_SUPPLY
    d = run([need("c", 3, same_zone())], [machine(f"a{i}", zone=f"z{i}") for i in range(3)])
    assert d.verdicts[0].unmet_reason is UnmetReason.TOPOLOGY_UNSATISFIABLE
    d = run([need("c", 3)], [machine("v", S.CONFIGURED, cluster="o", prio=0)])
    assert d.verdicts[0].unmet_reason is UnmetReason.PREEMPTION_EXHAUSTED


def test_pinned_penalties_never_nan() -> None:
    prof = profile(ib=PenaltyBucket.PINNED, rb=PenaltyBucket.PINNED)
    ms = [machine("spot", S.SPECULATIVE, ctype=SPOT, price=1.0, prob=0.1),
          machine("od", S.SPECULATIVE, ctype=OD, price=9.0), machine("free", S.SPECULATIVE, ctype=OD, price=20.0)]
    d = run([need("c", 2, prof)], ms)
    assert [a.machine_id for a in d.actions] == ["od", "free"]
    assert all(isinstance(a, Drain) is False for a in d.actions)


def test_fast_built_records_equal_normal_construction() -> None:
    import dataclasses

    from bigfleet.decision import Configure, Verdict

    d = run([need("c", 2), need("d", 9, profile(5))], [machine("i0"), machine("i1"), machine("i2")])
    for obj in list(d.verdicts) + list(d.actions):
        cls = type(obj)
        rebuilt = cls(**{f.name: getattr(obj, f.name) for f in dataclasses.fields(cls)})
        assert rebuilt == obj and hash(repr(rebuilt)) == hash(repr(obj))
        assert set(vars(obj)) == {f.name for f in dataclasses.fields(cls)}
    assert any(isinstance(a, Configure) for a in d.actions) and all(isinstance(v, Verdict) for v in d.verdicts)


def test_gangs_credit_first_prevents_need_swapping() -> None:
    """A plain need and a rack gang of equal priority in one cluster: the gang's own machines stay
    with the gang (with `gangs_credit_first`), so nothing is re-acquired or reclaimed."""
    gang = need("ml", 3, same_zone(1000, "train"), arrival=10)
    web = need("ml", 2, profile(1000, reqs=[]), min_unit=gpu(1), arrival=1)
    ms = [machine(f"g{i}", S.CONFIGURED, cluster="ml", zone="rack-b", fp=gang.fingerprint, group="train",
                  prio=1000) for i in range(3)]
    ms += [machine(f"w{i}", S.CONFIGURED, cluster="ml", zone="rack-a", fp=web.fingerprint, prio=1000,
                   price=1.0, ctype=OD) for i in range(2)]
    ms += [machine(f"i{i}", zone="rack-c") for i in range(3)]
    st = EngineState(first_rollup=frozenset({"ml"}), same_domains={f"ml\x00train\x00{gang.fingerprint}": "rack-b"})
    fixed = run([web, gang], ms, state=st, config=EngineConfig(reclaim_cap_fraction=0))
    assert fixed.actions == ()  # the default keeps each gang's own machines with it
    # without it the plain need (earlier arrival) credits the gang's cheaper machines first
    swapped = run([web, gang], ms, state=st, config=EngineConfig(gangs_credit_first=False, reclaim_cap_fraction=0))
    assert swapped.actions != ()
