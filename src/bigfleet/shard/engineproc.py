"""The decision engine in a long-lived worker process, fed deltas.

Why: in one process the engine and the session event loop share the GIL, so a cycle of a few
hundred milliseconds shows up as roll-up Ack latency. The worker (``python -m
bigfleet.shard.engineproc``, a fresh interpreter: a forked copy of a process running gRPC threads
is unsafe) keeps its own mirror of the engine's inputs -- a machine `Inventory` (so the engine's
index follows the O(changes) tail path), the needs per cluster, the in-flight set and the carried
state -- and one `Engine`. Each cycle the shard sends only what changed since the previous one and
gets back the `Decision` (verdicts as a row diff) and the availability hints.

Consistency is by sequence number: every request names the mirror version it builds on; a worker
that is not at that version answers ``resync`` and the shard sends everything again. A worker that
dies or stalls is killed and replaced, and the first request to the new one is a full resync.

Split as usual: `WorkerCore` (the worker's state machine) and `MirrorFeed` (the shard's delta
builder) are pure and driven by tests in one process; `EngineWorker` is the process shell.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import pickle
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import IO, Any

from bigfleet.decision import Engine
from bigfleet.decision.consolidation import after_decide
from bigfleet.decision.types import Decision, EngineConfig, EngineState, Verdict
from bigfleet.machine import Inventory, Machine
from bigfleet.needs import Need, NeedsTable
from bigfleet.needs.quantity import format_quantity
from bigfleet.shard import availability
from bigfleet.shard.runtime import GC_THRESHOLDS, settle_heap

#: ``CycleRequest.base`` of a full resync: drop the mirror, then apply the request.
RESYNC = -1
_INVALID = -2

RowKey = tuple[str, str]
Hints = dict[Any, availability.Availability]


@dataclass
class CycleRequest:
    seq: int
    base: int
    upserts: list[Machine]
    removals: list[str]
    #: clusters whose needs changed since ``base``: their whole new tuple (empty = gone)
    needs: dict[str, tuple[Need, ...]]
    busy_add: list[str]
    busy_remove: list[str]
    now: int
    #: None = the state this worker returned for ``base`` (the shard did not replace it)
    state: EngineState | None
    config: EngineConfig
    frozen_clusters: frozenset[str] = frozenset()
    frozen_machines: frozenset[str] = frozenset()
    #: what the shard holds after this request (a cheap cross-check of the mirror)
    expect_machines: int = -1
    expect_clusters: int = -1


@dataclass
class CycleReply:
    seq: int
    #: "ok"; "failed" (the engine raised; the mirror is in step); "resync" (the mirror is not);
    #: "error" (the request could not be applied; the mirror is no longer trusted)
    status: str
    decision: Decision | None = None  # verdicts stripped: see rows
    hints: Hints = field(default_factory=dict)
    rows: dict[RowKey, tuple[Any, ...]] = field(default_factory=dict)
    rows_removed: list[RowKey] = field(default_factory=list)
    error: str = ""
    compute_seconds: float = 0.0
    #: suppressed (paused / dry-run) actions by kind; the decision keeps only the first few
    suppressed_counts: dict[str, int] = field(default_factory=dict)


#: suppressed and deferred actions shipped back per cycle (a dry run at 100k machines suppresses
#: ~50 000 Creates per cycle: only counts and a sample are worth unpickling on the shard; the
#: dashboard's action log keeps 200)
SUPPRESSED_SAMPLE = 200


def verdict_row(v: Verdict, cycle: int) -> tuple[Any, ...]:
    """A Verdict as plain data (cheap to pickle in bulk); field order is what readsvc reads.

    Ages are stored as the cycle they started at (the verdict's `unmet_since`; ``cycle - age`` for
    the parked age; -1 for no age), so the row of a
    need that stays unmet is the same every cycle and is not shipped again: with ages as such, every
    unmet need's row changed each cycle (a 6.4 MB reply per cycle at 50 000 unmet needs, unpickled
    in ~150 ms with the GIL held). `row_age` turns them back."""
    ms = v.matching_supply
    # Resources as (name, milli) pairs: formatting quantities for every unmet need each cycle was
    # a third of the row diff; the reader formats the few rows it serves (`row_resources`).
    return (v.satisfied, v.claimed_count, v.bootstrap_count, v.provision_count, v.same_domain,
            v.same_satisfiable, v.parked, _since(cycle, v.parked_age_cycles), v.unmet_since,
            int(v.unmet_reason),
            v.deficit.items() if not v.satisfied else (),
            (ms.idle, ms.configured, ms.speculative, ms.capped), v.victims_found,
            v.capacity_freed.items() if v.capacity_freed is not None else (), v.claimed_configured)


def row_resources(pairs: tuple[tuple[str, int], ...]) -> dict[str, str]:
    """A resources field stored by `verdict_row`, as wire quantity strings."""
    return {name: format_quantity(milli) for name, milli in pairs}


def _since(cycle: int, age: int) -> int:
    return cycle - age if age else -1


def row_age(since: int, cycle: int) -> int:
    """An age stored by `verdict_row`, as of ``cycle`` (the cycle of the record holding the row)."""
    return cycle - since if since >= 0 else 0


class _Mirror(Inventory):
    """The worker's copy of the shard's machine view. Writes skip the record invariant: the shard
    shows a machine being created for a cluster with that cluster set (the engine credits it), which
    the core invariant refuses; the shard has validated every record already."""

    __slots__ = ()

    def put(self, m: Machine) -> None:
        self._store(m, self.get(m.id))

    def drop(self, machine_id: str) -> None:
        old = self.get(machine_id)
        if old is not None:
            self._forget(old)


class _NeedsMirror(NeedsTable):
    """Each cluster's tuple installed as the shard sent it (already merged and ordered), so an
    unchanged cluster keeps the same tuple object and the engine's per-cluster cache hits."""

    __slots__ = ()

    def put(self, cluster_id: str, needs: tuple[Need, ...]) -> None:
        if needs:
            self._by_cluster[cluster_id] = needs
        elif cluster_id in self._by_cluster:
            del self._by_cluster[cluster_id]
        self._bump(cluster_id)


class WorkerCore:
    """The worker's state: mirror, engine, carried state and the verdict rows last returned."""

    def __init__(self) -> None:
        self.seq = _INVALID
        self.reset()

    def reset(self) -> None:
        if gc.get_freeze_count():
            gc.unfreeze()  # the old mirror must be collectable
        self.inventory = _Mirror()
        self.needs = _NeedsMirror()
        self.busy: set[str] = set()
        self.state: EngineState | None = None
        self.engine = Engine()
        self._rows: dict[RowKey, tuple[Any, tuple[Any, ...]]] = {}

    def handle(self, req: CycleRequest) -> CycleReply:
        if req.base == RESYNC:
            self.reset()
        elif req.base != self.seq:
            return CycleReply(req.seq, "resync", error=f"mirror at {self.seq}, request builds on {req.base}")
        self.seq = _INVALID  # until this request is fully applied and decided
        inv = self.inventory
        for mid in req.removals:
            inv.drop(mid)
        for m in req.upserts:
            inv.put(m)
        for c, ns in req.needs.items():
            self.needs.put(c, ns)
        self.busy.difference_update(req.busy_remove)
        self.busy.update(req.busy_add)
        if req.state is not None:
            self.state = req.state
        if self.state is None:
            return CycleReply(req.seq, "resync", error="no carried state")
        if (req.expect_machines >= 0 and req.expect_machines != len(inv)) or \
                (req.expect_clusters >= 0 and req.expect_clusters != len(self.needs.clusters())):
            return CycleReply(req.seq, "resync", error=(
                f"mirror out of step: {len(inv)} machines / {len(self.needs.clusters())} clusters, "
                f"shard has {req.expect_machines} / {req.expect_clusters}"))
        t0 = time.perf_counter()
        try:
            decision, hints = self.compute(req)
        except Exception as exc:
            # Every delta is applied, so the mirror is in step; only this decision failed. A fresh
            # engine drops whatever it had half updated, and the next cycle needs no resync.
            self.engine = Engine()
            self.seq = req.seq
            return CycleReply(req.seq, "failed", error=f"{type(exc).__name__}: {exc}")
        elapsed = time.perf_counter() - t0
        self.state = decision.state
        rows, removed = self._row_diff(decision)
        counts: dict[str, int] = {}
        for a in decision.suppressed:
            k = type(a).__name__
            counts[k] = counts.get(k, 0) + 1
        slim = replace(decision, verdicts=(), suppressed=decision.suppressed[:SUPPRESSED_SAMPLE],
                       deferred=decision.deferred[:SUPPRESSED_SAMPLE])
        self.seq = req.seq
        return CycleReply(req.seq, "ok", slim, hints, rows, removed, compute_seconds=elapsed,
                          suppressed_counts=counts)

    def compute(self, req: CycleRequest) -> tuple[Decision, Hints]:
        assert self.state is not None
        fc, fm = req.frozen_clusters, req.frozen_machines
        needs: Any = self.needs
        machines: Any = self.inventory
        if fc or fm:  # being handed off: invisible to the engine (rare; a plain list costs a full diff)
            needs = [n for c in self.needs.clusters() if c not in fc for n in self.needs.cluster(c)]
            machines = [m for m in self.inventory.machines() if m.id not in fm and m.cluster not in fc]
        decision = self.engine.decide(needs, machines, req.now, self.state, req.config)
        decision = after_decide(self.engine, decision, needs, self.state, req.config)  # (consolidation)
        # Hints for every requirement set in demand (the shard sends those of connected clusters),
        # from the free counts the engine's index keeps: O(machine classes), not a fleet walk.
        all_needs: Iterable[Need] = needs if isinstance(needs, list) else \
            (n for c in self.needs.clusters() for n in self.needs.cluster(c))
        hints = availability.compute_from_supply(all_needs, self.engine.free_supply(self.busy))
        return decision, hints

    def _row_diff(self, decision: Decision) -> tuple[dict[RowKey, tuple[Any, ...]], list[RowKey]]:
        """Rows of verdicts that changed since the last reply (the engine reuses verdict objects of
        unchanged clusters, unmet ones included, so identity settles most without building a row)."""
        prev = self._rows
        cycle = decision.state.cycle
        cur: dict[RowKey, tuple[Any, tuple[Any, ...]]] = {}
        changed: dict[RowKey, tuple[Any, ...]] = {}
        for v in decision.verdicts:
            k = (v.cluster_id, v.fingerprint)
            if k in cur:  # (a key repeated in one cycle: the last verdict wins)
                changed.pop(k, None)
            p = prev.get(k)
            if p is not None and p[0] is v:
                cur[k] = (v, p[1])
                continue
            row = verdict_row(v, cycle)
            cur[k] = (v, row)
            if p is None or p[1] != row:
                changed[k] = row
        removed = [k for k in prev if k not in cur]
        self._rows = cur
        return changed, removed


# -- the shard's side -----------------------------------------------------------------------------


class MirrorFeed:
    """Builds each cycle's request from what changed since the worker last acknowledged, and keeps
    the verdict rows the replies describe. Any failure calls `reset` and the next request resends
    everything (the worker's mirror is then rebuilt from scratch)."""

    def __init__(self) -> None:
        self._seq = 0
        self.rows: dict[RowKey, tuple[Any, ...]] = {}
        self.resyncs = 0
        self.reset()

    def reset(self) -> None:
        self.synced = False
        self._acked = RESYNC
        self._table: NeedsTable | None = None
        self._table_gen = -1
        self._sent_gen: dict[str, int] = {}
        self._busy: set[str] = set()
        self._state: EngineState | None = None

    def build(self, view: Any, table: NeedsTable, busy: Iterable[str], now: int, state: EngineState,
              config: EngineConfig, frozen_clusters: Iterable[str] = (), frozen_machines: Iterable[str] = ()
              ) -> CycleRequest:
        """``view`` is a `MachineView` (``machines()``, ``machine(id)``, ``take_dirty()``, ``len``)."""
        self._seq += 1
        full = not self.synced or table is not self._table
        busy_now = set(busy)
        dirty = view.take_dirty()
        upserts: list[Machine] = []
        removals: list[str] = []
        needs: dict[str, tuple[Need, ...]] = {}
        if full:
            self.resyncs += 1
            upserts = list(view.machines())
            for c in table.clusters():
                needs[c] = table.cluster(c)
            self._sent_gen = table.cluster_generations()
            busy_add, busy_remove = list(busy_now), []
        else:
            for mid in dirty:
                m = view.machine(mid)
                if m is None:
                    removals.append(mid)
                else:
                    upserts.append(m)
            if table.generation != self._table_gen:
                sent = self._sent_gen
                for c, g in table.cluster_generations().items():
                    if sent.get(c) != g:
                        needs[c] = table.cluster(c)
                        sent[c] = g
            busy_add = [m for m in busy_now if m not in self._busy]
            busy_remove = [m for m in self._busy if m not in busy_now]
        self._table, self._table_gen, self._busy = table, table.generation, busy_now
        send_state = state if full or state is not self._state else None
        return CycleRequest(
            seq=self._seq, base=RESYNC if full else self._acked, upserts=upserts, removals=removals,
            needs=needs, busy_add=busy_add, busy_remove=busy_remove, now=now, state=send_state,
            config=config, frozen_clusters=frozenset(frozen_clusters), frozen_machines=frozenset(frozen_machines),
            expect_machines=len(view), expect_clusters=len(table.clusters()),
        )

    def failed(self, req: CycleRequest) -> None:
        """The worker applied ``req`` but its engine raised: the mirror is in step, no decision."""
        if req.base == RESYNC:
            self.rows = {}  # the worker starts its row diff from nothing again
        self._acked = req.seq
        self.synced = True

    def accept(self, req: CycleRequest, reply: CycleReply) -> Decision:
        """Apply an ``ok`` reply; returns its decision (verdicts are in `rows`)."""
        assert reply.status == "ok" and reply.decision is not None and reply.seq == req.seq
        if req.base == RESYNC:
            self.rows = dict(reply.rows)
        elif reply.rows or reply.rows_removed:
            rows = dict(self.rows)  # a new dict: readers of the previous cycle's record keep theirs
            rows.update(reply.rows)
            for k in reply.rows_removed:
                rows.pop(k, None)
            self.rows = rows
        self._acked = req.seq
        self._state = reply.decision.state
        self.synced = True
        return reply.decision


# -- framing ----------------------------------------------------------------------------------------

_HEADER = struct.Struct(">Q")


class WorkerGone(RuntimeError):
    """The worker process exited, closed its pipe or was killed."""


def write_frame(out: IO[bytes], payload: bytes) -> None:
    out.write(_HEADER.pack(len(payload)))
    out.write(payload)
    out.flush()


def read_frame(inp: IO[bytes]) -> bytes | None:
    head = inp.read(_HEADER.size)
    if not head:
        return None
    if len(head) != _HEADER.size:
        raise WorkerGone("truncated frame header")
    (n,) = _HEADER.unpack(head)
    data = inp.read(n)
    if len(data) != n:
        raise WorkerGone(f"truncated frame ({len(data)} of {n} bytes)")
    return data


def worker_main(argv: list[str] | None = None) -> int:
    """The worker process: requests on stdin, replies on stdout, until stdin closes.
    ``argv``: an optional niceness increment (the shard's session loop should win the CPU)."""
    args = sys.argv[1:] if argv is None else argv
    if args and int(args[0]) > 0:
        os.nice(int(args[0]))
    # Its lifetime is the pipe's: a Ctrl-C meant for the shard must not kill it mid-cycle.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed by accident goes to the log, not into the reply stream
    inp = os.fdopen(0, "rb")
    core = WorkerCore()
    # The shard's collector policy: each cycle's survivors (the mirror, the needs that replaced
    # older ones, the verdict rows) are frozen, so young collections stay small. With the default
    # thresholds the collector walked them again and again: a quarter of a cycle's CPU at 2 500
    # unmet needs and no machines (a mirror without machines was never frozen before).
    gc.set_threshold(*GC_THRESHOLDS)
    last_full = time.monotonic()
    while True:
        try:
            data = read_frame(inp)
        except WorkerGone:
            return 1
        if data is None:
            return 0
        req: CycleRequest = pickle.loads(data)
        try:
            reply = core.handle(req)
        except Exception as exc:  # reported to the shard; the mirror is no longer trusted
            core.seq = _INVALID
            reply = CycleReply(req.seq, "error", error=f"{type(exc).__name__}: {exc}")
        del req, data
        write_frame(out, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))
        if core.seq != _INVALID and reply.status == "ok":
            last_full = settle_heap(time.monotonic(), last_full)


class EngineWorker:
    """The shard's handle on one worker process (start, round trip with a deadline, stop)."""

    def __init__(self, timeout: float = 120.0, argv: list[str] | None = None, nice: int = 0) -> None:
        self.timeout = timeout
        self.argv = argv or [sys.executable, "-m", "bigfleet.shard.engineproc", str(nice)]
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0
        #: extra time for a new process's first answer (interpreter start, imports, full resync)
        self.startup_grace = 30.0
        self._answered = False

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True)
        self.starts += 1
        self._answered = False

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()

    async def discard(self) -> None:
        """Kill the worker (if still running) and reap it; the next `start` makes a new one."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.to_thread(proc.wait)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()

    async def call(self, req: CycleRequest) -> CycleReply:
        """One round trip; pickling and unpickling run on a thread, never on the loop. On a
        timeout the worker is killed (which also unblocks the thread)."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            raise WorkerGone("engine worker not running")
        fut = asyncio.ensure_future(asyncio.to_thread(_roundtrip, proc, req))
        timeout = self.timeout if self._answered else self.timeout + self.startup_grace
        try:
            done, _ = await asyncio.wait({fut}, timeout=timeout)
        except asyncio.CancelledError:
            self.kill()
            with contextlib.suppress(BaseException):
                await fut
            raise
        if not done:
            self.kill()
            with contextlib.suppress(BaseException):
                await fut
            raise WorkerGone(f"engine worker did not answer within {timeout:g}s; killed")
        reply = fut.result()
        self._answered = True
        return reply

    async def stop(self, grace: float = 3.0) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            await asyncio.to_thread(proc.wait, grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)
        if proc.stdout is not None:
            proc.stdout.close()


def _roundtrip(proc: subprocess.Popen[bytes], req: CycleRequest) -> CycleReply:
    assert proc.stdin is not None and proc.stdout is not None
    payload = pickle.dumps(req, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        write_frame(proc.stdin, payload)
        data = read_frame(proc.stdout)
    except (OSError, ValueError) as exc:  # broken pipe, or a pipe closed by kill()/stop()
        raise WorkerGone(f"engine worker pipe: {exc}") from exc
    if data is None:
        raise WorkerGone(f"engine worker exited (code {proc.poll()})")
    try:
        reply: CycleReply = pickle.loads(data)
    except Exception as exc:  # a garbled stream: the worker cannot be trusted any more
        raise WorkerGone(f"engine worker reply unreadable: {type(exc).__name__}: {exc}") from exc
    if reply.seq != req.seq:
        raise WorkerGone(f"engine worker answered {reply.seq} to {req.seq}")
    return reply


if __name__ == "__main__":
    # Run the module's real copy (not this __main__ one), so replies pickle as bigfleet.shard.engineproc.*.
    from bigfleet.shard.engineproc import worker_main as _worker_main

    sys.exit(_worker_main())
