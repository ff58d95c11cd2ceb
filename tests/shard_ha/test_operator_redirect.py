"""The real operator session client (bigfleet.operator.session) against a replica group: a follower's
UNAVAILABLE + ``bigfleet-redirect`` sends it to the leader, and after kill -9 of the leader it lands on
the new one with its demand."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial

import pytest

from bigfleet.operator.metrics import OperatorMetrics
from bigfleet.operator.session import Backoff, SessionClient
from bigfleet.v1alpha1 import capacity_pb2, shard_pb2

from .group import Group, Replica, need, until

pytestmark = pytest.mark.slow


class RotatingResolver:
    """A redirect wins once; otherwise try the replicas in turn (what a coordinator lookup would do
    with a list of replica addresses)."""

    def __init__(self, targets: list[str]) -> None:
        self.targets = targets
        self.i = 0
        self.override: str | None = None
        self.redirects: list[str] = []

    async def resolve(self) -> str:
        if self.override:
            t, self.override = self.override, None
            return t
        t = self.targets[self.i % len(self.targets)]
        self.i += 1
        return t

    def redirect(self, target: str) -> None:
        self.redirects.append(target)
        self.override = target

    def failed(self, target: str) -> None:
        return None  # a redirect is used once already


class Handlers:
    def bootstrap(self, req: shard_pb2.BootstrapRequest) -> shard_pb2.BootstrapBlobResponse:
        return shard_pb2.BootstrapBlobResponse(request_id=req.request_id, user_data=b"#cloud-config\n", ttl_seconds=600)

    async def node_state(self, u: shard_pb2.NodeStateUpdate) -> None:
        return None

    async def available_capacity(self, u: shard_pb2.AvailableCapacityUpdate) -> None:
        return None

    async def reclaim(self, ins: shard_pb2.ReclaimInstruction,
                      send_ack: Callable[[shard_pb2.ReclaimAck], None]) -> None:
        send_ack(shard_pb2.ReclaimAck(instruction_id=ins.instruction_id, nodes_started=len(ins.nodes)))


async def _on(client: SessionClient, r: Replica, min_epoch: int = 0) -> bool:
    ack = client.last_ack
    return client.target == r.listen and ack is not None and ack.shard_epoch > min_epoch


async def _needs(r: Replica, cluster: str, n: int) -> bool:
    await r.cycle()
    return await r.needs(cluster) == n


async def test_operator_follows_the_redirect_and_the_failover() -> None:
    g = await Group(("--seed-count", "0")).start()
    ok = False
    task: asyncio.Task[None] | None = None
    try:
        leader = await g.leader()
        followers = [r for r in g.replicas if r is not leader]
        # The client is never given the leader's address: the only way to reach it is a follower's hint.
        # (A follower that has not yet learned the leader answers without one; the client then retries.)
        resolver = RotatingResolver([followers[0].listen, followers[1].listen])
        rollup = capacity_pb2.ClusterCapacityNeeds(cluster_id="op1", needs=[need("1"), need("2", priority=200)])
        client: SessionClient

        async def request_rollup() -> None:
            client.offer_rollup(rollup)

        client = SessionClient("op1", resolver, Handlers(), OperatorMetrics(), request_rollup=request_rollup,
                               rollup_interval=0.5, backoff=Backoff(initial=0.1, cap=0.5))
        task = asyncio.create_task(client.run())
        # Dialled a follower first; the follower's hint takes it to the leader.
        await until(partial(_on, client, leader), 30, "operator on the leader")
        assert leader.listen in resolver.redirects
        await until(partial(_needs, leader, "op1", 2), 30, "demand on the leader")
        old_epoch = client.last_ack.shard_epoch if client.last_ack else 0
        assert leader.proc is not None
        leader.proc.kill()
        new = await g.leader(timeout=30, exclude=leader)
        await until(partial(_on, client, new, old_epoch), 30, "operator on the new leader, newer epoch")
        await until(partial(_needs, new, "op1", 2), 30, "demand on the new leader")
        ok = True
    finally:
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        await g.close(dump=not ok)
