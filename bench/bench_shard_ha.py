"""Shard HA benchmarks (issue #6), all on 127.0.0.1:

1. Replicated ``Replace`` commits on a 3-replica pysyncobj group, each replica its own OS process:
   one-at-a-time latency and pipelined throughput (the leader process measures).
2. Roll-up ack latency through real ``bigfleet shard --raft-bind`` replicas (3) at a target rate,
   each ack waiting for the committed Replace; the same load on a single-replica shard for contrast.
3. Failover: kill -9 the leader, time until another replica reports SERVING (N runs).
4. Failover at scale (only with ``--failover-machines``): a fake provider holding N machines, half of
   them pre-bound to clusters (``bigfleet scaletest --prebind``'s seed), a 3-replica dry-run shard
   group, one operator stand-in session per cluster; kill -9 the leader and time, on the other
   replicas, health SERVING and the new leader's first completed cycle, with where the time went.

``python -m bench shard_ha [--quick] [--failovers N] [--rate R] [--seconds S]``
``python -m bench shard_ha --failover-machines 100000,500000 --failovers 3`` (runs part 4 only)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import multiprocessing as mp
import os
import queue
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bigfleet.process.procstat import proc_children, proc_cpu_seconds, tree_cpu_seconds
from bigfleet.rpc import insecure_channel
from bigfleet.scale import stats
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
        self.metrics = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
        rafts = [f"127.0.0.1:{free_port()}" for _ in range(replicas)]
        self.dirs = [tempfile.mkdtemp(prefix="bench-ha-") for _ in range(replicas)]
        self.procs: list[ManagedProcess] = []
        for i in range(replicas):
            args = ["shard", "--shard-id", "s1", "--listen", self.listens[i], "--provider", self.provider,
                    "--data-dir", self.dirs[i], "--log-format", "console", "--log-level", "warning",
                    "--cycle-interval", "1", "--no-empty-rollup-guard", "--metrics-listen", self.metrics[i]]
            if replicas > 1:
                args += ["--replica-id", f"r{i}", "--raft-bind", rafts[i], "--raft-password", PASSWORD,
                         "--raft-peers", ",".join(r for r in rafts if r != rafts[i])]
            self.procs.append(ManagedProcess.bigfleet(args, f"bench-shard-{i}").start())

    def scrape(self, i: int) -> stats.Samples:
        return _samples(f"http://{self.metrics[i]}/metrics")

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


async def ack_rows(rate: float, seconds: float) -> list[tuple[str, dict[str, float]]]:
    """Client-side latency (includes the load generator's own scheduling on a shared box) and the
    leader's own read-to-ack histogram (``bigfleet_shard_rollup_ack_seconds``) over the same run."""
    rows = []
    for n in (1, 3):
        f = Fleet(n)
        try:
            lead = await f.leader()
            await asyncio.sleep(1.0)
            before, cpu0 = f.scrape(lead), _cpu_by_role(f, lead)
            t0 = time.monotonic()
            x = await rollup_latency(f.listens[lead], rate, seconds)
            spent = time.monotonic() - t0
            cpu1 = _cpu_by_role(f, lead)
            x.update({f"{k}_cores": (cpu1[k] - cpu0[k]) / spent for k in cpu0})
            after = f.scrape(lead)
            name = "bigfleet_shard_rollup_ack_seconds"
            total = stats.delta(after, before, f"{name}_count")
            x["within_50ms"] = stats.delta(after, before, f"{name}_bucket", le="0.05") / max(1.0, total)
            x["server_p99"] = stats.histogram_quantile(after, before, name, 0.99)
            rows.append((f"{n} replica{'s' if n > 1 else ''}", x))
        finally:
            f.stop()
    return rows


def _cpu_by_role(f: Fleet, lead: int) -> dict[str, float]:
    """CPU seconds so far of the leader (its engine worker apart), the worker, the followers (summed)
    and this load generator: on a 2-core box they share the cores the ack latency depends on."""
    leader = f.procs[lead].pid
    return {"leader": proc_cpu_seconds(leader), "worker": tree_cpu_seconds(leader) - proc_cpu_seconds(leader),
            "followers": sum(tree_cpu_seconds(p.pid) for i, p in enumerate(f.procs) if i != lead),
            "generator": proc_cpu_seconds(os.getpid())}


def print_ack_rows(rate: float, seconds: float) -> None:
    print(f"\n| roll-up ack latency, target {rate:.0f}/s, {int(rate)} sessions at 1/s, {seconds:.0f} s "
          "| achieved/s | client p50 | client p99 | max | shard: acks ≤ 50 ms | shard p99 (bucket) "
          "| CPU (cores): leader / its worker / followers / generator |")
    print("|---|---|---|---|---|---|---|---|")
    for name, x in asyncio.run(ack_rows(rate, seconds)):
        print(f"| {name} | {x['rate']:.0f} | {x['p50'] * 1e3:.2f} ms | {x['p99'] * 1e3:.2f} ms | {x['max'] * 1e3:.1f} ms "
              f"| {x['within_50ms'] * 100:.1f} % | ≤ {x['server_p99'] * 1e3:.0f} ms | {x['leader_cores']:.2f} / "
              f"{x['worker_cores']:.2f} / {x['followers_cores']:.2f} / {x['generator_cores']:.2f} |")


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


# -- 4. failover at scale: kill -9 → SERVING → the new leader's first completed cycle ----------

SHARD_SERVICE = "bigfleet.v1alpha1.Shard"
REDIRECT_KEY = "bigfleet-redirect"


@dataclass
class StandinJob:
    """Operator stand-ins: one Session per cluster, each sending its cluster's first roll-up (the one
    the provider's seed was planned for) at once and every ``interval`` seconds, answering like the
    operator's session client: a ``bigfleet-redirect`` trailer is followed at once, any other end is
    retried with jittered backoff (0.5 s doubling to 30 s, reset on a Hello ack) on the next replica."""

    addrs: list[str]
    first: int
    clusters: list[int]
    shape: str
    per_cluster: float
    needs_per_cluster: int
    interval: float
    channels: int = 4


def _standins_main(job: dict[str, Any], events: Any, stop: Any) -> None:
    asyncio.run(_standins(StandinJob(**job), events, stop))


async def _standins(job: StandinJob, events: Any, stop: Any) -> None:
    from bigfleet.scale.workloads import cluster_id, rollup_needs

    opts = [("grpc.use_local_subchannel_pool", 1)]
    chans = {a: [insecure_channel(a, opts) for _ in range(job.channels)] for a in job.addrs}
    stopping = asyncio.Event()

    async def operator(k: int, idx: int) -> None:
        rnd = random.Random(idx)
        cid = cluster_id(idx)
        hello = shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id=cid, protocol_version="v1alpha1"))
        roll = shard_pb2.OperatorMessage(rollup=capacity_pb2.ClusterCapacityNeeds(
            cluster_id=cid, needs=rollup_needs(job.shape, idx, job.per_cluster, 0, job.needs_per_cluster)))
        target, backoff = job.addrs[job.first], 0.5
        while not stopping.is_set():
            call = shard_pb2_grpc.ShardStub(chans[target][k % job.channels]).Session()
            sender: asyncio.Task[None] | None = None
            redirect = ""

            async def send_rollups(c: Any = call) -> None:
                while True:
                    await c.write(roll)
                    await asyncio.sleep(job.interval)

            try:
                await call.write(hello)
                rolled = False
                while True:
                    m = await call.read()
                    if m is grpc.aio.EOF:
                        break
                    if m.WhichOneof("payload") != "ack":
                        continue
                    if m.ack.echo == "hello" and sender is None:
                        backoff = 0.5
                        events.put(("hello", idx, time.monotonic(), target))
                        sender = asyncio.create_task(send_rollups())
                    elif m.ack.echo == "rollup" and not rolled:
                        rolled = True
                        events.put(("rollup", idx, time.monotonic(), target))
            except grpc.aio.AioRpcError as exc:
                for key, val in exc.trailing_metadata() or ():
                    if key == REDIRECT_KEY and val:
                        redirect = str(val)
            except Exception:  # a write on a call that just ended, etc.: reconnect like an operator
                pass
            finally:
                if sender is not None:
                    sender.cancel()
                call.cancel()
            if stopping.is_set():
                return
            if redirect and redirect in chans and redirect != target:
                target = redirect
                continue
            await asyncio.sleep(backoff * (0.8 + 0.4 * rnd.random()))
            backoff = min(30.0, backoff * 2)
            if not redirect:
                target = job.addrs[(job.addrs.index(target) + 1) % len(job.addrs)]

    tasks = []
    for k, idx in enumerate(job.clusters):
        tasks.append(asyncio.create_task(operator(k, idx)))
        if k % 200 == 199:
            await asyncio.sleep(0.02)  # (as the scale load generator: no single burst of thousands of opens)
    while not stop.is_set():
        await asyncio.sleep(0.2)
    stopping.set()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _samples(url: str, timeout: float = 5.0) -> stats.Samples:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return stats.parse(r.read().decode())


def _get(smp: stats.Samples, name: str, **labels: str) -> float:
    return stats.delta(smp, {}, name, **labels)


class ScaleGroup:
    """One fake provider with ``machines`` slots (half of them pre-bound to ``clusters`` clusters, as
    ``bigfleet scaletest --prebind`` seeds it), three dry-run shard replicas in worker engine mode and
    the operator stand-ins (``standins`` processes, one Session per cluster). With ``probe`` every
    replica runs under ``bench.stall_probe`` and a control probe runs alone (logs/control-probe.log)."""

    def __init__(self, machines: int, clusters: int, workdir: Path, cycle_interval: float, standins: int,
                 probe: bool = False, raft_timeouts: str = "", pyspy: str = "", demand_fraction: float = 0.5,
                 needs_per_cluster: int = 3, shape: str = "aggregated") -> None:
        from bigfleet.scale import prebind

        self.machines, self.clusters, self.workdir = machines, clusters, workdir
        self.probe, self.raft_timeouts = probe or bool(raft_timeouts), raft_timeouts
        self.pyspy = pyspy
        self.kills = 0
        self.shape, self.needs_per_cluster, self.standins = shape, needs_per_cluster, standins
        self.per_cluster = machines * demand_fraction / clusters
        self.logs = workdir / "logs"
        t0 = time.perf_counter()
        bindings, _ = prebind.plan(shape, clusters, machines, 0, demand_fraction, needs_per_cluster)
        self.seed = workdir / "prebind.json"
        self.bound = prebind.write_seed(self.seed, bindings)
        del bindings
        self.plan_s = time.perf_counter() - t0
        self.provider = f"127.0.0.1:{free_port()}"
        self.pproc = ManagedProcess.bigfleet(
            ["fake-provider", "--listen", self.provider, "--seed-count", str(machines), "--committed-count", "0",
             "--prebind-file", str(self.seed), "--log-level", "warning"], "provider", log_dir=self.logs).start()
        self.control = ManagedProcess([sys.executable, "-m", "bench.stall_probe", "--control"], "control-probe",
                                      log_dir=self.logs).start() if probe or raft_timeouts else None
        self.listens = [f"127.0.0.1:{free_port()}" for _ in range(3)]
        self.rafts = [f"127.0.0.1:{free_port()}" for _ in range(3)]
        self.metrics = [f"http://127.0.0.1:{free_port()}/metrics" for _ in range(3)]
        self.dirs = [workdir / f"data-r{i}" for i in range(3)]
        self.cycle_interval = cycle_interval
        self.procs: list[ManagedProcess] = []
        self.ctx = mp.get_context("spawn")
        self.events: Any = self.ctx.Queue()
        self.stop_evt: Any = self.ctx.Event()
        self.workers: list[Any] = []
        # kind ("hello" / "rollup") -> cluster index -> times (monotonic) of its acks
        self.acks: dict[str, dict[int, list[float]]] = {"hello": {}, "rollup": {}}
        self.last_hello_target: dict[int, str] = {}

    def argv(self, i: int) -> list[str]:
        return ["shard", "--shard-id", "s1", "--listen", self.listens[i], "--provider", self.provider,
                "--metrics-listen", self.metrics[i].removeprefix("http://").removesuffix("/metrics"),
                "--data-dir", str(self.dirs[i]), "--cycle-interval", str(self.cycle_interval), "--dry-run",
                "--engine-mode", "worker", "--replica-id", f"r{i}", "--raft-bind", self.rafts[i],
                "--raft-password", PASSWORD, "--raft-peers", ",".join(r for r in self.rafts if r != self.rafts[i])]

    def start_replica(self, i: int) -> None:
        name = f"shard-r{i}"
        if self.probe:
            env = {"BENCH_RAFT_TIMEOUTS": self.raft_timeouts} if self.raft_timeouts else None
            p = ManagedProcess([sys.executable, "-m", "bench.stall_probe", *self.argv(i)], name, env=env,
                               log_dir=self.logs)
        else:
            p = ManagedProcess.bigfleet(self.argv(i), name, log_dir=self.logs)
        p.start()
        if i < len(self.procs):
            self.procs[i] = p
        else:
            self.procs.append(p)

    def start(self, timeout: float) -> None:
        wait_for_health(self.provider, timeout=timeout)
        for i in range(3):
            self.start_replica(i)

    def start_standins(self, first: int) -> None:
        idx = list(range(self.clusters))
        for w in range(self.standins):
            job = StandinJob(self.listens, first, idx[w::self.standins], self.shape, self.per_cluster,
                             self.needs_per_cluster, 10.0)
            p = self.ctx.Process(target=_standins_main, args=(asdict(job), self.events, self.stop_evt), daemon=True)
            p.start()
            self.workers.append(p)

    def drain_events(self) -> None:
        while True:
            try:
                kind, idx, t, target = self.events.get_nowait()
            except queue.Empty:
                return
            self.acks[kind].setdefault(idx, []).append(t)
            if kind == "hello":
                self.last_hello_target[idx] = target

    def rolled_up_since(self, t0: float) -> list[float]:
        """Per cluster, the first roll-up ack after ``t0`` (seconds after it)."""
        self.drain_events()
        out = []
        for ts in self.acks["rollup"].values():
            later = [t - t0 for t in ts if t > t0]
            if later:
                out.append(min(later))
        return out

    async def serving(self, i: int) -> bool:
        try:
            async with insecure_channel(self.listens[i]) as ch:
                r = await health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=SHARD_SERVICE), timeout=2)
            return bool(r.status == health_pb2.HealthCheckResponse.SERVING)
        except grpc.aio.AioRpcError:
            return False

    async def current_leader(self) -> int | None:
        if not any(p.alive() for p in self.procs):
            raise RuntimeError(f"every shard replica exited; see {self.logs}")
        for i in range(3):
            if self.procs[i].alive() and await self.serving(i):
                return i
        return None

    async def metric(self, i: int, name: str, **labels: str) -> float:
        try:
            return _get(await asyncio.to_thread(_samples, self.metrics[i]), name, **labels)
        except OSError:
            return math.nan

    async def steady(self, since: float, timeout: float) -> int:
        """Wait until one leader has acknowledged every stand-in's roll-up after ``since`` (monotonic),
        every follower holds every cluster's roll-up under that leader's epoch, and that same leader
        then ran three more cycles; returns it. A change of leader meanwhile starts the wait over."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lead = await self.current_leader()
            if lead is None or await self.metric(lead, "bigfleet_shard_cycles_total") < 1:
                await asyncio.sleep(0.5)
                continue
            # (a stand-in may stay stranded on a deposed leader: see "stranded" in the failover rows)
            if len(self.rolled_up_since(since)) < self.clusters * 0.99:
                await asyncio.sleep(0.5)
                continue
            epoch = await self.metric(lead, "bigfleet_shard_ha_epoch")
            behind = False
            for i in range(3):
                if i != lead and (await self.metric(i, "bigfleet_shard_ha_replicated_clusters") < self.clusters
                                  or await self.metric(i, "bigfleet_shard_ha_epoch") != epoch):
                    behind = True
            if behind:
                await asyncio.sleep(0.5)
                continue
            c0 = await self.metric(lead, "bigfleet_shard_cycles_total")
            while time.monotonic() < deadline and await self.serving(lead) and \
                    await self.metric(lead, "bigfleet_shard_ha_epoch") == epoch:
                if await self.metric(lead, "bigfleet_shard_cycles_total") >= c0 + 3:
                    return lead
                await asyncio.sleep(0.5)
        raise TimeoutError(f"no steady leader within {timeout:.0f} s")

    def stop(self) -> None:
        self.stop_evt.set()
        for w in self.workers:
            w.join(timeout=10)
            if w.is_alive():
                w.kill()
                w.join()
        for p in self.procs:
            p.stop()
        self.pproc.stop()
        if self.control is not None:
            self.control.stop()
        for d in self.dirs:
            shutil.rmtree(d, ignore_errors=True)
        self.seed.unlink(missing_ok=True)


def _log_records(path: Path) -> list[dict[str, Any]]:
    """A replica's JSON log lines, each with ``ts`` (unix seconds)."""
    out: list[dict[str, Any]] = []
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return out
    for line in lines:
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
            rec["ts"] = datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
        out.append(rec)
    return out


def _first(recs: list[dict[str, Any]], event: str, since: float, until: float = math.inf) -> dict[str, Any]:
    return next((r for r in recs if r.get("event") == event and since <= r["ts"] <= until), {})


def _stalls(recs: list[dict[str, Any]], since: float, until: float) -> list[float]:
    return [r["stall_s"] for r in recs if r.get("event") == "probe stall" and since <= r["ts"] <= until]


async def _one_failover(g: ScaleGroup, lead: int, timeout: float) -> dict[str, Any]:
    survivors = [i for i in range(3) if i != lead]
    base = {i: await asyncio.to_thread(_samples, g.metrics[i]) for i in survivors}
    cpu0 = {i: tree_cpu_seconds(g.procs[i].pid) for i in survivors}
    pcpu0 = proc_cpu_seconds(g.pproc.pid)
    orphans = proc_children(g.procs[lead].pid)  # the dead leader's engine worker
    spies = []
    if g.pyspy:  # GIL-holding samples of each survivor from just before the kill to its first cycle
        for i in survivors:
            out_file = g.logs / f"pyspy-r{i}-kill{g.kills + 1}.json"
            spies.append(subprocess.Popen([g.pyspy, "record", "--gil", "--nonblocking", "--threads", "-r", "100",
                                           "-f", "speedscope", "-o", str(out_file), "--pid", str(g.procs[i].pid)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        await asyncio.sleep(1.0)
    g.kills += 1
    load = os.getloadavg()
    t_wall = time.time()
    t0 = time.monotonic()
    g.procs[lead].kill()
    serving: dict[int, float] = {}
    cycled: dict[int, float] = {}
    at_cycle: dict[int, stats.Samples] = {}
    done = asyncio.Event()

    async def health(i: int) -> None:
        async with insecure_channel(g.listens[i]) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while not done.is_set() and time.monotonic() - t0 < timeout:
                try:
                    r = await stub.Check(health_pb2.HealthCheckRequest(service=SHARD_SERVICE), timeout=1)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        serving[i] = time.monotonic() - t0
                        return
                except grpc.aio.AioRpcError:
                    pass
                await asyncio.sleep(0.02)

    async def cycles(i: int) -> None:
        while not done.is_set() and time.monotonic() - t0 < timeout:
            try:
                smp = await asyncio.to_thread(_samples, g.metrics[i])
            except OSError:
                smp = {}
            if smp and stats.delta(smp, base[i], "bigfleet_shard_cycles_total") > 0:
                cycled[i] = time.monotonic() - t0
                at_cycle[i] = smp
                done.set()
                return
            await asyncio.sleep(0.1)

    await asyncio.gather(*(health(i) for i in survivors), *(cycles(i) for i in survivors))
    if not cycled:
        raise TimeoutError(f"no first cycle on a new leader within {timeout:.0f} s")
    for sp in spies:
        sp.send_signal(signal.SIGINT)
    for sp in spies:
        try:
            sp.wait(timeout=60)
        except subprocess.TimeoutExpired:
            sp.kill()
    new = next(iter(cycled))
    t_cycle = cycled[new]
    t_cycle_wall = t_wall + t_cycle
    cpu = tree_cpu_seconds(g.procs[new].pid) - cpu0[new]
    pcpu = proc_cpu_seconds(g.pproc.pid) - pcpu0
    orphan_alive = [p for p in orphans if Path(f"/proc/{p}").exists()]
    a, b = at_cycle[new], base[new]

    def d(name: str, **labels: str) -> float:
        return stats.delta(a, b, name, **labels)

    async def sessions_back() -> bool:
        return len(g.rolled_up_since(t0)) >= g.clusters

    deadline = time.monotonic() + min(timeout, 120.0)
    while not await sessions_back() and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    back = g.rolled_up_since(t0)
    # stand-ins whose last Hello was acknowledged by a replica that is not the new leader and whose
    # roll-up no replica acknowledged since: a Session accepted by a replica while it stepped down
    leader_addr = g.listens[new]
    stranded = []
    for idx in g.acks["hello"]:
        if not any(t > t0 for t in g.acks["rollup"].get(idx, [])) and g.last_hello_target.get(idx) != leader_addr:
            stranded.append(idx)
    recs = {i: _log_records(g.procs[i].log_path) for i in survivors}
    # the takeover that led to the first cycle: the new leader's last "leading the shard" before it
    leads = [r for r in recs[new] if r.get("event") == "leading the shard" and t_wall <= r["ts"] <= t_cycle_wall]
    lead_rec = leads[-1] if leads else {}
    rec_rec = _first(recs[new], "first reconcile done", lead_rec.get("ts", t_wall), t_cycle_wall + 5)
    takeovers = sum(1 for i in survivors for r in recs[i]
                    if r.get("event") == "leading the shard" and t_wall <= r["ts"] <= t_cycle_wall)
    stepdowns = sum(1 for i in survivors for r in recs[i]
                    if r.get("event") == "stepping down" and t_wall <= r["ts"] <= t_cycle_wall)
    row: dict[str, Any] = {
        "killed": f"r{lead}", "new_leader": f"r{new}", "load_before": load, "load_after": os.getloadavg(),
        "kill_unix": t_wall, "kill_mono": t0,
        "serving_s": min(serving.values()) if serving else math.nan,
        "serving_by": {f"r{i}": v for i, v in serving.items()}, "first_cycle_s": t_cycle,
        "takeovers_until_first_cycle": takeovers, "stepdowns_until_first_cycle": stepdowns,
        "takeover_ms": lead_rec.get("takeover_ms", math.nan),
        "leading_logged_s": lead_rec["ts"] - t_wall if lead_rec else math.nan,
        "first_reconcile_logged_s": rec_rec["ts"] - t_wall if rec_rec else math.nan,
        "machines_listed": rec_rec.get("machines"),
        "list_rpc_s": d("bigfleet_shard_provider_rpc_duration_seconds_sum", rpc="List"),
        "list_rpcs": d("bigfleet_shard_provider_rpc_duration_seconds_count", rpc="List"),
        "reconcile_s": d("bigfleet_shard_cycle_phase_duration_seconds_sum", phase="reconcile"),
        "reconciles": d("bigfleet_shard_cycle_phase_duration_seconds_count", phase="reconcile"),
        "decide_s": d("bigfleet_shard_cycle_phase_duration_seconds_sum", phase="decide"),
        "engine_worker_s": d("bigfleet_shard_cycle_phase_duration_seconds_sum", phase="engine_worker"),
        "engine_resyncs": d("bigfleet_shard_engine_worker_resyncs_total"),
        "rollups_by_first_cycle": d("bigfleet_shard_rollups_total"),
        "replaces_by_first_cycle": _get(a, "bigfleet_shard_ha_replaces_applied") - _get(b, "bigfleet_shard_ha_replaces_applied"),
        "sessions_at_first_cycle": _get(a, "bigfleet_shard_active_sessions"),
        "leader_cpu_s": cpu, "provider_cpu_s": pcpu,
        "orphan_worker_alive_at_first_cycle": len(orphan_alive),
        "sessions_back": len(back), "sessions_stranded": len(stranded),
        "stranded_on": sorted({g.last_hello_target.get(i, "") for i in stranded}),
        "sessions_back_p50_s": stats.quantile(back, 0.5),
        "sessions_back_max_s": stats.quantile(back, 1.0),
        "errors_logged": sorted({str(r.get("event")) for i in survivors for r in recs[i]
                                 if r.get("level") == "error" and r["ts"] >= t_wall})[:5],
    }
    if g.probe:
        ctl = _log_records(g.logs / "control-probe.log")
        st = _stalls(recs[new], t_wall, t_cycle_wall)
        cs = _stalls(ctl, t_wall, t_cycle_wall)
        row["probe_new_leader_stalls_over_0_3s"] = sum(1 for x in st if x > 0.3)
        row["probe_new_leader_max_stall_s"] = max(st, default=0.0)
        row["probe_control_stalls_over_0_3s"] = sum(1 for x in cs if x > 0.3)
        row["probe_control_max_stall_s"] = max(cs, default=0.0)
    for pid in orphan_alive:  # (the dead leader's engine worker exits when its stdin closes)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    # restart the killed replica from its data dir; it rejoins as a follower before the next kill
    g.start_replica(lead)
    return row


def _leadership_changes(g: ScaleGroup, since: float, until: float) -> int:
    return sum(1 for p in g.procs for r in _log_records(p.log_path)
               if r.get("event") == "leading the shard" and since <= r["ts"] <= until)


async def scale_failovers(machines: int, runs: int, clusters: int, standins: int, cycle_interval: float,
                          timeout: float, workdir: Path, probe: bool = False, raft_timeouts: str = "",
                          pyspy: str = "") -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    g = ScaleGroup(machines, clusters, workdir, cycle_interval, standins, probe, raft_timeouts, pyspy)
    out: dict[str, Any] = {"machines": machines, "clusters": clusters, "bound": g.bound,
                           "raft_timeouts": raft_timeouts or "shipped (replica groups: 3-6 s elections, 6 s fallback)",
                           "plan_s": round(g.plan_s, 1), "workdir": str(workdir), "runs": [], "steady": [],
                           "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
                           "load_start": os.getloadavg()}
    try:
        g.start(timeout)
        t_wall = time.time()
        deadline = time.monotonic() + timeout
        first = None
        while first is None and time.monotonic() < deadline:
            first = await g.current_leader()
            if first is None:
                await asyncio.sleep(0.2)
        if first is None:
            raise TimeoutError("no shard leader")
        g.start_standins(first)
        lead = await g.steady(0.0, timeout)
        out["steady"].append({"after": "start", "seconds": round(time.monotonic() - t_start, 1),
                              "leader_changes": _leadership_changes(g, t_wall, time.time())})
        for k in range(runs):
            row = await _one_failover(g, lead, timeout)
            out["runs"].append(row)
            print(f"#   {machines} machines, failover {k + 1}/{runs}: SERVING {row['serving_s']:.2f} s, first cycle "
                  f"{row['first_cycle_s']:.2f} s, {row['takeovers_until_first_cycle']} takeover(s) "
                  f"(load {row['load_before'][0]:.1f})", flush=True)
            t1 = time.monotonic()
            lead = await g.steady(row["kill_mono"], timeout)
            out["steady"].append({"after": f"failover {k + 1}", "seconds": round(time.monotonic() - t1, 1),
                                  "leader_changes": _leadership_changes(g, row["kill_unix"] + row["first_cycle_s"],
                                                                        time.time())})
    except (TimeoutError, RuntimeError) as exc:  # e.g. leadership never settles: the result says so
        out["error"] = str(exc)
        print(f"#   {machines} machines: {exc}", flush=True)
    finally:
        out["load_end"] = os.getloadavg()
        out["seconds"] = time.monotonic() - t_start
        out["all_leader_changes"] = sum(1 for p in g.procs for r in _log_records(p.log_path)
                                        if r.get("event") == "leading the shard")
        g.stop()
    return out


def _mmm(xs: list[float], unit: str = " s") -> str:
    xs = [x for x in xs if not math.isnan(x)]
    if not xs:
        return "—"
    return f"{min(xs):.2f} / {statistics.median(xs):.2f} / {max(xs):.2f}{unit}"


def print_scale_failovers(results: list[dict[str, Any]]) -> None:
    print("\n| kill -9 the leader (3 replicas, dry-run, worker engine) | runs | → another replica SERVING "
          "min / p50 / max | → new leader's first completed cycle min / p50 / max | takeovers until then "
          "| stand-ins' roll-ups acked by the new leader, max |")
    print("|---|---|---|---|---|---|")
    for r in results:
        runs = r["runs"]
        print(f"| {r['machines']:,} machines ({r['bound']:,} pre-bound), {r['clusters']:,} clusters, "
              f"Raft timeouts {r['raft_timeouts']} "
              f"| {len(runs)} | {_mmm([x['serving_s'] for x in runs])} | {_mmm([x['first_cycle_s'] for x in runs])} "
              f"| {', '.join(str(x['takeovers_until_first_cycle']) for x in runs)} "
              f"| {_mmm([x['sessions_back_max_s'] for x in runs])}; stranded on a deposed leader: "
              f"{', '.join(str(x['sessions_stranded']) for x in runs)} |")
    print("\n| machines | run | load 1/5 min | killed → new | first SERVING | leader that cycled: SERVING "
          "(takeover_ms claim → SERVING) "
          "| first reconcile done | List RPC (calls) | reconcile List+merge (calls) | decide (engine worker) "
          "| first cycle | CPU new leader+worker / provider | roll-ups / Replace commits by then |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        for k, x in enumerate(r["runs"], 1):
            print(f"| {r['machines']:,} | {k} | {x['load_before'][0]:.1f} / {x['load_before'][1]:.1f} "
                  f"| {x['killed']} → {x['new_leader']} | {x['serving_s']:.2f} s "
                  f"| {x['leading_logged_s']:.2f} s ({x['takeover_ms']:.0f} ms) "
                  f"| {x['first_reconcile_logged_s']:.2f} s | {x['list_rpc_s']:.2f} s ({x['list_rpcs']:.0f}) "
                  f"| {x['reconcile_s']:.2f} s ({x['reconciles']:.0f}) "
                  f"| {x['decide_s']:.2f} s ({x['engine_worker_s']:.2f} s) | {x['first_cycle_s']:.2f} s "
                  f"| {x['leader_cpu_s']:.1f} / {x['provider_cpu_s']:.1f} s "
                  f"| {x['rollups_by_first_cycle']:.0f} / {x['replaces_by_first_cycle']:.0f} |")
        if r.get("error"):
            print(f"#   {r['machines']:,}: stopped: {r['error']} ({r['all_leader_changes']} leader changes logged "
                  f"in {r['seconds']:.0f} s, {len(r['runs'])} kills)")
        for s in r["steady"]:
            print(f"#   {r['machines']:,}: steady leader {s['seconds']} s after {s['after']}; "
                  f"leader changes meanwhile: {s['leader_changes']}")



def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench shard_ha")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--failovers", type=int, default=None,
                    help="kill -9 runs (default 20; with --failover-machines: per size, default 3)")
    ap.add_argument("--rate", type=float, default=500)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--acks-only", action="store_true", help="run only the roll-up ack latency rows")
    ap.add_argument("--failover-machines", default="",
                    help="comma-separated machine counts: run only the failover-at-scale benchmark (part 4)")
    ap.add_argument("--failover-clusters", type=int, default=0,
                    help="clusters (one stand-in Session each); default machines / 100, as bigfleet scaletest")
    ap.add_argument("--failover-standins", type=int, default=2, help="stand-in processes")
    ap.add_argument("--failover-cycle-interval", type=float, default=2.0)
    ap.add_argument("--failover-timeout", type=float, default=900.0, help="seconds for any one wait")
    ap.add_argument("--failover-workdir", default="", help="logs (kept) and data (removed); default a temp dir")
    ap.add_argument("--failover-json", default="", help="write the raw per-run figures here")
    ap.add_argument("--failover-probe", action="store_true",
                    help="run each replica under bench.stall_probe (a thread logging its wake-up lateness) plus a "
                         "control probe process, to tell GIL stalls from a loaded box")
    ap.add_argument("--failover-raft-timeouts", default="", metavar="MIN,MAX,FALLBACK",
                    help="diagnostics: run the replicas' Raft members with these election timeouts and leader "
                         "fallback (seconds) instead of the shipped 3,6,6 for replica groups (implies --failover-probe)")
    ap.add_argument("--failover-pyspy", default="", metavar="PATH",
                    help="diagnostics: a py-spy binary; each survivor is sampled (--gil, speedscope) from just "
                         "before the kill to the first cycle, into the logs dir")
    a = ap.parse_args(argv)
    if a.failover_machines:
        sizes = [int(x.replace("_", "")) for x in a.failover_machines.split(",") if x.strip()]
        root = Path(a.failover_workdir or tempfile.mkdtemp(prefix="bench-ha-scale-"))
        results = []
        for n in sizes:
            clusters = a.failover_clusters or max(1, n // 100)
            results.append(asyncio.run(scale_failovers(n, a.failovers or 3, clusters, a.failover_standins,
                                                       a.failover_cycle_interval, a.failover_timeout,
                                                       root / f"m{n}", a.failover_probe, a.failover_raft_timeouts,
                                                       a.failover_pyspy)))
            if a.failover_json:
                Path(a.failover_json).write_text(json.dumps(results, indent=2, default=str))
        print_scale_failovers(results)
        print(f"\n(logs: {root})")
        return 0
    if a.failovers is None:
        a.failovers = 20
    if a.quick:
        a.failovers, a.seconds = 3, 3
    if a.acks_only:
        print_ack_rows(a.rate, a.seconds)
        return 0
    r = bench_replace(5000 if a.quick else 20000, 256)
    print(f"| replicated Replace (3 processes, 10-need roll-up, {r['bytes']:.0f} B) | value |")
    print("|---|---|")
    print(f"| one at a time: p50 / p99 | {r['seq_p50'] * 1e3:.2f} ms / {r['seq_p99'] * 1e3:.2f} ms |")
    print(f"| one at a time: commits/s | {r['seq_rate']:.0f} |")
    print(f"| pipelined ({r['conc']:.0f} in flight): commits/s | {r['pipelined_rate']:.0f} |")

    print_ack_rows(a.rate, a.seconds)
    ts = asyncio.run(failovers(a.failovers))
    print(f"\n| failover: kill -9 leader → new leader SERVING (n={len(ts)}) | value |")
    print("|---|---|")
    print(f"| min / p50 / p90 / max | {min(ts):.2f} / {statistics.median(ts):.2f} / {_q(ts, 0.9):.2f} / {max(ts):.2f} s |")
    print(f"| within 5 s | {sum(1 for t in ts if t <= 5)}/{len(ts)} |")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
