"""One pool across two providers in the deployed topology: a 3-replica shard group given two fake
provider processes (bare metal only, cloud quota only). The leader binds the bare metal first and
creates the rest at the cloud provider; after kill -9 the new leader reads both providers and keeps
every machine, creating and configuring nothing twice."""

from __future__ import annotations

import shutil

import pytest

from bigfleet.rpc import insecure_channel
from bigfleet.testing import ManagedProcess, free_port, wait_for_health
from bigfleet.v1alpha1 import provider_pb2, provider_pb2_grpc, shardread_pb2, shardread_pb2_grpc

from .group import Operator, Replica, need, until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

S = provider_pb2.MachineState


def _provider(name: str, *args: str) -> tuple[ManagedProcess, str]:
    addr = f"127.0.0.1:{free_port()}"
    proc = ManagedProcess.bigfleet(["fake-provider", "--listen", addr, "--log-format", "console", *args], name).start()
    wait_for_health(addr, timeout=60)
    return proc, addr


async def _machines(addr: str) -> list[provider_pb2.Machine]:
    async with insecure_channel(addr) as ch:
        lst = await provider_pb2_grpc.CapacityProviderStub(ch).List(provider_pb2.ListFilter(), timeout=10)
        return list(lst.machines)


async def _bound(addr: str) -> set[str]:
    return {m.id for m in await _machines(addr) if m.cluster == "c1" and m.state == S.MACHINE_STATE_CONFIGURED}


async def _counts(r: Replica) -> shardread_pb2.InventoryCounts:
    async with insecure_channel(r.listen) as ch:
        out: shardread_pb2.InventoryCounts = await shardread_pb2_grpc.ShardReadStub(ch).GetInventoryCounts(
            shardread_pb2.InventoryCountsRequest(), timeout=5)
        return out


async def test_replica_group_pools_two_providers_and_failover_keeps_both() -> None:
    metal, metal_addr = _provider("metal", "--cloud", "onprem", "--committed-count", "2", "--seed-count", "0")
    cloud, cloud_addr = _provider("cloud", "--cloud", "aws", "--seed-count", "4", "--committed-count", "0")
    rafts = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    replicas = [Replica(f"r{i}", f"metal={metal_addr}", rafts, raft=rafts[i],
                        extra=("--provider", f"cloud={cloud_addr}", "--no-empty-rollup-guard")).start()
                for i in range(3)]
    ok = False
    try:
        async def leader(exclude: Replica | None = None) -> Replica:
            async def find() -> Replica | None:
                for r in replicas:
                    if r is not exclude and r.proc is not None and r.proc.alive() and await r.serving():
                        return r
                return None
            found: Replica = await until(find, 60, "a serving leader")
            return found

        first = await leader()
        async with Operator(first.listen, "c1") as op:
            await op.rollup([need("7", count=3)])

            async def three() -> bool:
                return len(await _bound(metal_addr)) == 2 and len(await _bound(cloud_addr)) == 1
            await until(three, 60, "both bare-metal hosts and one cloud machine configured for c1")
        cloud_used = [m.id for m in await _machines(cloud_addr) if m.state != S.MACHINE_STATE_SPECULATIVE]
        assert len(cloud_used) == 1  # only the remainder was created, at the provider that offers it

        assert first.proc is not None
        first.proc.kill()
        new = await leader(exclude=first)

        async def sees_all() -> bool:
            c = await _counts(new)
            return c.bound_by_cluster.get("c1", 0) == 3 and c.total == 2 + 4
        await until(sees_all, 60, "the new leader reads both providers' machines")
        start = await new.cycle()
        await until(lambda: _at_least(new, start + 5), 30, "five more cycles on the new leader")
        assert len(await _bound(metal_addr)) == 2 and len(await _bound(cloud_addr)) == 1
        assert [m.id for m in await _machines(cloud_addr) if m.state != S.MACHINE_STATE_SPECULATIVE] == cloud_used
        ok = True
    finally:
        for r in replicas:
            if r.proc is not None:
                if not ok:
                    print(f"---- {r.name} log ----\n" + r.logs()[-4000:])
                r.proc.stop()
            shutil.rmtree(r.data_dir, ignore_errors=True)
        metal.stop()
        cloud.stop()


async def _at_least(r: Replica, n: int) -> bool:
    return await r.cycle() >= n
