"""`bigfleet all-in-one`: coordinator, fake provider and shard as supervised processes, plus N simulated
clusters whose operators speak the real Session protocol; a live view, and a summary at the end.

The wiring is production's: each simulated operator is given the coordinator address(es) and finds
(on first contact: is placed on) its shard through ``Coordinator.LookupCluster`` with the real
operator's resolver, so ``bigfleetctl`` sees every cluster bound. The shard serves the read-only
dashboard on loopback. Start-up prints the dashboard URL and the ``bigfleetctl`` commands to try.

``--aws-emulator`` makes the pool span two providers: the fake provider's bare metal and the AWS
provider's on-demand and spot instances against a local moto server (needs ``pip install ./providers/aws
'moto[server]'``); the shard prices them together, so Idle bare metal is used first.

The demand comes from a built-in workload scenario (steady services, batch bursts, a rack gang,
spot-tolerant jobs, a priority spike that forces preemption, withdrawals) or ``--scenario FILE``
(the simulator's YAML format; one scenario cycle = one ``--tick``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import shutil
import signal
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bigfleet.allinone.fleet import Fleet, FleetSpec
from bigfleet.allinone.operators import SimCoordinatorResolver, WireOperator
from bigfleet.observability import configure_logging
from bigfleet.sim.harness import SimCluster
from bigfleet.sim.scenario import Scenario, ScenarioError, load, mixed_fleet

STATES = ("speculative", "creating", "idle", "configuring", "configured", "draining", "deleting", "failed")


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bigfleet all-in-one", description=__doc__.split("\n\n")[0])
    p.add_argument("--clusters", type=int, default=20, help="simulated clusters (built-in scenario)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds to run before the summary")
    p.add_argument("--scenario", default="", help="YAML scenario file (see docs/simulator.md)")
    p.add_argument("--tick", type=float, default=1.0, help="seconds per scenario cycle (roll-up period)")
    p.add_argument("--plain", action="store_true", help="periodic plain lines instead of the live view "
                                                         "(the default when stdout is not a terminal)")
    p.add_argument("--print-every", type=float, default=5.0, help="seconds between plain lines")
    p.add_argument("--log-level", default="warning")
    p.add_argument("--tls", choices=["off", "auto"], default="off",
                   help="auto: run every hop with mTLS, certificates issued by a local CA into --tls-dir")
    p.add_argument("--tls-dir", default="",
                   help="PKI directory for --tls auto (default <workdir>/pki); an existing ca.crt/ca.key is reused")
    p.add_argument("--aws-emulator", action="store_true",
                   help="one pool across two providers: the fake provider's bare metal plus on-demand and spot "
                        "from the AWS provider (bigfleet-provider-aws) against a local moto server")
    p.add_argument("--dashboard-port", type=int, default=0, metavar="PORT",
                   help="port of the shard's read-only dashboard on 127.0.0.1 (default: a free port)")
    a = p.parse_args(argv)
    if a.tls_dir and a.tls != "auto":
        p.error("--tls-dir needs --tls auto")
    if a.clusters < 1 or a.duration <= 0 or a.tick <= 0:
        p.error("--clusters, --duration and --tick must be positive")
    if not 0 <= a.dashboard_port <= 65535:
        p.error("--dashboard-port must be 0 (a free port) or a port number")
    if a.dashboard_port and not _port_free(a.dashboard_port):
        p.error(f"--dashboard-port {a.dashboard_port}: 127.0.0.1:{a.dashboard_port} is already in use")
    if a.aws_emulator:
        missing = [what for mod, what in (("bigfleet_provider_aws", "the AWS provider (pip install ./providers/aws)"),
                                          ("moto.server", "moto's server (pip install 'moto[server]')"))
                   if not _importable(mod)]
        if missing:
            p.error("--aws-emulator needs " + " and ".join(missing))
    return a


def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:  # the parent package is missing
        return False


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def bigfleetctl_prefix(fleet: Fleet) -> list[str]:
    """How to run this build's bigfleetctl against the fleet: the program, ``--coordinator`` and, under
    mTLS, the admin certificate (global flags, so they go before the command)."""
    sibling = Path(sys.executable).parent / "bigfleetctl"  # the same virtualenv's script
    on_path = shutil.which("bigfleetctl")
    prog: list[str]
    if sibling.is_file():
        same = on_path is not None and Path(on_path).resolve() == sibling.resolve()
        prog = ["bigfleetctl"] if same else [str(sibling)]
    elif on_path:
        prog = ["bigfleetctl"]
    else:
        prog = [sys.executable, "-m", "bigfleet.ctl.main"]
    return [*prog, "--coordinator", ",".join(fleet.coordinators), *fleet.tls_flags("admin")]


def try_commands(fleet: Fleet, cluster_id: str) -> list[str]:
    """The bigfleetctl commands start-up suggests (each ready to paste)."""
    pre = bigfleetctl_prefix(fleet)
    return [shlex.join([*pre, *rest]) for rest in
            (["clusters"], ["needs", "--cluster", cluster_id], ["shards"], ["inventory"])]


@dataclass
class Snapshot:
    elapsed: float = 0.0
    cycle: int = 0
    states: Counter[str] = field(default_factory=Counter)
    total: int = 0
    inflight: int = 0
    shortfalls: int = 0
    needs: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    actions_last: Counter[str] = field(default_factory=Counter)
    connected: int = 0
    demand: int = 0
    configured_in_clusters: int = 0
    double_assigned: int = 0
    restarts: dict[str, int] = field(default_factory=dict)
    shards_registered: int = -1  # -1: the coordinator did not answer
    bindings: dict[str, str] | None = None  # cluster -> shard on the coordinator; None: it did not answer
    pool: dict[tuple[str, str, str], int] = field(default_factory=dict)  # (provider, capacity, state) -> n

    def bound(self, ops: list[WireOperator]) -> int:
        """How many of these clusters the coordinator has placed on a shard."""
        return sum(1 for o in ops if o.cluster_id in (self.bindings or {}))


def bound_report(ops: list[WireOperator]) -> tuple[int, int]:
    """(machines configured across the clusters' own views, machines claimed by more than one cluster)."""
    owners: Counter[str] = Counter()
    for op in ops:
        for mid in op.model.nodes:
            owners[mid] += 1
    configured = sum(1 for op in ops for st in op.model.nodes.values() if st == 5)
    return configured, sum(1 for n in owners.values() if n > 1)


def pool_lines(pool: dict[tuple[str, str, str], int]) -> list[str]:
    """One line per (provider, capacity type): how many are configured, idle and in total."""
    groups: dict[tuple[str, str], Counter[str]] = {}
    for (prov, cap, state), n in pool.items():
        groups.setdefault((prov, cap), Counter())[state] += n
    return [f"{prov} {cap}: configured {c['configured']}, idle {c['idle']}, "
            f"in flight {c['creating'] + c['configuring'] + c['draining'] + c['deleting']} of {sum(c.values())}"
            for (prov, cap), c in sorted(groups.items())]


def render_plain(s: Snapshot, ops: list[WireOperator]) -> str:
    st = " ".join(f"{k}={s.states.get(k, 0)}" for k in STATES if s.states.get(k, 0))
    acts = " ".join(f"{k}={v}" for k, v in sorted(s.actions_last.items())) or "-"
    bound = "?" if s.bindings is None else str(s.bound(ops))
    return (f"[{s.elapsed:6.1f}s] cycle={s.cycle} machines={s.total} {st} | needs={s.needs} "
            f"demand~{s.demand} machines shortfalls={s.shortfalls} in-flight={s.inflight} | "
            f"actions since last: {acts} | clusters connected={s.connected} bound={bound} | "
            f"coordinator shards={s.shards_registered}"
            + (" | pool: " + "; ".join(pool_lines(s.pool)) if len({k[0] for k in s.pool}) > 1 else ""))


def render_rich(s: Snapshot, ops: list[WireOperator], duration: float, subtitle: str = "") -> Any:
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    inv = Table(title="Inventory by state", expand=True)
    for k in STATES:
        inv.add_column(k, justify="right")
    inv.add_row(*(str(s.states.get(k, 0)) for k in STATES))
    head = Table.grid(expand=True)
    head.add_row(f"[b]t[/b] {s.elapsed:5.0f}s / {duration:.0f}s", f"[b]cycle[/b] {s.cycle}",
                 f"[b]needs[/b] {s.needs}", f"[b]shortfalls[/b] {s.shortfalls}", f"[b]in flight[/b] {s.inflight}",
                 f"[b]double-assigned[/b] {s.double_assigned}",
                 f"[b]coordinator[/b] {'down' if s.shards_registered < 0 else f'{s.shards_registered} shard(s)'}",
                 f"[b]bound[/b] {'?' if s.bindings is None else s.bound(ops)}/{len(ops)}")
    acts = Table(title="Actions (since last refresh / total)", expand=True)
    for k in ("Create", "Configure", "Drain", "Delete"):
        acts.add_column(k, justify="right")
    acts.add_row(*(f"{s.actions_last.get(k, 0)} / {int(s.metrics.get('actions:' + k, 0))}"
                   for k in ("Create", "Configure", "Drain", "Delete")))
    cl = Table(title="Clusters", expand=True)
    for col in ("cluster", "shard", "up", "workloads", "demand", "cfg", "boots", "reclaims"):
        cl.add_column(col, justify="left" if col in ("cluster", "shard") else "right")
    cycle = s.cycle
    for op in ops[:12]:
        m = op.model
        cl.add_row(m.cluster_id, (s.bindings or {}).get(m.cluster_id, "-"),
                   "yes" if op.connected.is_set() else "[red]no[/red]",
                   ",".join(w.name for w, _ in m.active(cycle)) or "-", str(m.demand_machines(cycle)),
                   str(sum(1 for st in m.nodes.values() if st == 5)), str(op.bootstraps), str(op.reclaims))
    if len(ops) > 12:
        cl.caption = f"... and {len(ops) - 12} more clusters"
    parts: list[Any] = [head, inv, acts]
    if len({k[0] for k in s.pool}) > 1:
        pool = Table(title="One pool across providers", expand=True)
        for col in ("provider", "capacity", "configured", "idle", "in flight", "total"):
            pool.add_column(col, justify="left" if col in ("provider", "capacity") else "right")
        groups: dict[tuple[str, str], Counter[str]] = {}
        for (prov, cap, state), n in s.pool.items():
            groups.setdefault((prov, cap), Counter())[state] += n
        for (prov, cap), c in sorted(groups.items()):
            pool.add_row(prov, cap, str(c["configured"]), str(c["idle"]),
                         str(c["creating"] + c["configuring"] + c["draining"] + c["deleting"]), str(sum(c.values())))
        parts.append(pool)
    return Panel(Group(*parts, cl), title="BigFleet all-in-one", subtitle=subtitle or None)


def summary(s: Snapshot, ops: list[WireOperator], wall: float) -> str:
    lines = ["", "=== BigFleet all-in-one summary ===",
             f"ran {wall:.0f}s: {int(s.metrics.get('cycles', 0))} shard cycles, {len(ops)} clusters, "
             f"{sum(o.rollups for o in ops)} roll-ups sent",
             "inventory: " + ", ".join(f"{k} {s.states.get(k, 0)}" for k in STATES) + f" (total {s.total})",
             "actions: " + ", ".join(f"{k} {int(s.metrics.get('actions:' + k, 0))}"
                                     for k in ("Create", "Configure", "Drain", "Delete")),
             f"bootstraps answered {sum(o.bootstraps for o in ops)}, reclaims acknowledged "
             f"{sum(o.reclaims for o in ops)}, operator reconnects {sum(max(0, o.connects - 1) for o in ops)}",
             f"demand at the end ~{s.demand} machines; configured in clusters {s.configured_in_clusters}; "
             f"shortfalls {s.shortfalls}",
             f"double-assigned machines: {s.double_assigned}",
             "coordinator: " + ("not answering" if s.shards_registered < 0
                                else f"leader, {s.shards_registered} shard(s) registered"
                                + ("" if s.bindings is None else f", {s.bound(ops)} of {len(ops)} clusters bound")),
             *(["pool: " + "; ".join(pool_lines(s.pool))] if len({k[0] for k in s.pool}) > 1 else []),
             "daemon restarts: " + (", ".join(f"{k} {v}" for k, v in s.restarts.items() if v) or "none"),
             "result: " + ("OK" if s.double_assigned == 0 else "PROBLEM (a machine is claimed by two clusters)")]
    return "\n".join(lines)


async def observe(fleet: Fleet, ops: list[WireOperator], cycle: int, started: float,
                  prev: dict[str, float]) -> Snapshot:
    s = Snapshot(elapsed=time.monotonic() - started, cycle=cycle, restarts=dict(fleet.restarts))
    with contextlib.suppress(Exception):
        c = await fleet.counts()
        s.states = Counter({k.lower().removeprefix("machine_state_"): int(v) for k, v in c.by_state.items()})
        s.total, s.inflight = int(c.total), int(c.in_flight)
    with contextlib.suppress(Exception):
        s.shortfalls = len((await fleet.shortfalls()).shortfalls)
    with contextlib.suppress(Exception):
        s.metrics = await asyncio.to_thread(fleet.metrics)
    with contextlib.suppress(Exception):
        s.shards_registered = await fleet.shards_registered()
    with contextlib.suppress(Exception):
        s.bindings = await fleet.bindings()
    if len(fleet.providers) > 1:
        with contextlib.suppress(Exception):
            s.pool = await fleet.pool()
    for k, v in s.metrics.items():
        if k.startswith("actions:"):
            d = int(v - prev.get(k, 0))
            if d:
                s.actions_last[k.split(":", 1)[1]] = d
    s.connected = sum(1 for o in ops if o.connected.is_set())
    s.needs = sum(len(o.model.active(cycle)) for o in ops)
    s.demand = sum(o.model.demand_machines(cycle) for o in ops)
    s.configured_in_clusters, s.double_assigned = bound_report(ops)
    return s


async def run(args: argparse.Namespace, scenario: Scenario) -> int:
    plain = args.plain or not sys.stdout.isatty()
    spec = FleetSpec(committed=scenario.committed, speculative=scenario.speculative,
                     cycle_interval=max(0.5, args.tick), tls=args.tls == "auto",
                     pki_dir=Path(args.tls_dir) if args.tls_dir else None,
                     cluster_ids=tuple(sorted(scenario.clusters)), dashboard_port=args.dashboard_port,
                     aws_emulator=args.aws_emulator)
    fleet = Fleet(spec)
    _announce(spec, scenario)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    ops: list[WireOperator] = []
    try:
        await asyncio.to_thread(fleet.start)
        # Production wiring: each operator is given the coordinator(s), not the shard, and is placed
        # on a shard by its first LookupCluster (with its own cluster certificate under mTLS).
        for cid, ws in sorted(scenario.clusters.items()):
            tls = fleet.tls_for(f"cluster-{cid}")
            ops.append(WireOperator(SimCluster(cid, ws), SimCoordinatorResolver(cid, fleet.coordinators, tls), tls))
        for op in ops:
            op.start()
        await _fleet_up(fleet, spec, ops)
        started = time.monotonic()
        cycle, prev = await _drive(args, scenario, fleet, ops, stop, plain, started)
        snap = await observe(fleet, ops, cycle, started, prev)
        print(summary(snap, ops, time.monotonic() - started), flush=True)
        return 0 if snap.double_assigned == 0 else 1
    finally:
        for op in ops:
            await op.stop()
        await asyncio.to_thread(fleet.stop)


def _announce(spec: FleetSpec, scenario: Scenario) -> None:
    if spec.aws_emulator:
        print(f"starting coordinator, fake provider ({scenario.committed} bare-metal hosts), moto and the AWS "
              f"provider (~{scenario.speculative} on-demand and spot slots) and shard; logs in "
              f"{spec.workdir / 'logs'}", flush=True)
    else:
        print(f"starting coordinator, fake provider ({scenario.committed} hosts + {scenario.speculative} quota "
              f"slots) and shard; logs in {spec.workdir / 'logs'}", flush=True)
    if spec.tls:
        print(f"mTLS on every hop; certificates in {spec.pki} (bigfleetctl: --tls-cert {spec.pki / 'admin.crt'} "
              f"--tls-key {spec.pki / 'admin.key'} --tls-ca {spec.pki / 'ca.crt'}, before the command)", flush=True)


async def _fleet_up(fleet: Fleet, spec: FleetSpec, ops: list[WireOperator]) -> None:
    """Say where everything is, the dashboard's URL once it answers, and what to try."""
    provs = ", ".join(f"{n} {a}" if n else a for n, a in fleet.providers.items())
    print(f"fleet up: shard {fleet.addrs['shard']}, coordinator {fleet.addrs['coordinator']}, "
          f"provider{'s' if len(fleet.providers) > 1 else ''} {provs}; {len(ops)} simulated clusters placed "
          "through the coordinator"
          + (" (mTLS)" if spec.tls else ""), flush=True)
    dashboard_up = await asyncio.to_thread(fleet.wait_dashboard)
    print(f"dashboard: {fleet.dashboard_url}" if dashboard_up else
          f"dashboard: not answering at {fleet.dashboard_url} (see {spec.workdir / 'logs'})", flush=True)
    print("try, while it runs:", *(f"  {c}" for c in try_commands(fleet, ops[0].cluster_id if ops else "CLUSTER")),
          sep="\n", flush=True)


async def _drive(args: argparse.Namespace, scenario: Scenario, fleet: Fleet, ops: list[WireOperator],
                 stop: asyncio.Event, plain: bool, started: float) -> tuple[int, dict[str, float]]:
    """Tick the simulated clusters, apply the scenario's faults, restart dead daemons and show the
    fleet until the duration ends or a signal; returns the ticks run and the last metrics shown."""
    subtitle = f"dashboard {fleet.dashboard_url}"
    cycle, prev, last_print = 0, dict[str, float](), 0.0
    live: Any = None
    if not plain:
        from rich.live import Live

        live = Live(render_rich(Snapshot(), ops, args.duration, subtitle), refresh_per_second=2)
        live.start()
    try:
        while not stop.is_set() and time.monotonic() - started < args.duration:
            now_ns = time.time_ns()
            for f in scenario.faults:
                if f.at == cycle and f.cluster:
                    for op in ops:
                        if op.cluster_id == f.cluster and f.kind in ("disconnect", "reconnect"):
                            op.cut(f.kind == "disconnect")
            for op in ops:
                op.tick(cycle, now_ns)
            for name in await asyncio.to_thread(fleet.check):
                print(f"supervisor: {name} exited; restarted it", flush=True)
            snap = await observe(fleet, ops, cycle, started, prev)
            if plain:
                if snap.elapsed - last_print >= args.print_every:
                    print(render_plain(snap, ops), flush=True)
                    last_print = snap.elapsed
                    prev = dict(snap.metrics)
            else:
                live.update(render_rich(snap, ops, args.duration, subtitle))
                prev = dict(snap.metrics)
            cycle += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), args.tick)
    finally:
        if live is not None:
            live.stop()
    return cycle, prev


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    configure_logging(args.log_level, "console", "all-in-one")
    try:
        cycles = max(1, int(args.duration / args.tick))
        scenario = load(args.scenario) if args.scenario else mixed_fleet(args.clusters, cycles)
    except (ScenarioError, OSError) as exc:
        print(f"bigfleet all-in-one: {exc}", file=sys.stderr)
        return 2
    return asyncio.run(run(args, scenario))
