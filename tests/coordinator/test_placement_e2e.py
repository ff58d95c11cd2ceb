"""Placement through a real coordinator: bounded load, sticky bindings, add/remove shards."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.v1alpha1 import coordinator_pb2 as pb

pytestmark = pytest.mark.slow


def test_lookup_places_within_cap_and_rebalance_moves_only_to_the_newcomer(tmp_path: Path) -> None:
    g = CoordGroup(tmp_path, 1, extra=("--rebalance-interval", "0"))
    g.start_all()
    try:
        g.leader()
        for s in range(8):
            g.call(0, "ReportShard", pb.ShardReport(shard_id=f"shard-{s}", shard_address=f"10.0.0.{s}:7780"))
        n = 240
        placed = {}
        for i in range(n):
            r = g.call(0, "LookupCluster", pb.LookupClusterRequest(cluster_id=f"cl-{i:04d}"))
            placed[r.cluster_id] = r.shard_id  # type: ignore[attr-defined]
        load = Counter(placed.values())
        assert len(load) == 8 and max(load.values()) / (n / 8) <= 1.25
        # Sticky: asking again changes nothing.
        assert g.call(0, "LookupCluster", pb.LookupClusterRequest(cluster_id="cl-0007")).shard_id == placed["cl-0007"]  # type: ignore[attr-defined]
        # A ninth shard: nothing moves until a rebalance; the plan moves ~1/9, nearly all to it
        # (a shard above the new, lower cap also sheds to its next choice).
        g.call(0, "ReportShard", pb.ShardReport(shard_id="shard-8", shard_address="10.0.0.8:7780"))
        binds = g.call(0, "ListClusterBindings", pb.ListClusterBindingsRequest()).bindings  # type: ignore[attr-defined]
        assert {b.cluster_id: b.shard_id for b in binds} == placed
        plan = g.call(0, "PlanRebalance", pb.PlanRebalanceRequest())
        moves = list(plan.moves)  # type: ignore[attr-defined]
        assert 0 < len(moves) <= 1.2 * n / 9
        assert sum(1 for m in moves if m.to_shard_id == "shard-8") >= 0.75 * len(moves)
        assert max(plan.load_after.values()) <= max(-(-n // 9), int(1.25 * n / 9))  # type: ignore[attr-defined]
        assert plan.live_shards == 9 and plan.total_clusters == n  # type: ignore[attr-defined]
        # Removing a shard unbinds only its clusters; their next lookups re-place them elsewhere.
        gone = "shard-3"
        g.call(0, "RemoveShard", pb.RemoveShardRequest(shard_id=gone))
        binds = g.call(0, "ListClusterBindings", pb.ListClusterBindingsRequest()).bindings  # type: ignore[attr-defined]
        after = {b.cluster_id: b.shard_id for b in binds}
        assert after == {c: s for c, s in placed.items() if s != gone}
        for c in [c for c, s in placed.items() if s == gone]:
            r = g.call(0, "LookupCluster", pb.LookupClusterRequest(cluster_id=c))
            assert r.shard_id != gone and r.newly_bound  # type: ignore[attr-defined]
            after[c] = r.shard_id  # type: ignore[attr-defined]
        assert sum(1 for c in placed if placed[c] != after[c]) == load[gone]
    finally:
        g.stop_all()
