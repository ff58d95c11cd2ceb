"""Shard-side handoff costs: the ownership filter every reconcile applies to each provider record,
the durable ledger write that precedes every release/adopt ack, and what the handoff-window check
(GetClusterStatus on the Hello of an unknown cluster) adds to a Session's admission (real processes)."""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bigfleet.shard.handoff import EXCLUSIVE, OWNER_KEY, SHARED, OwnershipLedger, save_ledger
from bigfleet.v1alpha1 import provider_pb2


def _records(n: int) -> list[provider_pb2.Machine]:
    out = []
    for i in range(n):
        pb = provider_pb2.Machine(id=f"m-{i:06d}")
        if i % 2:
            pb.cluster = f"c{i % 100}"
            pb.shard_metadata[OWNER_KEY] = "A" if i % 4 == 1 else "B"
        out.append(pb)
    return out


async def _hellos(addr: str, clusters: list[str], concurrency: int) -> list[float]:
    """Seconds from Hello to the shard's hello ack, per cluster (``concurrency`` streams at a time)."""
    from bigfleet.rpc import insecure_channel
    from bigfleet.v1alpha1 import shard_pb2, shard_pb2_grpc

    out: list[float] = []
    sem = asyncio.Semaphore(concurrency)
    async with insecure_channel(addr) as ch:
        stub = shard_pb2_grpc.ShardStub(ch)

        async def one(cid: str) -> None:
            async with sem:
                call = stub.Session()
                t0 = time.perf_counter()
                await call.write(shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id=cid,
                                                                                 protocol_version="v1alpha1")))
                msg = await call.read()
                out.append(time.perf_counter() - t0)
                assert msg.WhichOneof("payload") == "ack", msg
                call.cancel()

        await asyncio.gather(*(one(c) for c in clusters))
    return out


def hello_admission(n: int = 1000, concurrency: int = 32) -> None:
    """Hello -> ack latency of never-seen clusters on a shard without and with --coordinator."""
    from bigfleet.coordinator.localgroup import CoordGroup
    from bigfleet.testing import ManagedProcess, free_port, wait_for_health

    with tempfile.TemporaryDirectory() as d:
        g = CoordGroup(Path(d) / "coord", 1)
        g.start_all()
        paddr = f"127.0.0.1:{free_port()}"
        procs = [ManagedProcess.bigfleet(["fake-provider", "--listen", paddr, "--seed-count", "4",
                                          "--log-level", "warning"], "provider").start()]
        try:
            wait_for_health(paddr, 60)
            print("\n| shard | new clusters | concurrency | Hello->ack p50 ms | p99 ms | max ms |")
            print("|---|---:|---:|---:|---:|---:|")
            for label, extra in (("no --coordinator", []), ("--coordinator (GetClusterStatus per Hello)",
                                                          ["--coordinator", g.addresses[0]])):
                saddr = f"127.0.0.1:{free_port()}"
                sp = ManagedProcess.bigfleet(
                    ["shard", "--shard-id", "bench", "--listen", saddr, "--provider", paddr, "--data-dir",
                     str(Path(d) / f"shard-{len(procs)}"), "--log-level", "warning", *extra], "shard").start()
                procs.append(sp)
                wait_for_health(saddr, 60)
                asyncio.run(_hellos(saddr, [f"warm-{i}" for i in range(50)], concurrency))
                lat = sorted(asyncio.run(_hellos(saddr, [f"c-{label[:2]}-{i}" for i in range(n)], concurrency)))
                p = statistics.quantiles(lat, n=100)
                print(f"| {label} | {n} | {concurrency} | {p[49] * 1e3:.2f} | {p[98] * 1e3:.2f} | {lat[-1] * 1e3:.2f} |")
                sp.stop()
        finally:
            for proc in procs:
                proc.stop()
            g.stop_all()


def main(argv: list[str]) -> int:
    recs = _records(100_000)
    print("| case | records | released/adopted | total ms | ns/record |")
    print("|---|---:|---:|---:|---:|")
    for mode, label in ((EXCLUSIVE, "owns() exclusive"), (SHARED, "owns() shared")):
        led = OwnershipLedger("A", mode)
        led.release((r.id for r in recs[::10]), "c")
        led.adopt(r.id for r in recs[5::10])
        t0 = time.perf_counter()
        mine = sum(1 for r in recs if led.owns(r))
        dt = time.perf_counter() - t0
        print(f"| {label} ({mine} mine) | {len(recs)} | {len(led.released)}/{len(led.adopted)} | {dt * 1e3:.1f} | {dt / len(recs) * 1e9:.0f} |")
    with tempfile.TemporaryDirectory() as d:
        for n in (1_000, 10_000, 100_000):
            led = OwnershipLedger("A")
            led.release_cluster("c", (f"m-{i:06d}" for i in range(n)), "B", "h:1")
            t0 = time.perf_counter()
            reps = 5
            for _ in range(reps):
                save_ledger(Path(d) / "ownership.json", led)
            dt = (time.perf_counter() - t0) / reps
            print(f"| save_ledger (fsync) | - | {n}/0 | {dt * 1e3:.1f} | - |")
    hello_admission()
    return 0


if __name__ == "__main__":
    raise SystemExit(main([]))
