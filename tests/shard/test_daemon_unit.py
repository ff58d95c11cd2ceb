"""The daemon's boundary logic in-process (no provider calls succeed here): roll-up ingest with the
guard and all-or-nothing validation, the machine view's routing and stickiness, and the rails the
shard enforces on the engine's actions (first-roll-up gate, in-flight dedupe, applicability)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from bigfleet.decision import Decision, Drain, EngineState, PhaseStats
from bigfleet.observability import new_registry
from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
from bigfleet.shard.executor import ExecutorConfig
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.view import MachineView
from bigfleet.testing import free_port
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2, shard_pb2
from bigfleet.wire.machine import META_NEED_FINGERPRINT

from .opsim import need
from .spy import until

S = provider_pb2.MachineState


def machine(mid: str, state: int, cluster: str = "", price: float = 0.1) -> provider_pb2.Machine:
    pb = provider_pb2.Machine(id=mid, state=state, instance_type="m5.2xlarge", zone="us-east-1a",  # type: ignore[arg-type]
                              price_per_hour=price, cluster=cluster,
                              labels={"topology.kubernetes.io/zone": "us-east-1a"})
    pb.resources.resources.update({"cpu": "8", "memory": "32Gi"})
    if state != S.MACHINE_STATE_SPECULATIVE:
        pb.host.provider, pb.host.ref = "fake", f"host-{mid}"
    if cluster:
        pb.shard_metadata[META_NEED_FINGERPRINT] = "fp"
    return pb


@pytest.fixture
async def daemon() -> AsyncIterator[ShardDaemon]:
    cfg = DaemonConfig(shard_id="s1", provider=f"127.0.0.1:{free_port()}", epoch=3,
                       executor=ExecutorConfig(execute_timeout=0.5))
    d = ShardDaemon(cfg, ShardMetrics(new_registry()))
    d.provider.lifecycle_timeout = 0.3
    try:
        yield d
    finally:
        await d.stop(drain_timeout=0.2)


def rollup(cluster: str, needs: list[capacity_pb2.CapacityNeed]) -> capacity_pb2.ClusterCapacityNeeds:
    return capacity_pb2.ClusterCapacityNeeds(cluster_id=cluster, needs=needs)


async def test_rollup_validation_is_all_or_nothing(daemon: ShardDaemon) -> None:
    ok = await daemon.handle_rollup("c1", rollup("c1", [need("1"), need("2", priority=7)]))
    assert ok.accepted
    before = daemon.store.table.cluster("c1")
    bad = need("1")
    bad.min_unit["cpu"] = "-3"
    out = await daemon.handle_rollup("c1", rollup("c1", [need("5"), bad]))
    assert not out.accepted and "min_unit" in out.error
    assert daemon.store.table.cluster("c1") == before
    assert daemon.metrics.rollups_rejected.labels("c1")._value.get() == 1
    # An empty cluster_id in the roll-up means the session's cluster.
    assert (await daemon.handle_rollup("c2", rollup("", [need("1")]))).accepted
    assert len(daemon.store.table.cluster("c2")) == 1


async def test_identical_rollup_is_acked_without_reapplying(daemon: ShardDaemon) -> None:
    r = rollup("c1", [need("1"), need("2", priority=7)])
    assert (await daemon.handle_rollup("c1", r)).accepted
    gen = daemon.store.table.generation
    r.timestamp_unix_nanos = 12345  # only the timestamp differs
    assert (await daemon.handle_rollup("c1", r)).accepted
    assert daemon.store.table.generation == gen
    # a real change is applied
    assert (await daemon.handle_rollup("c1", rollup("c1", [need("3")]))).accepted
    assert daemon.store.table.generation == gen + 1
    # and a rejected roll-up never poisons the shortcut
    bad = rollup("c1", [need("1")])
    bad.needs[0].priority = 5
    bad.needs[0].interruption_penalty_bucket = 99  # type: ignore[assignment]
    assert not (await daemon.handle_rollup("c1", bad)).accepted
    assert not (await daemon.handle_rollup("c1", bad)).accepted


async def test_empty_rollup_guard_holds_a_collapse(daemon: ShardDaemon) -> None:
    from bigfleet.shard.guard import GuardConfig

    daemon.intake.guard.config = GuardConfig(min_hold_seconds=0)  # (the time rule: tests/shard/test_units.py)
    many = [need("1", priority=p) for p in range(12)]
    assert (await daemon.handle_rollup("c1", rollup("c1", many))).accepted
    for _ in range(2):
        held = await daemon.handle_rollup("c1", rollup("c1", []))
        assert held.quarantined and not held.accepted
        assert len(daemon.store.table.cluster("c1")) == 12
    assert (await daemon.handle_rollup("c1", rollup("c1", []))).accepted
    assert daemon.store.table.cluster("c1") == ()
    assert daemon.store.has_rolled_up("c1")


async def test_reclaim_waits_for_first_rollup_and_dedupes(daemon: ShardDaemon) -> None:
    daemon.view.set(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1"))
    d = Decision(actions=(Drain("m1", "c1", 600, 0, "reclaim"),), shortfalls=(), verdicts=(), stats=PhaseStats(),
                 state=EngineState())
    await daemon.dispatcher.dispatch(d)
    assert "m1" not in daemon.view.inflight  # gated: c1 has not spoken since start
    assert daemon.view.get("m1").state == S.MACHINE_STATE_CONFIGURED  # type: ignore[union-attr]
    daemon.store.mark_first_rollup("c1")
    await daemon.dispatcher.dispatch(d)
    assert daemon.view.inflight.get("m1") == "Reclaim"
    assert daemon.view.get("m1").state == S.MACHINE_STATE_DRAINING  # type: ignore[union-attr]
    await daemon.dispatcher.dispatch(d)  # same machine again: deduped, not a second drain
    assert daemon.metrics.actions_deduped._value.get() == 1
    # A preempt is never gated (the preemptor's demand is live).
    daemon.view.set(machine("m2", S.MACHINE_STATE_CONFIGURED, "c9"))
    await daemon.dispatcher.dispatch(Decision(actions=(Drain("m2", "c9", 10, 1_000_000, "preempt"),), shortfalls=(), verdicts=(),
                             stats=PhaseStats(), state=EngineState()))
    assert daemon.view.inflight.get("m2") == "Preempt"


async def test_one_create_is_held_back_per_orphan_create(daemon: ShardDaemon) -> None:
    """After a restart, a machine still CREATING that no flow here drives (its reservation died with
    the old process) will turn up Idle and be handed out: one Create per such orphan is held back,
    the rest of the cycle's Creates go ahead (holding back all of them stalled every acquisition
    for up to two execute timeouts after any restart)."""
    from bigfleet.decision import Create

    submitted: list[str] = []
    daemon.executor.submit_create = lambda mid, binding: submitted.append(mid)  # type: ignore[method-assign]
    for i in range(2):
        daemon.view.set(machine(f"orphan{i}", S.MACHINE_STATE_CREATING))
    for i in range(5):
        daemon.view.set(machine(f"spec{i}", S.MACHINE_STATE_SPECULATIVE))
    creates = tuple(Create(f"spec{i}", "c1", "fp", 100) for i in range(5))
    d = Decision(actions=creates, shortfalls=(), verdicts=(), stats=PhaseStats(), state=EngineState())
    await daemon.dispatcher.dispatch(d)
    assert submitted == ["spec2", "spec3", "spec4"]
    assert daemon.metrics.action_outcomes.labels("Provision", "deferred_orphan_create")._value.get() == 2
    # an orphan the provider has finished creating no longer holds anything back
    for i in range(2):
        daemon.view.set(machine(f"orphan{i}", S.MACHINE_STATE_IDLE))
    submitted.clear()
    await daemon.dispatcher.dispatch(d)
    assert submitted == [f"spec{i}" for i in range(5)]


async def test_a_large_decision_is_dispatched_in_chunks_with_the_loop_running_between(daemon: ShardDaemon) -> None:
    """Thousands of actions must not hold the session loop for the whole dispatch; every action is
    still claimed exactly once, and a cluster frozen by a handoff mid-dispatch gets no more."""
    from bigfleet.decision import Create

    n = 5 * daemon.dispatcher.CHUNK
    submitted: list[str] = []
    daemon.executor.submit_create = lambda mid, binding: submitted.append(mid)  # type: ignore[method-assign]
    for i in range(n):
        daemon.view.set(machine(f"spec{i:04d}", S.MACHINE_STATE_SPECULATIVE))
    creates = tuple(Create(f"spec{i:04d}", "c1" if i < n // 2 else "c2", "fp", 100) for i in range(n))
    d = Decision(actions=creates, shortfalls=(), verdicts=(), stats=PhaseStats(), state=EngineState())
    seen_between: list[int] = []

    async def other_session_work() -> None:
        while len(submitted) < n:
            seen_between.append(len(submitted))
            if len(submitted) >= n // 2:
                daemon.frozen_clusters.add("c2")  # a handoff of c2 begins mid-dispatch
            await asyncio.sleep(0)

    other = asyncio.create_task(other_session_work())
    await daemon.dispatcher.dispatch(d)
    other.cancel()
    assert any(0 < k < n // 2 for k in seen_between), seen_between  # the loop ran during the dispatch
    k = len(submitted)  # in order, each once, and nothing of c2 after the freeze was seen
    assert submitted == [f"spec{i:04d}" for i in range(k)]
    assert n // 2 <= k <= n // 2 + daemon.dispatcher.CHUNK
    assert daemon.metrics.action_outcomes.labels("Create", "frozen_handoff")._value.get() == n - k


async def test_failed_transition_ends_failed_with_error(daemon: ShardDaemon) -> None:
    daemon.view.set(machine("m1", S.MACHINE_STATE_IDLE))
    assert daemon.executor.submit_delete("m1")
    await daemon.executor.drain_all(10)
    pb = daemon.view.get("m1")
    assert pb is not None and pb.state == S.MACHINE_STATE_FAILED
    assert pb.last_error.startswith("Delete:")
    assert "m1" not in daemon.view.inflight
    # FAILED is sticky: the provider's (older) record does not resurrect it.
    daemon.view.observe(machine("m1", S.MACHINE_STATE_IDLE))
    assert daemon.view.get("m1").state == S.MACHINE_STATE_FAILED  # type: ignore[union-attr]
    # Actions for a FAILED machine are not applicable.
    assert not daemon.executor.submit_delete("m1")


def test_view_routes_updates_and_rejects_bad_records() -> None:
    sent: list[tuple[str, shard_pb2.ShardMessage]] = []
    rejected: list[str] = []
    v = MachineView(on_node_update=lambda c, m: sent.append((c, m)), on_reject=rejected.append)
    assert v.set(machine("m1", S.MACHINE_STATE_IDLE))
    assert sent == []  # unbound: nobody to tell
    assert v.set(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1"))
    assert v.set(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1"))  # unchanged: no duplicate update
    assert v.set(machine("m1", S.MACHINE_STATE_IDLE))  # drained: goes to the cluster it left
    assert [(c, m.node_state_update.state) for c, m in sent] == [
        ("c1", S.MACHINE_STATE_CONFIGURED), ("c1", S.MACHINE_STATE_IDLE)]
    u = sent[0][1].node_state_update
    assert u.supersedes_key == "node:m1" and u.node_name == "m1" and u.provider_id == "host-m1"
    assert u.labels["node.kubernetes.io/instance-type"] == "m5.2xlarge"
    # a record with a NaN price is rejected, the last good one kept
    assert not v.set(machine("m1", S.MACHINE_STATE_IDLE, price=float("nan")))
    assert rejected == ["price"]
    assert v.get("m1").price_per_hour == 0.1  # type: ignore[union-attr]
    # a machine being created for a cluster is routed there before it carries the cluster
    v.reserved_for["m2"] = "c2"
    assert v.set(machine("m2", S.MACHINE_STATE_CREATING))
    assert sent[-1][0] == "c2"
    m2 = v.machine("m2")
    assert m2 is not None and m2.cluster == "c2"  # the engine sees the reservation
    assert [p.id for p in v.bound_to("c2")] == ["m2"]


def test_view_keeps_records_serialized_and_hands_out_copies() -> None:
    v = MachineView()
    for i in range(6):
        state = (S.MACHINE_STATE_IDLE, S.MACHINE_STATE_CONFIGURED, S.MACHINE_STATE_DRAINING)[i % 3]
        assert v.set(machine(f"m{i}", state, "" if state == S.MACHINE_STATE_IDLE else f"c{i % 2}"))
    assert all(isinstance(raw, bytes) for raw in v._pb.values())  # not parsed messages (~8x the memory)
    got = v.get("m1")
    assert got is not None and got == machine("m1", S.MACHINE_STATE_CONFIGURED, "c1")
    got.state = S.MACHINE_STATE_FAILED  # a copy: the view is not changed behind its back
    assert v.get("m1").state == S.MACHINE_STATE_CONFIGURED  # type: ignore[union-attr]
    assert v.shows(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1")) and not v.shows(got)
    # census from counts and the cluster index equals a walk over every record
    for want in ("", "c0", "c1", "nope"):
        per_state: dict[int, int] = {}
        bound: dict[str, int] = {}
        pbs = [pb for pb in v.all() if not want or pb.cluster == want]
        for pb in pbs:
            per_state[pb.state] = per_state.get(pb.state, 0) + 1
            if pb.cluster and pb.state in (S.MACHINE_STATE_CONFIGURING, S.MACHINE_STATE_CONFIGURED,
                                           S.MACHINE_STATE_DRAINING):
                bound[pb.cluster] = bound.get(pb.cluster, 0) + 1
        assert v.census(want) == (per_state, bound, len(pbs), 0), want
    # the provider's newer record of a machine the executor owns is kept aside, and dropped once shown
    v.inflight["m0"] = "Provision"
    newer = machine("m0", S.MACHINE_STATE_CONFIGURING, "c9")
    assert v.observe(newer)
    assert v.provider_latest["m0"] == newer and v.get("m0").state == S.MACHINE_STATE_IDLE  # type: ignore[union-attr]
    del v.inflight["m0"]
    assert v.observe(newer)
    assert "m0" not in v.provider_latest and v.get("m0") == newer
    assert v.census("c9")[1:] == ({"c9": 1}, 1, 0)


async def test_capacity_hints_are_sent_at_the_configured_rate() -> None:
    from bigfleet.shard.availability import Availability
    from bigfleet.shard.sessions import OperatorSession
    from bigfleet.wire.needs import rollup_from_proto

    cfg = DaemonConfig(shard_id="s1", provider=f"127.0.0.1:{free_port()}", epoch=1, available_capacity_rate=400.0)
    d = ShardDaemon(cfg, ShardMetrics(new_registry()))
    sessions = []
    needs = []
    for c in range(20):
        sess = OperatorSession(f"c{c}", None, 4096)  # type: ignore[arg-type]
        d.sessions.install(sess)
        sessions.append(sess)
        _, ns = rollup_from_proto(rollup(f"c{c}", [need(zone=f"z{k}") for k in range(5)]), 0)
        needs.extend(ns)
    hint = Availability(3, 1, 0.1, {"cpu": "8"})
    # Each send records how many hints were still queued: a tick takes its batch off the queue
    # first, so the sends of one tick share that number and a new number means a new tick.
    queued_at_send: list[int] = []
    for sess in sessions:
        real = sess.send
        sess.send = lambda msg, real=real: (queued_at_send.append(len(d.hints.queue)), real(msg))[1]  # type: ignore[method-assign]
    sender = asyncio.create_task(d.hints.run())
    try:
        # what a cycle hands over: the walk runs on the sender's task
        started = time.monotonic()
        d.hints.pending = (needs, {n.requirements: hint for n in needs})
        d.hints.ready.set()
        await until(lambda: len(queued_at_send) == 100 and not len(d.hints.queue), 10, "every hint sent")
        elapsed = time.monotonic() - started
        ticks = [(n, queued_at_send.count(n)) for n in sorted(set(queued_at_send), reverse=True)]
        per_tick = int(400 * d.hints.TICK)  # 400/s x TICK s per tick
        assert ticks == [(100 - per_tick * (k + 1), per_tick) for k in range(100 // per_tick)]
        assert elapsed >= (100 // per_tick - 1) * d.hints.TICK  # (sleeps between the ticks at least)
        frames = [(sess.cluster_id, f) for sess in sessions for f in sess.outbox.pop_ready()]
        assert {f.available_capacity.available_count for _, f in frames} == {3}
        assert len({(c, f.available_capacity.supersedes_key) for c, f in frames}) == 100
    finally:
        sender.cancel()
        await d.stop(drain_timeout=0.1)


async def test_heap_is_settled_between_cycles_and_handed_back_periodically() -> None:
    """Survivors are frozen every ``heap_settle_interval`` even when no cycle runs (young
    collections stay small); the periodic unfreeze still collects reference cycles."""
    import gc
    import weakref

    from bigfleet.shard.runtime import UNFREEZE_EVERY

    class Node:
        pass

    cfg = DaemonConfig(shard_id="s1", provider=f"127.0.0.1:{free_port()}", epoch=3, heap_settle_interval=0.02)
    d = ShardDaemon(cfg, ShardMetrics(new_registry()))
    assert d.engine.settles_heap  # worker mode: the settle loop applies
    gc.unfreeze()
    task = asyncio.create_task(d.heap.run())
    # No automatic collection in the window before the first settle: a young collection there would
    # free the cycle before it is frozen (whether one came depended on the allocation count so far).
    gc.disable()
    try:
        a, b = Node(), Node()
        a.other, b.other = b, a  # type: ignore[attr-defined]
        gone = weakref.ref(a)
        del a, b  # garbage, but only the collector can free a cycle
        frozen_before = gc.get_freeze_count()
        await until(lambda: gc.get_freeze_count() > frozen_before, 5.0)
        gc.collect()
        assert gone() is not None  # frozen: out of the collector's sight
        d.heap.last_unfreeze -= UNFREEZE_EVERY  # the periodic hand-back is due
        await until(lambda: gone() is None, 5.0)
    finally:
        gc.enable()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await d.stop(drain_timeout=0.2)


def test_provider_records_no_legal_path_explains_are_quarantined() -> None:
    """Lists skip intermediate states, so a jump is fine; leaving FAILED, or a bound machine moving to
    another cluster without passing Idle, is not: the machine is failed here with the reason."""
    rejected: list[str] = []
    v = MachineView(on_reject=rejected.append)
    v.observe(machine("m1", S.MACHINE_STATE_SPECULATIVE))
    v.observe(machine("m1", S.MACHINE_STATE_CONFIGURED, "c1"))  # a skip (Create, Idle, Configure unseen): fine
    assert v.get("m1").state == S.MACHINE_STATE_CONFIGURED and not rejected  # type: ignore[union-attr]
    assert not v.observe(machine("m1", S.MACHINE_STATE_CONFIGURED, "c2"))  # rebound without Idle
    pb = v.get("m1")
    assert pb is not None and pb.state == S.MACHINE_STATE_FAILED and "without Idle" in pb.last_error
    assert rejected == ["illegal_transition"] and "m1" in v.failed_local
    failed = machine("m2", S.MACHINE_STATE_FAILED)
    failed.last_error = "disk gone"
    assert v.observe(failed)
    assert not v.observe(machine("m2", S.MACHINE_STATE_IDLE))  # FAILED is terminal
    assert "FAILED -> MACHINE_STATE_IDLE" in v.get("m2").last_error  # type: ignore[union-attr]
    failed.id = "m3"
    assert v.observe(failed)
    assert v.observe(machine("m3", S.MACHINE_STATE_SPECULATIVE))  # a slot recycled out of band
    assert len(rejected) == 2


async def test_reclaim_gate_opens_with_the_demand_not_while_its_commit_is_in_flight(daemon: ShardDaemon) -> None:
    """A cycle can run while a roll-up's replicated commit is awaited. Had the gate opened first, that
    cycle would see the cluster as rolled up over its old demand (empty just after an adoption) and
    reclaim machines the new roll-up wants (seen in the handoff-window test under load)."""
    seen: list[tuple[bool, bool, int]] = []
    replace = daemon.intake.log.replace

    async def observed_replace(cluster_id: str, data: bytes, now: int, epoch: int, timeout: float = 5.0) -> bool:
        seen.append((daemon.store.has_rolled_up(cluster_id), cluster_id in daemon.store.engine_state().first_rollup,
                     len(daemon.store.table.cluster(cluster_id))))
        return await replace(cluster_id, data, now, epoch, timeout)

    daemon.intake.log.replace = observed_replace  # type: ignore[method-assign]
    assert (await daemon.handle_rollup("c1", rollup("c1", [need("1", count=2)]))).accepted
    assert seen == [(False, False, 0)]  # during the commit: gate closed, no demand yet
    assert daemon.store.has_rolled_up("c1") and "c1" in daemon.store.engine_state().first_rollup
    assert daemon.store.table.cluster("c1")
