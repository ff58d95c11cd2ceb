"""bigfleetctl pointed at a follower replica of a shard group: every shard verb follows the
follower's ``bigfleet-redirect`` to the leader (docs/shard.md), instead of reporting the shard
unreachable. The two replicas here are small gRPC servers answering as a leader and a follower do."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator

import grpc
import pytest

from bigfleet.rpc import new_server
from bigfleet.v1alpha1 import shardread_pb2 as spb
from bigfleet.v1alpha1 import shardread_pb2_grpc as sgrpc


class Leader(sgrpc.ShardReadServicer, sgrpc.ShardAdminServicer):
    def __init__(self) -> None:
        self.paused = False
        self.reasons: list[str] = []

    async def GetInventoryCounts(self, request: spb.InventoryCountsRequest, context: object) -> spb.InventoryCounts:
        return spb.InventoryCounts(by_state={"MACHINE_STATE_IDLE": 7}, total=7)

    async def GetActuation(self, request: spb.GetActuationRequest, context: object) -> spb.ActuationStatus:
        return spb.ActuationStatus(paused=self.paused, cycle=3)

    async def SetActuation(self, request: spb.SetActuationRequest, context: object) -> spb.ActuationStatus:
        self.paused = request.paused
        self.reasons.append(request.reason)
        return spb.ActuationStatus(paused=self.paused, cycle=3)


class Follower(sgrpc.ShardReadServicer, sgrpc.ShardAdminServicer):
    """What a follower replica answers every shard RPC with (shard/ha/controller.py)."""

    def __init__(self, leader: str) -> None:
        self.leader = leader
        self.calls = 0

    async def _redirect(self, request: object, context: grpc.aio.ServicerContext) -> None:
        self.calls += 1
        await context.abort(grpc.StatusCode.UNAVAILABLE, f"not the shard leader; leader at {self.leader}",
                            trailing_metadata=(("bigfleet-redirect", self.leader),))

    GetInventoryCounts = GetActuation = SetActuation = _redirect  # type: ignore[assignment]


async def _serve(servicer: object) -> tuple[grpc.aio.Server, str]:
    server, _ = new_server(interceptors=[])
    sgrpc.add_ShardReadServicer_to_server(servicer, server)  # type: ignore[arg-type]
    sgrpc.add_ShardAdminServicer_to_server(servicer, server)  # type: ignore[arg-type]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
async def group() -> AsyncIterator[tuple[Leader, Follower, str]]:
    leader = Leader()
    ls, laddr = await _serve(leader)
    follower = Follower(laddr)
    fs, faddr = await _serve(follower)
    try:
        yield leader, follower, faddr
    finally:
        await fs.stop(None)
        await ls.stop(None)


async def _ctl(*args: str) -> tuple[int, str, str]:
    p = await asyncio.create_subprocess_exec(sys.executable, "-m", "bigfleet.ctl.main", *args,
                                             stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(p.communicate(), 60)
    return p.returncode or 0, out.decode(), err.decode()


async def test_shard_verbs_follow_a_followers_redirect(group: tuple[Leader, Follower, str]) -> None:
    leader, follower, faddr = group
    code, out, err = await _ctl("inventory", "--shard", faddr, "-o", "json")
    assert code == 0, err
    assert json.loads(out)[0]["total"] == 7
    code, _, err = await _ctl("pause", "--shard", faddr, "--reason", "maintenance window")
    assert code == 0, err
    assert leader.paused and leader.reasons == ["maintenance window"]
    code, _, err = await _ctl("resume", "--shard", faddr)
    assert code == 0, err
    assert not leader.paused
    assert follower.calls == 3  # each verb asked the follower first, then its leader
