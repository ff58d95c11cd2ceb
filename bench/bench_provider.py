"""Provider benchmarks: lifecycle RPC throughput of the fake provider and List of a large fleet.

Runs the real `bigfleet fake-provider` as a subprocess on loopback and drives it
from a grpc.aio client in this process (so client and server share the
machine's cores, as a shard and its provider would on one host).

    python -m bench provider                      # defaults
    python -m bench.bench_provider --machines 5000 --concurrency 64 --list-machines 100000
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bigfleet.provider.kit.core import ProviderCore
from bigfleet.provider.kit.server import encode_list
from bigfleet.rpc import insecure_channel
from bigfleet.testing import ManagedProcess, free_port, wait_for_health
from bigfleet.v1alpha1 import provider_pb2 as pb
from bigfleet.v1alpha1 import provider_pb2_grpc as pbg


def cpu_seconds(pid: int) -> float:
    """User+system CPU time of a process (Linux /proc), to state capacity per core under a shared box."""
    import os

    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(seed: int, extra: list[str]) -> tuple[ManagedProcess, str]:
    target = f"127.0.0.1:{free_port()}"
    proc = ManagedProcess.bigfleet(["fake-provider", "--listen", target, "--seed-count", str(seed),
                                    "--log-level", "warning", *extra], "bench-fake-provider")
    proc.start()
    wait_for_health(target, timeout=300)
    return proc, target


async def _phase(stub: pbg.CapacityProviderStub, name: str, ids: list[str], conc: int) -> tuple[float, list[float]]:
    lat: list[float] = []
    it = iter(enumerate(ids))

    async def worker() -> None:
        for i, mid in it:
            t0 = time.perf_counter()
            if name == "Create":
                await stub.Create(pb.CreateRequest(machine_id=mid, shard_id="bench", shard_epoch=1,
                                                   sequence_number=i + 1))
            elif name == "Configure":
                await stub.Configure(pb.ConfigureRequest(machine_id=mid, cluster_id="bench-cluster",
                                                         shard_metadata={"k": "v"}, bootstrap_blob=b"x" * 256))
            elif name == "Drain":
                await stub.Drain(pb.DrainRequest(machine_id=mid))
            else:
                await stub.Delete(pb.DeleteRequest(machine_id=mid))
            lat.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    return time.perf_counter() - t0, lat


async def _settle(stub: pbg.CapacityProviderStub, state: int, n: int) -> None:
    while len((await stub.List(pb.ListFilter(states=[state]))).machines) < n:  # type: ignore[list-item]
        await asyncio.sleep(0.02)


PHASES = (("Create", pb.MACHINE_STATE_IDLE), ("Configure", pb.MACHINE_STATE_CONFIGURED),
          ("Drain", pb.MACHINE_STATE_IDLE), ("Delete", pb.MACHINE_STATE_SPECULATIVE))


def _client_proc(target: str, ids: list[str], conc: int, barrier: Any, out: Any, settle_ids: int) -> None:
    """One client process: runs each phase on its slice, in step with the others via the barrier."""

    async def body() -> None:
        async with insecure_channel(target) as ch:
            stub = pbg.CapacityProviderStub(ch)
            for name, settled in PHASES:
                await asyncio.to_thread(barrier.wait)
                secs, lat = await _phase(stub, name, ids, conc)
                out.put((name, secs, lat))
                await asyncio.to_thread(barrier.wait)
                if settle_ids:
                    await _settle(stub, settled, settle_ids)
                await asyncio.to_thread(barrier.wait)

    asyncio.run(body())


def lifecycle(target: str, n: int, conc: int, procs: int) -> list[tuple[str, int, float, float, float]]:
    import multiprocessing as mp

    async def all_ids() -> list[str]:
        async with insecure_channel(target) as ch:
            return [m.id for m in (await pbg.CapacityProviderStub(ch).List(pb.ListFilter())).machines]

    ids = asyncio.run(all_ids())[:n]
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(procs)
    out = ctx.Queue()
    workers = [ctx.Process(target=_client_proc, args=(target, ids[i::procs], max(1, conc // procs), barrier, out,
                                                      len(ids) if i == 0 else 0)) for i in range(procs)]
    for w in workers:
        w.start()
    got: dict[str, list[tuple[float, list[float]]]] = {}
    for _ in range(procs * len(PHASES)):
        name, secs, lat = out.get(timeout=600)
        got.setdefault(name, []).append((secs, lat))
    for w in workers:
        w.join(60)
    rows = []
    for name, _ in PHASES:
        lat = [x for _, ls in got[name] for x in ls]
        secs = max(sec for sec, _ in got[name])
        q = statistics.quantiles(lat, n=100)
        rows.append((name, len(lat), len(lat) / secs, q[49] * 1000, q[98] * 1000))
    return rows


async def list_full(target: str, repeats: int) -> tuple[int, list[float]]:
    async with insecure_channel(target) as ch:
        stub = pbg.CapacityProviderStub(ch)
        times, n = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            lst = await stub.List(pb.ListFilter(), timeout=120)
            times.append(time.perf_counter() - t0)
            n = len(lst.machines)
        return n, times


def list_in_process(n: int, repeats: int) -> tuple[float, float]:
    """Server-side cost only: filter + encode (cold cache, then warm)."""
    from bigfleet.provider.fake.catalog import build_catalog

    core = ProviderCore()
    core.seed(build_catalog(n))
    rng = random.Random(0)
    t0 = time.perf_counter()
    recs, rev = core.list([], 0, b"", rng)
    encode_list(recs, rev)
    cold = time.perf_counter() - t0
    warm = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        recs, rev = core.list([], 0, b"", rng)
        encode_list(recs, rev)
        warm.append(time.perf_counter() - t0)
    return cold, min(warm)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench_provider")
    p.add_argument("--machines", type=int, default=4000, help="machines cycled through the lifecycle")
    p.add_argument("--concurrency", type=int, default=64, help="calls in flight, over all client processes")
    p.add_argument("--client-procs", type=int, default=2, help="client processes (one Python client saturates "
                   "before the provider does)")
    p.add_argument("--list-machines", type=int, default=100_000)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)

    print(f"### lifecycle RPCs against `bigfleet fake-provider` ({args.machines} machines, "
          f"{args.concurrency} concurrent from {args.client_procs} grpc.aio client processes)")
    print(f"{'store':<10} {'rpc':<10} {'calls':>6} {'rpc/s':>8} {'p50 ms':>8} {'p99 ms':>8}")
    for label, extra in (("memory", []), ("state-file", ["--state-file", str(Path(tempfile.mkdtemp()) / "s.json")])):
        proc, target = start(args.machines, extra)
        try:
            cpu0 = cpu_seconds(proc.pid)
            rows = lifecycle(target, args.machines, args.concurrency, args.client_procs)
            cpu = cpu_seconds(proc.pid) - cpu0
        finally:
            proc.stop()
        for name, calls, rate, p50, p99 in rows:
            print(f"{label:<10} {name:<10} {calls:>6} {rate:>8.0f} {p50:>8.2f} {p99:>8.2f}")
        n_calls = sum(r[1] for r in rows)
        total = n_calls / sum(r[1] / r[2] for r in rows)
        print(f"{label:<10} {'all four':<10} {n_calls:>6} {total:>8.0f}   provider CPU {cpu:.1f} s "
              f"(incl. settle polling) = {n_calls / cpu:.0f} lifecycle RPC per CPU-second")

    print(f"\n### List of {args.list_machines} machines")
    cold, warm = list_in_process(args.list_machines, args.repeats)
    print(f"server side, in process (filter + encode): cold {cold * 1000:.0f} ms, warm {warm * 1000:.0f} ms")
    t0 = time.perf_counter()
    proc, target = start(args.list_machines, [])
    boot = time.perf_counter() - t0
    try:
        n, times = asyncio.run(list_full(target, args.repeats))
    finally:
        proc.stop()
    print(f"over gRPC incl. client decode: {n} machines, first {times[0] * 1000:.0f} ms, "
          f"best {min(times) * 1000:.0f} ms, median {statistics.median(times) * 1000:.0f} ms "
          f"(provider boot with {args.list_machines} seeds: {boot:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
