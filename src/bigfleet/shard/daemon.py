"""The shard daemon: wires sessions, the demand store, reconcile, the cycle loop and the executor.

The decision engine is pure; everything here is the imperative shell around
it. One asyncio loop owns all state, so no locks: roll-ups, reconcile merges,
executor completions and cycles interleave only at ``await`` points.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import os
import pickle
import signal
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from itertools import chain
from typing import Any

import grpc

from bigfleet.decision import (  # imported up front: a forked child must not need the import lock
    Engine,
    decide,
)
from bigfleet.decision.types import Configure, Create, Decision, Delete, Drain, EngineConfig
from bigfleet.machine import MachineState
from bigfleet.needs import Need, ValidationError, snapshot_sort_key
from bigfleet.observability import get_logger
from bigfleet.security.limits import LimitExceeded, check_rollup
from bigfleet.shard import availability, engineproc
from bigfleet.shard.engineproc import verdict_row
from bigfleet.shard.executor import Binding, Executor, ExecutorConfig
from bigfleet.shard.guard import EmptyRollupGuard, GuardConfig
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderClient, ProviderError
from bigfleet.shard.sessions import OperatorSession, RollupOutcome, SessionRegistry, SessionServicer
from bigfleet.shard.store import LocalDemandStore
from bigfleet.shard.view import MachineView
from bigfleet.v1alpha1 import capacity_pb2, coordinator_pb2, provider_pb2
from bigfleet.wire.needs import requirement_to_proto, rollup_from_proto

log = get_logger("bigfleet.shard")

S = provider_pb2.MachineState


@dataclass
class DaemonConfig:
    shard_id: str
    provider: str
    epoch: int
    cycle_interval: float = 10.0
    min_cycle_gap: float = 0.2
    #: seconds between heap settles (`ShardDaemon._settle_heap_loop`); 0 = only after cycles
    heap_settle_interval: float = 1.0
    reconcile_interval: float = 1.0
    full_reconcile_every: int = 300
    available_capacity_interval: float = 5.0
    # AvailableCapacityUpdate frames written per second, shard-wide (0: as soon as decided).
    available_capacity_rate: float = 1000.0
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    # Injectable clocks and inline compute let the simulator (bigfleet.sim) run this daemon's real
    # cycle and execution flows deterministically on a virtual event-loop clock.
    clock: Callable[[], float] = time.monotonic
    wall_ns: Callable[[], int] = time.time_ns
    compute_inline: bool = False
    # Run each cycle's engine in a forked child (copy-on-write inputs, no GIL shared with the
    # session loop); only actions, shortfalls, state and compact verdict rows come back.
    compute_fork: bool = False
    # Where the engine runs: "worker" (a long-lived process fed deltas, bigfleet.shard.engineproc),
    # "thread" (this process, off the loop), "inline" (on the loop), "fork" (a child per cycle).
    # compute_inline / compute_fork, when set, win (the simulator sets compute_inline).
    engine_mode: str = "worker"
    # A worker that has not answered a cycle in this long is killed and replaced (full resync).
    engine_timeout: float = 120.0
    # Niceness added to the worker: on a busy box the session loop (latency) wins the CPU over the
    # engine (throughput).
    engine_nice: int = 10

    @property
    def mode(self) -> str:
        if self.compute_inline:
            return "inline"
        if self.compute_fork:
            return "fork"
        if self.engine_mode not in ENGINE_MODES:
            raise ValueError(f"engine mode must be one of {ENGINE_MODES}, got {self.engine_mode!r}")
        return self.engine_mode


ENGINE_MODES = ("worker", "thread", "inline", "fork")


class CycleRecord:
    """What ShardRead serves: the last cycle's inputs and verdicts (soft state).

    The needs may be given per cluster (the tuples the table held at the cycle); the flat sorted
    tuple is then built on first read, so a cycle does not sort 50 000 needs on the session loop
    for a reader that may never come."""

    def __init__(self, cycle: int = 0, computed_at_unix_nanos: int = 0, needs: tuple[Need, ...] | None = (),
                 decision: Decision | None = None, verdict_rows: dict[tuple[str, str], tuple[Any, ...]] | None = None,
                 by_cluster: Mapping[str, tuple[Need, ...]] | None = None) -> None:
        self.cycle = cycle
        self.computed_at_unix_nanos = computed_at_unix_nanos
        self.decision = decision
        # Worker and fork modes: verdicts as compact rows keyed by (cluster, fingerprint) (see verdict_row()).
        self.verdict_rows = verdict_rows if verdict_rows is not None else {}
        self._needs = needs if by_cluster is None else None
        self._by_cluster = by_cluster

    @property
    def needs(self) -> tuple[Need, ...]:
        if self._needs is None:
            rows = [n for ns in (self._by_cluster or {}).values() for n in ns]
            rows.sort(key=snapshot_sort_key)
            self._needs = tuple(rows)
        return self._needs


class ShardDaemon:
    def __init__(self, config: DaemonConfig, metrics: ShardMetrics, tls: Any = None,
                 provider: ProviderClient | None = None) -> None:
        self.config = config
        self.metrics = metrics
        self.store = LocalDemandStore()
        self.sessions = SessionRegistry(metrics)
        self.view = MachineView(on_node_update=self._route_node_update, on_reject=self._on_reject,
                                wall_ns=config.wall_ns)
        self.provider = provider or ProviderClient(config.provider, config.shard_id, config.epoch, metrics, tls=tls)
        self.executor = Executor(
            self.view, self.provider, self.sessions, self.resolve_binding, config.executor, metrics,
            on_settled=self.trigger, clock=config.clock,
        )
        self.guard = EmptyRollupGuard(config.guard)
        self.availability = availability.AvailabilityEmitter(config.available_capacity_interval)
        self.sessions.on_removed.append(self.availability.forget_cluster)
        self.servicer = SessionServicer(self.sessions, self.handle_rollup, self._ack_info, self._resync)
        self.paused = config.engine.paused
        self.dry_run = config.engine.dry_run
        self.metrics.paused.set(1 if self.paused else 0)
        self.coordinator_term = 0
        self.term_source: Any = None  # set by the CLI to the heartbeat loop's instruction gate
        # HA (bigfleet.shard.ha): commits the roll-up through Raft; the ack waits for it, and a
        # False (not leader, no quorum) rejects the roll-up so the operator resends it.
        self.before_apply: Callable[[str, capacity_pb2.ClusterCapacityNeeds, int], Awaitable[bool]] | None = None
        self.reconciled = asyncio.Event()
        self.last = CycleRecord()
        self.cycles = 0
        # Observers of each finished cycle (the dashboard's action log); called on the loop, must be cheap.
        self.cycle_observers: list[Callable[[CycleRecord], None]] = []
        self._trigger = asyncio.Event()
        self._stopping = asyncio.Event()
        self._cursor = b""
        self._reconciles = 0
        self._reconcile_task: asyncio.Task[None] | None = None
        # AvailableCapacityUpdate pass bookkeeping (see _emit_availability)
        self._avail_at = float("-inf")
        self._avail_sessions = -1
        self._avail_frozen = 0
        self._avail_dirty: set[str] = set()
        self._hints = availability.HintQueue()
        self._hints_ready = asyncio.Event()
        self._hints_paced = config.available_capacity_rate > 0 and not config.compute_inline
        self._hint_input: tuple[Iterable[Need], dict[Any, availability.Availability]] | None = None
        self._quarantine_shown: set[str] = set()
        self._last_reconcile = 0.0
        self._last_compute = 0.0
        # One long-lived engine: it keeps its machine index and per-cluster results between cycles, so
        # a steady cycle costs what changed (its output is identical to a fresh decide()). Used by one
        # cycle at a time (never concurrently); a forked child gets a fresh decide() instead.
        self.engine = Engine()
        self.engine_mode = config.mode
        self._feed = engineproc.MirrorFeed()
        self._worker = engineproc.EngineWorker(config.engine_timeout, nice=config.engine_nice) if self.engine_mode == "worker" else None
        self._accepted_digest: dict[str, bytes] = {}
        self._suppressed_counts: dict[str, int] | None = None
        self._gc_started = 0.0
        self._last_unfreeze = config.clock()
        self._tasks: list[asyncio.Task[Any]] = []
        # Cross-shard handoff (bigfleet.shard.handoff): which provider machines are ours (None = all),
        # clusters/machines being handed away (no cycle decides for them, no action touches them),
        # and where a handed-off cluster's operator should go next.
        self.owns: Callable[[provider_pb2.Machine], bool] | None = None
        self.owner_id = ""
        self.frozen_clusters: set[str] = set()
        self.frozen_machines: set[str] = set()
        self.redirects: dict[str, str] = {}

    # -- wiring helpers ------------------------------------------------------------------------

    def _ack_info(self) -> tuple[int, int]:
        if self.term_source is not None:
            self.coordinator_term = max(self.coordinator_term, int(getattr(self.term_source, "high_water", 0)))
        return self.coordinator_term, self.config.epoch

    def _route_node_update(self, cluster_id: str, msg: Any) -> None:
        self.sessions.send(cluster_id, msg)

    def _on_reject(self, reason: str) -> None:
        self.metrics.machines_rejected.labels(reason).inc()

    def _resync(self, session: OperatorSession) -> None:
        from bigfleet.shard.view import node_state_update

        for pb in self.view.bound_to(session.cluster_id):
            session.send(node_state_update(pb, session.cluster_id))

    def trigger(self) -> None:
        self._trigger.set()

    # -- roll-ups ------------------------------------------------------------------------------

    async def handle_rollup(self, cluster_id: str, pb: capacity_pb2.ClusterCapacityNeeds) -> RollupOutcome:
        started = time.perf_counter()
        # Operators resend the same demand every 10 s. A roll-up byte-identical (needs only) to the
        # last one accepted for this cluster, with nothing held by the guard, would validate and
        # apply to exactly the same table: ack it without decoding again.
        digest = hashlib.blake2b(b"\x00".join(n.SerializeToString(deterministic=True) for n in pb.needs),
                                 digest_size=16).digest()
        if self._accepted_digest.get(cluster_id) == digest and not self.guard.held(cluster_id):
            self.metrics.rollups.inc()
            self.metrics.rollup_duration.observe(time.perf_counter() - started)
            return RollupOutcome(True)
        now = self.config.wall_ns()
        if not pb.cluster_id:
            fixed = capacity_pb2.ClusterCapacityNeeds()
            fixed.CopyFrom(pb)
            fixed.cluster_id = cluster_id
            pb = fixed
        try:
            check_rollup(pb)  # size bounds first: cheap, and before anything is decoded
            _, needs = rollup_from_proto(pb, now)
        except (ValidationError, LimitExceeded) as exc:
            self.metrics.rollups_rejected.labels(cluster_id).inc()
            log.warning("roll-up rejected", cluster=cluster_id, error=str(exc))
            return RollupOutcome(False, error=str(exc))
        self.store.mark_first_rollup(cluster_id)
        if not self.guard.admit(cluster_id, len(needs)):
            self.metrics.rollup_quarantined.labels(cluster_id).set(self.guard.held(cluster_id))
            self._quarantine_shown.add(cluster_id)
            log.warning("roll-up held by the empty-roll-up guard", cluster=cluster_id, rows=len(needs),
                        held=self.guard.held(cluster_id))
            return RollupOutcome(False, quarantined=True)
        if cluster_id in self._quarantine_shown:
            # Per-cluster series exist only while (or since) a cluster was held: one zero-valued
            # child per cluster would make every scrape of a 5 000-session shard walk 5 000 series.
            self.metrics.rollup_quarantined.labels(cluster_id).set(0)
        if self.before_apply is not None and not await self.before_apply(cluster_id, pb, now):
            return RollupOutcome(False, error="roll-up not replicated (shard replica not leading); resend")
        changed = self.store.apply_rollup(cluster_id, needs, now)
        if changed:
            self._avail_dirty.add(cluster_id)
        self._accepted_digest[cluster_id] = digest
        self.metrics.rollups.inc()
        if changed:
            self.trigger()
        self.metrics.rollup_duration.observe(time.perf_counter() - started)
        return RollupOutcome(True)

    # -- bindings (what Configure needs for a need) --------------------------------------------

    def resolve_binding(self, cluster_id: str, fingerprint: str, priority: int) -> Binding | None:
        for n in self.store.table.cluster(cluster_id):
            if n.fingerprint == fingerprint:
                return binding_for_need(n)
        return None

    # -- reconcile -----------------------------------------------------------------------------

    async def reconcile(self, full: bool = False) -> None:
        """Merge the provider's records; a full List also forgets machines the provider erased."""
        full = full or not self._cursor or self._reconciles % self.config.full_reconcile_every == 0
        started = time.perf_counter()
        mark = self.executor.end_mark()
        lst = await self.provider.list(b"" if full else self._cursor)
        seen: set[str] = set()
        owns = self.owns
        for i, pb in enumerate(lst.machines):
            if i % 1000 == 999:
                await asyncio.sleep(0)  # a big List must not hold the loop (sessions wait)
            if owns is not None and not owns(pb):
                continue  # another shard's machine on a shared provider (a full List forgets it below)
            seen.add(pb.id)
            if self.executor.ended_after(pb.id, mark):
                self.executor.recheck(pb)  # this record may predate the flow that just ended
                continue
            self.view.observe(pb)
        if full:
            for i, mid in enumerate(self.view.ids()):
                if i % 5000 == 4999:
                    await asyncio.sleep(0)
                if mid not in seen and mid not in self.view.inflight and mid not in self.view.failed_local:
                    self.view.forget(mid)
        self._cursor = bytes(lst.revision)
        self._reconciles += 1
        self._last_reconcile = self.config.clock()
        self.metrics.phase_duration.labels("reconcile").observe(time.perf_counter() - started)
        if not self.reconciled.is_set():
            self.reconciled.set()
            log.info("first reconcile done", machines=len(self.view))

    # -- the cycle -----------------------------------------------------------------------------

    async def run_cycle(self) -> Decision | None:
        cycle_started = time.perf_counter()
        if self._reconcile_task is None and self.config.clock() - self._last_reconcile >= self.config.reconcile_interval:
            try:
                await self.reconcile()
            except ProviderError as exc:
                log.warning("reconcile failed; deciding on the last known inventory", error=str(exc))
        if not self.reconciled.is_set():
            return None
        engine_cfg = replace(self.config.engine, paused=self.paused, dry_run=self.dry_run)
        now = self.config.wall_ns()
        fc, fm = self.frozen_clusters, self.frozen_machines
        t0 = time.perf_counter()
        rows: dict[tuple[str, str], tuple[Any, ...]] = {}
        suppressed_counts: dict[str, int] | None = None
        snapshot: tuple[Need, ...] | None = None
        by_cluster: dict[str, tuple[Need, ...]] | None = None
        if self._worker is not None:
            # Per-cluster tuples (O(clusters)), not the table's sorted snapshot (O(needs log needs)
            # on the loop whenever any cluster changed).
            table = self.store.table
            by_cluster = {c: table.cluster(c) for c in table.clusters() if c not in fc}
            decision, hints, rows, suppressed_counts = await self._compute_in_worker(now, engine_cfg)
        else:
            snapshot = tuple(self.store.table.snapshot())
            if fc:  # being handed off: invisible to the engine
                snapshot = tuple(n for n in snapshot if n.cluster_id not in fc)
            self.view.take_dirty()  # (only the worker's mirror consumes change tracking)
            # Immutable inputs (Need and Machine records are frozen; the containers are copies), so the
            # engine can run on a worker thread while the loop keeps serving sessions.
            machines = list(self.view.machines())
            if fc or fm:
                machines = [m for m in machines if m.id not in fm and m.cluster not in fc]
            busy = frozenset(self.view.inflight)
            connected = [n for n in snapshot if self.sessions.get(n.cluster_id) is not None]
            if self.engine_mode == "inline":
                decision, hints = _compute(
                    snapshot, machines, busy, connected, now, self.store.engine_state(), engine_cfg, self.engine
                )
            elif self.engine_mode == "fork":
                decision, hints, rows = await _compute_forked(
                    snapshot, machines, busy, connected, now, self.store.engine_state(), engine_cfg
                )
            else:
                decision, hints = await asyncio.to_thread(
                    _compute, snapshot, machines, busy, connected, now, self.store.engine_state(), engine_cfg,
                    self.engine,
                )
        self._last_compute = time.perf_counter() - t0
        self.metrics.phase_duration.labels("decide").observe(self._last_compute)
        self.store.save_engine_state(decision.state)
        self.cycles += 1
        self.metrics.cycles.inc()
        t1 = time.perf_counter()
        self._suppressed_counts = suppressed_counts
        await self._execute(decision)
        self.metrics.phase_duration.labels("execute").observe(time.perf_counter() - t1)
        self.metrics.shortfalls.set(len(decision.shortfalls))
        self.last = CycleRecord(self.cycles, now, snapshot, decision, rows, by_cluster=by_cluster)
        for observe in self.cycle_observers:
            try:
                observe(self.last)
            except Exception as exc:  # an observer must never stop cycles
                log.warning("cycle observer failed", error=str(exc))
        needs_seen = snapshot if snapshot is not None else chain.from_iterable((by_cluster or {}).values())
        if self._hints_paced:
            # The hint walk is advisory work: it runs on the sender's task, not inside the cycle.
            self._hint_input = (needs_seen, hints)
            self._hints_ready.set()
        else:
            await self._emit_availability(needs_seen, hints)
        self._update_inventory_gauge()
        self.metrics.cycle_duration.observe(time.perf_counter() - cycle_started)
        if decision.follow_up:
            self.trigger()
        if self._worker is not None:
            self._settle_heap()
        return decision

    # -- garbage collector ---------------------------------------------------------------------

    #: how often frozen objects are handed back to the collector (bounds what a freeze can leak)
    UNFREEZE_EVERY = 600.0

    def _settle_heap(self) -> None:
        """Move what survived this cycle out of the collector's sight (``gc.freeze``, a list splice).

        The shard holds ~10^6 long-lived objects (records, protos, needs); a full collection walks
        them all, ~0.1 s per 100 000 machines, on whichever thread triggers it -- usually the
        session loop. Frozen objects are still freed by reference counting; reference cycles among
        them (a closed session's tasks, say) wait for the periodic unfreeze and full collection:
        one such pause every ``UNFREEZE_EVERY`` seconds instead of one every few cycles."""
        now = self.config.clock()
        if now - self._last_unfreeze >= self.UNFREEZE_EVERY:
            self._last_unfreeze = now
            gc.unfreeze()
            gc.collect()
        gc.freeze()

    async def _settle_heap_loop(self) -> None:
        """Settle the heap between cycles too. The collector starts a young collection when
        allocations minus deallocations pass its threshold, and every object freed from an older
        generation counts as a deallocation: at 500 roll-ups/s each new roll-up's needs replace
        old, frozen ones, so the count barely moves while the young list grows by ~25 000
        survivors a second. Left alone, the young collection comes after 3-6 s over ~100 000
        objects: a 40-60 ms pause for every session. Settled every second, it stays a few ms."""
        while True:
            await asyncio.sleep(self.config.heap_settle_interval)
            self._settle_heap()

    def _gc_watch(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
            return
        took = time.perf_counter() - self._gc_started
        gen = info.get("generation", 0)
        self.metrics.gc_pause.labels(str(gen)).observe(took)
        if took > 0.05:
            log.info("long garbage collection", generation=gen, seconds=round(took, 3),
                     collected=info.get("collected", 0))

    async def _compute_in_worker(self, now: int, cfg: EngineConfig) -> tuple[
            Decision, dict[Any, availability.Availability], dict[tuple[str, str], tuple[Any, ...]], dict[str, int]]:
        """One cycle in the engine worker: send what changed, get the decision back. A dead, stuck
        or out-of-step worker is replaced (or resynced) and the cycle retried once."""
        worker, feed = self._worker, self._feed
        assert worker is not None
        last_error = ""
        for attempt in (1, 2):
            if not worker.alive():
                if worker.proc is not None:  # it died since the last cycle
                    log.warning("engine worker exited; starting a new one (full resync)",
                                exit_code=worker.returncode(), pid=worker.pid)
                    self.metrics.engine_worker_restarts.inc()
                    await worker.discard()
                worker.start()
                feed.reset()
            req = feed.build(self.view, self.store.table, self.view.inflight, now, self.store.engine_state(), cfg,
                             self.frozen_clusters, self.frozen_machines)
            if req.base == engineproc.RESYNC:
                self.metrics.engine_worker_resyncs.inc()
            try:
                reply = await worker.call(req)
            except engineproc.WorkerGone as exc:
                last_error = str(exc)
                log.warning("engine worker failed; replacing it", error=last_error, attempt=attempt, pid=worker.pid)
                await worker.discard()
                self.metrics.engine_worker_restarts.inc()
                feed.reset()
                continue
            if reply.status == "ok":
                decision = feed.accept(req, reply)
                self.metrics.phase_duration.labels("engine_worker").observe(reply.compute_seconds)
                return decision, reply.hints, feed.rows, reply.suppressed_counts
            if reply.status == "failed":  # an engine bug, not a transport problem: no resync, no retry
                feed.failed(req)
                raise RuntimeError(f"engine failed in the worker: {reply.error}")
            feed.reset()
            last_error = reply.error
            if reply.status == "resync":
                log.info("engine worker asked for a full resync", reason=reply.error, attempt=attempt)
                continue
            raise RuntimeError(f"engine worker: {reply.error}")
        raise RuntimeError(f"engine worker: no decision after a restart ({last_error})")

    #: actions handed to the executor between two returns to the session loop
    EXECUTE_CHUNK = 64

    async def _execute(self, decision: Decision) -> None:
        """Hand the decision's actions to the executor. Each submission claims its machine on its
        own (checking state and in-flight again), so the loop may run in between: a cycle that
        creates 5 000 machines costs ~0.5 s of record parsing and would otherwise hold every
        session for that long (measured: 130-260 ms stalls at 6 000 actions). The simulator's
        virtual-clock cycles (compute_inline) dispatch in one go, as their traces expect."""
        from collections import Counter

        # (the worker ships only a sample of suppressed actions, with the full counts beside them)
        counts, self._suppressed_counts = self._suppressed_counts, None
        suppressed = counts if counts is not None else Counter(type(a).__name__ for a in decision.suppressed)
        counter = self.metrics.actions_dryrun if decision.mode == "dry_run" else self.metrics.actions_suppressed
        for kind, n in suppressed.items():
            counter.labels(kind).inc(n)
        for kind, n in Counter(type(a).__name__ for a in decision.actions).items():
            self.metrics.actions.labels(kind).inc(n)
        orphans = self._orphan_creates() if decision.actions else 0
        fc, fm = self.frozen_clusters, self.frozen_machines
        chunked = not self.config.compute_inline
        for i, a in enumerate(decision.actions):
            if chunked and i % self.EXECUTE_CHUNK == self.EXECUTE_CHUNK - 1:
                await asyncio.sleep(0)  # (fc/fm are the live sets: a handoff begun meanwhile counts)
            if (fc or fm) and (a.machine_id in fm or getattr(a, "cluster_id", "") in fc
                               or ((shown := self.view.get(a.machine_id)) is not None
                                   and self.view.route(shown) in fc)):
                # Decided before a handoff froze them: never act on a machine being handed away.
                self.metrics.action_outcomes.labels(type(a).__name__, "frozen_handoff").inc()
                continue
            if isinstance(a, Create) and orphans:
                # A Create from a previous incarnation (or one we lost track of) is still running:
                # its machine will be Idle shortly and the engine will hand it out then. Creating
                # another in its place would over-acquire because the old reservation died with the
                # process; so one Create is held back per orphan, and the rest go ahead.
                orphans -= 1
                self.metrics.action_outcomes.labels("Provision", "deferred_orphan_create").inc()
                continue
            if isinstance(a, Create):
                binding = Binding(
                    a.cluster_id, a.need_fingerprint, a.priority, a.interruption_penalty_dollars,
                    a.reclamation_penalty_dollars, tuple(requirement_to_proto(r) for r in a.requirements), a.group,
                )
                self.executor.submit_create(a.machine_id, binding)
            elif isinstance(a, Configure):
                binding = Binding(
                    a.cluster_id, a.need_fingerprint, a.priority, a.interruption_penalty_dollars,
                    a.reclamation_penalty_dollars, tuple(requirement_to_proto(r) for r in a.requirements), a.group,
                )
                self.executor.submit_configure(a.machine_id, binding)
            elif isinstance(a, Drain):
                if a.reason == "reclaim" and not self.store.has_rolled_up(a.cluster_id):
                    # Phase 3 waits for the cluster's first roll-up since start: a restart alone
                    # must never reclaim anything.
                    self.metrics.action_outcomes.labels("Reclaim", "gated_first_rollup").inc()
                    continue
                self.executor.submit_drain(a.machine_id, a.grace_period_seconds, a.preemptor_priority, a.reason)
            elif isinstance(a, Delete):
                self.executor.submit_delete(a.machine_id)

    def _orphan_creates(self) -> int:
        """CREATING machines nobody here is driving, seen for less than two execute timeouts
        (after that they no longer hold back new Creates: the provider is expected to fail them)."""
        window = int(2 * self.config.executor.execute_timeout * 1e9)
        now = self.config.wall_ns()
        n = 0
        for mid in self.view.creating:
            m = self.view.machine(mid)
            if m is not None and m.state == MachineState.CREATING and mid not in self.view.inflight \
                    and now - m.state_since_unix_nanos < window:
                n += 1
        return n

    async def _emit_availability(self, needs: Iterable[Need], hints: dict[Any, availability.Availability]) -> None:
        """Send due AvailableCapacityUpdates to the connected clusters among ``needs``.

        Walking every need costs O(needs) on the loop, and a busy shard cycles several times a
        second, so the full walk runs once per ``available_capacity_interval`` (the hint's own rate
        limit) or when sessions came or went; in between, only clusters whose demand changed since
        the last pass are looked at (their new needs get a hint right after the cycle)."""
        now = self.config.clock()
        full = (now - self._avail_at >= self.config.available_capacity_interval
                or self.sessions.version != self._avail_sessions or len(self.frozen_clusters) != self._avail_frozen)
        if full:
            self._avail_at, self._avail_sessions = now, self.sessions.version
            self._avail_frozen = len(self.frozen_clusters)
            self._avail_dirty.clear()
            todo: Iterable[Need] = needs
        elif self._avail_dirty:
            table, fc = self.store.table, self.frozen_clusters
            dirty, self._avail_dirty = self._avail_dirty, set()
            todo = [n for c in dirty if c not in fc for n in table.cluster(c)]
        else:
            return
        get = self.sessions.get
        pace = self._hints_paced
        for i, need in enumerate(todo):
            if i % 256 == 255:
                await asyncio.sleep(0)  # long lists must not hold the loop (measured: 2 000 needs ≈ 60 ms)
            if get(need.cluster_id) is None:
                continue
            a = hints.get(need.requirements)
            if a is not None and self.availability.due(need.cluster_id, need.fingerprint, a, now):
                if pace:
                    self._hints.put(need, a)
                else:
                    self.sessions.send(need.cluster_id, availability.update_message(need, a))

    #: how often the paced hint sender wakes up (it sends ``available_capacity_rate`` x this per tick)
    HINT_TICK = 0.05

    async def _send_hints(self) -> None:
        """Walk the newest cycle's hints and write the due ones at ``available_capacity_rate`` frames
        per second, so a burst of hints never stands between an operator and its roll-up's ack (see
        HintQueue), and the walk itself never lengthens a cycle."""
        per_tick = max(1, int(self.config.available_capacity_rate * self.HINT_TICK))
        get = self.sessions.get
        while True:
            await self._hints_ready.wait()
            self._hints_ready.clear()
            while True:
                if self._hint_input is not None:
                    needs, hints = self._hint_input
                    self._hint_input = None
                    await self._emit_availability(needs, hints)
                if not len(self._hints):
                    break
                for need, a in self._hints.take(per_tick):
                    session = get(need.cluster_id)
                    if session is not None:  # (a cluster that went away meanwhile gets nothing)
                        session.send(availability.update_message(need, a))
                self.metrics.hints_queued.set(len(self._hints))
                await asyncio.sleep(self.HINT_TICK)

    def _update_inventory_gauge(self) -> None:
        counts = self.view.counts()
        for st in S.values():
            if st == S.MACHINE_STATE_UNSPECIFIED:
                continue
            self.metrics.inventory.labels(S.Name(st).removeprefix("MACHINE_STATE_").lower()).set(counts.get(st, 0))

    async def cycle_loop(self) -> None:
        """Cycles every ``cycle_interval`` and soon after a trigger; consecutive cycles are spaced by
        at least ``min_cycle_gap`` and by the last engine run's duration, so the engine never takes
        more than about half of the process while roll-ups keep arriving."""
        last_cycle = 0.0
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._trigger.wait(), self.config.cycle_interval)
            except TimeoutError:
                pass
            if self._stopping.is_set():
                return
            gap = max(self.config.min_cycle_gap, self._last_compute) - (self.config.clock() - last_cycle)
            if gap > 0:
                await asyncio.sleep(gap)
            self._trigger.clear()
            last_cycle = self.config.clock()
            try:
                await self.run_cycle()
            except Exception:
                log.exception("cycle failed")

    async def initial_reconcile(self) -> None:
        """Full List, retried until it works: no decision is made on an inventory we have not read."""
        delay = 0.2
        while not self._stopping.is_set():
            try:
                await self.reconcile(full=True)
                return
            except ProviderError as exc:
                log.warning("initial reconcile failed; retrying", error=str(exc), retry_in=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._worker is not None and not self._worker.alive():
            self._worker.start()  # imports while the first reconcile runs
        if not self.config.compute_inline and self._gc_watch not in gc.callbacks:
            gc.callbacks.append(self._gc_watch)
        self._tasks.append(asyncio.create_task(self._start_loops(), name="shard-loops"))
        if not self.config.compute_inline:  # (the simulator's virtual clock has no real lag)
            self._tasks.append(asyncio.create_task(self._watch_loop_lag(), name="shard-loop-lag"))
        if self._hints_paced:
            self._tasks.append(asyncio.create_task(self._send_hints(), name="shard-hints"))
        if self._worker is not None and self.config.heap_settle_interval > 0:
            self._tasks.append(asyncio.create_task(self._settle_heap_loop(), name="shard-heap"))

    async def _watch_loop_lag(self) -> None:
        """Sessions are served by this loop; a stall here is latency for every operator."""
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(0.1)
            self.metrics.loop_lag.observe(max(0.0, time.perf_counter() - t0 - 0.1))

    async def _start_loops(self) -> None:
        await self.initial_reconcile()
        if not self.config.compute_inline:
            # Reconcile on its own task: a cycle never waits on a provider List (a full one at 500k
            # machines takes seconds to serve), it decides on the view as last merged. The simulator
            # (compute_inline) keeps reconcile inside the cycle so its virtual-clock traces stand.
            self._reconcile_task = asyncio.create_task(self.reconcile_loop(), name="shard-reconcile")
            self._tasks.append(self._reconcile_task)
        self.trigger()
        await self.cycle_loop()

    async def reconcile_loop(self) -> None:
        """Merge the provider's changes every ``reconcile_interval``, independent of cycles."""
        interval = max(self.config.reconcile_interval, 0.05)
        while not self._stopping.is_set():
            try:
                await asyncio.wait_for(self._stopping.wait(), interval)
                return
            except TimeoutError:
                pass
            try:
                await self.reconcile()
            except ProviderError as exc:
                log.warning("reconcile failed; cycles decide on the last known inventory", error=str(exc))
            except Exception:
                log.exception("reconcile failed")

    async def stop(self, drain_timeout: float = 5.0) -> None:
        self._stopping.set()
        self._trigger.set()
        self.servicer.shutting_down = True
        self.sessions.close_all(grpc.StatusCode.UNAVAILABLE, "shard shutting down; reconnect")
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._gc_watch in gc.callbacks:
            gc.callbacks.remove(self._gc_watch)
        if self._worker is not None:
            gc.unfreeze()  # what this daemon froze is collectable again (HA: a later term starts afresh)
        if self._worker is not None:
            await self._worker.stop()
        await self.executor.drain_all(drain_timeout)
        await self.provider.close()

    def build_report(self) -> coordinator_pb2.ShardReport:
        """The heartbeat's payload: a small inventory summary and the last cycle's shortfalls."""
        from bigfleet.shard.readsvc import shortfalls_to_proto

        # From counts the view keeps on every write: O(in flight), not a walk over the fleet.
        view = self.view
        total = len(view)
        counts = view.counts()
        free = counts.get(S.MACHINE_STATE_IDLE, 0) + counts.get(S.MACHINE_STATE_SPECULATIVE, 0)
        for mid in view.inflight:
            pb = view.get(mid)
            if pb is not None and pb.state in (S.MACHINE_STATE_IDLE, S.MACHINE_STATE_SPECULATIVE):
                free -= 1
        per_type = {k: n for k, n in view.type_counts.items() if n > 0}
        per_zone = {k: n for k, n in view.zone_counts.items() if n > 0}
        rec = self.last
        return coordinator_pb2.ShardReport(
            shard_id=self.config.shard_id,
            shard_epoch=self.config.epoch,
            summary=coordinator_pb2.ShardSummary(
                total_machines=total, free_machines=free, per_instance_type_counts=per_type,
                per_zone_counts=per_zone, provider_address=self.config.provider,
            ),
            shortfalls=shortfalls_to_proto(rec.decision.shortfalls if rec.decision else ())[:100],
        )

    def set_actuation(self, paused: bool, dry_run: bool) -> None:
        self.paused, self.dry_run = paused, dry_run
        self.metrics.paused.set(1 if paused else 0)
        log.warning("actuation changed", paused=paused, dry_run=dry_run)
        self.trigger()


def _compute(
    snapshot: tuple[Need, ...], machines: list[Any], busy: frozenset[str], connected: list[Need], now: int,
    state: Any, cfg: EngineConfig, engine: Engine | None = None,
) -> tuple[Decision, dict[Any, availability.Availability]]:
    """The pure part of a cycle (runs on a worker thread or in a forked child)."""
    decision = (engine.decide if engine is not None else decide)(snapshot, machines, now, state, cfg)
    return decision, availability.compute(connected, machines, busy)


def _child_compute(w: int, args: tuple[Any, ...]) -> None:
    """Runs in the forked child: compute, write the pickled result, never return."""
    code = 1
    try:
        gc.disable()
        decision, hints = _compute(*args)
        rows = {(v.cluster_id, v.fingerprint): verdict_row(v, decision.state.cycle) for v in decision.verdicts}
        payload = pickle.dumps((replace(decision, verdicts=()), hints, rows), protocol=5)
        view = memoryview(payload)
        while view:
            view = view[os.write(w, view):]
        code = 0
    finally:
        os._exit(code)


def _read_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    while True:
        b = os.read(fd, 1 << 20)
        if not b:
            return b"".join(chunks)
        chunks.append(b)


async def _compute_forked(
    snapshot: tuple[Need, ...], machines: list[Any], busy: frozenset[str], connected: list[Need], now: int,
    state: Any, cfg: EngineConfig, timeout: float = 300.0,
) -> tuple[Decision, dict[Any, availability.Availability], dict[tuple[str, str], tuple[Any, ...]]]:
    """The engine in a forked child. The child touches nothing but pure code and a pipe (no gRPC,
    no logging, no garbage collector) and leaves with os._exit; the parent reads on a thread."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        raise
    if pid == 0:  # pragma: no cover - child
        os.close(r)
        _child_compute(w, (snapshot, machines, busy, connected, now, state, cfg))
    os.close(w)
    try:
        data = await asyncio.wait_for(asyncio.to_thread(_read_all, r), timeout)
    except TimeoutError:
        os.kill(pid, signal.SIGKILL)  # a stuck child must not stall cycles forever
        raise
    finally:
        _, status = await asyncio.to_thread(os.waitpid, pid, 0)
        os.close(r)
    if status != 0 or not data:
        raise RuntimeError(f"engine child failed (wait status {status})")
    decision, hints, rows = pickle.loads(data)
    return decision, hints, rows


def binding_for_need(n: Need) -> Binding:
    return Binding(
        cluster_id=n.cluster_id,
        need_fingerprint=n.fingerprint,
        priority=n.priority,
        interruption_penalty_dollars=n.profile.interruption_penalty_dollars,
        reclamation_penalty_dollars=n.profile.reclamation_penalty_dollars,
        requirements=tuple(requirement_to_proto(r) for r in n.requirements),
        group=n.group,
    )
