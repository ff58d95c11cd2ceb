"""`bigfleet scaletest`: load real shard(s) at scale and report cycle, roll-up and bind figures.

Starts, as real processes, one fake provider per shard (seeded with ``--machines`` speculative
slots and ``--committed`` idle hosts, split across shards), a coordinator when ``--shards`` > 1
or ``--coordinator`` is given, the shard(s), and ``--workers`` load-generator processes that
open one Session per simulated cluster and roll up shaped demand every ``--interval`` seconds.
After a warm-up it measures for ``--duration`` seconds and prints a table; ``--json`` writes
the same figures as JSON.

    bigfleet scaletest --shape aggregated --clusters 1000 --machines 100000 --interval 10
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import secrets
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bigfleet.process import ManagedProcess, free_port, wait_for_health, wait_until
from bigfleet.process.procstat import proc_cpu_seconds, tree_cpu_seconds, tree_rss_mb
from bigfleet.scale import stats
from bigfleet.scale.loadgen import Job
from bigfleet.scale.workloads import SHAPES

BIND_KINDS = ("Configure", "Create")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bigfleet scaletest", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, default="aggregated")
    p.add_argument("--clusters", type=int, default=1000, help="simulated clusters (one Session each)")
    p.add_argument("--machines", type=int, default=100_000, help="speculative slots in total (all shards)")
    p.add_argument("--committed", type=int, default=0, help="idle committed hosts in total (all shards)")
    p.add_argument("--demand-fraction", type=float, default=0.5,
                   help="total demand as a fraction of inventory (1.0 = the reprovisioning regime)")
    p.add_argument("--needs-per-cluster", type=int, default=3, help="aggregated shape only")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between a session's roll-ups")
    p.add_argument("--change-fraction", type=float, default=0.1, help="chance a roll-up changes the demand")
    p.add_argument("--warmup", type=float, default=20.0, help="seconds of load before measuring")
    p.add_argument("--duration", type=float, default=30.0, help="seconds measured")
    p.add_argument("--cycle-interval", type=float, default=2.0)
    p.add_argument("--shards", type=int, default=1)
    p.add_argument("--coordinator", action="store_true", help="run a coordinator even with one shard")
    p.add_argument("--workers", type=int, default=2, help="load-generator processes")
    p.add_argument("--channels", type=int, default=4, help="gRPC channels per worker and shard")
    p.add_argument("--actuate", action="store_true", help="execute actions (default: shard --dry-run)")
    p.add_argument("--prebind", action="store_true",
                   help="steady state: the provider starts with the demand already CONFIGURED (as a shard would "
                        "have bound it); implies --actuate; one shard only")
    p.add_argument("--shard-arg", action="append", default=[], help="extra shard flag (repeatable)")
    p.add_argument("--json", dest="json_path", default="", help="write the report here as JSON")
    p.add_argument("--workdir", default="", help="logs and data (default: a new temp dir)")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for start-up and Hellos")
    return p


@dataclass
class ShardProc:
    name: str
    proc: ManagedProcess
    provider: ManagedProcess
    addr: str
    metrics_url: str


class Sampler(threading.Thread):
    """Polls each shard's counters and RSS so binds per cycle and peak RSS can be computed."""

    def __init__(self, shards: list[ShardProc], period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.shards, self.period = shards, period
        self.series: dict[str, list[tuple[float, float]]] = {s.name: [] for s in shards}
        self.rss_max: dict[str, float] = {s.name: 0.0 for s in shards}
        self.stop_evt = threading.Event()

    def run(self) -> None:
        while not self.stop_evt.wait(self.period):
            for s in self.shards:
                try:
                    smp = stats.parse(_fetch(s.metrics_url, 5))
                except OSError:
                    continue
                cyc = stats.delta(smp, {}, "bigfleet_shard_cycles_total")
                binds = sum(stats.delta(smp, {}, "bigfleet_shard_actions_total", kind=k) for k in BIND_KINDS)
                binds += sum(stats.delta(smp, {}, "bigfleet_shard_actions_dryrun_total", kind=k) for k in BIND_KINDS)
                self.series[s.name].append((cyc, binds))
                self.rss_max[s.name] = max(self.rss_max[s.name], tree_rss_mb(s.proc.pid))


def _cycles_run(url: str) -> bool:
    return stats.delta(stats.parse(_fetch(url, 5)), {}, "bigfleet_shard_cycles_total") >= 1


def _fetch(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        body: bytes = r.read()
    return body.decode()


def start_fleet(args: argparse.Namespace, workdir: Path) -> tuple[list[ShardProc], ManagedProcess | None, str]:
    logs = workdir / "logs"
    coord: ManagedProcess | None = None
    coord_addr = ""
    if args.shards > 1 or args.coordinator:
        coord_addr = f"127.0.0.1:{free_port()}"
        pw = workdir / "raft-password"
        pw.write_text(secrets.token_hex(24))
        pw.chmod(0o600)
        coord = ManagedProcess.bigfleet([
            "coordinator", "--node-id", "coord-1", "--listen", coord_addr, "--raft-bind", f"127.0.0.1:{free_port()}",
            "--data-dir", str(workdir / "coordinator"), "--raft-password-file", str(pw),
            "--rebalance-interval", "0", "--log-level", "warning"], "coordinator", log_dir=logs).start()
        wait_for_health(coord_addr, args.start_timeout)
    shards: list[ShardProc] = []
    for k in range(args.shards):
        name = f"shard-{k + 1}"
        paddr, saddr, maddr = (f"127.0.0.1:{free_port()}" for _ in range(3))
        pargv = ["fake-provider", "--listen", paddr, "--provider-name", f"fake{k + 1}",
                 "--seed-count", str(args.machines // args.shards), "--committed-count", str(args.committed // args.shards),
                 "--log-level", "warning"]
        if args.prebind:
            pargv += ["--prebind-file", str(write_prebind_seed(args, workdir, f"fake{k + 1}", name))]
        prov = ManagedProcess.bigfleet(pargv, f"provider-{k + 1}", log_dir=logs).start()
        sargv = ["shard", "--shard-id", name, "--listen", saddr, "--provider", paddr, "--metrics-listen", maddr,
                 "--data-dir", str(workdir / name), "--cycle-interval", str(args.cycle_interval),
                 "--log-level", "warning"]
        if coord_addr:
            sargv += ["--coordinator", coord_addr, "--heartbeat-interval", "2"]
        if not args.actuate:
            sargv.append("--dry-run")
        sargv += args.shard_arg
        shards.append(ShardProc(name, ManagedProcess.bigfleet(sargv, name, log_dir=logs), prov, saddr,
                                f"http://{maddr}/metrics"))
    for s in shards:
        wait_for_health(_listen_of(s.provider), args.start_timeout)
        s.proc.start()
    for s in shards:
        wait_for_health(s.addr, args.start_timeout)
        wait_until(functools.partial(_fetch, s.metrics_url, 2), args.start_timeout, what=f"{s.name} metrics")
        # Sessions open once the shard has its inventory (its first cycle follows the first full
        # List): at 500 000 machines that List takes tens of seconds, and a warm-up that overlaps it
        # measures start-up, not the steady state the report is about.
        wait_until(functools.partial(_cycles_run, s.metrics_url), args.start_timeout, interval=0.5,
                   what=f"{s.name} first cycle")
    if coord_addr:
        wait_until(lambda: _registered(coord_addr) >= args.shards, args.start_timeout, what="shards registered")
    return shards, coord, coord_addr


def write_prebind_seed(args: argparse.Namespace, workdir: Path, provider: str, shard: str) -> Path:
    """Compute the steady-state bindings in-process (the engine on the same catalog and roll-ups)
    and write the fake provider's seed file; the counts are kept for the report."""
    from bigfleet.scale import prebind

    t0 = time.perf_counter()
    bindings, d = prebind.plan(args.shape, args.clusters, args.machines, args.committed, args.demand_fraction,
                               args.needs_per_cluster, provider, shard if args.coordinator else "")
    path = workdir / f"prebind-{provider}.json"
    prebind.write_seed(path, bindings)
    args.prebind_info = {"machines_bound": len(bindings), "plan_unsatisfied_needs": d.stats.unsatisfied,
                         "plan_seconds": round(time.perf_counter() - t0, 2)}
    return path


def _listen_of(p: ManagedProcess) -> str:
    argv = list(p.argv)
    return argv[argv.index("--listen") + 1]


def _registered(coord_addr: str) -> int:
    import asyncio

    from bigfleet.coordclient.client import CoordinatorClient
    from bigfleet.v1alpha1 import coordinator_pb2 as pb

    async def go() -> int:
        c = CoordinatorClient([coord_addr], timeout=5.0)
        try:
            r = await c.call("ListShards", pb.ListShardsRequest())
            return sum(1 for s in r.shards if s.address)
        finally:
            await c.close()

    try:
        return asyncio.run(go())
    except Exception:
        return 0


def start_workers(args: argparse.Namespace, shards: list[ShardProc], coord_addr: str,
                  workdir: Path) -> list[subprocess.Popen[str]]:
    total_slots = args.machines + args.committed
    per_cluster = total_slots * args.demand_fraction / max(1, args.clusters)
    workers = []
    for w in range(args.workers):
        mine = list(range(w, args.clusters, args.workers))
        if not mine:
            continue
        job = Job(clusters=mine, shape=args.shape, machines_per_cluster=per_cluster,
                  needs_per_cluster=args.needs_per_cluster, interval=args.interval,
                  change_fraction=args.change_fraction, shard="" if coord_addr else shards[0].addr,
                  coordinator=coord_addr, channels=args.channels, open_timeout=args.start_timeout)
        err = open(workdir / "logs" / f"loadgen-{w}.log", "w")  # noqa: SIM115 - lives as long as the child
        workers.append(subprocess.Popen(
            [sys.executable, "-m", "bigfleet.scale.loadgen", json.dumps(asdict(job))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, bufsize=1))
    return workers


def _read_tagged(p: subprocess.Popen[str], tag: str) -> str:
    assert p.stdout is not None
    for line in p.stdout:
        if line.startswith(tag + " "):
            return line[len(tag) + 1:].strip()
    raise RuntimeError(f"load generator exited (code {p.wait()}) before {tag}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bigfleet-scaletest-"))
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "logs").mkdir(exist_ok=True)
    shards: list[ShardProc] = []
    coord: ManagedProcess | None = None
    workers: list[subprocess.Popen[str]] = []
    try:
        shards, coord, coord_addr = start_fleet(args, workdir)
        rss_idle = {s.name: tree_rss_mb(s.proc.pid) for s in shards}
        at_start = {s.name: stats.parse(_fetch(s.metrics_url)) for s in shards}
        t_open = time.perf_counter()
        workers = start_workers(args, shards, coord_addr, workdir)
        ready = sum(int(_read_tagged(p, "READY")) for p in workers)
        open_s = time.perf_counter() - t_open
        rss_open = {s.name: tree_rss_mb(s.proc.pid) for s in shards}
        now = time.time()
        t_from, t_stop = now + args.warmup, now + args.warmup + args.duration
        for p in workers:
            assert p.stdin is not None
            p.stdin.write(f"GO {t_from} {t_stop}\n")
            p.stdin.flush()
        sampler = Sampler(shards)
        # In the first interval every session sends only its initial (unchanged) roll-up: what the
        # shard issues by then is what the starting fleet lacks (prebind: should be ~nothing).
        time.sleep(max(0.0, min(t_from, now + 0.95 * args.interval) - time.time()))
        first_round = {s.name: stats.parse(_fetch(s.metrics_url)) for s in shards}
        time.sleep(max(0.0, t_from - time.time()))
        before = {s.name: stats.parse(_fetch(s.metrics_url)) for s in shards}
        cpu0 = {s.name: tree_cpu_seconds(s.proc.pid) for s in shards}
        pcpu0 = {s.name: proc_cpu_seconds(s.provider.pid) for s in shards}
        m0 = time.perf_counter()
        sampler.start()
        time.sleep(max(0.0, t_stop - time.time()))
        after = {s.name: stats.parse(_fetch(s.metrics_url)) for s in shards}
        cpu1 = {s.name: tree_cpu_seconds(s.proc.pid) for s in shards}
        pcpu1 = {s.name: proc_cpu_seconds(s.provider.pid) for s in shards}
        window = time.perf_counter() - m0
        sampler.stop_evt.set()
        sampler.join()
        results = [json.loads(_read_tagged(p, "RESULT")) for p in workers]
        for p in workers:
            p.wait(timeout=60)
        return report(args, shards, results, before, after, window, cpu0, cpu1, pcpu0, pcpu1, rss_idle, rss_open,
                      sampler, ready, open_s, workdir, at_start, first_round)
    finally:
        for p in workers:
            if p.poll() is None:
                p.kill()
                p.wait()
        for s in shards:
            s.proc.stop()
            s.provider.stop()
        if coord is not None:
            coord.stop()


def report(args: argparse.Namespace, shards: list[ShardProc], results: list[dict[str, Any]],
           before: dict[str, stats.Samples], after: dict[str, stats.Samples], window: float,
           cpu0: dict[str, float], cpu1: dict[str, float], pcpu0: dict[str, float], pcpu1: dict[str, float],
           rss_idle: dict[str, float], rss_open: dict[str, float], sampler: Sampler, ready: int, open_s: float,
           workdir: Path, at_start: dict[str, stats.Samples] | None = None,
           first_round: dict[str, stats.Samples] | None = None) -> dict[str, Any]:
    out = _load_summary(args, results, window, ready, open_s)
    per_shard_sessions: dict[str, int] = {}
    for r in results:
        for a, n in r["per_shard"].items():
            per_shard_sessions[a] = per_shard_sessions.get(a, 0) + n
    for s in shards:
        out["shards"][s.name] = {
            "sessions": per_shard_sessions.get(s.addr, 0),
            **_shard_report(after[s.name], before[s.name], window, sampler.series[s.name],
                            (at_start or {}).get(s.name, {}), (first_round or {}).get(s.name, {})),
            "cpu_cores": (cpu1[s.name] - cpu0[s.name]) / window,
            "provider_cpu_cores": (pcpu1[s.name] - pcpu0[s.name]) / window,
            "rss_idle_mb": rss_idle[s.name],
            "rss_open_mb": rss_open[s.name],
            "rss_max_mb": sampler.rss_max[s.name],
        }
    counts = [sh["sessions"] for sh in out["shards"].values()]
    out["placement_max_over_mean"] = max(counts) / (sum(counts) / len(counts)) if sum(counts) else math.nan
    out["fleet_rollups_accepted_per_s"] = sum(sh["rollups_accepted"] for sh in out["shards"].values()) / window
    out["fleet_binds_issued_per_s"] = sum(sh["binds_issued"] for sh in out["shards"].values()) / window
    out["workdir"] = str(workdir)
    return out


def _load_summary(args: argparse.Namespace, results: list[dict[str, Any]], window: float, ready: int,
                  open_s: float) -> dict[str, Any]:
    """What the load generators saw: roll-up acks, first binds, reconnects and errors."""
    ack = [x for r in results for x in r["ack"]]
    first_bind = [x for r in results for x in r["first_bind"]]
    out: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k not in ("json_path",)},
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "sessions_open": ready,
        "sessions_open_seconds": round(open_s, 2),
        "window_seconds": round(window, 2),
        "rollups_sent": sum(r["sent"] for r in results),
        "rollups_measured": len(ack),
        "rollup_ack_p50_ms": stats.quantile(ack, 0.5) * 1000,
        "rollup_ack_p99_ms": stats.quantile(ack, 0.99) * 1000,
        "rollup_ack_max_ms": stats.quantile(ack, 1.0) * 1000,
        "rollup_to_first_bind_p50_s": stats.quantile(first_bind, 0.5),
        "rollup_to_first_bind_p99_s": stats.quantile(first_bind, 0.99),
        "session_reconnects": sum(r["reconnects"] for r in results),
        "session_open_retries": sum(r.get("open_retries", 0) for r in results),
        "session_open_errors": sorted({e for r in results for e in r.get("open_errors", [])})[:5],
        "loadgen_errors": [e for r in results for e in r["errors"]][:10],
        "bootstraps_answered": sum(r["bootstraps"] for r in results),
        "shards": {},
    }
    if getattr(args, "prebind_info", None):
        out["prebind"] = args.prebind_info
    return out


def _shard_report(a: stats.Samples, b: stats.Samples, window: float, series: list[tuple[float, float]],
                  z: stats.Samples,
                  fr: stats.Samples) -> dict[str, Any]:
    """One shard's figures over the window (`b` to `a`), from its start (`z`) and its first round (`fr`)."""
    binds = sum(stats.delta(a, b, "bigfleet_shard_actions_total", kind=k) for k in BIND_KINDS)
    binds_dry = sum(stats.delta(a, b, "bigfleet_shard_actions_dryrun_total", kind=k) for k in BIND_KINDS)
    # from shard start to the measurement window: the first cycles that credit the (pre-)bound fleet
    kinds = ("Configure", "Create", "Drain", "Delete")
    warm = {k: stats.delta(b, z, "bigfleet_shard_actions_total", kind=k) for k in kinds}
    first = {k: stats.delta(fr, z, "bigfleet_shard_actions_total", kind=k) for k in kinds} if fr else {}
    peak, mean = stats.per_cycle_peaks(series)
    phase_metric = "bigfleet_shard_cycle_phase_duration_seconds"
    phases = {ph: {"p50_s_le": stats.histogram_quantile(a, b, phase_metric, 0.5, phase=ph),
                   "p99_s_le": stats.histogram_quantile(a, b, phase_metric, 0.99, phase=ph)}
              for ph in stats.label_values(a, f"{phase_metric}_bucket", "phase")}
    rpc_metric = "bigfleet_shard_provider_rpc_duration_seconds_count"
    rpcs = {rpc: stats.delta(a, b, rpc_metric, rpc=rpc) / window for rpc in stats.label_values(a, rpc_metric, "rpc")}
    inv = {st: stats.delta(a, {}, "bigfleet_shard_inventory_machines", state=st)  # (summed over its other labels)
           for st in stats.label_values(a, "bigfleet_shard_inventory_machines", "state")}
    return {
        "inventory": inv,
        "cycles": stats.delta(a, b, "bigfleet_shard_cycles_total"),
        "cycle_p50_s_le": stats.histogram_quantile(a, b, "bigfleet_shard_cycle_duration_seconds", 0.5),
        "cycle_p99_s_le": stats.histogram_quantile(a, b, "bigfleet_shard_cycle_duration_seconds", 0.99),
        "phases": phases,
        "rollup_handle_p99_ms_le": stats.histogram_quantile(a, b, "bigfleet_shard_rollup_handle_seconds", 0.99) * 1000,
        "loop_lag_p99_ms_le": stats.histogram_quantile(a, b, "bigfleet_shard_event_loop_lag_seconds", 0.99) * 1000,
        "rollups_accepted": stats.delta(a, b, "bigfleet_shard_rollups_total"),
        "binds_issued": binds,
        "binds_dry_run": binds_dry,
        "drains_issued": stats.delta(a, b, "bigfleet_shard_actions_total", kind="Drain"),
        "first_rollup_round_actions": first,
        "warmup_actions": warm,
        "warmup_cycles": stats.delta(b, z, "bigfleet_shard_cycles_total"),
        "binds_per_cycle_mean": mean,
        "binds_per_cycle_max": peak,
        "shortfalls_last": a.get(("bigfleet_shard_shortfalls", ()), math.nan),
        "provider_rpcs_per_s": rpcs,
    }


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.3f}"
    if isinstance(v, dict):
        return ", ".join(f"{k}={_fmt(x)}" for k, x in v.items())
    return str(v)


def render(res: dict[str, Any]) -> str:
    lines = ["| metric | value |", "|---|---|"]
    for k, v in res.items():
        if k in ("shards", "config"):
            continue
        lines.append(f"| {k} | {_fmt(v)} |")
    for name, sh in res["shards"].items():
        for k, v in sh.items():
            if k == "phases":
                for ph, q in v.items():
                    lines.append(f"| {name} phase {ph} p50/p99 (s, ≤) | {_fmt(q['p50_s_le'])} / {_fmt(q['p99_s_le'])} |")
            else:
                lines.append(f"| {name} {k} | {_fmt(v)} |")
    c = res["config"]
    lines.append("")
    lines.append(f"(shape {c['shape']}, {c['clusters']} clusters, {c['machines']}+{c['committed']} machines, "
                 f"{c['shards']} shard(s), interval {c['interval']} s, {'prebind, actuate' if c.get('prebind') else 'actuate' if c['actuate'] else 'dry-run'}; "
                 f"histogram quantiles are bucket upper bounds)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.clusters < 1 or args.machines < 0 or args.shards < 1 or args.workers < 1:
        print("bigfleet scaletest: --clusters, --shards and --workers must be >= 1", file=sys.stderr)
        return 2
    if args.prebind:
        if args.shards != 1:
            print("bigfleet scaletest: --prebind needs --shards 1 (placement decides which shard owns a cluster)",
                  file=sys.stderr)
            return 2
        args.actuate = True
    try:
        res = run(args)
    except (RuntimeError, TimeoutError) as exc:
        print(f"bigfleet scaletest: {exc}", file=sys.stderr)
        return 1
    print(render(res))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(res, indent=2, default=str))
    return 0
