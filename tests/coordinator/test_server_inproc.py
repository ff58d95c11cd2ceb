"""The gRPC surface of a single in-process replica: validation codes, soft state, instructions."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from bigfleet.coordclient.client import CoordinatorClient
from bigfleet.coordinator.server import CoordinatorConfig, CoordinatorDaemon, _unreachable
from bigfleet.testing import free_port
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2
from bigfleet.v1alpha1 import coordinator_pb2 as pb


@pytest.fixture
async def coord(tmp_path: Path) -> AsyncIterator[tuple[CoordinatorDaemon, CoordinatorClient]]:
    cfg = CoordinatorConfig(
        node_id="solo",
        listen=f"127.0.0.1:{free_port()}",
        raft_bind=f"127.0.0.1:{free_port()}",
        data_dir=tmp_path / "d",
        password="pw",
        rebalance_interval=0,
    )
    d = CoordinatorDaemon(cfg)
    await d.start()
    client = CoordinatorClient([d.grpc_address], timeout=5.0)
    try:
        deadline = time.monotonic() + 30
        while not d.ready():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        yield d, client
    finally:
        await client.close()
        await d.stop()


async def code_of(client: CoordinatorClient, method: str, req: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as ei:
        await client.call(method, req)
    return ei.value.code()


async def test_validation_codes(coord: tuple[CoordinatorDaemon, CoordinatorClient]) -> None:
    _, c = coord
    inv = grpc.StatusCode.INVALID_ARGUMENT
    assert await code_of(c, "ReportShard", pb.ShardReport()) == inv
    assert await code_of(c, "LookupCluster", pb.LookupClusterRequest()) == inv
    assert await code_of(c, "AssignDomain", pb.AssignDomainRequest(topology_key="k")) == inv
    assert await code_of(c, "UnassignDomain", pb.UnassignDomainRequest(topology_value="v")) == inv
    assert await code_of(c, "RemoveShard", pb.RemoveShardRequest()) == inv
    assert await code_of(c, "JoinRaftCluster", pb.JoinRaftClusterRequest(node_id="x")) == inv
    assert await code_of(c, "PlanRebalance", pb.PlanRebalanceRequest(load_factor=0.5)) == inv
    assert await code_of(c, "ApplyRebalance", pb.ApplyRebalanceRequest(max_moves=-1)) == inv
    assert await code_of(c, "LookupCluster", pb.LookupClusterRequest(cluster_id="c")) == grpc.StatusCode.UNAVAILABLE
    assert await code_of(c, "RemoveShard", pb.RemoveShardRequest(shard_id="nope")) == grpc.StatusCode.NOT_FOUND
    assert await code_of(c, "AbortTransfer", pb.AbortTransferRequest()) == inv
    assert await code_of(c, "AbortTransfer", pb.AbortTransferRequest(transfer_id="nope")) == grpc.StatusCode.NOT_FOUND
    # Unassigning an absent domain succeeds (idempotent).
    await c.call("UnassignDomain", pb.UnassignDomainRequest(topology_key="k", topology_value="v"))


async def test_values_that_would_poison_the_replicated_state_are_refused(
        coord: tuple[CoordinatorDaemon, CoordinatorClient]) -> None:
    """Ids, addresses and numbers are checked before anything is written: a shard id no shard can
    have would get clusters placed on it, a cluster id the shard refuses binds an operator that can
    never roll up, a NaN load factor crashed the planner (UNKNOWN)."""
    _, c = coord
    inv = grpc.StatusCode.INVALID_ARGUMENT
    for sid, addr in (("bad shard\n", "s:1"), ("x" * 300, "s:1"), ("s1", "not an address at all"), ("s1", "h:99999"),
                      ("s1", "h:0"), ("s1", "h:")):
        assert await code_of(c, "ReportShard", pb.ShardReport(shard_id=sid, shard_address=addr)) == inv, (sid, addr)
    bad_reports = [
        pb.ShardReport(shard_id="s1", summary=pb.ShardSummary(total_machines=-1)),
        pb.ShardReport(shard_id="s1", summary=pb.ShardSummary(per_zone_counts={"z": -3})),
        pb.ShardReport(shard_id="s1", summary=pb.ShardSummary(provider_address="nowhere")),
        pb.ShardReport(shard_id="s1", shortfalls=[pb.Shortfall(deficit=provider_pb2.Resources(resources={"cpu": "abc"}))]),
        pb.ShardReport(shard_id="s1", shortfalls=[pb.Shortfall(interruption_penalty_bucket=99)]),  # type: ignore[arg-type]
        pb.ShardReport(shard_id="s1", shortfalls=[pb.Shortfall(age_cycles=-1)]),
    ]
    for r in bad_reports:
        assert await code_of(c, "ReportShard", r) == inv, r
    for cid in ("bad cluster\t", "x\x00\x01", "c" * 100_000):
        assert await code_of(c, "LookupCluster", pb.LookupClusterRequest(cluster_id=cid)) == inv
    for lf in (float("nan"), float("inf"), 1e308 * 10):
        assert await code_of(c, "PlanRebalance", pb.PlanRebalanceRequest(load_factor=lf)) == inv
        assert await code_of(c, "ApplyRebalance", pb.ApplyRebalanceRequest(load_factor=lf)) == inv
    assert await code_of(c, "AssignDomain", pb.AssignDomainRequest(
        topology_key="bad key", topology_value="v", shard_id="s1")) == inv
    assert await code_of(c, "AssignDomain", pb.AssignDomainRequest(
        topology_key="k", topology_value="v" * 64, shard_id="s1")) == inv
    for addr in ("abc", "127.0.0.1:notaport", "127.0.0.1:99999", "127.0.0.1:0"):
        assert await code_of(c, "JoinRaftCluster", pb.JoinRaftClusterRequest(node_id="n2", raft_address=addr)) == inv
    assert (await c.call("ListShards", pb.ListShardsRequest())).shards == []
    # a well-formed report and a plain load factor still pass
    await c.call("ReportShard", pb.ShardReport(shard_id="s1", shard_address="[::1]:7780",
                                               summary=pb.ShardSummary(provider_address="dns:///prov:7443")))
    await c.call("PlanRebalance", pb.PlanRebalanceRequest(load_factor=1.5))


async def test_joining_an_address_nobody_listens_on_changes_nothing(
        coord: tuple[CoordinatorDaemon, CoordinatorClient]) -> None:
    """Adding a member that never answers would cost a group of one its quorum for good (it
    survived restarts); the join is refused before the membership changes."""
    d, c = coord
    dead = f"127.0.0.1:{free_port()}"
    assert await code_of(c, "JoinRaftCluster", pb.JoinRaftClusterRequest(
        node_id="n2", raft_address=dead)) == grpc.StatusCode.FAILED_PRECONDITION
    assert dead not in d.r().members()
    # still the leader: a write goes through at once
    await c.call("ReportShard", pb.ShardReport(shard_id="s1", shard_address="127.0.0.1:7780"))
    assert [s.shard_id for s in (await c.call("ListShards", pb.ListShardsRequest())).shards] == ["s1"]


async def test_a_replica_that_binds_its_raft_port_a_moment_after_the_join_is_reachable() -> None:
    """`bigfleetctl raft join` right after starting a replica: its Raft port opens from pysyncobj's
    thread a moment later; the probe waits for it instead of refusing (nobody at all: refused)."""
    port = free_port()

    async def listen_later() -> asyncio.Server:
        await asyncio.sleep(0.6)
        return await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", port)

    later = asyncio.create_task(listen_later())
    try:
        assert await _unreachable(f"127.0.0.1:{port}", settle=5.0) == ""
    finally:
        (await later).close()
    assert await _unreachable(f"127.0.0.1:{free_port()}", settle=0.5) != ""


async def test_reports_soft_state_and_instruction_cycle(coord: tuple[CoordinatorDaemon, CoordinatorClient]) -> None:
    d, c = coord
    summary = pb.ShardSummary(total_machines=10, free_machines=3, provider_address="prov:1", per_zone_counts={"z1": 10})
    sf = pb.Shortfall(priority=7, age_cycles=2, deficit=provider_pb2.Resources(resources={"cpu": "4"}))
    ack = await c.call("ReportShard", pb.ShardReport(shard_id="s1", cycle=5, shard_epoch=1, summary=summary, shortfalls=[sf], shard_address="s1:7780"))
    assert ack.acknowledged and ack.coordinator_term >= 1 and list(ack.instructions) == []
    # An out-of-order report (lower cycle, same epoch) does not overwrite the soft state.
    await c.call("ReportShard", pb.ShardReport(shard_id="s1", cycle=3, shard_epoch=1, summary=pb.ShardSummary(total_machines=99)))
    reps = (await c.call("ListShardReports", pb.ListShardReportsRequest(shard_id="s1"))).reports
    assert [(r.cycle, r.summary.total_machines) for r in reps] == [(5, 10)]
    assert reps[0].shortfalls[0].priority == 7
    # A report without a summary (a new shard leader before its first reconcile) keeps the last one.
    await c.call("ReportShard", pb.ShardReport(shard_id="s1", cycle=1, shard_epoch=2))
    reps = (await c.call("ListShardReports", pb.ListShardReportsRequest(shard_id="s1"))).reports
    assert [(r.cycle, r.summary.total_machines) for r in reps] == [(1, 10)]
    assert (await c.call("ListShardReports", pb.ListShardReportsRequest(shard_id="other"))).reports == []
    # A restarted shard (new epoch) may start its cycle count over.
    await c.call("ReportShard", pb.ShardReport(shard_id="s1", cycle=1, shard_epoch=2, summary=summary))
    reps = (await c.call("ListShardReports", pb.ListShardReportsRequest())).reports
    assert reps[0].cycle == 1
    # Instructions: queued by AssignDomain, redelivered until acked, cleared by the ack.
    await c.call("AssignDomain", pb.AssignDomainRequest(topology_key="rack", topology_value="r1", shard_id="s1"))
    a1 = await c.call("ReportShard", pb.ShardReport(shard_id="s1", cycle=2, shard_epoch=2))
    a2 = await c.call("ReportShard", pb.ShardReport(shard_id="s1", cycle=3, shard_epoch=2))
    assert len(a1.instructions) == 1 and a1.instructions[0].instruction_id == a2.instructions[0].instruction_id
    ins = a1.instructions[0]
    assert ins.coordinator_term == a1.coordinator_term and ins.sequence_number >= 1 and len(ins.instruction_id) == 16
    done = pb.InstructAck(instruction_id=ins.instruction_id, outcome=pb.InstructAck.OUTCOME_ACCEPTED)
    a3 = await c.call("ReportShard", pb.ShardReport(shard_id="s1", cycle=4, shard_epoch=2, instruction_acks=[done]))
    assert list(a3.instructions) == []
    # The provider address rides on the summary and is kept with the shard.
    assert d.r().read(lambda st: st.shards["s1"].provider_address) == "prov:1"
    # SnapshotSave streams meta first, then data.
    frames = [f async for f in await c.stream("SnapshotSave", pb.SnapshotSaveRequest())]
    assert frames[0].WhichOneof("payload") == "meta_json" and all(f.WhichOneof("payload") == "data" for f in frames[1:])
    assert json.loads(frames[0].meta_json)["Size"] == sum(len(f.data) for f in frames[1:]) > 0


async def test_silent_shard_is_down_not_deleted(tmp_path: Path) -> None:
    cfg = CoordinatorConfig(
        node_id="solo",
        listen=f"127.0.0.1:{free_port()}",
        raft_bind=f"127.0.0.1:{free_port()}",
        data_dir=tmp_path / "d",
        password="pw",
        rebalance_interval=0,
        down_after=0.5,
    )
    d = CoordinatorDaemon(cfg)
    await d.start()
    c = CoordinatorClient([d.grpc_address])
    try:
        deadline = time.monotonic() + 30
        while not d.ready():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        await c.call("ReportShard", pb.ShardReport(shard_id="s1", shard_address="s1:1"))
        assert (await c.call("LookupCluster", pb.LookupClusterRequest(cluster_id="c1"))).shard_id == "s1"
        await asyncio.sleep(0.8)
        plan = await c.call("PlanRebalance", pb.PlanRebalanceRequest())
        assert plan.live_shards == 0 and list(plan.stranded_clusters) == ["c1"]
        assert [s.shard_id for s in (await c.call("ListShards", pb.ListShardsRequest())).shards] == ["s1"]
        # Its cluster stays bound to it (sticky); a new cluster cannot be placed on a down shard.
        assert (await c.call("LookupCluster", pb.LookupClusterRequest(cluster_id="c1"))).shard_id == "s1"
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await c.call("LookupCluster", pb.LookupClusterRequest(cluster_id="c2"))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        # One report and it is live again.
        await c.call("ReportShard", pb.ShardReport(shard_id="s1"))
        assert (await c.call("LookupCluster", pb.LookupClusterRequest(cluster_id="c2"))).shard_id == "s1"
    finally:
        await c.close()
        await d.stop()


async def test_heartbeat_loop_runs_a_handoff_while_a_drain_is_still_draining(
    coord: tuple[CoordinatorDaemon, CoordinatorClient],
) -> None:
    from bigfleet.coordclient.client import BaseInstructionHandler, HeartbeatLoop

    d, c = coord
    release_started = asyncio.Event()
    drain_gate = asyncio.Event()

    class Donor(BaseInstructionHandler):
        async def cross_shard_drain(self, msg: pb.CrossShardDrain) -> list[str]:
            await drain_gate.wait()  # victims take minutes to drain
            return []

        async def release_cluster(self, msg: pb.ReleaseCluster) -> list[str]:
            release_started.set()
            return ["m1"]

    await c.call("ReportShard", pb.ShardReport(shard_id="s1", shard_address="s1:1"))
    await c.call("ReportShard", pb.ShardReport(shard_id="s2", shard_address="s2:1"))
    await d.write({"op": "bind_cluster", "cluster_id": "k", "shard_id": "s1", "now": 1})
    await d.write({"op": "start_transfer", "transfer_id": "drain-1", "kind": "drain", "from": "s1", "to": "s2", "now": 2, "preemptor_priority": 9})
    await d.write({"op": "start_handoffs", "now": 3, "moves": [{"cluster_id": "k", "from": "s1", "to": "s2", "transfer_id": "h-1"}]})
    loop = HeartbeatLoop(CoordinatorClient([d.grpc_address]), "s1", lambda: pb.ShardReport(), Donor(), interval=0.1)
    task = asyncio.create_task(loop.run())
    try:
        await asyncio.wait_for(release_started.wait(), 10)

        async def phase(tid: str) -> str:
            return str(d.r().read(lambda st: st.transfers[tid].phase))

        deadline = time.monotonic() + 10
        while await phase("h-1") != "adopting":
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert await phase("drain-1") == "releasing"  # still draining, did not block the handoff
        drain_gate.set()
        while await phase("drain-1") != "done":
            assert time.monotonic() < deadline + 10
            await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await loop.client.close()


@pytest.mark.parametrize(
    ("released", "second_kind"),
    [
        ([], "drain"),  # tier 1 found nothing matching: the next tick preempts on the donor
        (["idle-gpu-0"], None),  # tier 1 moved a machine: nothing more this tick (cooldown)
    ],
    ids=["empty-release-escalates-to-tier-2", "matching-release-stays-tier-1"],
)
async def test_an_empty_tier1_release_escalates_to_a_drain(
    coord: tuple[CoordinatorDaemon, CoordinatorClient], released: list[str], second_kind: str | None
) -> None:
    """The 2-shard report: "lo" holds the pool (a priority-1 000 cluster) and free machines of
    other shapes; "hi" has an aged priority-2 000 000 shortfall. The leader's own loop: plan,
    start, the donor's ack through ReportShard, plan again."""
    d, c = coord
    req = capacity_pb2.NodeSelectorRequirement(
        key="node.kubernetes.io/instance-type", operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_IN, values=["gpu-8"]
    )
    unit = provider_pb2.Resources(resources={"gpu": "8"})
    short = pb.Shortfall(requirements=[req], deficit=provider_pb2.Resources(resources={"gpu": "8"}), priority=2_000_000,
                         age_cycles=20, min_unit=unit)
    lo_summary = pb.ShardSummary(total_machines=40, free_machines=3)
    await c.call("ReportShard", pb.ShardReport(shard_id="lo", cycle=1, summary=lo_summary))
    await c.call("ReportShard", pb.ShardReport(shard_id="hi", cycle=1, summary=pb.ShardSummary(total_machines=4), shortfalls=[short]))

    def transfers() -> list[tuple[str, str, str, str, int]]:
        return d.r().read(
            lambda st: [(t.kind, t.from_shard, t.to_shard, t.phase, t.preemptor_priority)
                        for t in sorted(st.transfers.values(), key=lambda t: t.created_at_ns)]
        )

    # The donor has free machines, so tier 1 comes first even though the shortfall is past the drain age.
    assert await d.rebalance_inventory_once() == 1
    assert transfers() == [("inventory", "lo", "hi", "releasing", 2_000_000)]
    [rel] = (await c.call("ReportShard", pb.ShardReport(shard_id="lo", cycle=2, summary=lo_summary))).instructions
    assert rel.WhichOneof("payload") == "transfer_ownership"
    assert rel.transfer_ownership.min_unit == unit  # the donor picks only machines that hold one
    ack = pb.InstructAck(instruction_id=rel.instruction_id, outcome=pb.InstructAck.OUTCOME_ACCEPTED, machine_ids=released)
    await c.call("ReportShard", pb.ShardReport(shard_id="lo", cycle=3, summary=lo_summary, instruction_acks=[ack]))
    if not released:
        assert transfers()[0][3] == "done"
        assert await d.rebalance_inventory_once() == 1
        assert [t[:3] for t in transfers()] == [("inventory", "lo", "hi"), (second_kind, "lo", "hi")]
        [drain] = (await c.call("ReportShard", pb.ShardReport(shard_id="lo", cycle=4, summary=lo_summary))).instructions
        assert drain.cross_shard_drain.preemptor_priority == 2_000_000
        assert list(drain.cross_shard_drain.requirements) == [req]
        assert drain.cross_shard_drain.min_unit == unit
        # The drain is in flight: no third transfer is started beside it.
        assert await d.rebalance_inventory_once() == 0
    else:
        assert transfers()[0][3] == "adopting"
        assert await d.rebalance_inventory_once() == 0


async def test_a_shard_without_an_address_gets_no_new_cluster(coord: tuple[CoordinatorDaemon, CoordinatorClient]) -> None:
    """LookupCluster hands the shard's address to the operator: a shard that never reported one is
    skipped by placement (and with no other shard there is nothing to place on)."""
    _, c = coord
    await c.call("ReportShard", pb.ShardReport(shard_id="noaddr", cycle=1))
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await c.call("LookupCluster", pb.LookupClusterRequest(cluster_id="c-first"))
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    await c.call("ReportShard", pb.ShardReport(shard_id="dialable", cycle=1, shard_address="127.0.0.1:7780"))
    for i in range(20):
        r = await c.call("LookupCluster", pb.LookupClusterRequest(cluster_id=f"c{i}"))
        assert (r.shard_id, r.shard_address) == ("dialable", "127.0.0.1:7780")
    # a later report without the address keeps the registered one
    await c.call("ReportShard", pb.ShardReport(shard_id="dialable", cycle=2))
    r = await c.call("LookupCluster", pb.LookupClusterRequest(cluster_id="c0"))
    assert r.shard_address == "127.0.0.1:7780"
