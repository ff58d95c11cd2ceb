"""Real-process fixtures for the shard's end-to-end tests: a fake-provider process, a recording
pass-through in front of it, and a shard process, all on free loopback ports."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from grpc_health.v1 import health_pb2, health_pb2_grpc

from bigfleet.rpc import insecure_channel
from bigfleet.testing import ManagedProcess, free_port, wait_for_health
from bigfleet.v1alpha1 import shardread_pb2, shardread_pb2_grpc

from .spy import SpyProvider, spy_provider, until


def start_provider(*args: str, name: str = "provider") -> tuple[ManagedProcess, str]:
    port = free_port()
    addr = f"127.0.0.1:{port}"
    proc = ManagedProcess.bigfleet(["fake-provider", "--listen", addr, "--log-format", "console", *args], name).start()
    wait_for_health(addr, timeout=60)
    return proc, addr


@dataclass
class ShardProc:
    provider_addr: str
    data_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="bigfleet-shard-"))
    extra: tuple[str, ...] = ()
    addr: str = ""
    proc: ManagedProcess | None = None

    async def start(self) -> ShardProc:
        self.addr = self.addr or f"127.0.0.1:{free_port()}"
        self.proc = ManagedProcess.bigfleet(
            ["shard", "--shard-id", "s1", "--listen", self.addr, "--provider", self.provider_addr,
             "--data-dir", self.data_dir, "--cycle-interval", "0.3", "--min-cycle-gap", "0.05",
             "--reconcile-interval", "0.2", "--log-format", "console", *self.extra],
            "shard",
        ).start()
        await until(lambda: self._healthy(), 60, f"shard health at {self.addr}", interval=0.1)
        return self

    tls: Any = None  # the TLSConfig tests use to reach this shard (admin identity)

    async def _healthy(self) -> bool:
        async with self._dial() as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return bool(r.status == health_pb2.HealthCheckResponse.SERVING)

    def logs(self) -> str:
        return self.proc.logs() if self.proc else ""

    def _dial(self) -> Any:
        if self.tls is not None:
            from bigfleet.security.tls import dial

            return dial(self.addr, self.tls)
        return insecure_channel(self.addr)

    async def counts(self, cluster_id: str = "") -> shardread_pb2.InventoryCounts:
        async with self._dial() as ch:
            r: shardread_pb2.InventoryCounts = await shardread_pb2_grpc.ShardReadStub(ch).GetInventoryCounts(
                shardread_pb2.InventoryCountsRequest(cluster_id=cluster_id), timeout=5)
            return r

    async def cycle(self) -> int:
        async with self._dial() as ch:
            st = await shardread_pb2_grpc.ShardAdminStub(ch).GetActuation(shardread_pb2.GetActuationRequest(), timeout=5)
            return int(st.cycle)

    async def inspect(self, cluster_id: str = "") -> list[shardread_pb2.InspectNeedsResponse]:
        async with self._dial() as ch:
            call = shardread_pb2_grpc.ShardReadStub(ch).InspectNeeds(
                shardread_pb2.InspectNeedsRequest(cluster_id=cluster_id), timeout=5)
            return [r async for r in call]

    async def wait_cycles(self, n: int, timeout: float = 30) -> None:
        start = await self.cycle()
        await until(lambda: self._cycle_at_least(start + n), timeout, f"{n} more cycles")

    async def _cycle_at_least(self, n: int) -> bool:
        return await self.cycle() >= n


def print_shard_logs(shards: dict[str, ShardProc | None], coordinator_logs: str = "") -> None:
    """On a failure: the tail of each started shard's log (and the coordinators'), for the report."""
    for name, s in shards.items():
        if s is not None:
            print(f"---- shard {name} log ----\n" + s.logs()[-5000:])
    if coordinator_logs:
        print("---- coordinator log ----\n" + coordinator_logs[-3000:])


def stop_shards(*shards: ShardProc | None) -> None:
    for s in shards:
        if s is not None and s.proc is not None:
            s.proc.stop()


@asynccontextmanager
async def fleet(provider_args: tuple[str, ...], shard_args: tuple[str, ...] = (), provider_tls: Any = None,
                ) -> AsyncIterator[tuple[ManagedProcess, SpyProvider, ShardProc]]:
    prov, paddr = start_provider(*provider_args)
    shard: ShardProc | None = None
    try:
        async with spy_provider(paddr, provider_tls) as (spy, spy_addr):
            shard = await ShardProc(spy_addr, extra=shard_args).start()
            try:
                yield prov, spy, shard
            finally:
                if shard.proc:
                    shard.proc.stop()
    except BaseException:
        if shard is not None:
            print("---- shard log ----\n" + shard.logs()[-6000:])
        print("---- provider log ----\n" + prov.logs()[-3000:])
        raise
    finally:
        prov.stop()
