"""The pure parts of the shard's handoff: the ownership rule, the ledger's persistence, and how donors
and drain victims are chosen."""

from __future__ import annotations

import json
from pathlib import Path

from bigfleet.machine import Assignment, Machine, MachineState
from bigfleet.machine.record import INSTANCE_TYPE_LABEL
from bigfleet.needs import Resources
from bigfleet.shard.ha.state import HAState, ReleasedCluster
from bigfleet.shard.handoff import (
    EXCLUSIVE,
    OWNER_KEY,
    SHARED,
    load_legacy_ledger,
    owns,
    pick_donations,
    pick_drain_victims,
)
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2
from bigfleet.wire.machine import encode_shard_metadata, machine_from_proto

S = provider_pb2.MachineState
ZONE = "topology.kubernetes.io/zone"


def rec(mid: str, state: int = S.MACHINE_STATE_IDLE, zone: str = "a", cpu: str = "4", cluster: str = "",
        priority: int = 0, penalty: float = 0.0, owner: str = "", price: float = 1.0, alloc: str = "",
        itype: str = "m5") -> provider_pb2.Machine:
    md: dict[str, str] = {}
    if owner:  # the owner mark exists only on bound machines (cleared with the binding)
        cluster = cluster or "k"
        state = S.MACHINE_STATE_CONFIGURED
    if cluster:
        md.update(encode_shard_metadata(Assignment(priority, penalty, 0.0, "fp", "")))
    if owner:
        md[OWNER_KEY] = owner
    return provider_pb2.Machine(
        id=mid, state=state, instance_type=itype, zone=zone, price_per_hour=price, labels={ZONE: zone},  # type: ignore[arg-type]
        resources=provider_pb2.Resources(resources={"cpu": cpu}), cluster=cluster, shard_metadata=md,
        allocatable=provider_pb2.Resources(resources={"cpu": alloc} if alloc else {}),
        host=provider_pb2.HostRef(provider="fake", ref=mid) if state not in (S.MACHINE_STATE_SPECULATIVE,) else None,
    )


def m(*a: object, **kw: object) -> Machine:
    return machine_from_proto(rec(*a, **kw), now_unix_nanos=1)  # type: ignore[arg-type]


def zone_is(z: str) -> list[capacity_pb2.NodeSelectorRequirement]:
    return [capacity_pb2.NodeSelectorRequirement(key=ZONE, operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_IN,
                                                 values=[z])]


def type_is(t: str) -> list[capacity_pb2.NodeSelectorRequirement]:
    return [capacity_pb2.NodeSelectorRequirement(key=INSTANCE_TYPE_LABEL,
                                                 operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_IN, values=[t])]


def state(epoch: int = 1) -> HAState:
    return HAState(epoch=epoch)


def test_exclusive_owns_all_but_released_and_other_owners() -> None:
    st = state()
    mine = lambda r: owns(st.ledger, "A", EXCLUSIVE, r)  # noqa: E731
    assert mine(rec("m1"))
    assert not mine(rec("m2", owner="B"))
    assert mine(rec("m3", owner="A"))
    assert st.release_cluster("c1", ("m1", "m1", "m4"), "B", "h:1", 1) == ("m1", "m4")
    assert not mine(rec("m1")) and not mine(rec("m4", owner="A"))
    assert st.ledger.released_clusters["c1"] == ReleasedCluster("B", "h:1", ("m1", "m4"))
    # a repeat answers what the first release recorded; a stale epoch changes nothing
    assert st.release_cluster("c1", ("m9",), "B", "h:1", 1) == ("m1", "m4")
    assert st.release_cluster("c2", ("m3",), "B", "h:1", 0) is None and mine(rec("m3", owner="A"))
    assert st.adopt(("m1",), "c1", 1)  # handed back: ours again, the cluster is served again
    assert mine(rec("m1")) and "c1" not in st.ledger.released_clusters


def test_shared_owns_only_adopted_or_marked() -> None:
    st = state()
    mine = lambda r: owns(st.ledger, "B", SHARED, r)  # noqa: E731
    assert not mine(rec("m1"))
    assert mine(rec("m2", owner="B"))
    st.adopt(("m1",), "", 1)
    assert mine(rec("m1", owner="A"))  # an adoption wins over a stale owner mark
    assert st.release_machines(("m1",), "transfer:t1", 1) == ("m1",)
    assert st.release_machines(("m2",), "transfer:t1", 1) == ("m1",)  # idempotent per transfer id
    assert not mine(rec("m1"))


def test_no_machine_has_two_claimants() -> None:
    """Exclusive A and shared B over the same records, through a release/adopt: never both."""
    a, b = state(), state()
    recs = [rec(f"m{i}") for i in range(6)] + [rec("x", owner="B"), rec("y", owner="A")]

    def check() -> None:
        for r in recs:
            assert not (owns(a.ledger, "A", EXCLUSIVE, r) and owns(b.ledger, "B", SHARED, r)), r.id

    check()
    ids = a.release_cluster("c", ("m0", "m1"), "B", "", 1)
    assert ids is not None
    check()
    b.adopt(ids, "c", 1)
    check()
    assert owns(b.ledger, "B", SHARED, recs[0]) and not owns(a.ledger, "A", EXCLUSIVE, recs[0])
    b.release_machines(("m0",), "transfer:back", 1)
    a.adopt(("m0",), "", 1)
    check()
    assert owns(a.ledger, "A", EXCLUSIVE, recs[0]) and not owns(b.ledger, "B", SHARED, recs[0])


def test_ledger_file_of_an_older_shard_is_read_for_import(tmp_path: Path) -> None:
    (tmp_path / "o.json").write_text(json.dumps({
        "shard_id": "A", "released": {"m1": "c1", "m7": "transfer:t"}, "adopted": ["m9"],
        "released_clusters": {"c1": {"to": "B", "address": "h:1", "machines": ["m1"]}}}))
    led = load_legacy_ledger(tmp_path / "o.json")
    assert led is not None
    assert led.released == {"m1": "c1", "m7": "transfer:t"} and led.adopted == {"m9"}
    assert led.released_clusters["c1"] == ReleasedCluster("B", "h:1", ("m1",))
    assert load_legacy_ledger(tmp_path / "missing.json") is None


def test_donations_idle_first_then_speculative_matching_and_covering() -> None:
    ms = [m("s1", S.MACHINE_STATE_SPECULATIVE, price=0.1), m("i1", price=2.0), m("i2", price=1.0),
          m("i3", zone="b"), m("c1", S.MACHINE_STATE_CONFIGURED, cluster="k")]
    assert pick_donations(ms, set(), zone_is("a"), Resources.parse({"cpu": "8"})) == ["i2", "i1"]
    assert pick_donations(ms, {"i2"}, zone_is("a"), Resources.parse({"cpu": "8"})) == ["i1", "s1"]
    assert pick_donations(ms, set(), zone_is("a"), Resources()) == ["i2"]  # empty deficit: one machine
    assert pick_donations(ms, set(), zone_is("c"), Resources.parse({"cpu": "1"})) == []


def test_drain_victims_lower_priority_lowest_score_first() -> None:
    ms = [m("v1", S.MACHINE_STATE_CONFIGURED, cluster="k", priority=10, penalty=5.0),
          m("v2", S.MACHINE_STATE_CONFIGURED, cluster="k", priority=10, penalty=1.0),
          m("hi", S.MACHINE_STATE_CONFIGURED, cluster="k", priority=100, penalty=0.0),
          m("idle")]
    assert pick_drain_victims(ms, set(), 50, [], Resources.parse({"cpu": "8"})) == ["v2", "v1"]
    assert pick_drain_victims(ms, set(), 50, [], Resources.parse({"cpu": "2"})) == ["v2"]
    assert pick_drain_victims(ms, set(), 10, [], Resources.parse({"cpu": "2"})) == []  # strictly lower only
    assert MachineState.CONFIGURED in {x.state for x in ms}


def test_drain_victims_already_draining_come_first() -> None:
    """A redelivered drain (after a kill -9 or failover) finishes the drain the previous leader had
    started rather than disrupting another machine; higher-priority drains are still never taken."""
    ms = [m("c1", S.MACHINE_STATE_CONFIGURED, cluster="k", priority=10, penalty=0.0),
          m("d1", S.MACHINE_STATE_DRAINING, cluster="k", priority=10, penalty=5.0),
          m("d2", S.MACHINE_STATE_DRAINING, cluster="k", priority=100, penalty=0.0)]
    assert pick_drain_victims(ms, set(), 50, [], Resources.parse({"cpu": "2"})) == ["d1"]
    assert pick_drain_victims(ms, set(), 50, [], Resources.parse({"cpu": "8"})) == ["d1", "c1"]
    assert pick_drain_victims(ms, {"d1"}, 50, [], Resources.parse({"cpu": "2"})) == ["c1"]  # in flight here


CPU8 = Resources.parse({"cpu": "8"})


def busy(mid: str, cpu: str, alloc: str, itype: str = "m5", penalty: float = 0.0) -> Machine:
    return m(mid, S.MACHINE_STATE_CONFIGURED, cluster="k", priority=100, cpu=cpu, alloc=alloc, itype=itype,
             penalty=penalty)


def test_drain_victims_must_serve_the_need_allocatable_and_min_unit() -> None:
    """Found by the topology test: an 8-vCPU machine (7.5 allocatable) was drained for a priority-5000
    need of 8-CPU pods; it could not host one, the need stayed unmet and another drain followed."""
    small = [busy(f"s{i}", "8", "7500m") for i in range(4)]
    assert pick_drain_victims(small, set(), 5000, [], CPU8, CPU8) == []
    big = busy("big", "16", "15500m", penalty=9.0)  # drained last by score, but the only one that fits
    assert pick_drain_victims([*small, big], set(), 5000, [], CPU8, CPU8) == ["big"]
    # whole units: the second 8-CPU pod does not fit in big's remaining 7.5
    big2 = busy("big2", "16", "15500m", penalty=10.0)
    assert pick_drain_victims([*small, big, big2], set(), 5000, [], Resources.parse({"cpu": "16"}), CPU8) == \
        ["big", "big2"]
    # the requirements are matched against the instance type too
    assert pick_drain_victims([*small, big], set(), 5000, type_is("c5"), CPU8, CPU8) == []
    assert pick_drain_victims([*small, busy("c", "16", "15500m", "c5")], set(), 5000, type_is("c5"), CPU8,
                              CPU8) == ["c"]
    # no min unit: allocatable is what counts, not raw capacity
    assert pick_drain_victims(small, set(), 5000, [], CPU8) == ["s0", "s1"]


def test_donations_must_serve_the_need_allocatable_and_min_unit() -> None:
    small = [m(f"s{i}", cpu="8", alloc="7500m") for i in range(3)]
    assert pick_donations(small, set(), [], CPU8, CPU8) == []
    big = m("big", cpu="16", alloc="15500m", price=5.0)
    assert pick_donations([*small, big], set(), [], CPU8, CPU8) == ["big"]
    assert pick_donations([*small, big], set(), type_is("c5"), CPU8, CPU8) == []
    assert pick_donations(small, set(), [], CPU8) == ["s0", "s1"]


async def test_a_paused_shard_refuses_a_cross_shard_drain() -> None:
    """The kill switch covers the coordinator's instructions too (found by the chart-topology test:
    a paused shard drained a machine for another shard)."""
    import pytest

    from bigfleet.observability import new_registry
    from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
    from bigfleet.shard.metrics import ShardMetrics
    from bigfleet.v1alpha1 import coordinator_pb2

    d = ShardDaemon(DaemonConfig(shard_id="A", provider="127.0.0.1:1", epoch=1, compute_inline=True),
                    ShardMetrics(new_registry()))
    d.view.set(rec("c1", S.MACHINE_STATE_CONFIGURED, cluster="low", priority=1))
    d.reconciled.set()
    submitted: list[str] = []
    d.executor.submit_drain = lambda mid, *a, **k: submitted.append(mid) or True  # type: ignore[method-assign,func-returns-value]
    await d.set_actuation(True, False)
    msg = coordinator_pb2.CrossShardDrain(preemptor_priority=1000, to_shard_id="B", transfer_id="t1")
    with pytest.raises(RuntimeError, match="paused"):
        await d.handoff.cross_shard_drain(msg)
    await d.set_actuation(False, True)
    with pytest.raises(RuntimeError, match="dry-run"):
        await d.handoff.cross_shard_drain(msg)
    assert submitted == [] and not d.log.ledger().released
