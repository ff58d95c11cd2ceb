"""Where a cycle's decision is computed: one interface, two backends.

* :class:`WorkerEngine` (production): a long-lived engine process fed only what changed since the
  previous cycle (:mod:`bigfleet.shard.engineproc`), so neither the engine nor its serialisation
  shares the session loop's GIL.
* :class:`InlineEngine` (the simulator and small tests): the same incremental :class:`Engine` on
  the event loop, so a virtual clock sees every cycle complete in zero time.

Both take the same :class:`CycleInputs` and return the same :class:`CycleOutput`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from bigfleet.decision import Engine
from bigfleet.decision.consolidation import after_decide
from bigfleet.decision.types import Decision, EngineConfig, EngineState
from bigfleet.needs import Need, NeedsTable
from bigfleet.observability import get_logger
from bigfleet.shard import availability, engineproc
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.view import MachineView

log = get_logger("bigfleet.shard.engines")

RowKey = tuple[str, str]


@dataclass
class CycleInputs:
    """What one cycle decides on (the live objects; backends copy what they keep)."""

    view: MachineView
    table: NeedsTable
    state: EngineState
    config: EngineConfig
    now_unix_nanos: int
    frozen_clusters: set[str]
    frozen_machines: set[str]
    connected: Callable[[str], bool]  # does the cluster have an open Session (hint targets)


@dataclass
class CycleOutput:
    decision: Decision
    hints: dict[Any, availability.Availability]
    # compact verdict rows keyed by (cluster, fingerprint) (worker) or none (inline: in the decision)
    rows: dict[RowKey, tuple[Any, ...]] = field(default_factory=dict)
    # full counts of suppressed actions when the decision carries only a sample (worker)
    suppressed_counts: dict[str, int] | None = None
    # the needs decided on: a flat sorted snapshot (inline) or per-cluster tuples (worker)
    snapshot: tuple[Need, ...] | None = None
    by_cluster: dict[str, tuple[Need, ...]] | None = None

    def needs_seen(self) -> Iterable[Need]:
        if self.snapshot is not None:
            return self.snapshot
        return (n for ns in (self.by_cluster or {}).values() for n in ns)


class EngineBackend(Protocol):
    #: whether the shard process should settle its heap after cycles (the worker keeps the
    #: engine's objects out of this process, so what survives here is long-lived)
    settles_heap: bool

    def start(self) -> None: ...

    async def decide(self, inputs: CycleInputs) -> CycleOutput: ...

    async def stop(self) -> None: ...


class InlineEngine:
    """The engine on the event loop (one incremental :class:`Engine`, same output as ``decide``)."""

    settles_heap = False

    def __init__(self) -> None:
        self.engine = Engine()

    def start(self) -> None:
        pass

    async def decide(self, inputs: CycleInputs) -> CycleOutput:
        fc, fm = inputs.frozen_clusters, inputs.frozen_machines
        snapshot = tuple(inputs.table.snapshot())
        if fc:  # being handed off: invisible to the engine
            snapshot = tuple(n for n in snapshot if n.cluster_id not in fc)
        inputs.view.take_dirty()  # (only the worker's mirror consumes change tracking)
        machines = list(inputs.view.machines())
        if fc or fm:
            machines = [m for m in machines if m.id not in fm and m.cluster not in fc]
        busy = frozenset(inputs.view.inflight)
        connected = [n for n in snapshot if inputs.connected(n.cluster_id)]
        decision = self.engine.decide(snapshot, machines, inputs.now_unix_nanos, inputs.state, inputs.config)
        decision = after_decide(self.engine, decision, snapshot, inputs.state, inputs.config)  # (consolidation)
        hints = availability.compute(connected, machines, busy)
        return CycleOutput(decision, hints, snapshot=snapshot)

    async def stop(self) -> None:
        pass


class WorkerEngine:
    """The engine in its own process; a dead, stuck or out-of-step worker is replaced (or
    resynced) and the cycle retried once on the new one."""

    settles_heap = True

    def __init__(self, metrics: ShardMetrics, timeout: float = 120.0, nice: int = 10) -> None:
        self.metrics = metrics
        self.worker = engineproc.EngineWorker(timeout, nice=nice)
        self.feed = engineproc.MirrorFeed()

    def start(self) -> None:
        if not self.worker.alive():
            self.worker.start()  # imports while the first reconcile runs

    async def decide(self, inputs: CycleInputs) -> CycleOutput:
        # Per-cluster tuples (O(clusters)), not the table's sorted snapshot (O(needs log needs) on
        # the loop whenever any cluster changed).
        table, fc = inputs.table, inputs.frozen_clusters
        by_cluster = {c: table.cluster(c) for c in table.clusters() if c not in fc}
        worker, feed = self.worker, self.feed
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
            req = feed.build(inputs.view, table, inputs.view.inflight, inputs.now_unix_nanos, inputs.state,
                             inputs.config, fc, inputs.frozen_machines)
            if req.base == engineproc.RESYNC:
                self.metrics.engine_worker_resyncs.inc()
            try:
                reply = await worker.call(req)
            except engineproc.WorkerGone as exc:
                last_error = str(exc)
                log.warning("engine worker failed; replacing it (full resync)", error=last_error,
                            attempt=attempt, pid=worker.pid)
                await worker.discard()
                self.metrics.engine_worker_restarts.inc()
                feed.reset()
                continue
            if reply.status == "ok":
                decision = feed.accept(req, reply)
                self.metrics.phase_duration.labels("engine_worker").observe(reply.compute_seconds)
                return CycleOutput(decision, reply.hints, feed.rows, reply.suppressed_counts, by_cluster=by_cluster)
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

    async def stop(self) -> None:
        await self.worker.stop()


ENGINE_MODES = ("worker", "inline")


def engine_backend(mode: str, metrics: ShardMetrics, timeout: float, nice: int) -> EngineBackend:
    if mode == "worker":
        return WorkerEngine(metrics, timeout, nice)
    if mode == "inline":
        return InlineEngine()
    raise ValueError(f"engine mode must be one of {ENGINE_MODES}, got {mode!r}")
