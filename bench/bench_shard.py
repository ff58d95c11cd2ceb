"""Shard Session load: N operator sessions, each sending a 10-need roll-up every interval, against a
real `bigfleet shard` process (and a real fake provider), while decision cycles run.

Measures, from the operator side, roll-up → Ack{"rollup"} latency (p50/p99/max), the shard's own
validate+apply histogram, the shard process's CPU and RSS (total and per session), and cycles run.

    python -m bench.bench_shard --sessions 5000 --interval 10 --duration 40
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import random
import statistics
import subprocess
import tempfile
import time
import urllib.request

import grpc

from bigfleet.process.procstat import proc_children, proc_cpu_seconds, proc_rss_mb
from bigfleet.rpc import insecure_channel
from bigfleet.shard.cli import GC_THRESHOLDS
from bigfleet.testing import ManagedProcess, free_port, wait_for_health, wait_until
from bigfleet.v1alpha1 import capacity_pb2, shard_pb2, shard_pb2_grpc

ZONES = ("us-east-1a", "us-east-1b", "us-east-1c", "us-central1-a", "us-central1-b")


def rollup(cluster: str, variant: int, rnd: random.Random | None = None) -> capacity_pb2.ClusterCapacityNeeds:
    needs = []
    for k in range(10):
        reqs = [capacity_pb2.NodeSelectorRequirement(
            key="topology.kubernetes.io/zone", operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_IN,
            values=[ZONES[k % len(ZONES)]])]
        # one need changes every time, so the table changes and cycles are triggered
        cpu = 1000 * (1 + (k % 3)) + (variant * 100 if k == 0 else 0)
        needs.append(capacity_pb2.CapacityNeed(
            requirements=reqs, aggregate_resources={"cpu": f"{cpu}m", "memory": f"{2 + k % 4}Gi"},
            priority=(hash(cluster) % 1000) * 10 + k, min_unit={"cpu": "500m", "memory": "1Gi"},
            interruption_penalty_bucket=capacity_pb2.PENALTY_BUCKET_64))
    return capacity_pb2.ClusterCapacityNeeds(cluster_id=cluster, timestamp_unix_nanos=time.time_ns(), needs=needs)


class Session:
    def __init__(self, stub: shard_pb2_grpc.ShardStub, cluster: str, interval: float, lat: list[float],
                 stop: asyncio.Event, change_fraction: float = 0.1) -> None:
        self.change_fraction = change_fraction
        self.stub, self.cluster, self.interval, self.lat, self.stop = stub, cluster, interval, lat, stop
        self.pending: list[float] = []
        self.ready = asyncio.Event()
        self.sent = 0
        self.frames = 0
        self.kinds: dict[str, int] = {}
        self.error = ""
        self.reconnects = 0
        self.error_at: list[float] = []

    async def run(self, start_offset: float, go: asyncio.Event, measure_from: list[float]) -> None:
        """Open the stream (reconnecting like an operator would if the open fails), then roll up."""
        rnd = random.Random(self.cluster)
        while not self.stop.is_set():
            call = self.stub.Session()
            reader = asyncio.create_task(self._read(call, measure_from))
            try:
                await call.write(shard_pb2.OperatorMessage(hello=shard_pb2.Hello(cluster_id=self.cluster,
                                                                                  protocol_version="v1alpha1")))
                await asyncio.wait_for(self.ready.wait(), 60)
                await go.wait()
                await asyncio.sleep(start_offset)
                await self._loop(call, rnd)
                return
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, TimeoutError) as exc:
                self.error = (f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.aio.AioRpcError)
                              else repr(exc))
                self.reconnects += 1
                self.error_at.append(time.perf_counter())
                self.pending.clear()
                await asyncio.sleep(0.5 + rnd.random())
            finally:
                call.cancel()
                reader.cancel()

    async def _loop(self, call: grpc.aio.StreamStreamCall, rnd: random.Random) -> None:
        if True:
            n = 0
            variant = 0
            while not self.stop.is_set():
                if n and rnd.random() < self.change_fraction:
                    variant = (variant + 1) % 4  # this cluster's demand changed
                self.pending.append(time.perf_counter())
                await call.write(shard_pb2.OperatorMessage(rollup=rollup(self.cluster, variant)))
                self.sent += 1
                n += 1
                try:
                    await asyncio.wait_for(self.stop.wait(), self.interval)
                except TimeoutError:
                    pass

    async def _read(self, call: grpc.aio.StreamStreamCall, measure_from: list[float]) -> None:
        try:
            async for msg in call:
                self.frames += 1
                kind = msg.WhichOneof("payload")
                self.kinds[kind] = self.kinds.get(kind, 0) + 1
                if kind == "ack":
                    if msg.ack.echo == "hello":
                        self.ready.set()
                    elif msg.ack.echo == "rollup" and self.pending:
                        t0 = self.pending.pop(0)
                        if measure_from and t0 >= measure_from[0]:
                            self.lat.append(time.perf_counter() - t0)
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass


async def _settle_heap(stop: asyncio.Event) -> None:
    while not stop.is_set():
        gc.freeze()
        await asyncio.sleep(1.0)


async def _watch_lag(out: list[float], stop: asyncio.Event, measure_from: list[float]) -> None:
    """How late a 20 ms timer fires on the load generator's own loop (its share of the ack latency)."""
    while not stop.is_set():
        t0 = time.perf_counter()
        await asyncio.sleep(0.02)
        if measure_from:
            out.append(max(0.0, time.perf_counter() - t0 - 0.02))


def _buckets(text: str, name: str) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    return out


def histogram_quantile(text: str, name: str, q: float, baseline: str = "") -> float:
    """Upper bucket bound holding quantile ``q`` of the observations made after ``baseline``."""
    buckets = _buckets(text, name)
    base = dict(_buckets(baseline, name)) if baseline else {}
    buckets = [(le, c - base.get(le, 0.0)) for le, c in buckets]
    if not buckets or buckets[-1][1] == 0:
        return float("nan")
    total = buckets[-1][1]
    for le, c in buckets:
        if c >= q * total:
            return le
    return float("inf")


def _only(text: str, label: str) -> str:
    """The exposition lines carrying ``label`` (one child of a labelled histogram)."""
    return "\n".join(line for line in text.splitlines() if label in line)


def _count(text: str, name: str, label: str, baseline: str) -> float:
    def one(t: str) -> float:
        for line in t.splitlines():
            if line.startswith(name + "_count{") and label in line:
                return float(line.rsplit(" ", 1)[1])
        return 0.0
    return one(text) - one(baseline)


def metric_value(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


async def drive(args: argparse.Namespace, shard_addr: str, pid: int, metrics_url: str) -> dict[str, float]:
    channels = [insecure_channel(shard_addr, [("grpc.use_local_subchannel_pool", 1)]) for _ in range(args.channels)]
    stubs = [shard_pb2_grpc.ShardStub(ch) for ch in channels]
    stop = asyncio.Event()
    lat: list[float] = []
    measure_from: list[float] = []
    rss0 = proc_rss_mb(pid)
    sessions = [Session(stubs[i % len(stubs)], f"bench-{i:05d}", args.interval, lat, stop, args.change_fraction)
                for i in range(args.sessions)]
    t_open = time.perf_counter()
    client_lag: list[float] = []
    lag_task = asyncio.create_task(_watch_lag(client_lag, stop, measure_from))
    go = asyncio.Event()
    tasks = []
    for i, s in enumerate(sessions):
        # first roll-ups spread over one interval, once every session is open
        tasks.append(asyncio.create_task(s.run(args.interval * (i / args.sessions), go, measure_from)))
        if i % 200 == 199:
            await asyncio.sleep(0.05)
    deadline = time.monotonic() + 120
    while not all(s.ready.is_set() for s in sessions):
        if time.monotonic() > deadline:
            ready = sum(s.ready.is_set() for s in sessions)
            errs = [s.error for s in sessions if s.error and not s.ready.is_set()][:3]
            raise RuntimeError(f"only {ready}/{len(sessions)} sessions acknowledged Hello; errors: {errs}")
        await asyncio.sleep(0.1)
    open_s = time.perf_counter() - t_open
    # The load generator is one process standing in for 5 000 operators: its own collector pauses
    # would be counted as shard latency. Same treatment as the shard (see ShardDaemon._settle_heap_loop).
    settle = asyncio.create_task(_settle_heap(stop))
    await asyncio.sleep(1.0)
    cpu_idle0, rss_open = proc_cpu_seconds(pid), proc_rss_mb(pid)
    await asyncio.sleep(2.0)
    cpu_idle = (proc_cpu_seconds(pid) - cpu_idle0) / 2.0
    go.set()
    # warm-up: one full interval of roll-ups, then measure
    await asyncio.sleep(args.interval)
    measure_from.append(time.perf_counter())
    cpu_m0, t_m0 = proc_cpu_seconds(pid), time.perf_counter()
    ccpu0 = proc_cpu_seconds(os.getpid())
    text0 = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    await asyncio.sleep(args.duration)
    text1 = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    cpu_m1, t_m1 = proc_cpu_seconds(pid), time.perf_counter()
    ccpu1 = proc_cpu_seconds(os.getpid())
    rss_load = proc_rss_mb(pid)
    stop.set()
    await asyncio.gather(*tasks, lag_task, settle, return_exceptions=True)
    gc.unfreeze()
    for ch in channels:
        await ch.close()
    lat.sort()
    client_lag.sort()
    n = len(lat)
    errors = [s.error for s in sessions if s.error and not s.ready.is_set()]
    cycles = metric_value(text1, "bigfleet_shard_cycles_total") - metric_value(text0, "bigfleet_shard_cycles_total")
    return {
        "sessions": args.sessions,
        "open_seconds": open_s,
        "rollups_measured": n,
        "rollups_per_s": n / (t_m1 - t_m0),
        "p50_ms": lat[n // 2] * 1000 if n else float("nan"),
        "p99_ms": lat[min(n - 1, int(n * 0.99))] * 1000 if n else float("nan"),
        "max_ms": lat[-1] * 1000 if n else float("nan"),
        "mean_ms": statistics.fmean(lat) * 1000 if n else float("nan"),
        "server_handle_p99_ms_le": histogram_quantile(text1, "bigfleet_shard_rollup_handle_seconds", 0.99, text0) * 1000,
        "server_read_to_ack_p99_ms_le": histogram_quantile(text1, "bigfleet_shard_rollup_ack_seconds", 0.99, text0) * 1000,
        "server_read_to_ack_p50_ms_le": histogram_quantile(text1, "bigfleet_shard_rollup_ack_seconds", 0.5, text0) * 1000,
        "loop_lag_p99_ms_le": histogram_quantile(text1, "bigfleet_shard_event_loop_lag_seconds", 0.99, text0) * 1000,
        "loop_lag_max_ms_le": histogram_quantile(text1, "bigfleet_shard_event_loop_lag_seconds", 1.0, text0) * 1000,
        "client_loop_lag_p99_ms": client_lag[int(len(client_lag) * 0.99)] * 1000 if client_lag else float("nan"),
        "client_loop_lag_max_ms": client_lag[-1] * 1000 if client_lag else float("nan"),
        "client_cpu_cores": (ccpu1 - ccpu0) / (t_m1 - t_m0),
        **{f"gc_gen{g}_pauses": _count(text1, "bigfleet_shard_gc_pause_seconds", f'generation="{g}"', text0)
           for g in (0, 1, 2)},
        **{f"gc_gen{g}_max_ms_le": histogram_quantile(
            _only(text1, f'generation="{g}"'), "bigfleet_shard_gc_pause_seconds", 1.0,
            _only(text0, f'generation="{g}"')) * 1000 for g in (0, 1, 2)},
        "cycles": cycles,
        "cycle_p50_s_le": histogram_quantile(text1, "bigfleet_shard_cycle_duration_seconds", 0.5, text0),
        "cycle_p99_s_le": histogram_quantile(text1, "bigfleet_shard_cycle_duration_seconds", 0.99, text0),
        "shard_cpu_idle_cores": cpu_idle,
        "shard_cpu_load_cores": (cpu_m1 - cpu_m0) / (t_m1 - t_m0),
        "shard_rss_start_mb": rss0,
        "shard_rss_open_mb": rss_open,
        "shard_rss_load_mb": rss_load,
        "rss_per_session_kb": (rss_open - rss0) * 1024 / args.sessions,
        **{f"frames_{k}": sum(s.kinds.get(k, 0) for s in sessions)
           for k in sorted({k for s in sessions for k in s.kinds})},
        "session_reconnects": sum(s.reconnects for s in sessions),
        "session_reconnects_measured": sum(t0 >= t_m0 for s in sessions for t0 in s.error_at),
        "sessions_failed": len(errors),
        "session_error_kinds": "; ".join(f"{n}x {e[:120]}" for e, n in collections.Counter(
            s.error for s in sessions if s.error).most_common(3)) or "-",
        "cpu_ms_per_rollup": (cpu_m1 - cpu_m0) * 1000 / n if n else float("nan"),
    }


def pin_shard(shard_pid: int, provider_pid: int) -> None:
    """Give the shard process (every thread) CPU 0 and everything else -- its engine worker, the
    fake provider, this load generator -- the other CPUs: on a 2-core box this stands in for the
    provider and the operators living on other machines, as they do in production."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--pin-shard needs at least 2 CPUs")
    rest = ",".join(str(c) for c in cpus[1:])
    subprocess.run(["taskset", "-a", "-cp", str(cpus[0]), str(shard_pid)], check=True, stdout=subprocess.DEVNULL)
    for pid in [*proc_children(shard_pid), provider_pid, os.getpid()]:
        subprocess.run(["taskset", "-a", "-cp", rest, str(pid)], check=True, stdout=subprocess.DEVNULL)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench_shard")
    p.add_argument("--sessions", type=int, default=int(os.environ.get("BENCH_SHARD_SESSIONS", "5000")))
    p.add_argument("--interval", type=float, default=10.0, help="seconds between a session's roll-ups")
    p.add_argument("--duration", type=float, default=float(os.environ.get("BENCH_SHARD_DURATION", "30")))
    p.add_argument("--channels", type=int, default=8)
    p.add_argument("--change-fraction", type=float, default=0.1,
                   help="probability a roll-up differs from the session's previous one (1.0 = always)")
    p.add_argument("--machines", type=int, default=5000, help="speculative slots at the fake provider")
    p.add_argument("--committed", type=int, default=1000, help="idle committed hosts at the fake provider")
    p.add_argument("--actuate", action="store_true", help="execute actions (default: --dry-run, cycles still run)")
    p.add_argument("--cycle-interval", type=float, default=10.0)
    p.add_argument("--shard-arg", action="append", default=[], help="extra flag for the shard (repeatable)")
    p.add_argument("--pin-shard", action="store_true",
                   help="shard on CPU 0, its worker, the provider and the load generator on the others (taskset)")
    args = p.parse_args(argv)
    gc.set_threshold(*GC_THRESHOLDS)  # the shard's own settings

    logdir = tempfile.mkdtemp(prefix="bench-shard-")
    paddr = f"127.0.0.1:{free_port()}"
    prov = ManagedProcess.bigfleet(["fake-provider", "--listen", paddr, "--seed-count", str(args.machines),
                                    "--committed-count", str(args.committed), "--log-level", "warning"], "provider",
                                   log_dir=__import__("pathlib").Path(logdir)).start()
    saddr = f"127.0.0.1:{free_port()}"
    maddr = f"127.0.0.1:{free_port()}"
    shard_args = ["shard", "--shard-id", "bench", "--listen", saddr, "--provider", paddr, "--metrics-listen", maddr,
                  "--data-dir", logdir, "--cycle-interval", str(args.cycle_interval), "--log-level", "warning"]
    if not args.actuate:
        shard_args.append("--dry-run")
    shard_args += args.shard_arg
    try:
        wait_for_health(paddr, 60)
        shard = ManagedProcess.bigfleet(shard_args, "shard", log_dir=__import__("pathlib").Path(logdir)).start()
        try:
            wait_for_health(saddr, 60)
            wait_until(lambda: urllib.request.urlopen(f"http://{maddr}/metrics", timeout=2).read(), 30, what="metrics")
            if args.pin_shard:
                pin_shard(shard.pid, prov.pid)
            res = asyncio.run(drive(args, saddr, shard.pid, f"http://{maddr}/metrics"))
        finally:
            shard.stop()
    finally:
        prov.stop()
    print("| metric | value |\n|---|---|")
    for k, v in res.items():
        print(f"| {k} | {v:.3f} |" if isinstance(v, float) else f"| {k} | {v} |")
    print(f"\n(mode: {'actuate' if args.actuate else 'dry-run'}{', shard pinned to CPU 0' if args.pin_shard else ''}, "
          f"change fraction {args.change_fraction}, "
          f"machines {args.machines}+{args.committed}, "
          f"interval {args.interval}s, duration {args.duration}s, logs {logdir})")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
