"""Three real coordinator processes: election, leader-only RPCs, failover, static stability, handoff."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from bigfleet.coordclient.client import (
    DIRECT_METADATA,
    CoordinatorClient,
    CoordinatorUnavailable,
    lookup_cluster,
)
from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.v1alpha1 import coordinator_pb2 as pb

from .standin import Registry, StandInShard

pytestmark = pytest.mark.slow


@pytest.fixture
def group(tmp_path: Path) -> Iterator[CoordGroup]:
    g = CoordGroup(tmp_path, 3, extra=("--down-after", "30", "--rebalance-interval", "0"))
    g.start_all()
    try:
        yield g
    finally:
        g.stop_all()


async def until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


def test_leader_only_failover_and_no_acknowledged_write_lost(group: CoordGroup) -> None:
    leader = group.leader()
    followers = [i for i in range(3) if i != leader]
    # Only the leader serves; a follower asked not to forward (test_forwarding.py) refuses.
    for f in followers:
        with pytest.raises(grpc.RpcError) as ei:
            group.call(f, "ListShards", pb.ListShardsRequest(), metadata=DIRECT_METADATA)
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not leader" in ei.value.details()
    # Leader hints appear once every member registered its address.
    hinted = group.addr(leader)

    def hint_ok() -> bool:
        try:
            group.call(followers[0], "ListShards", pb.ListShardsRequest(), metadata=DIRECT_METADATA)
        except grpc.RpcError as e:
            return f"leader={hinted}" in (e.details() or "")
        return False

    deadline = time.monotonic() + 20
    while not hint_ok():
        assert time.monotonic() < deadline, "no leader hint"
        time.sleep(0.1)
    with pytest.raises(grpc.RpcError) as ei:
        group.call(leader, "ReportShard", pb.ShardReport())
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as ei:
        group.call(leader, "LookupCluster", pb.LookupClusterRequest(cluster_id="x"))
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE  # no shard registered yet

    for s in range(4):
        group.call(leader, "ReportShard", pb.ShardReport(shard_id=f"shard-{s}", shard_address=f"10.0.0.{s}:7780"))
    acked: dict[str, str] = {}
    kills = []
    for round_ in range(2):  # reduced count in CI; bench/bench_coordinator.py runs 20
        for c in range(15):
            cid = f"cluster-{round_}-{c}"
            r = group.call(leader, "LookupCluster", pb.LookupClusterRequest(cluster_id=cid))
            acked[cid] = r.shard_id  # type: ignore[attr-defined]
        group.kill(leader)
        t0 = time.monotonic()
        new = group.leader(timeout=30)
        kills.append(time.monotonic() - t0)
        assert new != leader
        got = group.call(new, "ListClusterBindings", pb.ListClusterBindingsRequest())
        bound = {b.cluster_id: b.shard_id for b in got.bindings}  # type: ignore[attr-defined]
        assert bound == acked, "an acknowledged write was lost across failover"
        # Lookups are sticky on the new leader.
        for cid, sid in list(acked.items())[:5]:
            assert group.call(new, "LookupCluster", pb.LookupClusterRequest(cluster_id=cid)).shard_id == sid  # type: ignore[attr-defined]
        group.start(leader)  # the killed replica rejoins from its journal
        leader = new
    print(f"failover times (s): {[round(k, 3) for k in kills]}")
    # Removing a shard unbinds only its clusters; unknown shard is NOT_FOUND.
    victim = "shard-1"
    group.call(leader, "RemoveShard", pb.RemoveShardRequest(shard_id=victim))
    with pytest.raises(grpc.RpcError) as ei:
        group.call(leader, "RemoveShard", pb.RemoveShardRequest(shard_id=victim))
    assert ei.value.code() == grpc.StatusCode.NOT_FOUND
    got = group.call(leader, "ListClusterBindings", pb.ListClusterBindingsRequest())
    bound = {b.cluster_id: b.shard_id for b in got.bindings}  # type: ignore[attr-defined]
    assert bound == {c: s for c, s in acked.items() if s != victim}
    # Domains: codes from the spec.
    group.call(leader, "AssignDomain", pb.AssignDomainRequest(topology_key="rack", topology_value="r1", shard_id="shard-0"))
    for req, code in [
        (pb.AssignDomainRequest(topology_key="rack", topology_value="r1", shard_id="shard-2"), grpc.StatusCode.ALREADY_EXISTS),
        (pb.AssignDomainRequest(topology_key="rack", topology_value="r2", shard_id="nope"), grpc.StatusCode.NOT_FOUND),
        (pb.AssignDomainRequest(topology_key="rack", shard_id="shard-0"), grpc.StatusCode.INVALID_ARGUMENT),
    ]:
        with pytest.raises(grpc.RpcError) as ei:
            group.call(leader, "AssignDomain", req)
        assert ei.value.code() == code
    ack = group.call(leader, "ReportShard", pb.ShardReport(shard_id="shard-0"))
    assert [i.assign_domain.topology_value for i in ack.instructions] == ["r1"]  # type: ignore[attr-defined]


async def test_shards_keep_cycling_without_quorum_and_resume_reporting(group: CoordGroup) -> None:
    await asyncio.to_thread(group.leader)
    reg = Registry()
    shard = StandInShard("shard-a", reg, group.addresses, interval=0.1)
    shard.start()
    try:
        await until(lambda: shard.loop.reports_ok >= 3, 20, "first reports")
        # Lose quorum: kill two of three replicas.
        survivors = [0]
        for i in (1, 2):
            group.kill(i)
        failed0, cycles0 = shard.loop.reports_failed, shard.cycles
        await until(lambda: shard.loop.reports_failed >= failed0 + 3, 30, "reports failing without quorum")
        await until(lambda: shard.cycles >= cycles0 + 20, 30, "shard cycles while the coordinator is down")
        assert all(not t.done() for t in shard._tasks), "the shard's loops must survive coordinator loss"
        with pytest.raises(CoordinatorUnavailable):
            await CoordinatorClient([group.addr(i) for i in survivors], timeout=1.0).call("ListShards", pb.ListShardsRequest())
        # Quorum back: reporting resumes by itself.
        for i in (1, 2):
            group.start(i)
        ok0 = shard.loop.reports_ok
        await until(lambda: shard.loop.reports_ok >= ok0 + 3, 40, "reports resuming after quorum returns")
    finally:
        await shard.stop()


async def test_fenced_cluster_handoff_survives_leader_failover(group: CoordGroup) -> None:
    leader = await asyncio.to_thread(group.leader)
    reg = Registry()
    a = StandInShard("shard-a", reg, group.addresses)
    b = StandInShard("shard-b", reg, group.addresses)
    a.start()
    client = CoordinatorClient(group.addresses)
    try:
        await until(lambda: a.loop.reports_ok >= 1, 20, "shard-a registered")
        clusters = [f"c{i}" for i in range(12)]
        for cid in clusters:  # only shard-a is live: everything binds there
            r = await lookup_cluster(group.addresses, cid)
            assert r.shard_id == "shard-a" and r.newly_bound and r.shard_address == "shard-a.test:7780"
            a.serve(cid, [f"{cid}-m{j}" for j in range(3)])
        b.adopt_gate = asyncio.Event()
        b.start()
        await until(lambda: b.loop.reports_ok >= 1, 20, "shard-b registered")
        # Adding a shard moved nothing by itself.
        bindings = await client.call("ListClusterBindings", pb.ListClusterBindingsRequest())
        assert {x.shard_id for x in bindings.bindings} == {"shard-a"}
        plan = await client.call("PlanRebalance", pb.PlanRebalanceRequest())
        moves = {m.cluster_id for m in plan.moves}
        assert moves and all(m.to_shard_id == "shard-b" for m in plan.moves)
        assert len(moves) <= 7  # cap(12, 2) = ceil/floor bound: never more than the cap requires
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await client.call("ApplyRebalance", pb.ApplyRebalanceRequest(expected_plan_id="0000"))
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        applied = await client.call("ApplyRebalance", pb.ApplyRebalanceRequest(expected_plan_id=plan.plan_id))
        assert {m.cluster_id for m in applied.started} == moves

        async def phases() -> dict[str, str]:
            tr = await client.call("ListTransfers", pb.ListTransfersRequest())
            return {t.cluster_id: t.phase for t in tr.transfers}

        # shard-a releases; shard-b's adopt is held: the handoff sits in "adopting".
        deadline = time.monotonic() + 20
        while set((await phases()).values()) != {"adopting"}:
            assert time.monotonic() < deadline, await phases()
            await asyncio.sleep(0.05)
        assert all(reg.cluster_owner[c] is None for c in moves)  # released, not yet adopted: nobody acts
        moving = next(iter(moves))
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await client.call("LookupCluster", pb.LookupClusterRequest(cluster_id=moving))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        # Kill the leader mid-handoff: the next leader continues from Raft state.
        group.kill(leader)
        await asyncio.to_thread(group.leader, 30.0)
        b.adopt_gate.set()
        deadline = time.monotonic() + 30
        while set((await phases()).values()) != {"done"}:
            assert time.monotonic() < deadline, await phases()
            await asyncio.sleep(0.05)
        assert reg.violations == []
        for cid in clusters:
            want = "shard-b" if cid in moves else "shard-a"
            assert reg.cluster_owner[cid] == want
            assert all(reg.machine_owner[f"{cid}-m{j}"] == want for j in range(3))
            r = await lookup_cluster(group.addresses, cid)
            assert r.shard_id == want and r.binding_epoch == (2 if cid in moves else 1)
        assert set(b.clusters) == moves and not (set(a.clusters) & moves)
        again = await client.call("PlanRebalance", pb.PlanRebalanceRequest())
        assert list(again.moves) == []
    finally:
        await a.stop()
        await b.stop()
        await client.close()
