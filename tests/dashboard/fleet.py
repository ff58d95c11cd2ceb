"""A small real fleet for the ctl and dashboard tests: one coordinator replica, one fake provider,
one shard (all with dashboards on), and a scripted operator on a background thread that keeps a
Session open, answers bootstrap pulls, and rolls up the needs it is told to."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import tempfile
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.rpc import channel_options, insecure_channel
from bigfleet.testing import ManagedProcess, free_port, wait_for_health, wait_until
from bigfleet.v1alpha1 import capacity_pb2, shard_pb2, shard_pb2_grpc, shardread_pb2, shardread_pb2_grpc


def need(cpu: str, count: int = 1, priority: int = 100) -> capacity_pb2.CapacityNeed:
    milli = int(float(cpu) * 1000) * count
    return capacity_pb2.CapacityNeed(aggregate_resources={"cpu": f"{milli}m"}, priority=priority, min_unit={"cpu": cpu})


class Operator:
    """One cluster's Session on its own thread and event loop."""

    def __init__(self, target: str, cluster_id: str) -> None:
        self.target = target
        self.cluster_id = cluster_id
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name=f"op-{cluster_id}")
        self.thread.start()
        self.call: Any = None
        self.channel: Any = None
        self.task: Any = None
        self._run(self._open())

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=30)

    async def _open(self) -> None:
        self.channel = insecure_channel(self.target)
        self.call = shard_pb2_grpc.ShardStub(self.channel).Session()
        await self.call.write(shard_pb2.OperatorMessage(
            hello=shard_pb2.Hello(cluster_id=self.cluster_id, protocol_version="v1alpha1")))
        self.task = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
            while True:
                msg = await self.call.read()
                if msg is grpc.aio.EOF:
                    return
                kind = msg.WhichOneof("payload")
                if kind == "bootstrap_request":
                    await self.call.write(shard_pb2.OperatorMessage(bootstrap_response=shard_pb2.BootstrapBlobResponse(
                        request_id=msg.bootstrap_request.request_id, user_data=b"#cloud-config\n", ttl_seconds=3600)))
                elif kind == "reclaim_instruction":
                    ri = msg.reclaim_instruction
                    await self.call.write(shard_pb2.OperatorMessage(reclaim_ack=shard_pb2.ReclaimAck(
                        instruction_id=ri.instruction_id, nodes_started=len(ri.nodes))))

    def rollup(self, needs: list[capacity_pb2.CapacityNeed]) -> None:
        async def send() -> None:
            await self.call.write(shard_pb2.OperatorMessage(
                rollup=capacity_pb2.ClusterCapacityNeeds(cluster_id=self.cluster_id, needs=needs)))
        self._run(send())

    def close(self) -> None:
        async def shut() -> None:
            with contextlib.suppress(Exception):
                self.call.cancel()
            if self.task is not None:
                self.task.cancel()
                with contextlib.suppress(BaseException):
                    await self.task
            await self.channel.close()
        with contextlib.suppress(Exception):
            self._run(shut())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)


@dataclass
class Fleet:
    root: Path
    coord: CoordGroup | None = None
    provider: ManagedProcess | None = None
    shard: ManagedProcess | None = None
    shard_addr: str = ""
    shard_http: str = ""
    coord_http: str = ""
    operators: list[Operator] = field(default_factory=list)

    @property
    def coordinator(self) -> str:
        assert self.coord is not None
        return ",".join(self.coord.addresses)

    # -- what the APIs say (the reference the CLI and page are compared against) -------------
    def counts(self, cluster_id: str = "") -> shardread_pb2.InventoryCounts:
        with grpc.insecure_channel(self.shard_addr, options=channel_options()) as ch:
            r: shardread_pb2.InventoryCounts = shardread_pb2_grpc.ShardReadStub(ch).GetInventoryCounts(
                shardread_pb2.InventoryCountsRequest(cluster_id=cluster_id), timeout=5)
            return r

    def shortfalls(self) -> shardread_pb2.ListShortfallsResponse:
        with grpc.insecure_channel(self.shard_addr, options=channel_options()) as ch:
            r: shardread_pb2.ListShortfallsResponse = shardread_pb2_grpc.ShardReadStub(ch).ListShortfalls(
                shardread_pb2.ListShortfallsRequest(), timeout=5)
            return r

    def actuation(self) -> shardread_pb2.ActuationStatus:
        with grpc.insecure_channel(self.shard_addr, options=channel_options()) as ch:
            r: shardread_pb2.ActuationStatus = shardread_pb2_grpc.ShardAdminStub(ch).GetActuation(
                shardread_pb2.GetActuationRequest(), timeout=5)
            return r

    def api(self, http: str) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{http}/api/fleet", timeout=10) as r:
            data: dict[str, Any] = json.loads(r.read())
            return data

    def logs(self) -> str:
        parts = []
        for name, p in (("provider", self.provider), ("shard", self.shard)):
            if p is not None:
                parts.append(f"---- {name} ----\n{p.logs()[-4000:]}")
        if self.coord is not None:
            parts.append(f"---- coordinator ----\n{self.coord.logs()[-3000:]}")
        return "\n".join(parts)


def ctl(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run bigfleetctl as a real process."""
    return subprocess.run([sys.executable, "-m", "bigfleet.ctl.main", *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


@contextlib.contextmanager
def running_fleet(*shard_args: str) -> Iterator[Fleet]:
    """Coordinator + provider + shard; clusters c1 (satisfiable) and c2 (short) bound via the coordinator."""
    f = Fleet(Path(tempfile.mkdtemp(prefix="bigfleet-ctl-")))
    try:
        f.coord_http = f"127.0.0.1:{free_port()}"
        coord = f.coord = CoordGroup(f.root / "coord", 1, extra=("--rebalance-interval", "0", "--http-listen", f.coord_http))
        coord.start_all()
        paddr = f"127.0.0.1:{free_port()}"
        f.provider = ManagedProcess.bigfleet(
            ["fake-provider", "--listen", paddr, "--seed-count", "4", "--committed-count", "2", "--log-format", "console"],
            "provider", log_dir=f.root / "logs").start()
        wait_for_health(paddr, timeout=60)
        f.shard_addr, f.shard_http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
        f.shard = ManagedProcess.bigfleet(
            ["shard", "--shard-id", "shard-a", "--listen", f.shard_addr, "--provider", paddr,
             "--http-listen", f.shard_http, "--coordinator", f.coordinator, "--heartbeat-interval", "0.3",
             "--data-dir", str(f.root / "shard"), "--cycle-interval", "0.3", "--min-cycle-gap", "0.05",
             "--reconcile-interval", "0.2", "--log-format", "console", *shard_args],
            "shard", log_dir=f.root / "logs").start()
        wait_for_health(f.shard_addr, timeout=60)
        from bigfleet.v1alpha1 import coordinator_pb2 as cpb

        leader = coord.leader(timeout=60)

        def registered() -> bool:
            shards = coord.call(leader, "ListShards", cpb.ListShardsRequest()).shards  # type: ignore[attr-defined]
            return any(s.shard_id == "shard-a" and s.address for s in shards)

        wait_until(registered, 60, what="shard registered with the coordinator")
        for cid in ("c1", "c2"):
            r = coord.call(leader, "LookupCluster", cpb.LookupClusterRequest(cluster_id=cid))
            assert r.shard_id == "shard-a"  # type: ignore[attr-defined]
        op1, op2 = Operator(f.shard_addr, "c1"), Operator(f.shard_addr, "c2")
        f.operators += [op1, op2]
        op1.rollup([need("1", count=2, priority=200)])  # 2 cores: fits the 6-machine fleet
        op2.rollup([need("1", count=500, priority=100)])  # far more than exists: a shortfall

        def c1_configured() -> bool:
            c = f.counts("c1")
            return c.bound_by_cluster.get("c1", 0) >= 1 and c.by_state.get("MACHINE_STATE_CONFIGURED", 0) == c.total
        wait_until(c1_configured, 90, what="c1's machines configured")
        wait_until(lambda: len(f.shortfalls().shortfalls) > 0, 60, what="a shortfall for c2")
        yield f
    except BaseException:
        print(f.logs())
        raise
    finally:
        for op in f.operators:
            op.close()
        for p in (f.shard, f.provider):
            if p is not None:
                p.stop()
        if f.coord is not None:
            f.coord.stop_all()
