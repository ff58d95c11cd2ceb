"""The closed-loop simulator: the real shard (engine, cycle, executor, provider client, sessions)
against the in-process fake provider and simulated clusters, on a virtual clock.

Nothing here re-implements shard behaviour: ``ShardDaemon.run_cycle`` decides and executes,
``ShardDaemon.handle_rollup`` ingests, the real ``Executor`` runs its flows through the real
``ProviderClient`` into ``SimProvider``. The simulator only supplies time (``VirtualLoop``), demand
(``SimCluster``), faults and the invariant checks after every cycle.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from bigfleet.decision.types import Configure, Create, Decision, Drain, EngineConfig
from bigfleet.observability import new_registry
from bigfleet.provider.fake.backend import Dwell, FaultPlan, FaultRule
from bigfleet.provider.fake.catalog import Tier, build_catalog
from bigfleet.provider.fake.sim import SimProvider, SimStub
from bigfleet.provider.kit.model import CapacityType, Kind
from bigfleet.provider.kit.server import KitOptions
from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
from bigfleet.shard.executor import ExecutorConfig
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderClient
from bigfleet.shard.sessions import OperatorSession
from bigfleet.sim.invariants import InvariantChecker, Violation
from bigfleet.sim.scenario import SMALLEST_ALLOCATABLE_CPU, Scenario, Workload
from bigfleet.sim.vloop import VirtualLoop
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2, shard_pb2

S = provider_pb2.MachineState
EPOCH_NS = 1_767_225_600 * 10**9  # 2026-01-01T00:00:00Z: virtual wall clock origin
#: the quota slots of `Scenario.rack_slots`: on-demand 8-vCPU machines, alternating over two racks
RACK_SLOT_TIER = Tier("edge", "m5.2xlarge", CapacityType.ON_DEMAND, 0.384, 0.0, ("us-east-1a",),
                      {"cpu": "8", "memory": "32Gi", "pods": "110"}, {"cpu": "7500m", "memory": "30Gi", "pods": "110"},
                      racks=("edge-rack-a", "edge-rack-b"), billing="on-demand")
BLOB = b"#cloud-config\n# simulated bootstrap\n"


class RecordingStub(SimStub):
    """SimStub whose provider clock follows the event loop and which reports every state change."""

    def __init__(self, sim: SimProvider, clock: Callable[[], float], on_change: Callable[[str, int, int], None]) -> None:
        super().__init__(sim)
        self._clock = clock
        self._on_change = on_change
        #: Creates started per machine over the whole run (totals)
        self.creates_started: Counter[str] = Counter()
        #: Creates started per machine in its current lifetime: a machine deleted back to Speculative
        #: starts a new one, so a later Create of it is not a double create
        self.lifetime_creates: Counter[str] = Counter()

    def sync(self) -> None:
        now = self._clock()
        if now > self.sim.now:
            for c in self.sim.advance(now):
                self._observe(c.machine_id)

    def _observe(self, machine_id: str) -> None:
        self.note_change(machine_id, -1, int(self.sim.core.machines[machine_id].state))

    def note_change(self, machine_id: str, before: int, after: int) -> None:
        if after == S.MACHINE_STATE_SPECULATIVE:
            self.lifetime_creates.pop(machine_id, None)
        elif after == S.MACHINE_STATE_CREATING and before != after:
            self.creates_started[machine_id] += 1
            self.lifetime_creates[machine_id] += 1
        self._on_change(machine_id, before, after)

    async def _call(self, fn: Any, req: Any) -> Any:
        self.sync()
        mid = getattr(req, "machine_id", "")
        before = int(self.sim.core.machines[mid].state) if mid in self.sim.core.machines else None
        out = await super()._call(fn, req)
        if before is not None:
            after = int(self.sim.core.machines[mid].state)
            if after != before:
                self.note_change(mid, before, after)
        return out


@dataclass
class SimCluster:
    """A cluster and its operator: rolls up the whole demand, answers bootstrap pulls and reclaim
    instructions, and follows its nodes from NodeStateUpdates. Batch work starts when the cluster
    has room for it and withdraws ``duration`` cycles later."""

    cluster_id: str
    workloads: tuple[Workload, ...]
    connected: bool = True
    nodes: dict[str, int] = field(default_factory=dict)  # machine id -> state, as told by the shard
    node_cpu: dict[str, float] = field(default_factory=dict)
    running_since: dict[str, int] = field(default_factory=dict)
    done: set[str] = field(default_factory=set)
    session: OperatorSession | None = None
    bootstraps: int = 0
    reclaims: int = 0
    task: asyncio.Task[None] | None = None

    def active(self, cycle: int) -> list[tuple[Workload, int]]:
        out = []
        for w in self.workloads:
            if w.name in self.done or cycle < w.start or (w.stop is not None and cycle >= w.stop):
                continue
            pods = w.pods_at(cycle)
            if pods > 0:
                out.append((w, pods))
        return out

    def configured_cpu(self) -> float:
        return sum(self.node_cpu.get(m, 0.0) for m, st in self.nodes.items() if st == S.MACHINE_STATE_CONFIGURED)

    def advance_batches(self, cycle: int) -> None:
        """Pods bind to Configured machines, highest priority first; finished batches withdraw."""
        room = self.configured_cpu()
        for w, pods in sorted(self.active(cycle), key=lambda wp: -wp[0].priority):
            want = pods * w.cpu
            if want <= room + 1e-9:
                room -= want
                self.running_since.setdefault(w.name, cycle)
            if w.duration is not None and w.name in self.running_since \
                    and cycle - self.running_since[w.name] >= w.duration:
                self.done.add(w.name)

    def rollup(self, cycle: int, now_ns: int) -> capacity_pb2.ClusterCapacityNeeds:
        return capacity_pb2.ClusterCapacityNeeds(
            cluster_id=self.cluster_id, timestamp_unix_nanos=now_ns,
            needs=[w.to_need(p) for w, p in self.active(cycle)],
        )

    def demand_machines(self, cycle: int) -> int:
        return sum(w.machines_upper_bound(p) for w, p in self.active(cycle))

    def pump(self) -> None:
        s = self.session
        if s is None:
            return
        for msg in s.outbox.pop_ready():
            kind = msg.WhichOneof("payload")
            if kind == "node_state_update":
                u = msg.node_state_update
                if u.state in (S.MACHINE_STATE_CONFIGURING, S.MACHINE_STATE_CONFIGURED, S.MACHINE_STATE_DRAINING):
                    self.nodes[u.machine_id] = u.state
                    cpu = u.resources.resources.get("cpu", "0")
                    self.node_cpu[u.machine_id] = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
                else:
                    self.nodes.pop(u.machine_id, None)
            elif kind == "bootstrap_request":
                self.bootstraps += 1
                s.deliver_bootstrap(shard_pb2.BootstrapBlobResponse(
                    request_id=msg.bootstrap_request.request_id, user_data=BLOB, ttl_seconds=3600))
            elif kind == "reclaim_instruction":
                self.reclaims += 1
                ri = msg.reclaim_instruction
                s.deliver_reclaim_ack(shard_pb2.ReclaimAck(instruction_id=ri.instruction_id,
                                                           nodes_started=len(ri.nodes)))

    async def serve(self) -> None:
        s = self.session
        assert s is not None
        while not s.closed.is_set():
            await s.outbox.wait()
            self.pump()


@dataclass
class CycleStats:
    cycle: int
    t: float
    actions: Counter[str]
    states: Counter[str]
    needs: int
    shortfalls: int
    inflight: int
    demand_machines: int
    configured: int
    #: $/hour of every machine the provider bills (all but Speculative)
    cost_per_hour: float = 0.0


@dataclass
class SimResult:
    scenario: str
    cycles: int
    trace: list[str]
    violations: list[Violation]
    stats: list[CycleStats]
    final_states: Counter[str]
    totals: Counter[str]
    creates_started: int
    bootstraps: int
    reclaims: int

    @property
    def ok(self) -> bool:
        return not self.violations


def _state_name(v: int) -> str:
    name: str = S.Name(v)  # type: ignore[arg-type]
    return name.removeprefix("MACHINE_STATE_").lower()


def _action_line(a: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"kind": type(a).__name__, "machine": a.machine_id}
    if isinstance(a, Create | Configure):
        d["cluster"] = a.cluster_id
        d["priority"] = a.priority
    elif isinstance(a, Drain):
        d["reason"] = a.reason
        d["grace"] = a.grace_period_seconds
    return d


class Simulator:
    def __init__(self, scenario: Scenario, *, settle_cycles: int = 0,
                 on_cycle: Callable[[CycleStats], None] | None = None, keep_trace: bool = True) -> None:
        self.sc = scenario
        self.keep_trace = keep_trace  # a soak keeps no trace, so memory growth means a leak
        self.settle_cycles = settle_cycles
        self.on_cycle = on_cycle
        self.rng = random.Random(scenario.seed)
        self.loop = VirtualLoop()
        self.trace: list[str] = []
        self.stats: list[CycleStats] = []
        self.totals: Counter[str] = Counter()
        #: machines failed by ``lose`` faults, in order
        self.lost: list[str] = []

    # -- wiring ------------------------------------------------------------------------------------

    def _build(self) -> None:
        sc = self.sc
        catalog = build_catalog(sc.speculative, sc.committed)
        if sc.rack_slots:
            catalog += build_catalog(sc.rack_slots, 0, elastic=(RACK_SLOT_TIER,))
        timeout = 3 * sc.execute_timeout
        self.provider = SimProvider(
            catalog, dwell=Dwell(sc.dwell.create, sc.dwell.configure, sc.dwell.drain, sc.dwell.delete),
            faults=FaultPlan(seed=sc.seed),
            options=KitOptions(create_timeout=timeout, configure_timeout=timeout, drain_timeout=timeout,
                               delete_timeout=timeout, list_seed=sc.seed),
            now=self.loop.time(), list_seed=sc.seed,
        )
        self.checker = InvariantChecker(
            total_machines=len(catalog), execute_timeout=sc.execute_timeout, provider_timeout=timeout,
            cycle_seconds=sc.cycle_seconds, reclaim_cap_fraction=sc.reclaim_cap_fraction,
        )
        self.stub = RecordingStub(self.provider, self.loop.time, self.checker.transition)
        metrics = ShardMetrics(new_registry())
        clock = self.loop.time
        config = DaemonConfig(
            shard_id="sim-shard", provider="in-process", epoch=1, cycle_interval=sc.cycle_seconds,
            reconcile_interval=0.0, available_capacity_interval=sc.cycle_seconds,
            executor=ExecutorConfig(concurrency=64, execute_timeout=sc.execute_timeout, bootstrap_timeout=5.0,
                                    reclaim_ack_timeout=5.0, poll_interval=0.5, watch=False),
            engine=EngineConfig(reclaim_cap_fraction=sc.reclaim_cap_fraction, consolidation=sc.consolidation,
                                consolidation_payback_hours=sc.consolidation_payback_hours),
            clock=clock, wall_ns=lambda: EPOCH_NS + int(clock() * 1e9), compute_inline=True,
        )
        client = ProviderClient("in-process", "sim-shard", 1, metrics, stub=self.stub, clock=clock)
        self.shard = ShardDaemon(config, metrics, provider=client)
        self.clusters = {cid: SimCluster(cid, ws) for cid, ws in sorted(self.sc.clusters.items())}

    def _connect(self, c: SimCluster) -> None:
        s = OperatorSession(c.cluster_id, None, 4096)
        c.session, c.connected = s, True
        self.shard.sessions.install(s)
        self.shard.resync(s)
        c.task = asyncio.ensure_future(c.serve())

    def _disconnect(self, c: SimCluster) -> None:
        if c.session is not None:
            c.session.close(grpc.StatusCode.UNAVAILABLE, "simulated partition")
            self.shard.sessions.remove(c.session)
        c.session, c.connected = None, False

    # -- faults ------------------------------------------------------------------------------------

    def _apply_faults(self, cycle: int) -> None:
        plan = self.provider.faults
        for f in self.sc.faults:
            if f.at != cycle:
                continue
            kinds = frozenset(Kind(k) for k in f.kinds) if f.kinds else frozenset(Kind)
            if f.kind in ("fail", "hang"):
                plan.rules.append(FaultRule(f.kind, cluster=f.cluster, kinds=kinds))
            elif f.kind == "fail_rate":
                plan.fail_rate, plan.rate_kinds = f.rate, kinds
            elif f.kind == "clear":
                plan.rules.clear()
                plan.fail_rate = 0.0
            elif f.kind == "disconnect" and f.cluster in self.clusters:
                self._disconnect(self.clusters[f.cluster])
            elif f.kind == "reconnect" and f.cluster in self.clusters:
                self._connect(self.clusters[f.cluster])
            elif f.kind == "lose":
                self._lose(f.cluster)
            self._emit({"cycle": cycle, "fault": f.kind, "cluster": f.cluster, "kinds": sorted(f.kinds)})

    def _lose(self, cluster: str | None) -> None:
        """Fail the cluster's lowest-id Configured machine (a host loss); counted in `lost`."""
        self.stub.sync()
        ids = sorted(mid for mid, rec in self.provider.core.machines.items()
                     if int(rec.state) == S.MACHINE_STATE_CONFIGURED and (cluster is None or rec.cluster == cluster))
        if ids:
            before, after = self.provider.lose(ids[0])
            self.stub.note_change(ids[0], before, after)
            self.lost.append(ids[0])

    def _churn(self, cycle: int) -> None:
        """Soak churn: redraw every cluster's workloads (sizes, priorities, lifetimes)."""
        for c in self.clusters.values():
            n = self.rng.randint(0, 4)
            ws = []
            for i in range(n):
                ws.append(Workload(
                    f"w{cycle}-{i}", pods=self.rng.randint(1, 12), cpu=self.rng.choice((0.5, 1.0, 2.0, 3.5, 7.0)),
                    priority=self.rng.choice((0, 100, 1000, 1_000_000)), start=cycle,
                    duration=self.rng.choice((None, 5, 20)), spot_ok=self.rng.random() < 0.3,
                ))
            c.workloads = tuple(ws)
            c.done.clear()
            c.running_since.clear()

    # -- the loop ----------------------------------------------------------------------------------

    def _emit(self, rec: dict[str, Any]) -> None:
        if self.keep_trace:
            self.trace.append(json.dumps(rec, sort_keys=True, separators=(",", ":")))

    async def _cycle(self, cycle: int, final_demand: bool) -> None:
        sh = self.shard
        if not final_demand:
            self._apply_faults(cycle)
            if self.sc.churn_every and cycle % self.sc.churn_every == 0:
                self._churn(cycle)
        now_ns = sh.config.wall_ns()
        for c in self.clusters.values():
            c.pump()
            c.advance_batches(cycle)
            if c.connected:
                await sh.handle_rollup(c.cluster_id, c.rollup(cycle, now_ns))
        self.stub.sync()
        decision = await sh.run_cycle()
        self._record(cycle, decision)
        await asyncio.sleep(self.sc.cycle_seconds)
        self.stub.sync()
        for c in self.clusters.values():
            c.pump()
        demand = {cid: c.demand_machines(cycle) for cid, c in self.clusters.items()}
        self.checker.after_cycle(cycle, self.loop.time(), self.provider, sh.view, demand, self.stub.lifetime_creates,
                                 need_bounds=self._need_bounds(),
                                 cluster_nodes={cid: c.nodes for cid, c in self.clusters.items()},
                                 guard_held=frozenset(c for c in self.clusters if sh.intake.guard.held(c)))
        self._stats(cycle, decision, demand)

    def _need_bounds(self) -> dict[tuple[str, str], int]:
        """Most machines each need in the shard's table can use (all on the smallest machine shape)."""
        out: dict[tuple[str, str], int] = {}
        smallest = round(SMALLEST_ALLOCATABLE_CPU * 1000)
        for n in self.shard.store.table.snapshot():
            agg, unit = n.aggregate_resources.get("cpu"), n.min_unit.get("cpu")
            if agg <= 0 or unit <= 0:
                continue
            per_machine = max(1, smallest // unit) * unit
            out[(n.cluster_id, n.fingerprint)] = -(-agg // per_machine)
        return out

    def _record(self, cycle: int, d: Decision | None) -> None:
        if d is None:
            self._emit({"cycle": cycle, "skipped": True})
            return
        acts = sorted((_action_line(a) for a in d.actions), key=lambda x: (x["kind"], x["machine"]))
        for a in d.actions:
            self.totals[type(a).__name__] += 1
        self._emit({"cycle": cycle, "actions": acts, "shortfalls": len(d.shortfalls)})

    def _stats(self, cycle: int, d: Decision | None, demand: dict[str, int]) -> None:
        states = Counter(_state_name(int(m.state)) for m in self.provider.core.machines.values())
        st = CycleStats(
            cycle=cycle, t=self.loop.time(),
            actions=Counter(type(a).__name__ for a in d.actions) if d else Counter(),
            states=states, needs=len(self.shard.store.table), shortfalls=len(d.shortfalls) if d else 0,
            inflight=len(self.shard.view.inflight), demand_machines=sum(demand.values()),
            configured=states.get("configured", 0),
            cost_per_hour=round(sum(m.price_per_hour for m in self.provider.core.machines.values()
                                    if int(m.state) != S.MACHINE_STATE_SPECULATIVE), 6),
        )
        self.stats.append(st)
        if len(self.stats) > 256:  # soak: keep memory flat
            del self.stats[:128]
        if self.on_cycle:
            self.on_cycle(st)

    async def _main(self) -> SimResult:
        self._build()
        await self.shard.initial_reconcile()
        for c in self.clusters.values():
            self._connect(c)
        for cycle in range(self.sc.cycles):
            await self._cycle(cycle, final_demand=False)
        for i in range(self.settle_cycles):
            await self._cycle(self.sc.cycles + i, final_demand=True)
        # Let actions issued by the last cycles finish (virtual time, so this costs nothing): a flow
        # still running after its own deadline has passed is a stuck flow.
        pending = self.shard.executor.running()
        if pending:
            bound = 3 * self.sc.execute_timeout + self.shard.config.engine.reclaim_grace_seconds
            await asyncio.wait(pending, timeout=bound)
        self.stub.sync()
        self.checker.at_end(self.loop.time(), self.provider, self.shard.view)
        for c in self.clusters.values():
            if c.session is not None:
                c.session.close(grpc.StatusCode.UNAVAILABLE, "simulation over")
        await self.shard.executor.drain_all(0.0)
        await asyncio.gather(*(c.task for c in self.clusters.values() if c.task), return_exceptions=True)
        final = Counter(_state_name(int(m.state)) for m in self.provider.core.machines.values())
        return SimResult(
            scenario=self.sc.name, cycles=self.sc.cycles + self.settle_cycles, trace=self.trace,
            violations=self.checker.violations, stats=self.stats, final_states=final, totals=self.totals,
            creates_started=sum(self.stub.creates_started.values()),
            bootstraps=sum(c.bootstraps for c in self.clusters.values()),
            reclaims=sum(c.reclaims for c in self.clusters.values()),
        )

    def run(self) -> SimResult:
        try:
            return self.loop.run_until_complete(self._main())
        finally:
            self.loop.close()


def run(scenario: Scenario, settle_cycles: int = 0) -> SimResult:
    return Simulator(scenario, settle_cycles=settle_cycles).run()


def with_cycles(scenario: Scenario, cycles: int) -> Scenario:
    return replace(scenario, cycles=cycles)


__all__ = ["SimCluster", "SimResult", "Simulator", "run", "with_cycles"]
