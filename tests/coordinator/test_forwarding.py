"""A follower coordinator forwards client RPCs to the leader (one hop, the caller's deadline) and
relays the answer unchanged; the operator's resolver and CoordinatorClient follow a leader hint
when a follower still refuses.

The first test runs a real 3-replica group; the others put the forwarder in front of stand-in
servicers, to see what a leader receives and what a caller gets back in the failure cases."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from bigfleet.coordclient.client import (
    DIRECT_METADATA,
    FORWARDED_METADATA_KEY,
    LEADER_METADATA_KEY,
    RETRY_LATER_KEY,
    CoordinatorClient,
)
from bigfleet.coordinator.forward import LeaderForwarder
from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.operator.app import CoordinatorResolver
from bigfleet.rpc import insecure_channel, new_server
from bigfleet.testing import free_port
from bigfleet.v1alpha1 import coordinator_pb2 as pb
from bigfleet.v1alpha1 import coordinator_pb2_grpc as pbg

SLACK = 0.05


def _trailer(err: grpc.RpcError, key: str) -> str:
    return str(dict(err.trailing_metadata() or ()).get(key, ""))


@pytest.mark.slow
def test_a_follower_answers_as_the_leader_does(tmp_path: Path) -> None:
    g = CoordGroup(tmp_path, 3, extra=("--rebalance-interval", "0"))
    g.start_all()
    try:
        def hinting(leader: int) -> bool:  # every member registered its gRPC address: followers know where to forward
            for f in (i for i in range(3) if i != leader):
                try:
                    g.call(f, "ListShards", pb.ListShardsRequest(), metadata=DIRECT_METADATA)
                except grpc.RpcError as err:
                    if _trailer(err, LEADER_METADATA_KEY) != g.addr(leader):
                        return False
            return True

        deadline = time.monotonic() + 20
        # (0.3-0.6 s elections: on a loaded box the first leader found may not be the one that stays)
        while not hinting(leader := g.leader()):
            assert time.monotonic() < deadline, "followers never named the leader\n" + g.logs()[-4000:]
            time.sleep(0.1)
        followers = [i for i in range(3) if i != leader]

        # ReportShard is not forwarded (the leader pins it to the shard's own certificate): a
        # follower refuses it with the leader hint, which shards follow.
        with pytest.raises(grpc.RpcError) as ei:
            g.call(followers[0], "ReportShard", pb.ShardReport(shard_id="shard-0", shard_address="10.0.0.1:7780"))
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert _trailer(ei.value, LEADER_METADATA_KEY) == g.addr(leader)
        for s in range(3):
            g.call(leader, "ReportShard", pb.ShardReport(shard_id=f"shard-{s}", shard_address=f"10.0.0.{s}:7780"))

        # LookupCluster through a follower binds a new cluster (a write, on the leader) ...
        first: Any = g.call(followers[0], "LookupCluster", pb.LookupClusterRequest(cluster_id="c-new"))
        assert first.newly_bound and first.shard_id.startswith("shard-") and first.shard_address
        # ... and then every replica gives the leader's answer, field for field.
        want: Any = g.call(leader, "LookupCluster", pb.LookupClusterRequest(cluster_id="c-new"))
        assert (want.shard_id, want.shard_address, want.binding_epoch, want.newly_bound) == (
            first.shard_id, first.shard_address, first.binding_epoch, False,
        )
        for f in followers:
            assert g.call(f, "LookupCluster", pb.LookupClusterRequest(cluster_id="c-new")) == want
        for cid in (f"c{i}" for i in range(6)):
            bound: Any = g.call(followers[1], "LookupCluster", pb.LookupClusterRequest(cluster_id=cid))
            assert bound.newly_bound
            req = pb.LookupClusterRequest(cluster_id=cid)
            assert g.call(followers[1], "LookupCluster", req) == g.call(leader, "LookupCluster", req)

        # Reads and writes bigfleetctl uses, through a follower.
        status = pb.GetClusterStatusRequest(cluster_id="c-new")
        assert g.call(followers[1], "GetClusterStatus", status) == g.call(leader, "GetClusterStatus", status)
        bindings = pb.ListClusterBindingsRequest()
        assert g.call(followers[0], "ListClusterBindings", bindings) == g.call(leader, "ListClusterBindings", bindings)
        g.call(followers[1], "AssignDomain", pb.AssignDomainRequest(topology_key="rack", topology_value="r1", shard_id="shard-1"))
        listed: Any = g.call(leader, "ListDomainAssignments", pb.ListDomainAssignmentsRequest())
        assert [(a.topology_value, a.shard_id) for a in listed.assignments] == [("r1", "shard-1")]
        # The leader's refusals come back unchanged: code and details.
        for req in (pb.LookupClusterRequest(), pb.LookupClusterRequest(cluster_id="x" * 300)):
            codes = []
            for i in (leader, followers[0]):
                try:
                    g.call(i, "LookupCluster", req)
                    codes.append((grpc.StatusCode.OK, ""))
                except grpc.RpcError as err:
                    codes.append((err.code(), err.details()))
            assert codes[0] == codes[1], codes
        with pytest.raises(grpc.RpcError) as ei:
            g.call(followers[0], "AssignDomain", pb.AssignDomainRequest(topology_key="rack", topology_value="r1", shard_id="shard-2"))
        assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
        # The server-streaming snapshot is relayed frame by frame.
        with grpc.insecure_channel(g.addr(followers[1])) as ch:
            frames = list(pbg.CoordinatorStub(ch).SnapshotSave(pb.SnapshotSaveRequest(), timeout=10))
        assert frames[0].meta_json and b"c-new" in b"".join(f.data for f in frames[1:])
    finally:
        g.stop_all()


@pytest.mark.slow
async def test_forwarding_under_mtls(tmp_path: Path) -> None:
    """The follower checks the caller, then forwards with its own (admin) identity."""
    from bigfleet.security.certs import make_local_pki
    from bigfleet.security.tls import TLSConfig, dial

    pki = tmp_path / "pki"
    make_local_pki(pki, shards=["shard-0"], clusters=["cluster-a"])

    def tls(stem: str) -> TLSConfig:
        return TLSConfig.from_paths(pki / f"{stem}.crt", pki / f"{stem}.key", pki / "ca.crt")

    admin = ("--tls-cert", str(pki / "admin.crt"), "--tls-key", str(pki / "admin.key"), "--tls-ca", str(pki / "ca.crt"))
    g = CoordGroup(tmp_path / "g", 3, extra=("--rebalance-interval", "0", *admin))
    for i in range(3):
        g.start(i)
    shard = CoordinatorClient(g.addresses, tls=tls("shard-shard-0"), timeout=5.0)
    try:
        deadline = time.monotonic() + 30
        while True:  # registers through whichever replica leads (ReportShard follows the hint)
            try:
                await shard.call("ReportShard", pb.ShardReport(shard_id="shard-0", shard_address="s0:7780"))
                break
            except Exception:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.2)
        leader = shard.leader
        followers = [a for a in g.addresses if a != leader]

        async def lookup(addr: str, cluster_id: str) -> pb.LookupClusterResponse:
            async with dial(addr, tls("cluster-cluster-a")) as ch:
                resp: pb.LookupClusterResponse = await pbg.CoordinatorStub(ch).LookupCluster(
                    pb.LookupClusterRequest(cluster_id=cluster_id), timeout=5
                )
                return resp

        async def first_answer(addr: str) -> pb.LookupClusterResponse:
            deadline = time.monotonic() + 30
            while True:  # until the follower listens and knows the leader's gRPC address
                try:
                    return await lookup(addr, "cluster-a")
                except grpc.aio.AioRpcError as err:
                    assert err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION), err
                    assert time.monotonic() < deadline, err
                    await asyncio.sleep(0.2)

        firsts = [await first_answer(f) for f in followers]
        assert [(r.shard_id, r.newly_bound) for r in firsts] == [("shard-0", True), ("shard-0", False)]
        assert leader is not None
        want = await lookup(leader, "cluster-a")
        for f in followers:
            assert await lookup(f, "cluster-a") == want
        # The caller's identity is checked on the follower: cluster-a may not look up cluster-b.
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await lookup(followers[1], "cluster-b")
        assert ei.value.code() == grpc.StatusCode.PERMISSION_DENIED
        # A readonly caller's role travels with the forwarded call: it sees the binding through a
        # follower, but binds nothing (the leader sees the follower's admin certificate).
        async with dial(followers[0], tls("readonly")) as ch:
            stub = pbg.CoordinatorStub(ch)
            got = await stub.LookupCluster(pb.LookupClusterRequest(cluster_id="cluster-a"), timeout=5)
            assert got.shard_id == "shard-0"
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await stub.LookupCluster(pb.LookupClusterRequest(cluster_id="cluster-b"), timeout=5)
            assert ei.value.code() == grpc.StatusCode.NOT_FOUND, ei.value
            status = await stub.GetClusterStatus(pb.GetClusterStatusRequest(cluster_id="cluster-b"), timeout=5)
            assert not status.bound
    finally:
        await shard.close()
        g.stop_all()


# --- the forwarder in front of stand-in servicers ------------------------------------------------


class StandIn(pbg.CoordinatorServicer):
    """Answers like a leader (``answers``) or refuses like a follower (``hint``), and records calls."""

    def __init__(self, hint: str = "", answers: bool = True) -> None:
        self.hint = hint
        self.answers = answers
        self.calls: list[tuple[str, dict[str, str], float | None]] = []

    async def _seen(self, method: str, context: grpc.aio.ServicerContext) -> None:
        md = {k: v for k, v in context.invocation_metadata() or () if isinstance(v, str)}
        self.calls.append((method, md, context.time_remaining()))
        if not self.answers:
            trailer = ((LEADER_METADATA_KEY, self.hint),) if self.hint else ()
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                "coordinator: not leader" + (f"; leader={self.hint}" if self.hint else ""),
                                trailing_metadata=trailer)

    async def LookupCluster(self, request: pb.LookupClusterRequest, context: grpc.aio.ServicerContext) -> pb.LookupClusterResponse:
        await self._seen("LookupCluster", context)
        if request.cluster_id == "moving":
            await context.abort(grpc.StatusCode.UNAVAILABLE, "cluster moving is being handed off; retry shortly",
                                trailing_metadata=((RETRY_LATER_KEY, "handoff"),))
        context.set_trailing_metadata((("x-leader-said", "hello"),))
        return pb.LookupClusterResponse(cluster_id=request.cluster_id, shard_id="shard-0", shard_address="s0:7780", binding_epoch=3)

    async def ReportShard(self, request: pb.ShardReport, context: grpc.aio.ServicerContext) -> pb.ReportAck:
        await self._seen("ReportShard", context)
        return pb.ReportAck(acknowledged=True)

    async def SnapshotSave(self, request: pb.SnapshotSaveRequest, context: grpc.aio.ServicerContext) -> AsyncIterator[pb.SnapshotSaveChunk]:
        await self._seen("SnapshotSave", context)
        yield pb.SnapshotSaveChunk(meta_json=b"{}")
        yield pb.SnapshotSaveChunk(data=b"state")


class Replica:
    def __init__(self, servicer: StandIn, forwarder: LeaderForwarder | None = None) -> None:
        self.servicer = servicer
        self.forwarder = forwarder
        self.addr = f"127.0.0.1:{free_port()}"

    async def start(self) -> Replica:
        self.server, _ = new_server(interceptors=[self.forwarder] if self.forwarder else [])
        pbg.add_CoordinatorServicer_to_server(self.servicer, self.server)
        self.server.add_insecure_port(self.addr)
        await self.server.start()
        return self

    async def stop(self) -> None:
        await self.server.stop(0)
        if self.forwarder is not None:
            await self.forwarder.close()


def forwarding_follower(leader: str, max_timeout: float = 7.0) -> Replica:
    """A follower that knows ``leader``; its own handlers refuse with that hint."""
    fwd = LeaderForwarder(node_id="coord-1", ready=lambda: False, leader_hint=lambda: leader,
                          self_address=lambda: "me:1", max_timeout=max_timeout)
    return Replica(StandIn(hint=leader, answers=False), fwd)


async def call(addr: str, method: str, req: Any, timeout: float | None = 5.0, metadata: Any = None) -> Any:
    async with insecure_channel(addr) as ch:
        return await getattr(pbg.CoordinatorStub(ch), method)(req, timeout=timeout, metadata=metadata)


async def test_forwarded_call_reaches_the_leader_once_within_the_callers_deadline() -> None:
    leader = await Replica(StandIn()).start()
    follower = await forwarding_follower(leader.addr).start()
    try:
        resp = await call(follower.addr, "LookupCluster", pb.LookupClusterRequest(cluster_id="c1"), timeout=2.0)
        assert resp == pb.LookupClusterResponse(cluster_id="c1", shard_id="shard-0", shard_address="s0:7780", binding_epoch=3)
        ((method, md, remaining),) = leader.servicer.calls
        assert method == "LookupCluster" and md[FORWARDED_METADATA_KEY] == "coord-1"
        # (gRPC rounds a deadline up when it encodes it in the grpc-timeout header: a few ms.)
        assert remaining is not None and 0 < remaining <= 2.0 + SLACK
        assert follower.servicer.calls == []  # the follower's own handler never ran
        # No deadline from the caller: the forwarder's cap.
        await call(follower.addr, "LookupCluster", pb.LookupClusterRequest(cluster_id="c1"), timeout=None)
        remaining = leader.servicer.calls[-1][2]
        assert remaining is not None and 6.0 < remaining <= 7.0 + SLACK
        # The leader's trailing metadata and its errors come back unchanged.
        async with insecure_channel(follower.addr) as ch:
            c = pbg.CoordinatorStub(ch).LookupCluster(pb.LookupClusterRequest(cluster_id="c2"), timeout=5)
            await c
            assert ("x-leader-said", "hello") in tuple(await c.trailing_metadata())
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call(follower.addr, "LookupCluster", pb.LookupClusterRequest(cluster_id="moving"))
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert ei.value.details() == "cluster moving is being handed off; retry shortly"
        assert _trailer(ei.value, RETRY_LATER_KEY) == "handoff"
        # Streams are relayed.
        async with insecure_channel(follower.addr) as ch:
            frames = [f async for f in pbg.CoordinatorStub(ch).SnapshotSave(pb.SnapshotSaveRequest(), timeout=5)]
        assert [f.data for f in frames] == [b"", b"state"] and frames[0].meta_json == b"{}"
        # ReportShard is not forwarded: the follower's own handler answers (it refuses).
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call(follower.addr, "ReportShard", pb.ShardReport(shard_id="s"))
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert _trailer(ei.value, LEADER_METADATA_KEY) == leader.addr
        assert [m for m, _, _ in leader.servicer.calls].count("ReportShard") == 0
        # A call marked direct (or already forwarded) is never forwarded.
        n = len(leader.servicer.calls)
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call(follower.addr, "LookupCluster", pb.LookupClusterRequest(cluster_id="c1"), metadata=DIRECT_METADATA)
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION and len(leader.servicer.calls) == n
    finally:
        await follower.stop()
        await leader.stop()


async def test_one_hop_only() -> None:
    """A stale hint leads to another follower: that one refuses (with its own hint) instead of
    forwarding again, and the refusal is relayed."""
    real_leader = await Replica(StandIn()).start()
    stale = await forwarding_follower(real_leader.addr).start()
    first = await forwarding_follower(stale.addr).start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call(first.addr, "LookupCluster", pb.LookupClusterRequest(cluster_id="c1"))
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert _trailer(ei.value, LEADER_METADATA_KEY) == real_leader.addr
        assert real_leader.servicer.calls == []
        assert [(m, md[FORWARDED_METADATA_KEY]) for m, md, _ in stale.servicer.calls] == [("LookupCluster", "coord-1")]
        # The client follows that hint to the real leader.
        client = CoordinatorClient([first.addr], timeout=3.0)
        try:
            resp = await client.call("LookupCluster", pb.LookupClusterRequest(cluster_id="c1"))
        finally:
            await client.close()
        assert resp.shard_id == "shard-0" and client.leader == real_leader.addr
    finally:
        for r in (first, stale, real_leader):
            await r.stop()


@pytest.mark.parametrize("unreachable", ["closed-port", "unresolvable"])
async def test_leader_unreachable_is_answered_as_a_refusal_with_the_hint(unreachable: str) -> None:
    target = f"127.0.0.1:{free_port()}" if unreachable == "closed-port" else "coord-0.coord-headless.invalid:7790"
    follower = await forwarding_follower(target).start()
    try:
        with pytest.raises(grpc.aio.AioRpcError) as ei:
            await call(follower.addr, "LookupCluster", pb.LookupClusterRequest(cluster_id="c1"))
        assert ei.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "not leader" in (ei.value.details() or "")
        assert _trailer(ei.value, LEADER_METADATA_KEY) == target
    finally:
        await follower.stop()


# --- second line of defence: following the hint -------------------------------------------------


async def test_resolver_and_client_follow_a_dialable_hint_and_skip_an_undialable_one() -> None:
    leader = await Replica(StandIn()).start()
    refuses = await Replica(StandIn(hint=leader.addr, answers=False)).start()  # no forwarder: an older release
    blind = await Replica(StandIn(hint="coord-0.coord-headless.invalid:7790", answers=False)).start()
    try:
        def resolver(*coordinators: str) -> CoordinatorResolver:
            return CoordinatorResolver("c1", coordinators, cast(Any, object()), "ns", timeout=3.0)

        assert await resolver(refuses.addr).lookup() == "s0:7780"
        assert await resolver(blind.addr, leader.addr).lookup() == "s0:7780"
        t0 = time.monotonic()
        assert await resolver(blind.addr).lookup() is None  # the caller falls back to its cached shard
        assert time.monotonic() - t0 < 3.0

        for addrs in ([refuses.addr], [blind.addr, leader.addr]):
            client = CoordinatorClient(addrs, timeout=3.0)
            try:
                resp = await client.call("LookupCluster", pb.LookupClusterRequest(cluster_id="c1"))
                assert resp.shard_address == "s0:7780" and client.leader == leader.addr
            finally:
                await client.close()
    finally:
        for r in (blind, refuses, leader):
            await r.stop()


async def test_a_frozen_replica_costs_the_client_a_short_wait_not_its_timeout() -> None:
    """A SIGSTOPped coordinator (or a hung host) accepts TCP but never answers: the client tries the
    next address after a short connect wait instead of spending its whole timeout on it (bigfleetctl
    with the leader frozen took its full --timeout). A refused address still fails over at once."""
    import socket

    frozen = socket.socket()
    frozen.bind(("127.0.0.1", 0))
    frozen.listen(16)  # the kernel completes handshakes; nobody ever reads
    leader = await Replica(StandIn()).start()
    try:
        for first in (f"127.0.0.1:{frozen.getsockname()[1]}", f"127.0.0.1:{free_port()}"):
            client = CoordinatorClient([first, leader.addr], timeout=20.0)
            try:
                t0 = time.monotonic()
                resp = await client.call("LookupCluster", pb.LookupClusterRequest(cluster_id="c1"))
                took = time.monotonic() - t0
            finally:
                await client.close()
            assert resp.shard_address == "s0:7780" and client.leader == leader.addr
            assert took < 8.0, f"{first}: {took:.1f}s"
    finally:
        await leader.stop()
        frozen.close()
