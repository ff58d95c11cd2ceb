"""Dashboard sources against the real servicer code: a coordinator follower answers with the same
"not leader" refusal (and leader hint) as its gRPC API instead of stale data."""

from __future__ import annotations

from types import SimpleNamespace

from bigfleet.dashboard.coordinator_source import CoordinatorSource
from bigfleet.dashboard.model import ShortfallAges
from bigfleet.dashboard.sources import shortfall_rows
from bigfleet.v1alpha1 import coordinator_pb2, provider_pb2


class Follower:
    cfg = SimpleNamespace(node_id="node-2")

    def ready(self) -> bool:
        return False

    def leader_hint(self) -> str:
        return "10.0.0.1:7790"


async def test_follower_reports_not_leader_with_hint() -> None:
    d = await CoordinatorSource(Follower()).snapshot(100.0)
    assert d["component"] == "coordinator" and d["id"] == "node-2"
    assert "not leader" in d["error"] and d["leader"] == "10.0.0.1:7790"
    assert d["shards"] == [] and d["clusters"] == []


def test_shortfall_rows_carry_wall_age() -> None:
    sf = coordinator_pb2.Shortfall(priority=5, age_cycles=3, deficit=provider_pb2.Resources(resources={"cpu": "4"}))
    ages = ShortfallAges()
    assert shortfall_rows([sf], "s1", ages, 100.0)[0]["age_seconds"] == 0.0
    row = shortfall_rows([sf], "s1", ages, 160.0)[0]
    assert row["age_seconds"] == 60.0 and row["first_seen"] == "1970-01-01T00:01:40Z"
    assert row["deficit"] == {"cpu": "4"} and row["age_cycles"] == 3 and row["shard_id"] == "s1"
