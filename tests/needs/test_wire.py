# mypy: disable-error-code="arg-type,no-untyped-call,unused-ignore"
"""Demand protos ↔ domain: validation naming the field, and lossless round trips."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bigfleet.needs import Need, Operator, PenaltyBucket, Profile, Requirement, ValidationError
from bigfleet.v1alpha1 import capacity_pb2
from bigfleet.wire.needs import (
    need_from_proto,
    need_to_proto,
    requirement_from_proto,
    requirement_to_proto,
    rollup_from_proto,
    rollup_to_proto,
)

from .strategies import needs_for, requirements


def good_need(**over: Any) -> capacity_pb2.CapacityNeed:
    kw: dict[str, Any] = {
        "requirements": [capacity_pb2.NodeSelectorRequirement(key="zone", operator=1, values=["a"])],
        "aggregate_resources": {"cpu": "4", "memory": "8Gi"},
        "priority": 100,
        "spread": [capacity_pb2.TopologySpread(topology_key="zone", max_skew=1, when_unsatisfiable=1)],
        "interruption_penalty_bucket": 5,
        "reclamation_penalty_bucket": 3,
        "min_unit": {"cpu": "1"},
        "group": "",
    }
    kw.update(over)
    return capacity_pb2.CapacityNeed(**kw)


def rollup(*needs: capacity_pb2.CapacityNeed, cluster: str = "c1") -> capacity_pb2.ClusterCapacityNeeds:
    return capacity_pb2.ClusterCapacityNeeds(cluster_id=cluster, timestamp_unix_nanos=5, needs=list(needs))


def test_good_rollup() -> None:
    cluster, needs = rollup_from_proto(rollup(good_need(), good_need(priority=7)), 1234)
    assert cluster == "c1" and len(needs) == 2
    n = needs[0]
    assert n.cluster_id == "c1" and n.arrival_unix_nanos == 1234
    assert n.priority == 100
    assert n.interruption_bucket is PenaltyBucket.B4 and n.reclamation_bucket is PenaltyBucket.B1
    assert n.requirements == (Requirement("zone", Operator.IN, ("a",)),)
    assert n.min_unit.get("cpu") == 1000
    assert n.spread[0].topology_key == "zone"


def R(**kw: Any) -> capacity_pb2.NodeSelectorRequirement:
    return capacity_pb2.NodeSelectorRequirement(**kw)


@pytest.mark.parametrize(
    ("pb", "field"),
    [
        (rollup(good_need(), cluster=""), "cluster_id"),
        (rollup(good_need(), cluster="has space"), "cluster_id"),
        (rollup(good_need(), cluster="x" * 254), "cluster_id"),
        (rollup(good_need(), good_need(priority=1, aggregate_resources={"cpu": "-1"})), 'needs[1].aggregate_resources["cpu"]'),
        (rollup(good_need(aggregate_resources={"cpu": "4 cores"})), 'needs[0].aggregate_resources["cpu"]'),
        (rollup(good_need(min_unit={"memory": "1GB"})), 'needs[0].min_unit["memory"]'),
        (rollup(good_need(min_unit={"": "1"})), 'needs[0].min_unit[""]'),
        (rollup(good_need(interruption_penalty_bucket=28)), "needs[0].interruption_penalty_bucket"),
        (rollup(good_need(reclamation_penalty_bucket=-1)), "needs[0].reclamation_penalty_bucket"),
        (rollup(good_need(requirements=[R(key="zone", operator=0, values=["a"])])), "needs[0].requirements[0].operator"),
        (rollup(good_need(requirements=[R(key="zone", operator=6)])), "needs[0].requirements[0].operator"),
        (rollup(good_need(requirements=[R(key="", operator=3)])), "needs[0].requirements[0].key"),
        (rollup(good_need(requirements=[R(key="a b", operator=3)])), "needs[0].requirements[0].key"),
        (rollup(good_need(requirements=[R(key="k", operator=1)])), "needs[0].requirements[0].values"),
        (rollup(good_need(requirements=[R(key="k", operator=2)])), "needs[0].requirements[0].values"),
        (rollup(good_need(requirements=[R(key="k", operator=3, values=["x"])])), "needs[0].requirements[0].values"),
        (rollup(good_need(requirements=[R(key="k", operator=4, values=["x"])])), "needs[0].requirements[0].values"),
        (rollup(good_need(requirements=[R(key="k", operator=1, values=["ok", "v" * 64])])),
         "needs[0].requirements[0].values[1]"),
        (rollup(good_need(requirements=[R(key="k", operator=1, values=[""])])), "needs[0].requirements[0].values[0]"),
        (rollup(good_need(requirements=[R(key="k", operator=3)] * 65)), "needs[0].requirements"),
        (rollup(good_need(spread=[capacity_pb2.TopologySpread(topology_key="", max_skew=1)])),
         "needs[0].spread[0].topology_key"),
        (rollup(good_need(spread=[capacity_pb2.TopologySpread(topology_key="z", when_unsatisfiable=3)])),
         "needs[0].spread[0].when_unsatisfiable"),
        (rollup(good_need(group="g" * 4097)), "needs[0].group"),
    ],
)
def test_rejects_naming_the_field(pb: capacity_pb2.ClusterCapacityNeeds, field: str) -> None:
    with pytest.raises(ValidationError) as ei:
        rollup_from_proto(pb, 1)
    assert ei.value.field == field, str(ei.value)


def test_same_with_and_without_values_is_accepted() -> None:
    _, needs = rollup_from_proto(
        rollup(good_need(requirements=[R(key="rack", operator=5)]), good_need(requirements=[R(key="rack", operator=5, values=["r1"])])),
        1,
    )
    assert needs[0].profile.same == Requirement("rack", Operator.SAME)
    assert needs[1].profile.same == Requirement("rack", Operator.SAME, ("r1",))


def test_negative_skew_is_clamped_not_rejected() -> None:
    _, (n,) = rollup_from_proto(rollup(good_need(spread=[capacity_pb2.TopologySpread(topology_key="z", max_skew=-3)])), 1)
    assert n.spread[0].max_skew == 1


def test_empty_rollup_is_valid() -> None:
    assert rollup_from_proto(rollup(), 1) == ("c1", [])


def test_requirement_round_trip() -> None:
    r = Requirement("zone", Operator.NOT_IN, ("b", "a"))
    pb = requirement_to_proto(r)
    assert list(pb.values) == ["a", "b"] and pb.operator == 2
    assert requirement_from_proto(pb) == r


@settings(deadline=None)
@given(requirements())
def test_requirement_round_trip_property(r: Requirement) -> None:
    assert requirement_from_proto(requirement_to_proto(r)) == r


@settings(deadline=None, max_examples=80)
@given(needs_for("cluster-1"), st.integers(min_value=0, max_value=2**62))
def test_need_round_trip_property(n: Need, now: int) -> None:
    pb = need_to_proto(n)
    back = need_from_proto(capacity_pb2.CapacityNeed.FromString(pb.SerializeToString()), "cluster-1", now)
    assert back.profile == n.profile
    assert back.fingerprint == n.fingerprint
    assert back.aggregate_resources == n.aggregate_resources
    assert back.min_unit == n.min_unit
    assert back.arrival_unix_nanos == now
    assert need_to_proto(back) == pb  # canonical: the second encoding is byte-identical


@settings(deadline=None, max_examples=30)
@given(st.lists(needs_for("c9"), max_size=5))
def test_rollup_round_trip(needs: list[Need]) -> None:
    pb = rollup_to_proto("c9", needs, 77)
    cluster, back = rollup_from_proto(pb, 5)
    assert cluster == "c9"
    assert [b.profile for b in back] == [n.profile for n in needs]
    assert [b.aggregate_resources for b in back] == [n.aggregate_resources for n in needs]


def test_profile_from_wire_equals_profile_built_in_code() -> None:
    _, (n,) = rollup_from_proto(
        rollup(good_need(requirements=[R(key="zone", operator=1, values=["b", "a"]), R(key="gpu", operator=3)])), 1
    )
    built = Profile.build(
        [Requirement("gpu", Operator.EXISTS), Requirement("zone", Operator.IN, ("a", "b"))],
        n.spread,
        100,
        PenaltyBucket.B4,
        PenaltyBucket.B1,
    )
    assert n.profile == built and n.fingerprint == built.fingerprint()


def test_group_is_opaque_like_upstream_operators_send_it() -> None:
    """Go operators build the group as topologyKey + NUL + selector text; the shard must take it as is."""
    group = "topology.kubernetes.io/rack\x00app=train,;"
    _cluster, needs = rollup_from_proto(rollup(good_need(group=group)), 1)
    assert needs[0].profile.group == group
    assert need_to_proto(needs[0]).group == group
