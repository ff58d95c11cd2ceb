"""Load-generator worker: one process opening many operator Sessions and sending shaped roll-ups.

Driven by the harness over stdin/stdout lines, so several workers (one per core) can load one
shard without their own event loop becoming the bottleneck being measured:

    argv[1]  JSON job (clusters, shape, sizing, targets)
    stdout   ``READY <open sessions>`` once every Hello is acknowledged (or the open deadline passed)
    stdin    ``GO <t_measure_from> <t_stop>`` (wall-clock seconds): roll up until ``t_stop``
    stdout   ``RESULT <json>`` with latencies of roll-ups sent inside the window, then exit

Each session answers bootstrap pulls and reclaim instructions as an operator would, so runs with
actuation progress; the time from a changed roll-up to the cluster's next node update is recorded
as an end-to-end "roll-up to first bind" figure.
"""

from __future__ import annotations

import asyncio
import collections
import json
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import grpc

from bigfleet.rpc import insecure_channel
from bigfleet.scale.workloads import cluster_id, rollup_needs
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2, shard_pb2, shard_pb2_grpc

S = provider_pb2.MachineState
BLOB = b"#!/bin/sh\n# scale harness bootstrap\n"
BOUND = (S.MACHINE_STATE_CONFIGURING, S.MACHINE_STATE_CONFIGURED)


@dataclass
class Job:
    clusters: list[int]
    shape: str
    machines_per_cluster: float
    needs_per_cluster: int
    interval: float
    change_fraction: float
    shard: str = ""  # Session address, or empty to ask the coordinator
    coordinator: str = ""
    channels: int = 4
    open_timeout: float = 120.0


@dataclass
class Stats:
    ack: list[float] = field(default_factory=list)
    first_bind: list[float] = field(default_factory=list)
    sent: int = 0
    acked: int = 0
    node_updates: int = 0
    bootstraps: int = 0
    reclaims: int = 0
    reconnects: int = 0
    open_retries: int = 0
    open_errors: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    per_shard: dict[str, int] = field(default_factory=dict)


class Operator:
    def __init__(self, job: Job, index: int, stub: shard_pb2_grpc.ShardStub, stats: Stats,
                 window: list[float]) -> None:
        self.job, self.index, self.stub, self.stats, self.window = job, index, stub, stats, window
        self.cid = cluster_id(index)
        self.ready = asyncio.Event()
        self.pending: collections.deque[float] = collections.deque()
        self.changed_at: float | None = None
        self.out: asyncio.Queue[shard_pb2.OperatorMessage] = asyncio.Queue()
        self.rnd = random.Random(index)
        self.variant = 0
        self.ever_ready = False

    def _in_window(self, t: float) -> bool:
        return len(self.window) == 2 and self.window[0] <= t <= self.window[1]

    async def run(self, go: asyncio.Event, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            call = self.stub.Session()
            writer = asyncio.create_task(self._write(call))
            roller = asyncio.create_task(self._roll(go))
            try:
                await call.write(shard_pb2.OperatorMessage(hello=shard_pb2.Hello(
                    cluster_id=self.cid, protocol_version="v1alpha1")))
                async for msg in call:
                    self._handle(msg)
                return
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as exc:
                if stopping.is_set():
                    return  # our own cancellation surfacing as CANCELLED: not a reconnect
                if not self.ever_ready:
                    # the stream never reached the shard (client-side CANCELLED under an opening burst)
                    self.stats.open_retries += 1
                    if len(self.stats.open_errors) < 5:
                        self.stats.open_errors.append(f"{exc.code().name}: {exc.details()}"[:200]
                                                      if isinstance(exc, grpc.aio.AioRpcError) else repr(exc)[:200])
                    await asyncio.sleep(0.5 + self.rnd.random())
                    continue
                if len(self.stats.errors) < 20:
                    self.stats.errors.append(f"{self.cid}: {exc!r}"[:300])
                self.stats.reconnects += 1
            finally:
                writer.cancel()
                roller.cancel()
                call.cancel()
            self.pending.clear()
            self.ready.clear()
            await asyncio.sleep(0.5 + self.rnd.random())

    async def _write(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            msg = await self.out.get()
            if msg.HasField("rollup"):
                self.pending.append(time.time())
            await call.write(msg)

    async def _roll(self, go: asyncio.Event) -> None:
        await self.ready.wait()
        await go.wait()
        # spread the first roll-ups over one interval so arrivals are uniform
        await asyncio.sleep(self.job.interval * self.rnd.random())
        n = 0
        while True:
            now = time.time()
            if len(self.window) == 2 and now > self.window[1]:
                return
            changed = n == 0 or self.rnd.random() < self.job.change_fraction
            if n and changed:
                self.variant += 1
            if changed and self.changed_at is None:
                self.changed_at = now
            needs = rollup_needs(self.job.shape, self.index, self.job.machines_per_cluster, self.variant,
                                 self.job.needs_per_cluster)
            self.out.put_nowait(shard_pb2.OperatorMessage(rollup=capacity_pb2.ClusterCapacityNeeds(
                cluster_id=self.cid, timestamp_unix_nanos=time.time_ns(), needs=needs)))
            self.stats.sent += 1
            n += 1
            await asyncio.sleep(self.job.interval)

    def _handle(self, msg: shard_pb2.ShardMessage) -> None:
        kind = msg.WhichOneof("payload")
        now = time.time()
        if kind == "ack":
            if msg.ack.echo == "hello":
                self.ready.set()
                self.ever_ready = True
            elif msg.ack.echo == "rollup" and self.pending:
                t0 = self.pending.popleft()
                self.stats.acked += 1
                if self._in_window(t0):
                    self.stats.ack.append(now - t0)
        elif kind == "node_state_update":
            self.stats.node_updates += 1
            if msg.node_state_update.state in BOUND and self.changed_at is not None:
                if self._in_window(self.changed_at):
                    self.stats.first_bind.append(now - self.changed_at)
                self.changed_at = None
        elif kind == "bootstrap_request":
            self.stats.bootstraps += 1
            self.out.put_nowait(shard_pb2.OperatorMessage(bootstrap_response=shard_pb2.BootstrapBlobResponse(
                request_id=msg.bootstrap_request.request_id, user_data=BLOB, ttl_seconds=3600)))
        elif kind == "reclaim_instruction":
            self.stats.reclaims += 1
            ri = msg.reclaim_instruction
            self.out.put_nowait(shard_pb2.OperatorMessage(reclaim_ack=shard_pb2.ReclaimAck(
                instruction_id=ri.instruction_id, nodes_started=len(ri.nodes))))


async def resolve(job: Job) -> dict[int, str]:
    """Session address per cluster: the fixed shard, or the coordinator's placement."""
    if not job.coordinator:
        return dict.fromkeys(job.clusters, job.shard)
    from bigfleet.coordclient.client import CoordinatorClient
    from bigfleet.v1alpha1 import coordinator_pb2 as pb

    client = CoordinatorClient([a for a in job.coordinator.split(",") if a], timeout=30.0)
    out: dict[int, str] = {}
    sem = asyncio.Semaphore(16)

    async def one(i: int) -> None:
        async with sem:
            for attempt in range(60):
                try:
                    r = await client.call("LookupCluster", pb.LookupClusterRequest(cluster_id=cluster_id(i)))
                    if r.shard_address:
                        out[i] = r.shard_address
                        return
                except Exception:
                    if attempt == 59:
                        raise
                await asyncio.sleep(0.5)

    try:
        await asyncio.gather(*(one(i) for i in job.clusters))
    finally:
        await client.close()
    return out


async def _readline() -> str:
    return await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


async def run(job: Job) -> dict[str, Any]:
    stats = Stats()
    t0 = time.perf_counter()
    addrs = await resolve(job)
    lookup_s = time.perf_counter() - t0
    channels: dict[str, list[grpc.aio.Channel]] = {}
    for a in sorted(set(addrs.values())):
        channels[a] = [insecure_channel(a, [("grpc.use_local_subchannel_pool", 1)]) for _ in range(job.channels)]
    window: list[float] = []
    go = asyncio.Event()
    stopping = asyncio.Event()
    ops = []
    for k, i in enumerate(job.clusters):
        chs = channels[addrs[i]]
        ops.append(Operator(job, i, shard_pb2_grpc.ShardStub(chs[k % len(chs)]), stats, window))
        stats.per_shard[addrs[i]] = stats.per_shard.get(addrs[i], 0) + 1
    tasks = []
    for k, op in enumerate(ops):
        tasks.append(asyncio.create_task(op.run(go, stopping)))
        if k % 200 == 199:
            await asyncio.sleep(0.02)  # do not open thousands of streams in one burst
    deadline = time.monotonic() + job.open_timeout
    while not all(op.ready.is_set() for op in ops) and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    open_s = time.perf_counter() - t0
    print(f"READY {sum(op.ready.is_set() for op in ops)}", flush=True)
    line = (await _readline()).split()
    if not line or line[0] != "GO":
        stopping.set()
        for t in tasks:
            t.cancel()
        return {"aborted": True}
    window.extend([float(line[1]), float(line[2])])
    go.set()
    await asyncio.sleep(max(0.0, window[1] - time.time()) + 1.0)  # +1 s for the last acks
    stopping.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for chs in channels.values():
        for ch in chs:
            await ch.close()
    return {
        "sessions": len(ops), "open_seconds": open_s, "lookup_seconds": lookup_s,
        "ack": stats.ack, "first_bind": stats.first_bind, "sent": stats.sent, "acked": stats.acked,
        "node_updates": stats.node_updates, "bootstraps": stats.bootstraps, "reclaims": stats.reclaims,
        "reconnects": stats.reconnects, "open_retries": stats.open_retries, "open_errors": stats.open_errors, "errors": stats.errors, "per_shard": stats.per_shard,
    }


def main(argv: list[str]) -> int:
    job = Job(**json.loads(argv[0]))
    res = asyncio.run(run(job))
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
