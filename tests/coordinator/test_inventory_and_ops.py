"""Real processes: inventory rebalancing between stand-in shards, periodic export, Raft join, metrics."""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from bigfleet.coordclient.client import CoordinatorClient
from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.coordinator.snapshot import read_archive
from bigfleet.ctl.main import main as ctl
from bigfleet.testing import free_port, wait_until
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2
from bigfleet.v1alpha1 import coordinator_pb2 as pb

from .standin import Registry, StandInShard

pytestmark = pytest.mark.slow


async def test_aged_shortfall_pulls_idle_machines_from_a_donor(tmp_path: Path) -> None:
    g = CoordGroup(tmp_path, 1, extra=("--rebalance-interval", "0.3", "--transfer-cooldown", "60"))
    g.start_all()
    reg = Registry()
    donor = StandInShard("donor", reg, g.addresses, interval=0.1)
    needy = StandInShard("needy", reg, g.addresses, interval=0.1)
    client = CoordinatorClient(g.addresses)
    try:
        await asyncio.to_thread(g.leader)
        donor.give_idle([f"idle-{i}" for i in range(5)])
        req = capacity_pb2.NodeSelectorRequirement(key="zone", operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_IN, values=["z1"])
        needy.shortfall = pb.Shortfall(
            requirements=[req], deficit=provider_pb2.Resources(resources={"cpu": "16"}), priority=500, age_cycles=2
        )
        donor.start()
        needy.start()
        # Young shortfall: nothing moves (demand-pull with an age gate).
        await asyncio.sleep(1.0)
        assert (await client.call("ListTransfers", pb.ListTransfersRequest())).transfers == []
        needy.shortfall.age_cycles = 9
        deadline = time.monotonic() + 30
        while True:
            ts = (await client.call("ListTransfers", pb.ListTransfersRequest())).transfers
            if ts and ts[0].phase == "done":
                break
            assert time.monotonic() < deadline, ts
            await asyncio.sleep(0.1)
        [t] = ts
        assert (t.kind, t.from_shard_id, t.to_shard_id) == ("inventory", "donor", "needy")
        assert list(t.machine_ids) == ["idle-0", "idle-1"]
        assert needy.idle == {"idle-0", "idle-1"} and donor.idle == {"idle-2", "idle-3", "idle-4"}
        assert reg.violations == []
        # The donor got the selector: requirements and deficit travelled on the wire.
        rel = donor.inventory_releases
        assert list(rel) == [t.transfer_id]
        # Need met: no further transfer (and the cooldown holds anyway).
        await asyncio.sleep(1.0)
        assert len((await client.call("ListTransfers", pb.ListTransfersRequest())).transfers) == 1
    finally:
        await donor.stop()
        await needy.stop()
        await client.close()
        g.stop_all()


def test_periodic_export_metrics_and_raft_join(tmp_path: Path) -> None:
    export = tmp_path / "export"
    mport = free_port()
    g = CoordGroup(
        tmp_path / "g",
        4,
        extra=("--snapshot-export-dir", str(export), "--snapshot-export-interval", "0.5", "--rebalance-interval", "0"),
    )
    try:
        # Three voters; the 4th replica starts knowing them and is added with `bigfleetctl raft join`.
        for i in range(3):
            g.start(i, peers=[j for j in range(3) if j != i])
        leader = g.leader(among=[0, 1, 2])
        g.call(leader, "ReportShard", pb.ShardReport(shard_id="s1", shard_address="a:1"))
        g.call(leader, "LookupCluster", pb.LookupClusterRequest(cluster_id="c1"))
        latest = export / "latest"
        wait_until(lambda: (latest / "meta.json").exists() and (latest / "state").exists(), 20, what="periodic export")
        meta, _state = read_archive(latest.resolve())
        assert meta["Index"] > 0
        wait_until(lambda: read_archive(latest.resolve())[1]["cluster_to_shard"] == {"c1": "s1"}, 20, what="export content")

        g.extra = [*g.extra, "--metrics-listen", f"127.0.0.1:{mport}"]
        g.start(3, peers=[0, 1, 2])
        with pytest.raises(grpc.RpcError):
            g.call(3, "ListShards", pb.ListShardsRequest(), timeout=1.0)
        rc = ctl(["raft", "join", "--node-id", "node-3", "--raft-address", g.raft_addr(3), "--coordinator", ",".join(g.addresses[:3])])
        assert rc == 0
        # Joined: the new replica sees the leader and has the replicated state; with 4 voters,
        # losing the old leader still leaves a quorum of 3.
        from bigfleet.process.procs import health_status

        wait_until(lambda: health_status(g.addr(3), "bigfleet.v1alpha1.Coordinator") == 1, 20, what="joined replica sees a leader")
        g.kill(leader)
        new = g.leader(timeout=30)
        binds = g.call(new, "ListClusterBindings", pb.ListClusterBindingsRequest()).bindings  # type: ignore[attr-defined]
        assert [(b.cluster_id, b.shard_id) for b in binds] == [("c1", "s1")]
        text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read().decode()
        assert "bigfleet_coordinator_raft_term" in text and "bigfleet_coordinator_apply_total" in text
    finally:
        g.stop_all()
