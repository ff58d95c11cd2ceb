"""Smoke test of the public needs API (the detailed suites live beside it)."""

from __future__ import annotations

from bigfleet.needs import NeedsTable, Operator, PenaltyBucket, Requirement, Resources
from bigfleet.v1alpha1 import capacity_pb2
from bigfleet.wire.needs import need_to_proto, rollup_from_proto


def test_rollup_into_table_and_back() -> None:
    pb = capacity_pb2.ClusterCapacityNeeds(
        cluster_id="c1",
        needs=[
            capacity_pb2.CapacityNeed(
                requirements=[
                    capacity_pb2.NodeSelectorRequirement(key="zone", operator=1, values=["b", "a"])  # type: ignore[arg-type]
                ],
                aggregate_resources={"cpu": "1500m"},
                priority=10,
                interruption_penalty_bucket=int(PenaltyBucket.B8),  # type: ignore[arg-type]
            )
        ],
    )
    cluster, needs = rollup_from_proto(pb, now_unix_nanos=100)
    assert cluster == "c1"
    table = NeedsTable()
    assert table.replace(cluster, needs, 100)
    (need,) = table.snapshot()
    assert need.requirements == (Requirement("zone", Operator.IN, ("a", "b")),)
    assert need.aggregate_resources == Resources.from_milli({"cpu": 1500})
    assert need_to_proto(need).aggregate_resources["cpu"] == "1500m"
