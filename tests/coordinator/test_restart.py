"""Durability: a whole group stopped and started again (after log compaction) keeps its state."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.testing import wait_until
from bigfleet.v1alpha1 import coordinator_pb2 as pb

pytestmark = pytest.mark.slow


def snapshot_of(g: CoordGroup, i: int) -> tuple[Any, ...]:
    shards = g.call(i, "ListShards", pb.ListShardsRequest()).shards  # type: ignore[attr-defined]
    binds = g.call(i, "ListClusterBindings", pb.ListClusterBindingsRequest()).bindings  # type: ignore[attr-defined]
    doms = g.call(i, "ListDomainAssignments", pb.ListDomainAssignmentsRequest()).assignments  # type: ignore[attr-defined]
    return (
        tuple((s.shard_id, s.address) for s in shards),
        tuple((b.cluster_id, b.shard_id, b.binding_epoch) for b in binds),
        tuple((d.topology_key, d.topology_value, d.shard_id) for d in doms),
    )


def test_full_group_restart_after_compaction_keeps_state(tmp_path: Path) -> None:
    # Compact every 50 entries so the restart loads a dump plus a journal tail.
    g = CoordGroup(tmp_path, 3, extra=("--rebalance-interval", "0", "--raft-compaction-entries", "50"))
    g.start_all()
    try:
        leader = g.leader()
        for s in range(3):
            g.call(leader, "ReportShard", pb.ShardReport(shard_id=f"shard-{s}", shard_address=f"10.0.0.{s}:7780"))
        for c in range(150):
            g.call(leader, "LookupCluster", pb.LookupClusterRequest(cluster_id=f"c-{c:03d}"))
        g.call(leader, "AssignDomain", pb.AssignDomainRequest(topology_key="rack", topology_value="r1", shard_id="shard-2"))
        before = snapshot_of(g, leader)
        assert len(before[1]) == 150
        ack = g.call(leader, "ReportShard", pb.ShardReport(shard_id="shard-0"))
        term_before = ack.coordinator_term  # type: ignore[attr-defined]
        wait_until(lambda: any((g.data_dir(i) / "raft.dump").exists() for i in range(3)), 30, what="a compaction dump")
        g.stop_all()
        g.start_all()
        leader = g.leader(timeout=30)
        assert snapshot_of(g, leader) == before
        ack = g.call(leader, "ReportShard", pb.ShardReport(shard_id="shard-0"))
        assert ack.coordinator_term >= term_before  # type: ignore[attr-defined]
        # Still writable, still sticky.
        r = g.call(leader, "LookupCluster", pb.LookupClusterRequest(cluster_id="c-007"))
        assert (r.cluster_id, r.shard_id) == ("c-007", dict((b[0], b[1]) for b in before[1])["c-007"])  # type: ignore[attr-defined]
    finally:
        g.stop_all()
