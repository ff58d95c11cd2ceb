"""Small in-test shards built on the coordinator client library.

They keep just enough state to check the handoff's safety property: a
cluster and each of its machines have at most one owner at any moment
(``Registry.violations`` records any breach).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from bigfleet.coordclient.client import BaseInstructionHandler, CoordinatorClient, HeartbeatLoop
from bigfleet.v1alpha1 import coordinator_pb2 as pb


@dataclass
class Registry:
    machine_owner: dict[str, str | None] = field(default_factory=dict)
    cluster_owner: dict[str, str | None] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)


class StandInShard(BaseInstructionHandler):
    def __init__(self, shard_id: str, registry: Registry, addresses: list[str], interval: float = 0.2) -> None:
        super().__init__()
        self.shard_id = shard_id
        self.reg = registry
        self.clusters: dict[str, set[str]] = {}
        self.released: dict[str, list[str]] = {}
        self.adopt_gate: asyncio.Event | None = None
        self.cycles = 0
        # Inventory rebalancing: idle machines this shard owns, and an unmet need it reports.
        self.idle: set[str] = set()
        self.shortfall: pb.Shortfall | None = None
        self.inventory_releases: dict[str, list[str]] = {}
        self.client = CoordinatorClient(addresses, timeout=2.0)
        self.loop = HeartbeatLoop(
            self.client, shard_id, self.report, self, interval=interval, shard_address=f"{shard_id}.test:7780"
        )
        self._tasks: list[asyncio.Task[None]] = []

    def serve(self, cluster_id: str, machines: list[str]) -> None:
        """The cluster starts on this shard (first contact) with these machines."""
        self.clusters[cluster_id] = set(machines)
        self.reg.cluster_owner[cluster_id] = self.shard_id
        for m in machines:
            self.reg.machine_owner[m] = self.shard_id

    def give_idle(self, machines: list[str]) -> None:
        self.idle.update(machines)
        for m in machines:
            self.reg.machine_owner[m] = self.shard_id

    def report(self) -> pb.ShardReport:
        total = sum(len(m) for m in self.clusters.values()) + len(self.idle)
        rep = pb.ShardReport(summary=pb.ShardSummary(total_machines=total, free_machines=len(self.idle)))
        if self.shortfall is not None:
            rep.shortfalls.append(self.shortfall)
        return rep

    async def release_inventory(self, msg: pb.TransferOwnership) -> list[str]:
        if msg.transfer_id in self.inventory_releases:
            return self.inventory_releases[msg.transfer_id]
        want = 2  # a real shard sizes this from msg.deficit and msg.requirements
        give = sorted(self.idle)[:want]
        for m in give:
            self.idle.discard(m)
            if self.reg.machine_owner.get(m) != self.shard_id:
                self.reg.violations.append(f"{self.shard_id} released idle {m} it did not own")
            self.reg.machine_owner[m] = None
        self.inventory_releases[msg.transfer_id] = give
        return give

    async def adopt_inventory(self, msg: pb.TransferOwnership) -> None:
        for m in msg.machine_ids:
            mo = self.reg.machine_owner.get(m)
            if mo not in (None, self.shard_id):
                self.reg.violations.append(f"{self.shard_id} adopted idle {m} owned by {mo}")
            self.reg.machine_owner[m] = self.shard_id
            self.idle.add(m)
        self.shortfall = None  # the need is met now

    async def _cycle(self) -> None:
        # Stands in for the decision loop: it must keep going whatever the coordinator does.
        while True:
            self.cycles += 1
            await asyncio.sleep(0.05)

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self.loop.run()), asyncio.create_task(self._cycle())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.client.close()

    async def release_cluster(self, msg: pb.ReleaseCluster) -> list[str]:
        cid = msg.cluster_id
        if cid in self.released and cid not in self.clusters:
            return self.released[cid]  # idempotent redelivery
        machines = sorted(self.clusters.pop(cid, set()))
        for m in machines:
            if self.reg.machine_owner.get(m) != self.shard_id:
                self.reg.violations.append(f"{self.shard_id} released {m} it did not own")
            self.reg.machine_owner[m] = None
        if self.reg.cluster_owner.get(cid) == self.shard_id:
            self.reg.cluster_owner[cid] = None
        self.released[cid] = machines
        return machines

    async def adopt_cluster(self, msg: pb.AdoptCluster) -> None:
        if self.adopt_gate is not None:
            await self.adopt_gate.wait()
        cid = msg.cluster_id
        owner = self.reg.cluster_owner.get(cid)
        if owner not in (None, self.shard_id):
            self.reg.violations.append(f"{self.shard_id} adopted {cid} while {owner} served it")
        for m in msg.machine_ids:
            mo = self.reg.machine_owner.get(m)
            if mo not in (None, self.shard_id):
                self.reg.violations.append(f"{self.shard_id} adopted {m} owned by {mo}")
            self.reg.machine_owner[m] = self.shard_id
        self.reg.cluster_owner[cid] = self.shard_id
        self.clusters[cid] = set(msg.machine_ids)
