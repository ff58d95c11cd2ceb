"""The pure parts of the shard's handoff: the ownership rule, the ledger's persistence, and how donors
and drain victims are chosen."""

from __future__ import annotations

from pathlib import Path

from bigfleet.machine import Assignment, Machine, MachineState
from bigfleet.needs import Resources
from bigfleet.shard.handoff import (
    EXCLUSIVE,
    OWNER_KEY,
    SHARED,
    OwnershipLedger,
    load_ledger,
    pick_donations,
    pick_drain_victims,
    save_ledger,
)
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2
from bigfleet.wire.machine import encode_shard_metadata, machine_from_proto

S = provider_pb2.MachineState
ZONE = "topology.kubernetes.io/zone"


def rec(mid: str, state: int = S.MACHINE_STATE_IDLE, zone: str = "a", cpu: str = "4", cluster: str = "",
        priority: int = 0, penalty: float = 0.0, owner: str = "", price: float = 1.0) -> provider_pb2.Machine:
    md: dict[str, str] = {}
    if owner:  # the owner mark exists only on bound machines (cleared with the binding)
        cluster = cluster or "k"
        state = S.MACHINE_STATE_CONFIGURED
    if cluster:
        md.update(encode_shard_metadata(Assignment(priority, penalty, 0.0, "fp", "")))
    if owner:
        md[OWNER_KEY] = owner
    return provider_pb2.Machine(
        id=mid, state=state, instance_type="m5", zone=zone, price_per_hour=price, labels={ZONE: zone},  # type: ignore[arg-type]
        resources=provider_pb2.Resources(resources={"cpu": cpu}), cluster=cluster, shard_metadata=md,
        host=provider_pb2.HostRef(provider="fake", ref=mid) if state not in (S.MACHINE_STATE_SPECULATIVE,) else None,
    )


def m(*a: object, **kw: object) -> Machine:
    return machine_from_proto(rec(*a, **kw), now_unix_nanos=1)  # type: ignore[arg-type]


def zone_is(z: str) -> list[capacity_pb2.NodeSelectorRequirement]:
    return [capacity_pb2.NodeSelectorRequirement(key=ZONE, operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_IN,
                                                 values=[z])]


def test_exclusive_owns_all_but_released_and_other_owners() -> None:
    led = OwnershipLedger("A", EXCLUSIVE)
    assert led.owns(rec("m1"))
    assert not led.owns(rec("m2", owner="B"))
    assert led.owns(rec("m3", owner="A"))
    led.release_cluster("c1", ["m1", "m1", "m4"], "B", "h:1")
    assert not led.owns(rec("m1")) and not led.owns(rec("m4", owner="A"))
    assert led.cluster_released("c1") and led.redirect_for("c1") == "h:1"
    assert led.released_clusters["c1"]["machines"] == ["m1", "m4"]
    led.adopt(["m1"], "c1")  # handed back: ours again, the cluster is served again
    assert led.owns(rec("m1")) and not led.cluster_released("c1")


def test_shared_owns_only_adopted_or_marked() -> None:
    led = OwnershipLedger("B", SHARED)
    assert not led.owns(rec("m1"))
    assert led.owns(rec("m2", owner="B"))
    led.adopt(["m1"])
    assert led.owns(rec("m1", owner="A"))  # an adoption wins over a stale owner mark
    led.release(["m1"], "transfer:t1")
    assert not led.owns(rec("m1"))


def test_no_machine_has_two_claimants() -> None:
    """Exclusive A and shared B over the same records, through a release/adopt: never both."""
    a, b = OwnershipLedger("A", EXCLUSIVE), OwnershipLedger("B", SHARED)
    recs = [rec(f"m{i}") for i in range(6)] + [rec("x", owner="B"), rec("y", owner="A")]

    def check() -> None:
        for r in recs:
            assert not (a.owns(r) and b.owns(r)), r.id

    check()
    ids = a.release_cluster("c", ["m0", "m1"], "B", "")
    check()
    b.adopt(ids, "c")
    check()
    assert b.owns(recs[0]) and not a.owns(recs[0])
    b.release(["m0"], "transfer:back")
    a.adopt(["m0"])
    check()
    assert a.owns(recs[0]) and not b.owns(recs[0])


def test_ledger_round_trips_through_the_data_dir(tmp_path: Path) -> None:
    led = OwnershipLedger("A", EXCLUSIVE)
    led.release_cluster("c1", ["m1"], "B", "h:1")
    led.adopt(["m9"])
    save_ledger(tmp_path / "o.json", led)
    back = load_ledger(tmp_path / "o.json", "A", EXCLUSIVE)
    assert back.to_json() == led.to_json()
    assert load_ledger(tmp_path / "missing.json", "A", SHARED).mode == SHARED


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
