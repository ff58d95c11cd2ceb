"""Real-process fixtures for shard HA tests: one fake-provider process and N shard replica processes
(``bigfleet shard --raft-bind ...``) on free loopback ports, plus async probes."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bigfleet.rpc import insecure_channel
from bigfleet.testing import ManagedProcess, free_port, wait_for_health
from bigfleet.v1alpha1 import (
    capacity_pb2,
    provider_pb2,
    provider_pb2_grpc,
    shard_pb2,
    shard_pb2_grpc,
    shardread_pb2,
    shardread_pb2_grpc,
)

PASSWORD = "test-shard-raft-secret"


async def until(pred: Callable[[], Awaitable[Any]], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            v = await pred()
            if v:
                return v
        except (grpc.aio.AioRpcError, OSError) as exc:
            last = exc
        await asyncio.sleep(interval)
    raise TimeoutError(f"timed out after {timeout}s waiting for {what} (last error: {last})")


def need(cpu: str = "1", priority: int = 100, count: int = 1) -> capacity_pb2.CapacityNeed:
    milli = int(float(cpu) * 1000) * count
    return capacity_pb2.CapacityNeed(aggregate_resources={"cpu": f"{milli}m"}, priority=priority,
                                     min_unit={"cpu": cpu})


@dataclass
class Replica:
    name: str
    provider: str
    peers_raft: list[str]
    listen: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    raft: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    metrics: str = field(default_factory=lambda: f"127.0.0.1:{free_port()}")
    data_dir: str = field(default_factory=lambda: tempfile.mkdtemp(prefix="bigfleet-shard-ha-"))
    extra: tuple[str, ...] = ()
    proc: ManagedProcess | None = None

    def start(self) -> Replica:
        peers = ",".join(p for p in self.peers_raft if p != self.raft)
        self.proc = ManagedProcess.bigfleet(
            ["shard", "--shard-id", "s1", "--replica-id", self.name, "--listen", self.listen,
             "--provider", self.provider, "--data-dir", self.data_dir, "--raft-bind", self.raft,
             "--raft-peers", peers, "--raft-password", PASSWORD, "--metrics-listen", self.metrics, "--cycle-interval", "0.3",
             "--min-cycle-gap", "0.05", "--reconcile-interval", "0.2", "--log-format", "console", *self.extra],
            self.name,
        ).start()
        return self

    async def health(self) -> int:
        async with insecure_channel(self.listen) as ch:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return int(r.status)

    async def serving(self) -> bool:
        try:
            return bool(await self.health() == health_pb2.HealthCheckResponse.SERVING)
        except grpc.aio.AioRpcError:
            return False

    async def cycle(self) -> int:
        async with insecure_channel(self.listen) as ch:
            st = await shardread_pb2_grpc.ShardAdminStub(ch).GetActuation(shardread_pb2.GetActuationRequest(),
                                                                          timeout=2)
            return int(st.cycle)

    async def needs(self, cluster_id: str = "") -> int:
        async with insecure_channel(self.listen) as ch:
            call = shardread_pb2_grpc.ShardReadStub(ch).InspectNeeds(
                shardread_pb2.InspectNeedsRequest(cluster_id=cluster_id), timeout=3)
            async for r in call:
                return int(r.header.total_needs)
        return 0

    def logs(self) -> str:
        return self.proc.logs() if self.proc else ""

    async def metric(self, name: str) -> float | None:
        """One unlabelled sample from this replica's /metrics (None when absent or unreachable)."""
        def get() -> float | None:
            try:
                with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=2) as resp:
                    text = resp.read().decode()
            except OSError:
                return None
            for line in text.splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
            return None

        return await asyncio.to_thread(get)


@dataclass
class Group:
    provider_args: tuple[str, ...] = ("--seed-count", "0")
    size: int = 3
    replica_args: tuple[str, ...] = ()
    provider_proc: ManagedProcess | None = None
    provider: str = ""
    replicas: list[Replica] = field(default_factory=list)
    spy: Any = None  # a SpyProvider between the replicas and the provider, when with_spy
    with_spy: bool = False
    _spy_server: Any = None

    async def start(self) -> Group:
        self.provider = f"127.0.0.1:{free_port()}"
        self.provider_proc = ManagedProcess.bigfleet(
            ["fake-provider", "--listen", self.provider, "--log-format", "console", *self.provider_args],
            "provider").start()
        wait_for_health(self.provider, timeout=60)
        target = self.provider
        if self.with_spy:
            self.spy, self._spy_server, target = await start_spy(self.provider)
        rafts = [f"127.0.0.1:{free_port()}" for _ in range(self.size)]
        self.replicas = [Replica(f"r{i}", target, rafts, raft=rafts[i], extra=self.replica_args)
                         for i in range(self.size)]
        for r in self.replicas:
            r.start()
        return self

    async def leader(self, timeout: float = 60, exclude: Replica | None = None) -> Replica:
        async def find() -> Replica | None:
            for r in self.replicas:
                if r is not exclude and r.proc is not None and r.proc.alive() and await r.serving():
                    return r
            return None

        found: Replica = await until(find, timeout, "a serving leader")
        return found

    async def machines(self) -> list[provider_pb2.Machine]:
        async with insecure_channel(self.provider) as ch:
            lst = await provider_pb2_grpc.CapacityProviderStub(ch).List(provider_pb2.ListFilter(), timeout=10)
            return list(lst.machines)

    async def close(self, dump: bool = False) -> None:
        self.stop(dump)
        if self._spy_server is not None:
            await self._spy_server.stop(0)
            await self.spy.channel.close()

    def stop(self, dump: bool = False) -> None:
        for r in self.replicas:
            if r.proc is not None:
                if dump:
                    print(f"---- {r.name} log ----\n" + r.logs()[-5000:])
                r.proc.stop()
            shutil.rmtree(r.data_dir, ignore_errors=True)
        if self.provider_proc is not None:
            if dump:
                print("---- provider log ----\n" + self.provider_proc.logs()[-3000:])
            self.provider_proc.stop()


class Operator:
    """A minimal scripted operator: Hello, roll-ups, records acks and the end-of-stream status."""

    def __init__(self, target: str, cluster_id: str) -> None:
        self.target = target
        self.cluster_id = cluster_id
        self.acks: list[shard_pb2.Acknowledgement] = []
        self.frames: list[shard_pb2.ShardMessage] = []
        self.error: grpc.aio.AioRpcError | None = None
        self.done = asyncio.Event()

    async def __aenter__(self) -> Operator:
        self._ch = insecure_channel(self.target)
        self._call = shard_pb2_grpc.ShardStub(self._ch).Session()
        await self._call.write(shard_pb2.OperatorMessage(hello=shard_pb2.Hello(
            cluster_id=self.cluster_id, protocol_version="v1alpha1")))
        self._task = asyncio.create_task(self._read())
        return self

    async def _read(self) -> None:
        try:
            while True:
                m = await self._call.read()
                if m is grpc.aio.EOF:
                    return
                self.frames.append(m)
                if m.WhichOneof("payload") == "ack":
                    self.acks.append(m.ack)
                elif m.WhichOneof("payload") == "bootstrap_request":
                    await self._call.write(shard_pb2.OperatorMessage(bootstrap_response=shard_pb2.BootstrapBlobResponse(
                        request_id=m.bootstrap_request.request_id, user_data=b"#cloud-config\n", ttl_seconds=600)))
        except grpc.aio.AioRpcError as exc:
            self.error = exc
        finally:
            self.done.set()

    async def rollup(self, needs: list[capacity_pb2.CapacityNeed]) -> None:
        await self._call.write(shard_pb2.OperatorMessage(rollup=capacity_pb2.ClusterCapacityNeeds(
            cluster_id=self.cluster_id, needs=needs)))

    async def __aexit__(self, *exc: object) -> None:
        self._call.cancel()
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        await self._ch.close()


@dataclass
class Call:
    rpc: str
    machine_id: str
    epoch: int
    code: grpc.StatusCode
    at: float


class SpyProvider(provider_pb2_grpc.CapacityProviderServicer):
    """A pass-through in front of the fake provider recording each mutating call's epoch and outcome."""

    def __init__(self, upstream: str) -> None:
        self.channel = insecure_channel(upstream)
        self.stub = provider_pb2_grpc.CapacityProviderStub(self.channel)
        self.calls: list[Call] = []

    async def _fwd(self, rpc: str, req: Any, context: grpc.aio.ServicerContext) -> Any:
        fn = getattr(self.stub, rpc)
        remaining = context.time_remaining()
        try:
            resp = await fn(req, timeout=remaining if remaining is not None else 30)
        except grpc.aio.AioRpcError as exc:
            if hasattr(req, "shard_epoch"):
                self.calls.append(Call(rpc, req.machine_id, req.shard_epoch, exc.code(), time.monotonic()))
            await context.abort(exc.code(), exc.details() or "")
        if hasattr(req, "shard_epoch"):
            self.calls.append(Call(rpc, req.machine_id, req.shard_epoch, grpc.StatusCode.OK, time.monotonic()))
        return resp

    async def Create(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Create", request, context)

    async def Configure(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Configure", request, context)

    async def Drain(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Drain", request, context)

    async def Delete(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Delete", request, context)

    async def Get(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("Get", request, context)

    async def List(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        return await self._fwd("List", request, context)


async def start_spy(upstream: str) -> tuple[SpyProvider, grpc.aio.Server, str]:
    from bigfleet.rpc import new_server

    spy = SpyProvider(upstream)
    server, _health = new_server()
    provider_pb2_grpc.add_CapacityProviderServicer_to_server(spy, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return spy, server, f"127.0.0.1:{port}"
