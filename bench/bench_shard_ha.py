"""Shard HA benchmarks (issue #6), all on 127.0.0.1:

1. Replicated ``Replace`` commits on a 3-replica pysyncobj group, each replica its own OS process:
   one-at-a-time latency and pipelined throughput (the leader process measures).
2. Roll-up ack latency through real ``bigfleet shard --raft-bind`` replicas (3) at a target rate,
   each ack waiting for the committed Replace; the same load on a single-replica shard for contrast.
3. Failover: kill -9 the leader, time until another replica reports SERVING (N runs).

``python -m bench shard_ha [--quick] [--failovers N] [--rate R] [--seconds S]``
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import queue
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bigfleet.rpc import insecure_channel
from bigfleet.testing import ManagedProcess, free_port, wait_for_health
from bigfleet.v1alpha1 import capacity_pb2, shard_pb2, shard_pb2_grpc

PASSWORD = "bench-shard-raft"


def _q(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


# -- 1. raw replicated Replace ------------------------------------------------------------------

def _raft_member(me: str, peers: list[str], data_dir: str, lead: bool, n: int, conc: int, out: Any, stop: Any,
                 batch: bool = True) -> None:
    from bigfleet.shard.ha.node import ShardRaft, ShardRaftConfig

    async def run() -> None:
        raft = ShardRaft(ShardRaftConfig(me, peers, Path(data_dir), PASSWORD, compaction_min_entries=50_000,
                                               batch=batch))
        try:
            if not lead:
                while not stop.is_set():
                    await asyncio.sleep(0.1)
                return
            while not raft.is_leader():
                await asyncio.sleep(0.02)
            epoch, _ = await raft.claim("bench")
            data = capacity_pb2.ClusterCapacityNeeds(cluster_id="c", needs=[capacity_pb2.CapacityNeed(
                aggregate_resources={"cpu": "4"}, min_unit={"cpu": "1"}, priority=i) for i in range(10)]
            ).SerializeToString()
            lat: list[float] = []
            for i in range(min(n, 500)):
                t = time.perf_counter()
                await raft.replace(f"c{i % 100}", data, i, epoch)
                lat.append(time.perf_counter() - t)
            sem = asyncio.Semaphore(conc)

            async def one(i: int) -> None:
                async with sem:
                    await raft.replace(f"c{i % 1000}", data, i, epoch, timeout=30)

            t0 = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(n)))
            rate = n / (time.perf_counter() - t0)
            out.put({"seq_p50": _q(lat, 0.5), "seq_p99": _q(lat, 0.99), "seq_rate": len(lat) / sum(lat),
                     "pipelined_rate": rate, "n": n, "conc": conc, "bytes": len(data)})
        finally:
            raft.destroy()

    asyncio.run(run())


def bench_replace(n: int, conc: int, batch: bool = True) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    dirs = [tempfile.mkdtemp(prefix="bench-ha-") for _ in addrs]
    out, stop = ctx.Queue(), ctx.Event()
    # Replica 0 measures once it is the leader; the other two only follow (they may be elected first,
    # so every member measures if it leads: simplest is to make all three eligible and let one report).
    procs = [ctx.Process(target=_raft_member, args=(a, addrs, d, True, n, conc, out, stop, batch)) for a, d in zip(addrs, dirs, strict=True)]
    for p in procs:
        p.start()
    try:
        res: dict[str, float] | None = None
        deadline = time.monotonic() + 300
        while res is None:
            try:
                res = out.get(timeout=1)
            except queue.Empty:
                if time.monotonic() > deadline or not any(p.is_alive() for p in procs):
                    raise RuntimeError("raft bench members died or timed out") from None
    finally:
        stop.set()
        for p in procs:
            p.kill()
            p.join()
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)
    return res


# -- 2 and 3. real shard replica processes ------------------------------------------------------

class Fleet:
    def __init__(self, replicas: int, provider_args: tuple[str, ...] = ("--seed-count", "0")) -> None:
        self.provider = f"127.0.0.1:{free_port()}"
        self.pproc = ManagedProcess.bigfleet(["fake-provider", "--listen", self.provider, "--log-format", "console",
                                              *provider_args], "bench-provider").start()
        wait_for_health(self.provider, timeout=60)
        self.listens = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
        rafts = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
        self.dirs = [tempfile.mkdtemp(prefix="bench-ha-") for _ in range(replicas)]
        self.procs: list[ManagedProcess] = []
        for i in range(replicas):
            args = ["shard", "--shard-id", "s1", "--listen", self.listens[i], "--provider", self.provider,
                    "--data-dir", self.dirs[i], "--log-format", "console", "--log-level", "warning",
                    "--cycle-interval", "1", "--no-empty-rollup-guard"]
            if replicas > 1:
                args += ["--replica-id", f"r{i}", "--raft-bind", rafts[i], "--raft-password", PASSWORD,
                         "--raft-peers", ",".join(r for r in rafts if r != rafts[i])]
            self.procs.append(ManagedProcess.bigfleet(args, f"bench-shard-{i}").start())

    async def leader(self, timeout: float = 60, exclude: int = -1) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i, addr in enumerate(self.listens):
                if i == exclude or not self.procs[i].alive():
                    continue
                try:
                    async with insecure_channel(addr) as ch:
                        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=0.5)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return i
                except grpc.aio.AioRpcError:
                    pass
            await asyncio.sleep(0.02)
        raise TimeoutError("no leader")

    def stop(self) -> None:
        for p in self.procs:
            p.stop()
        self.pproc.stop()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)


async def rollup_latency(target: str, rate: float, seconds: float) -> dict[str, float]:
    """One session per roll-up per second (the shard paces each session at 2 roll-ups/s), each sending
    a changed roll-up; latency is from the write to the next ack (one roll-up in flight per session)."""
    sessions = max(1, int(rate))
    lat: list[float] = []
    per = sessions / rate

    async def op(k: int) -> None:
        async with insecure_channel(target) as ch:
            call = shard_pb2_grpc.ShardStub(ch).Session()
            await call.write(shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id=f"b{k}",
                                                                              protocol_version="v1alpha1")))

            async def next_ack() -> None:
                while True:
                    m = await call.read()
                    if m is grpc.aio.EOF:
                        raise RuntimeError("session ended")
                    if m.WhichOneof("payload") == "ack":
                        return

            await next_ack()  # the Hello's ack
            end = time.monotonic() + seconds
            nxt = time.monotonic() + per * (k / sessions)
            i = 0
            while time.monotonic() < end:
                await asyncio.sleep(max(0.0, nxt - time.monotonic()))
                nxt += per
                i += 1
                needs = [capacity_pb2.CapacityNeed(aggregate_resources={"cpu": f"{1 + (i % 7)}"}, min_unit={"cpu": "1"},
                                                   priority=p) for p in range(5)]
                t = time.perf_counter()
                await call.write(shard_pb2.OperatorMessage(rollup=capacity_pb2.ClusterCapacityNeeds(
                    cluster_id=f"b{k}", needs=needs)))
                await next_ack()
                lat.append(time.perf_counter() - t)
            call.cancel()

    t0 = time.monotonic()
    await asyncio.gather(*(op(k) for k in range(sessions)))
    wall = time.monotonic() - t0
    return {"n": len(lat), "rate": len(lat) / wall, "p50": _q(lat, 0.5), "p99": _q(lat, 0.99), "max": max(lat)}


async def failovers(runs: int) -> list[float]:
    times: list[float] = []
    for _ in range(runs):
        f = Fleet(3)
        try:
            lead = await f.leader()
            await asyncio.sleep(0.5)  # let followers connect (bench only: not a test condition)
            t = time.monotonic()
            f.procs[lead].kill()
            await f.leader(timeout=30, exclude=lead)
            times.append(time.monotonic() - t)
        finally:
            f.stop()
    return times


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench shard_ha")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--failovers", type=int, default=20)
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--seconds", type=float, default=10)
    a = ap.parse_args(argv)
    if a.quick:
        a.failovers, a.seconds = 3, 3
    r = bench_replace(5000 if a.quick else 20000, 256)
    print(f"| replicated Replace (3 processes, 10-need roll-up, {r['bytes']:.0f} B) | value |")
    print("|---|---|")
    print(f"| one at a time: p50 / p99 | {r['seq_p50'] * 1e3:.2f} ms / {r['seq_p99'] * 1e3:.2f} ms |")
    print(f"| one at a time: commits/s | {r['seq_rate']:.0f} |")
    print(f"| pipelined ({r['conc']:.0f} in flight): commits/s | {r['pipelined_rate']:.0f} |")

    async def acks() -> list[tuple[str, dict[str, float]]]:
        rows = []
        for n in (1, 3):
            f = Fleet(n)
            try:
                lead = await f.leader()
                rows.append((f"{n} replica{'s' if n > 1 else ''}", await rollup_latency(f.listens[lead], a.rate, a.seconds)))
            finally:
                f.stop()
        return rows

    print(f"\n| roll-up ack latency, target {a.rate:.0f}/s, {int(a.rate)} sessions at 1/s, {a.seconds:.0f} s "
          "| achieved/s | p50 | p99 | max |")
    print("|---|---|---|---|---|")
    for name, x in asyncio.run(acks()):
        print(f"| {name} | {x['rate']:.0f} | {x['p50'] * 1e3:.2f} ms | {x['p99'] * 1e3:.2f} ms | {x['max'] * 1e3:.1f} ms |")
    ts = asyncio.run(failovers(a.failovers))
    print(f"\n| failover: kill -9 leader → new leader SERVING (n={len(ts)}) | value |")
    print("|---|---|")
    print(f"| min / p50 / p90 / max | {min(ts):.2f} / {statistics.median(ts):.2f} / {_q(ts, 0.9):.2f} / {max(ts):.2f} s |")
    print(f"| within 5 s | {sum(1 for t in ts if t <= 5)}/{len(ts)} |")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
