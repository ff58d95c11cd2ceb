"""The engine worker (shard/engineproc.py): its delta-fed mirror decides exactly what `decide()` decides
on the shard's full inputs, through random inventory, demand, in-flight, handoff and actuation
changes; a sequence gap forces a full resync; and a worker killed (or stuck) mid-run is replaced
without changing a single decision."""

from __future__ import annotations

import asyncio
import os
import pickle
import random
import signal
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest

from bigfleet.decision import Decision, EngineConfig, decide
from bigfleet.observability import new_registry
from bigfleet.shard import availability
from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
from bigfleet.shard.engineproc import (
    RESYNC,
    SUPPRESSED_SAMPLE,
    EngineWorker,
    MirrorFeed,
    WorkerCore,
    verdict_row,
)
from bigfleet.shard.engines import CycleInputs, WorkerEngine
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.store import LocalDemandStore
from bigfleet.shard.view import MachineView
from bigfleet.testing import free_port
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2
from bigfleet.wire.machine import META_NEED_FINGERPRINT
from bigfleet.wire.needs import rollup_from_proto

from .opsim import need

S = provider_pb2.MachineState
NOW = 1_900_000_000 * 1_000_000_000
ZONES = ("z-a", "z-b", "z-c")
TYPES = (("m5.2xlarge", "8", 0.4), ("m5.xlarge", "4", 0.2), ("c5.large", "2", 0.09))
CLUSTERS = tuple(f"c{i}" for i in range(6))
STATES = (S.MACHINE_STATE_SPECULATIVE, S.MACHINE_STATE_IDLE, S.MACHINE_STATE_CREATING, S.MACHINE_STATE_CONFIGURING,
          S.MACHINE_STATE_CONFIGURED, S.MACHINE_STATE_DRAINING, S.MACHINE_STATE_DELETING, S.MACHINE_STATE_FAILED)


def pb_machine(rng: random.Random, mid: str) -> tuple[provider_pb2.Machine, str]:
    """A random valid provider record; returns it and the cluster a CREATING one is reserved for."""
    state = rng.choice(STATES)
    itype, cpu, price = rng.choice(TYPES)
    zone = rng.choice(ZONES)
    pb = provider_pb2.Machine(id=mid, state=state, instance_type=itype, zone=zone,
                              price_per_hour=price * rng.choice((1.0, 0.3)),
                              labels={"topology.kubernetes.io/zone": zone})
    pb.resources.resources.update({"cpu": cpu, "memory": "16Gi"})
    if state != S.MACHINE_STATE_SPECULATIVE:
        pb.host.provider, pb.host.ref = "fake", f"host-{mid}"
    if state in (S.MACHINE_STATE_CONFIGURING, S.MACHINE_STATE_CONFIGURED, S.MACHINE_STATE_DRAINING):
        pb.cluster = rng.choice(CLUSTERS)
        pb.shard_metadata[META_NEED_FINGERPRINT] = "fp"
    if state == S.MACHINE_STATE_FAILED:
        pb.last_error = "boom"
    reserved = rng.choice(CLUSTERS) if state == S.MACHINE_STATE_CREATING and rng.random() < 0.7 else ""
    return pb, reserved


def random_rollup(rng: random.Random, cluster: str) -> list[Any]:
    rows = []
    for _ in range(rng.randint(0, 4)):
        rows.append(need(rng.choice(("1", "2", "4")), priority=rng.choice((10, 100, 1000)),
                         zone=rng.choice((None, *ZONES)), count=rng.randint(1, 6),
                         interruption_bucket=rng.choice((0, 3, 8))))
    return rows


class World:
    """The shard-side inputs (a real MachineView and demand store), changed at random."""

    def __init__(self, seed: int, machines: int = 80) -> None:
        self.rng = random.Random(seed)
        self.view = MachineView(wall_ns=lambda: NOW)
        self.store = LocalDemandStore()
        self.now = NOW
        self.next_id = 0
        self.frozen_clusters: set[str] = set()
        self.frozen_machines: set[str] = set()
        self.config = EngineConfig(reclaim_cap_fraction=0.5, spot_hold_seconds=30, on_demand_hold_seconds=60)
        for _ in range(machines):
            self.add_machine()
        for c in CLUSTERS:
            self.rollup(c)

    def add_machine(self) -> None:
        mid = f"m{self.next_id:04d}"
        self.next_id += 1
        self.put(mid)

    def put(self, mid: str) -> None:
        pb, reserved = pb_machine(self.rng, mid)
        if reserved:
            self.view.reserved_for[mid] = reserved
        else:
            self.view.reserved_for.pop(mid, None)
        self.view.failed_local.discard(mid)
        assert self.view.set(pb)

    def rollup(self, cluster: str) -> None:
        pb = capacity_pb2.ClusterCapacityNeeds(cluster_id=cluster, needs=random_rollup(self.rng, cluster))
        _, needs = rollup_from_proto(pb, self.now)
        self.store.mark_first_rollup(cluster)
        self.store.apply_rollup(cluster, needs, self.now)

    def step(self) -> None:
        rng = self.rng
        self.now += rng.randint(1, 40) * 1_000_000_000
        ids = self.view.ids()
        for _ in range(rng.randint(0, 6)):
            op = rng.random()
            if op < 0.25 or not ids:
                self.add_machine()
            elif op < 0.55:
                self.put(rng.choice(ids))
            elif op < 0.65:
                self.view.forget(rng.choice(ids))
            elif op < 0.75:
                mid = rng.choice(ids)
                if mid in self.view.inflight:
                    del self.view.inflight[mid]
                else:
                    self.view.inflight[mid] = "Configure"
            else:
                self.rollup(rng.choice(CLUSTERS))
        r = rng.random()
        if r < 0.08:
            self.frozen_clusters = {rng.choice(CLUSTERS)}
            self.frozen_machines = set(rng.sample(self.view.ids(), min(3, len(self.view))))
        elif r < 0.2:
            self.frozen_clusters, self.frozen_machines = set(), set()
        if rng.random() < 0.1:
            self.config = replace(self.config, dry_run=not self.config.dry_run)

    def reference(self) -> tuple[Decision, dict[Any, availability.Availability], tuple[Any, ...]]:
        """`decide()` and `availability.compute` on the full inputs, filtered as the daemon does."""
        fc, fm = self.frozen_clusters, self.frozen_machines
        snap = tuple(n for n in self.store.table.snapshot() if n.cluster_id not in fc)
        ms = [m for m in self.view.machines() if m.id not in fm and m.cluster not in fc]
        d = decide(snap, ms, self.now, self.store.engine_state(), self.config)
        return d, availability.compute(snap, ms, frozenset(self.view.inflight)), snap

    def request(self, feed: MirrorFeed) -> Any:
        return feed.build(self.view, self.store.table, self.view.inflight, self.now, self.store.engine_state(),
                          self.config, self.frozen_clusters, self.frozen_machines)


def assert_same(got: Decision, rows: dict[Any, Any], hints: dict[Any, Any], world: World,
                suppressed_counts: dict[str, int] | None = None) -> Decision:
    want, want_hints, snap = world.reference()
    assert got.actions == want.actions
    assert got.shortfalls == want.shortfalls
    assert got.state == want.state
    assert got.mode == want.mode
    assert got.suppressed == want.suppressed[:SUPPRESSED_SAMPLE]
    assert got.deferred == want.deferred[:SUPPRESSED_SAMPLE]
    # (how the incremental engine got there differs: cache hits, classes kept in its index)
    same = {"clusters_recomputed": 0, "clusters_reused": 0, "machine_classes": 0}
    assert replace(got.stats, **same) == replace(want.stats, **same)
    assert rows == {(v.cluster_id, v.fingerprint): verdict_row(v, want.state.cycle) for v in want.verdicts}
    for n in snap:
        assert hints[n.requirements] == want_hints[n.requirements]
    if suppressed_counts is not None:
        want_counts: dict[str, int] = {}
        for a in want.suppressed:
            want_counts[type(a).__name__] = want_counts.get(type(a).__name__, 0) + 1
        assert suppressed_counts == want_counts
    return want


def assert_view_counters(view: MachineView) -> None:
    """The counts the view keeps on write equal a walk over its records."""
    pbs = list(view.all())
    assert view.counts() == +Counter(int(pb.state) for pb in pbs)
    assert +view.type_counts == +Counter(pb.instance_type for pb in pbs if pb.instance_type)
    assert +view.zone_counts == +Counter(pb.zone for pb in pbs if pb.zone)
    assert set(view.creating) == {pb.id for pb in pbs if pb.state == S.MACHINE_STATE_CREATING}


def roundtrip(core: WorkerCore, req: Any) -> Any:
    """Through pickle both ways, as over the pipe."""
    return pickle.loads(pickle.dumps(core.handle(pickle.loads(pickle.dumps(req, 5))), 5))


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_delta_fed_worker_decides_like_decide_on_full_inputs(seed: int) -> None:
    world = World(seed)
    feed, core = MirrorFeed(), WorkerCore()
    full = delta = 0
    actions = 0
    for _ in range(40):
        req = world.request(feed)
        full += req.base == RESYNC
        delta += req.base != RESYNC
        assert req.base == RESYNC or len(req.upserts) + len(req.removals) <= 12  # only what changed
        reply = roundtrip(core, req)
        assert reply.status == "ok", reply.error
        got = feed.accept(req, reply)
        assert_same(got, feed.rows, reply.hints, world, reply.suppressed_counts)
        actions += len(got.actions) + len(got.suppressed)
        world.store.save_engine_state(got.state)
        world.step()
        assert_view_counters(world.view)
    assert full == 1 and delta == 39
    assert actions > 0  # the sequence exercised the engine, not only empty cycles


def test_sequence_gap_or_lost_state_forces_a_full_resync() -> None:
    world = World(7)
    feed, core = MirrorFeed(), WorkerCore()
    for _ in range(3):
        req = world.request(feed)
        reply = roundtrip(core, req)
        world.store.save_engine_state(feed.accept(req, reply).state)
        world.step()
    # A request built on a version the worker never acknowledged (a reply lost on the way back).
    req = world.request(feed)
    bad = replace(req, base=req.base + 5)
    reply = roundtrip(core, bad)
    assert reply.status == "resync" and "builds on" in reply.error
    feed.reset()  # what the daemon does on "resync"
    req = world.request(feed)
    assert req.base == RESYNC and len(req.upserts) == len(world.view)
    reply = roundtrip(core, req)
    assert reply.status == "ok"
    assert_same(feed.accept(req, reply), feed.rows, reply.hints, world)
    # A mirror that drifted (the shard lost track of a change) is caught by the counts cross-check.
    world.step()
    req = world.request(feed)
    core.inventory.drop(next(iter(core.inventory.machines())).id)
    reply = roundtrip(core, req)
    assert reply.status == "resync" and "out of step" in reply.error
    # A fresh worker (restarted) knows nothing: it must not decide on an empty mirror.
    feed.reset()
    req = world.request(feed)
    fresh = WorkerCore()
    assert roundtrip(fresh, replace(req, base=3)).status == "resync"
    reply = roundtrip(fresh, req)
    assert reply.status == "ok"
    assert_same(feed.accept(req, reply), feed.rows, reply.hints, world)


def test_an_engine_failure_keeps_the_mirror_in_step() -> None:
    world = World(5)
    feed, core = MirrorFeed(), WorkerCore()
    req = world.request(feed)
    world.store.save_engine_state(feed.accept(req, roundtrip(core, req)).state)
    world.step()
    real = core.engine

    class Boom:
        def decide(self, *a: Any, **kw: Any) -> Any:
            raise ValueError("engine bug")

    core.engine = Boom()  # type: ignore[assignment]
    req = world.request(feed)
    reply = roundtrip(core, req)
    assert reply.status == "failed" and "engine bug" in reply.error
    feed.failed(req)
    assert core.engine is not real  # (a fresh one)
    for _ in range(3):  # later cycles are deltas again, and right
        world.step()
        req = world.request(feed)
        assert req.base != RESYNC
        reply = roundtrip(core, req)
        assert reply.status == "ok", reply.error
        got = feed.accept(req, reply)
        assert_same(got, feed.rows, reply.hints, world)
        world.store.save_engine_state(got.state)


# -- the real worker process, driven through the daemon -------------------------------------------


@pytest.fixture
async def daemon() -> AsyncIterator[ShardDaemon]:
    cfg = DaemonConfig(shard_id="s1", provider=f"127.0.0.1:{free_port()}", epoch=1, engine_timeout=10.0)
    d = ShardDaemon(cfg, ShardMetrics(new_registry()))
    yield d


def load(d: ShardDaemon, world: World) -> None:
    """Point the daemon at the world's inputs (the daemon's own view and store objects)."""
    d.view, d.store = world.view, world.store
    d.frozen_clusters, d.frozen_machines = world.frozen_clusters, world.frozen_machines


async def compute(d: ShardDaemon, world: World) -> tuple[Any, Any, Any, Any]:
    """One cycle through the daemon's engine backend on the world's inputs."""
    out = await d.engine.decide(CycleInputs(world.view, world.store.table, world.store.engine_state(), world.config,
                                            world.now, world.frozen_clusters, world.frozen_machines,
                                            lambda c: True))
    return out.decision, out.hints, out.rows, out.suppressed_counts


def worker_of(d: ShardDaemon) -> EngineWorker:
    assert isinstance(d.engine, WorkerEngine)
    return d.engine.worker


def counter(d: ShardDaemon, name: str) -> float:
    return float(getattr(d.metrics, name)._value.get())


async def test_worker_process_killed_or_stuck_is_replaced_and_decisions_stay_equal(daemon: ShardDaemon) -> None:
    d = daemon
    w = worker_of(d)
    world = World(11, machines=200)
    pids = []
    try:
        for step in range(14):
            load(d, world)
            if step == 4:  # killed between cycles
                os.kill(w.pid or 0, signal.SIGKILL)
                w.proc.wait()  # type: ignore[union-attr]
            if step == 8:  # stuck: the deadline kills it, the cycle retries on a new worker
                w.timeout = 1.0
                os.kill(w.pid or 0, signal.SIGSTOP)
            decision, hints, rows, counts = await compute(d, world)
            w.timeout = 10.0
            pids.append(w.pid)
            assert_same(decision, rows, hints, world, counts)
            world.store.save_engine_state(decision.state)
            world.step()
            if step == 0:  # before the first reconcile a report carries no summary (no fleet of 0)
                assert not d.build_report().HasField("summary")
                d.reconciled.set()
            summary = d.build_report().summary
            pbs = list(world.view.all())
            assert summary.total_machines == len(pbs)
            assert summary.free_machines == sum(
                1 for pb in pbs if pb.state in (S.MACHINE_STATE_IDLE, S.MACHINE_STATE_SPECULATIVE)
                and pb.id not in world.view.inflight)
            assert dict(summary.per_zone_counts) == dict(Counter(pb.zone for pb in pbs))
        assert len(set(pids)) == 3, pids  # the first worker, then one per failure
        assert counter(d, "engine_worker_restarts") == 2
        assert counter(d, "engine_worker_resyncs") == 3  # the first cycle and one per new worker
        # A worker killed while it computes: the cycle itself retries on a replacement.
        load(d, world)
        proc = w.proc
        assert proc is not None
        os.kill(proc.pid, signal.SIGSTOP)
        w.timeout = 30.0
        task = asyncio.create_task(compute(d, world))
        await asyncio.sleep(0.2)  # (the request is now in the stopped worker's pipe)
        os.kill(proc.pid, signal.SIGKILL)
        decision, hints, rows, counts = await task
        assert w.pid != proc.pid
        assert_same(decision, rows, hints, world, counts)
    finally:
        last = worker_of(d).proc
        await d.stop(drain_timeout=0.1)
    assert last is not None and last.poll() is not None  # stop() ends the worker


def test_rows_of_needs_that_stay_unmet_are_not_shipped_again_and_ages_read_back() -> None:
    from bigfleet.shard.engineproc import row_age

    world = World(11, machines=0)  # no machines: every need stays unmet, its age grows each cycle
    for c in CLUSTERS:
        _, ns = rollup_from_proto(capacity_pb2.ClusterCapacityNeeds(cluster_id=c, needs=[need("2", count=3)]), NOW)
        world.store.mark_first_rollup(c)
        world.store.apply_rollup(c, ns, NOW)
    feed, core = MirrorFeed(), WorkerCore()
    shipped = []
    for _ in range(6):
        req = world.request(feed)
        reply = roundtrip(core, req)
        assert reply.status == "ok", reply.error
        got = feed.accept(req, reply)
        world.store.save_engine_state(got.state)
        shipped.append(len(reply.rows))
        want = decide(tuple(world.store.table.snapshot()), [], NOW, world.store.engine_state(), world.config)
        cycle = got.state.cycle
        unmet = [v for v in want.verdicts if not v.satisfied]
        assert unmet
        # (`want` decided one cycle later on the saved state: its ages are one more)
        for v in unmet:
            row = feed.rows[(v.cluster_id, v.fingerprint)]
            assert row_age(row[8], cycle) + 1 == v.age_at(want.state.cycle)
    assert shipped[0] == len(CLUSTERS) and shipped[2:] == [0, 0, 0, 0]  # ages grow; rows stay the same


def gang(cpu: str, count: int, group: str) -> capacity_pb2.CapacityNeed:
    """A Same-zone gang: with too few machines it stays unmet and parks after a few cycles."""
    pb = need(cpu, count=count)
    pb.requirements.append(capacity_pb2.NodeSelectorRequirement(
        key="topology.kubernetes.io/zone", operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_SAME))
    pb.group = group
    return pb


@pytest.mark.parametrize("seed", [5, 6, 7])
def test_rows_of_reused_unmet_clusters_equal_rows_built_afresh(seed: int) -> None:
    """The worker keeps a reused cluster's rows when its unmet ages moved in step with the cycle:
    every cycle, the rows it holds equal `verdict_row` of a full `decide` -- also for parked gangs
    (whose re-issued verdicts keep a parked age that no longer moves) and for the cycle-skipping
    clusters that changed."""
    world = World(seed, machines=0)  # (no free supply: unmet clusters are cached and reused)
    rng = random.Random(seed)
    config = replace(world.config, park_after_cycles=2, reprobe_every_cycles=0)
    world.config = config

    def rollup(c: str) -> None:
        rows = random_rollup(rng, c) or [need("4", count=9)]
        if c in CLUSTERS[:3]:  # (a gang's cluster is reused only while its domain holds)
            rows.append(gang(rng.choice(("2", "4")), rng.randint(2, 5), f"g-{c}"))
        _, ns = rollup_from_proto(capacity_pb2.ClusterCapacityNeeds(cluster_id=c, needs=rows), world.now)
        world.store.mark_first_rollup(c)
        world.store.apply_rollup(c, ns, world.now)

    for c in CLUSTERS:
        rollup(c)
    feed, core = MirrorFeed(), WorkerCore()
    reused_unmet = parked = 0
    for i in range(30):
        req = world.request(feed)
        reply = roundtrip(core, req)
        assert reply.status == "ok", reply.error
        got = feed.accept(req, reply)
        want = assert_same(got, feed.rows, reply.hints, world)
        reused_unmet += core.engine.last_unmet_reused
        parked += sum(v.parked for v in want.verdicts)
        # now and then the state comes back without its unmet ages (as from an older snapshot):
        # reused clusters' ages restart, so their rows must be rebuilt
        world.store.save_engine_state(got.state if i % 7 != 6 else replace(got.state, unmet_ages={}))
        world.now += 10 * 1_000_000_000
        if i % 3 == 0:
            rollup(rng.choice(CLUSTERS))
    assert reused_unmet and parked  # both paths were exercised
