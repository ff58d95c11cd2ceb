"""Property-based invariants of `decide` over random inventories and demand (hypothesis)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bigfleet.decision import Configure, Create, Decision, Delete, Drain, EngineConfig, EngineState, decide
from bigfleet.machine import CapacityType, Inventory, Machine, MachineState, can_transition
from bigfleet.needs import Need, Operator, PenaltyBucket, Profile, Requirement, Resources, TopologySpread

from .fx import NOW, TYPE_KEY, ZONE_KEY, machine

S = MachineState
CLUSTERS = ("c0", "c1", "c2")
STATES = (S.IDLE, S.IDLE, S.SPECULATIVE, S.SPECULATIVE, S.CONFIGURED, S.CONFIGURED, S.CONFIGURING,
          S.CREATING, S.DRAINING, S.DELETING, S.FAILED)
TARGET = {Configure: S.CONFIGURING, Create: S.CREATING, Drain: S.DRAINING, Delete: S.DELETING}


def g(units: int) -> Resources:
    return Resources.from_milli({"nvidia.com/gpu": 4000 * units})


@st.composite
def machines(draw: st.DrawFn) -> list[Machine]:
    n = draw(st.integers(0, 24))
    out = []
    for i in range(n):
        state = draw(st.sampled_from(STATES))
        cluster = draw(st.sampled_from(CLUSTERS)) if state in (S.CONFIGURED, S.CONFIGURING) else ""
        if state is S.DRAINING:
            cluster = "c0"
        out.append(machine(
            f"m{i:02d}", state, cluster=cluster, zone=draw(st.sampled_from("abc")),
            itype=draw(st.sampled_from(("t0", "t1"))), res=g(draw(st.integers(1, 2))),
            ctype=draw(st.sampled_from(list(CapacityType))), price=draw(st.sampled_from((0.0, 1.0, 2.5, 6.0))),
            prob=draw(st.sampled_from((0.0, 0.05, 0.5))), prio=draw(st.sampled_from((0, 100, 1000, 5000))),
            ipd=draw(st.sampled_from((0.0, 1.0, 64.0, float("inf")))), rpd=draw(st.sampled_from((0.0, 8.0, 512.0))),
            since=draw(st.sampled_from((0, NOW))),
        ))
    return out


@st.composite
def needs(draw: st.DrawFn) -> list[Need]:
    out: dict[tuple[str, str], Need] = {}
    for _ in range(draw(st.integers(0, 6))):
        reqs = [Requirement(TYPE_KEY, Operator.IN, (draw(st.sampled_from(("t0", "t1"))),))]
        kind = draw(st.sampled_from(("plain", "plain", "same", "spread", "any")))
        spread = []
        if kind == "same":
            reqs.append(Requirement(ZONE_KEY, Operator.SAME, ()))
        elif kind == "spread":
            spread.append(TopologySpread(ZONE_KEY, draw(st.integers(1, 2))))
        elif kind == "any":
            reqs = []
        prof = Profile.build(reqs, spread, draw(st.sampled_from((0, 100, 1000, 5000, 10_000))),
                             draw(st.sampled_from((PenaltyBucket.ZERO, PenaltyBucket.B64, PenaltyBucket.PINNED))),
                             PenaltyBucket.ZERO, draw(st.sampled_from(("", "ga", "gb"))) if kind == "same" else "")
        n = Need(draw(st.sampled_from(CLUSTERS)), prof, g(draw(st.integers(1, 6))), g(draw(st.integers(1, 2))),
                 draw(st.integers(1, 5)))
        out.setdefault(n.key, n)
    return list(out.values())


def _decide(ns: list[Need], ms: list[Machine], ready: frozenset[str], cfg: EngineConfig | None = None,
            state: EngineState | None = None) -> Decision:
    st_ = state or EngineState(first_rollup=ready)
    return decide(ns, Inventory(ms), NOW + 3600 * 10**9, st_, cfg or EngineConfig())


SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(machines(), needs(), st.frozensets(st.sampled_from(CLUSTERS)))
def test_actions_are_legal_and_exclusive(ms: list[Machine], ns: list[Need], ready: frozenset[str]) -> None:
    d = _decide(ns, ms, ready)
    by_id = {m.id: m for m in ms}
    seen: set[str] = set()
    for a in d.actions:
        assert a.machine_id not in seen, f"two actions for {a.machine_id}"
        seen.add(a.machine_id)
        m = by_id[a.machine_id]
        assert can_transition(m.state, TARGET[type(a)]), (a, m)
        if isinstance(a, Drain):
            assert a.cluster_id == m.cluster
            if a.reason == "reclaim":
                assert a.cluster_id in ready
            else:
                assert m.assignment.priority < a.preemptor_priority
    # a machine is never assigned to two clusters: acquisitions only from unbound machines
    for a in d.actions:
        if isinstance(a, (Configure, Create)):
            assert by_id[a.machine_id].cluster in ("",)
    # reclaim cap
    conf: dict[str, int] = {}
    for m in ms:
        if m.state is S.CONFIGURED:
            conf[m.cluster] = conf.get(m.cluster, 0) + 1
    for c, n in conf.items():
        rec = [a for a in d.actions if isinstance(a, Drain) and a.reason == "reclaim" and a.cluster_id == c]
        assert len(rec) <= max(1, int(0.05 * n))


@SETTINGS
@given(machines(), needs(), st.frozensets(st.sampled_from(CLUSTERS)))
def test_no_over_acquisition(ms: list[Machine], ns: list[Need], ready: frozenset[str]) -> None:
    d = _decide(ns, ms, ready)
    by_id = {m.id: m for m in ms}
    per_need: dict[tuple[str, str], list[Resources]] = {}
    for a in d.actions:
        if isinstance(a, (Configure, Create)):
            m = by_id[a.machine_id]
            per_need.setdefault((a.cluster_id, a.need_fingerprint), []).append(m.effective_allocatable)
    agg = {}
    for n in ns:
        agg[n.key] = agg.get(n.key, Resources()) + n.aggregate_resources
    for v in d.verdicts:
        if v.folded_into:
            agg[(v.cluster_id, v.folded_into)] = agg.get((v.cluster_id, v.folded_into), Resources()) + next(
                n.aggregate_resources for n in ns if n.key == (v.cluster_id, v.fingerprint))
    for key, allocs in per_need.items():
        # everything but the last acquired machine must still fall short of the need's aggregate
        total = Resources()
        for a in allocs[:-1]:
            total = total + a
        assert not total.covers(agg[key]) or agg[key].is_zero(), (key, allocs, agg[key])


def _could_use(n: Need, m: Machine, domain: str) -> bool:
    if not m.matches(n.requirements) or not m.effective_allocatable.covers(n.min_unit):
        return False
    same = n.profile.same
    return same is None or m.match_labels.get(same.key) == domain


def _precedence(n: Need) -> tuple[int, int, int]:
    return (n.priority, int(n.profile.interruption_bucket) or 1, int(n.profile.reclamation_bucket) or 1)


@SETTINGS
@given(machines(), needs())
def test_priority_is_never_inverted(ms: list[Machine], ns: list[Need]) -> None:
    d = _decide(ns, ms, frozenset())
    by_id = {m.id: m for m in ms}
    by_key = {n.key: n for n in ns}
    short = [(by_key[(v.cluster_id, v.fingerprint)], v) for v in d.verdicts
             if not v.satisfied and not v.parked and not v.folded_into]
    for hi, v in short:
        if hi.profile.strict_spread is not None:
            continue
        for a in d.actions:
            if not isinstance(a, (Configure, Create)):
                continue
            m = by_id[a.machine_id]
            if m.assignment.need_fingerprint:  # reserved for its need by an earlier Create
                continue
            lo_prec = (a.priority,)
            if lo_prec[0] >= hi.priority:
                continue
            assert not _could_use(hi, m, v.same_domain), f"{a} served while {hi} short"


@SETTINGS
@given(machines(), needs(), st.frozensets(st.sampled_from(CLUSTERS)), st.randoms())
def test_deterministic_and_order_independent(ms: list[Machine], ns: list[Need], ready: frozenset[str],
                                             rnd: random.Random) -> None:
    a = _decide(ns, ms, ready)
    b = _decide(ns, ms, ready)
    assert a == b
    ms2, ns2 = list(ms), list(ns)
    rnd.shuffle(ms2)
    rnd.shuffle(ns2)
    c = _decide(ns2, ms2, ready)
    assert c == a
    assert repr(c) == repr(a)


@SETTINGS
@given(machines(), needs())
def test_paused_emits_nothing_and_state_round_trips(ms: list[Machine], ns: list[Need]) -> None:
    d = _decide(ns, ms, frozenset(CLUSTERS), EngineConfig(paused=True))
    assert d.actions == ()
    normal = _decide(ns, ms, frozenset(CLUSTERS))
    assert d.suppressed == normal.actions
    assert EngineState.from_dict(d.state.to_dict()) == d.state


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(machines(), needs())
def test_closed_loop_converges_without_flapping(ms: list[Machine], ns: list[Need]) -> None:
    """Apply every action as if the provider completed it instantly; the loop must settle."""
    inv = {m.id: m for m in ms}
    state = EngineState(first_rollup=frozenset(CLUSTERS))
    now = NOW
    cfg = EngineConfig(reclaim_cap_fraction=0, on_demand_hold_seconds=None, spot_hold_seconds=None)
    for _ in range(12):
        d = decide(ns, Inventory(inv.values()), now, state, cfg)
        state = d.state
        if not d.actions:
            break
        for a in d.actions:
            m = inv[a.machine_id]
            if isinstance(a, (Configure, Create)):
                inv[m.id] = m.replace(state=S.CONFIGURED, cluster=a.cluster_id, host_provider="fake",
                                      host_ref=m.id, assigned_priority=a.priority,
                                      assigned_need_fingerprint=a.need_fingerprint, assigned_group=a.group,
                                      assigned_interruption_penalty_dollars=a.interruption_penalty_dollars,
                                      assigned_reclamation_penalty_dollars=a.reclamation_penalty_dollars)
            elif isinstance(a, Drain):
                inv[m.id] = m.unassigned(S.IDLE, now)
            elif isinstance(a, Delete):
                inv[m.id] = m.replace(state=S.SPECULATIVE, host_provider="", host_ref="")
        now += 10**10
    else:
        raise AssertionError(f"no fixed point after 12 cycles: {d.actions}")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(machines(), needs(), needs(), st.randoms())
def test_incremental_engine_matches_fresh_decide(ms: list[Machine], ns1: list[Need], ns2: list[Need],
                                                 rnd: random.Random) -> None:
    """A long-lived Engine (index and per-cluster caches reused) decides exactly like a fresh one."""
    from bigfleet.decision import Engine
    from bigfleet.needs import NeedsTable

    eng = Engine()
    inv = Inventory(ms)
    table = NeedsTable()
    state = EngineState(first_rollup=frozenset(CLUSTERS))
    now = NOW
    for cycle in range(8):
        demand = ns1 if cycle % 3 != 2 else ns2
        for c in CLUSTERS:
            table.replace(c, [n for n in demand if n.cluster_id == c], now) if any(
                n.cluster_id == c for n in demand) else table.remove(c)
        cfg = EngineConfig()
        got = eng.decide(table, inv, now, state, cfg)
        want = decide(table, Inventory(list(inv)), now, state, cfg)
        assert got.actions == want.actions
        assert got.verdicts == want.verdicts
        assert got.shortfalls == want.shortfalls
        assert got.state == want.state
        state = got.state
        # apply a random subset of the actions, as a provider would, at random speed
        for a in got.actions:
            if rnd.random() < 0.3:
                continue
            m = inv[a.machine_id]
            if isinstance(a, Configure):
                inv.transition(m.id, S.CONFIGURING, now, cluster=a.cluster_id, assigned_priority=a.priority,
                               assigned_need_fingerprint=a.need_fingerprint, assigned_group=a.group)
                if rnd.random() < 0.7:
                    inv.transition(m.id, S.CONFIGURED, now)
            elif isinstance(a, Create):
                inv.transition(m.id, S.CREATING, now, host_provider="fake", host_ref=m.id,
                               assigned_need_fingerprint=a.need_fingerprint)
                if rnd.random() < 0.5:
                    inv.transition(m.id, S.IDLE, now)
            elif isinstance(a, Drain):
                inv.transition(m.id, S.DRAINING, now)
                if rnd.random() < 0.7:
                    inv.upsert(inv[m.id].unassigned(S.IDLE, now))
            elif isinstance(a, Delete):
                inv.transition(m.id, S.DELETING, now)
                if rnd.random() < 0.7:
                    inv.upsert(inv[m.id].replace(state=S.SPECULATIVE, host_provider="", host_ref="",
                                                 state_since_unix_nanos=now))
        now += 30 * 10**9


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(machines(), needs(), st.frozensets(st.sampled_from(CLUSTERS)))
def test_bulk_crediting_equals_machine_by_machine(ms: list[Machine], ns: list[Need], ready: frozenset[str]) -> None:
    from unittest import mock

    from bigfleet.decision import credit

    fast = _decide(ns, ms, ready)
    with mock.patch.object(credit, "_take_runs", lambda *a: False), \
            mock.patch.object(credit, "_cluster_plans", lambda *a: None):
        slow = _decide(ns, ms, ready)
    assert fast == slow


@st.composite
def homogeneous_fleet(draw: st.DrawFn) -> list[Machine]:
    """Few shapes, many machines each, varied reclamation penalties: exercises the bulk paths."""
    out = []
    for i in range(draw(st.integers(0, 40))):
        state = draw(st.sampled_from((S.CONFIGURED, S.CONFIGURED, S.CONFIGURING, S.IDLE, S.SPECULATIVE)))
        cluster = draw(st.sampled_from(CLUSTERS)) if state in (S.CONFIGURED, S.CONFIGURING) else ""
        out.append(machine(f"h{i:02d}", state, cluster=cluster, zone=draw(st.sampled_from("ab")),
                           itype="t0", res=g(1), price=draw(st.sampled_from((1.0, 2.0))),
                           rpd=draw(st.sampled_from((0.0, 0.0, 8.0)))))
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(homogeneous_fleet(), needs())
def test_bulk_crediting_equals_machine_by_machine_on_dense_classes(ms: list[Machine], ns: list[Need]) -> None:
    from unittest import mock

    from bigfleet.decision import credit

    ready = frozenset(CLUSTERS)
    fast = _decide(ns, ms, ready, EngineConfig(reclaim_cap_fraction=0))
    with mock.patch.object(credit, "_take_runs", lambda *a: False), \
            mock.patch.object(credit, "_cluster_plans", lambda *a: None):
        slow = _decide(ns, ms, ready, EngineConfig(reclaim_cap_fraction=0))
    assert fast == slow


@SETTINGS
@given(machines(), needs(), st.frozensets(st.sampled_from(CLUSTERS)))
def test_claimed_configured_counts_the_configured_machines_credited(ms: list[Machine], ns: list[Need],
                                                                   ready: frozenset[str]) -> None:
    """`Verdict.claimed_configured` (what the shard tells a cluster serves each need) counts the
    Configured machines among the ones credited to the need: never more than it credited, all of them
    in a cluster without Configuring machines, and never more than the cluster holds in all."""
    d = _decide(ns, ms, ready)
    conf: dict[str, int] = {}
    configuring: set[str] = set()
    for m in ms:
        if m.state is S.CONFIGURED:
            conf[m.cluster] = conf.get(m.cluster, 0) + 1
        elif m.cluster:
            configuring.add(m.cluster)
    total: dict[str, int] = {}
    for v in d.verdicts:
        credited = v.claimed_count - v.bootstrap_count - v.provision_count
        assert 0 <= v.claimed_configured <= credited, v
        if v.cluster_id not in configuring and not any(m.state is S.CREATING for m in ms):
            assert v.claimed_configured == credited, v
        if not v.folded_into:
            total[v.cluster_id] = total.get(v.cluster_id, 0) + v.claimed_configured
    for c, k in total.items():
        assert k <= conf.get(c, 0), (c, k, conf)
