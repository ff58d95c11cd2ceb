"""Two shards on one provider, and drains that need the operator's word first.

(a) A shard that loses a race for a machine (another shard bound, moved or erased it first) re-reads
the machine and shows the provider's record; it never marks a healthy machine FAILED. Only a genuine
failure (an error on a machine still in the state the call needed) does.

(b) A Configured machine is drained only after its cluster's operator received the ReclaimInstruction
and either acked it or its grace ran out: no session, an instruction that never left the outbox, or
one neither acked nor past its grace, keeps the machine (no provider Drain).

Everything runs against a real provider kit server over gRPC; the drain tests also run the real
Session server with a scripted operator on the other end of the stream.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from prometheus_client import CollectorRegistry

from bigfleet.observability import new_registry
from bigfleet.provider.fake.backend import Dwell, SimulatedCloud
from bigfleet.provider.fake.catalog import build_catalog
from bigfleet.provider.kit.server import KitOptions, RunningProvider, serve
from bigfleet.rpc import new_server
from bigfleet.shard.executor import Executor, ExecutorConfig
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.provider_client import ProviderClient
from bigfleet.shard.sessions import OperatorSession, RollupOutcome, SessionRegistry, SessionServicer
from bigfleet.shard.view import MachineView
from bigfleet.v1alpha1 import provider_pb2, shard_pb2, shard_pb2_grpc

from .opsim import FakeOperator
from .test_executor import binding, rig, settled, until

S = provider_pb2.MachineState


def outcome(metrics: ShardMetrics, kind: str, name: str) -> int:
    return int(metrics.action_outcomes.labels(kind, name)._value.get())


async def walk(client: ProviderClient, mid: str, rpc: str, state: int, *args: Any) -> provider_pb2.Machine:
    """Drive ``mid`` through one transition with ``client`` (another shard) and wait for ``state``."""
    await getattr(client, rpc)(mid, *args)
    deadline = time.monotonic() + 10
    while True:
        pb = await client.get(mid)
        if pb.state == state:
            return pb
        assert time.monotonic() < deadline, f"{mid} never reached {S.Name(state)}"
        await asyncio.sleep(0.01)


# -- (a) races ------------------------------------------------------------------------------------


async def test_a_configure_that_lost_the_race_rereads_and_does_not_fail_the_machine() -> None:
    async with rig(3) as r:
        other = ProviderClient(f"127.0.0.1:{r.provider.port}", "s2", 1)  # a second shard, same provider
        try:
            mid = r.ids[0]
            await walk(other, mid, "create", S.MACHINE_STATE_IDLE)
            r.view.set(await r.client.get(mid))  # both shards see it Idle
            await walk(other, mid, "configure", S.MACHINE_STATE_CONFIGURED, "theirs", b"#x\n", {})
            # Our Configure for another cluster is refused (ALREADY_EXISTS: bound elsewhere).
            assert r.executor.submit_configure(mid, binding("c1"))
            await until(lambda: settled(r), 10, "the flow")
            pb = r.view.get(mid)
            assert pb is not None
            assert pb.state == S.MACHINE_STATE_CONFIGURED and pb.cluster == "theirs", pb
            assert not pb.last_error
            assert mid not in r.view.failed_local and mid not in r.view.reserved_for
            assert r.rpcs("Get") >= 1  # re-read, not guessed
            metrics = r.executor.metrics
            assert metrics is not None
            assert outcome(metrics, "Bootstrap", "conflict_reread") == 1
            assert outcome(metrics, "Bootstrap", "configure_error") == 0
        finally:
            await other.close()


async def test_a_delete_answered_wrong_state_rereads_and_shows_the_provider_record() -> None:
    async with rig(3) as r:
        other = ProviderClient(f"127.0.0.1:{r.provider.port}", "s2", 1)
        try:
            mid = r.ids[0]
            await walk(other, mid, "create", S.MACHINE_STATE_IDLE)
            r.view.set(await r.client.get(mid))
            await walk(other, mid, "configure", S.MACHINE_STATE_CONFIGURED, "theirs", b"#x\n", {})
            # Our Delete of the (to us) Idle machine: the kit answers INTERNAL (invalid transition),
            # which is not fencing; the re-read shows it Configured, so it is a lost race.
            assert r.executor.submit_delete(mid)
            await until(lambda: settled(r), 10, "the flow")
            pb = r.view.get(mid)
            assert pb is not None and pb.state == S.MACHINE_STATE_CONFIGURED and pb.cluster == "theirs", pb
            assert mid not in r.view.failed_local
            assert r.rpcs("Delete") == 1
            metrics = r.executor.metrics
            assert metrics is not None and outcome(metrics, "Delete", "conflict_reread") == 1
            # The next cycle may act on it again (nothing sticky was left behind).
            assert r.executor.submit_drain(mid, 0, 0, "reclaim") is True
        finally:
            await other.close()


async def test_a_machine_the_provider_no_longer_knows_is_forgotten_not_failed() -> None:
    async with rig(2) as r:
        ghost = provider_pb2.Machine()
        ghost.CopyFrom(r.view.get(r.ids[0]))  # type: ignore[arg-type]
        ghost.id = "ghost-1"
        assert r.view.set(ghost)
        assert r.executor.submit_create("ghost-1", binding("c1"))  # NOT_FOUND from Create, then from Get
        await until(lambda: settled(r), 10, "the flow")
        assert r.view.get("ghost-1") is None
        assert "ghost-1" not in r.view.failed_local
        metrics = r.executor.metrics
        assert metrics is not None and outcome(metrics, "Provision", "conflict_reread") == 1


async def test_a_machine_moved_away_while_the_flow_waits_is_shown_as_it_is_not_failed() -> None:
    # Polling mode reads the machine every 0.5 s; the other shard configures it as soon as our Create
    # finishes (0.3 s), so the flow never sees it Idle: before, it waited out its timeout and FAILED it.
    async with rig(2, dwell=Dwell(create=0.3), watch=False, poll_interval=0.5, execute_timeout=1.5) as r:
        other = ProviderClient(f"127.0.0.1:{r.provider.port}", "s2", 1)
        try:
            mid = r.ids[0]
            assert r.executor.submit_create(mid, binding("c1"))

            async def grab() -> None:
                while (await other.get(mid)).state != S.MACHINE_STATE_IDLE:
                    await asyncio.sleep(0.005)
                await other.configure(mid, "theirs", b"#x\n", {})

            await asyncio.wait_for(grab(), 10)
            await until(lambda: settled(r), 10, "the flow")
            pb = r.view.get(mid)
            assert pb is not None and pb.cluster == "theirs", pb
            assert pb.state in (S.MACHINE_STATE_CONFIGURING, S.MACHINE_STATE_CONFIGURED)
            assert mid not in r.view.failed_local and not pb.last_error
            assert r.rpcs("Configure") == 1  # only theirs
            metrics = r.executor.metrics
            assert metrics is not None and outcome(metrics, "Provision", "conflict_reread") == 1
        finally:
            await other.close()


async def test_a_genuine_error_on_a_machine_in_the_right_state_still_fails_it_after_a_reread() -> None:
    async with rig(2) as r:
        mid = r.ids[0]
        assert r.executor.submit_create(mid, None)
        await until(lambda: settled(r), 10, "the create")
        # A Configure the provider refuses as malformed (too many metadata entries): INVALID_ARGUMENT
        # while the machine is Idle, exactly the state the call needed.
        r.client.extra_metadata = {f"k{i}": "" for i in range(65537)}
        assert r.executor.submit_configure(mid, binding("c1"))
        await until(lambda: settled(r), 10, "the configure")
        pb = r.view.get(mid)
        assert pb is not None and pb.state == S.MACHINE_STATE_FAILED
        assert "INVALID_ARGUMENT" in pb.last_error
        assert r.rpcs("Get") == 1  # it looked before deciding


# -- (b) drains and the operator --------------------------------------------------------------------


@dataclass
class DrainRig:
    executor: Executor
    view: MachineView
    client: ProviderClient
    provider: RunningProvider
    registry: SessionRegistry
    metrics: ShardMetrics
    target: str  # the Session server
    ids: list[str]
    drains: list[tuple[float, str]]  # (when, machine) of every provider Drain call the shard made


@asynccontextmanager
async def drain_rig(n: int, **cfg: Any) -> AsyncIterator[DrainRig]:
    """Provider kit + Session server + executor with the real SessionRegistry; every machine starts
    Configured for cluster ``c{i}`` (walked there directly, not through the executor)."""
    cloud = SimulatedCloud(build_catalog(n), "fake", Dwell(), None)
    provider = await serve(cloud, options=KitOptions(list_seed=1), registry=CollectorRegistry())
    metrics = ShardMetrics(new_registry())
    client = ProviderClient(f"127.0.0.1:{provider.port}", "s1", 1, metrics)
    registry = SessionRegistry(metrics)

    async def on_rollup(cluster_id: str, pb: Any) -> RollupOutcome:
        return RollupOutcome(True)

    servicer = SessionServicer(registry, on_rollup, lambda: (1, 1), lambda s: None)
    server, _ = new_server()
    shard_pb2_grpc.add_ShardServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    view = MachineView()
    ids = sorted(pb.id for pb in (await client.list()).machines)[:n]
    for i, mid in enumerate(ids):
        await walk(client, mid, "create", S.MACHINE_STATE_IDLE)
        view.set(await walk(client, mid, "configure", S.MACHINE_STATE_CONFIGURED, f"c{i}", b"#x\n", {}))
    drains: list[tuple[float, str]] = []
    real_drain = client.drain

    async def recording_drain(machine_id: str, grace: int) -> provider_pb2.TransitionAck:
        drains.append((time.monotonic(), machine_id))
        return await real_drain(machine_id, grace)

    client.drain = recording_drain  # type: ignore[method-assign]
    executor = Executor(view, client, registry, lambda c, fp, prio: binding(c, fp), ExecutorConfig(**cfg), metrics)
    try:
        yield DrainRig(executor, view, client, provider, registry, metrics, f"127.0.0.1:{port}", ids, drains)
    finally:
        await executor.drain_all(2.0)
        await client.close()
        await server.stop(None)
        await provider.stop(0)


def state(d: DrainRig, mid: str) -> int:
    pb = d.view.get(mid)
    assert pb is not None
    return int(pb.state)


async def test_no_session_means_no_drain() -> None:
    async with drain_rig(1, reclaim_ack_timeout=0.5) as d:
        mid = d.ids[0]
        assert d.executor.submit_drain(mid, 0, 0, "reclaim")
        await until(lambda: not d.view.inflight, 10, "the flow")
        assert d.drains == []  # the provider was never asked to drain
        assert state(d, mid) == S.MACHINE_STATE_CONFIGURED and d.view.get(mid).cluster == "c0"  # type: ignore[union-attr]
        assert mid not in d.view.reserved_for and mid not in d.view.failed_local
        assert outcome(d.metrics, "Reclaim", "no_session") == 1
        assert (await d.client.get(mid)).state == S.MACHINE_STATE_CONFIGURED


async def test_an_instruction_that_never_left_the_outbox_means_no_drain_and_is_withdrawn() -> None:
    async with drain_rig(1, reclaim_ack_timeout=0.4) as d:
        mid = d.ids[0]
        stuck = OperatorSession("c0", None, 4096)  # type: ignore[arg-type]  # a stream that never writes
        d.registry.install(stuck)
        assert d.executor.submit_drain(mid, 0, 5, "preempt")
        await until(lambda: not d.view.inflight, 10, "the flow")
        assert d.drains == []
        assert state(d, mid) == S.MACHINE_STATE_CONFIGURED
        assert outcome(d.metrics, "Preempt", "reclaim_undelivered") == 1
        # The queued frame was withdrawn: a writer that gets to it later skips it.
        frames = stuck.outbox.pop_ready()
        assert [f.WhichOneof("payload") for f in frames] == ["reclaim_instruction"]
        assert stuck.before_write(frames[0]) is False


async def test_a_closed_session_means_no_drain() -> None:
    async with drain_rig(1, reclaim_ack_timeout=5.0) as d:
        mid = d.ids[0]
        gone = OperatorSession("c0", None, 4096)  # type: ignore[arg-type]
        d.registry.install(gone)
        gone.close(grpc.StatusCode.UNAVAILABLE, "stream ended")  # (still registered: removal races the flow)
        started = time.monotonic()
        assert d.executor.submit_drain(mid, 0, 0, "reclaim")
        await until(lambda: not d.view.inflight, 10, "the flow")
        assert time.monotonic() - started < 2  # known at once, no waiting for an ack
        assert d.drains == []
        assert state(d, mid) == S.MACHINE_STATE_CONFIGURED
        assert outcome(d.metrics, "Reclaim", "reclaim_undelivered") == 1


async def test_drain_waits_for_delivery_and_then_an_ack_or_the_grace() -> None:
    async with drain_rig(3, reclaim_ack_timeout=2.0) as d:
        acked, kept, expired = d.ids
        received: dict[str, float] = {}

        def on_frame(msg: shard_pb2.ShardMessage) -> None:
            if msg.WhichOneof("payload") == "reclaim_instruction":
                received[msg.reclaim_instruction.nodes[0]] = time.monotonic()

        ops = [FakeOperator(d.target, "c0", on_frame=on_frame),
               FakeOperator(d.target, "c1", ack_reclaims=False, on_frame=on_frame),
               FakeOperator(d.target, "c2", ack_reclaims=False, on_frame=on_frame)]
        for op in ops:
            await op.__aenter__()
        try:
            await until(lambda: len(d.registry) == 3, 10, "three sessions")
            assert d.executor.submit_drain(acked, 30, 0, "reclaim")  # acked: drained at once
            assert d.executor.submit_drain(kept, 30, 0, "reclaim")  # no ack, grace 30 s > 2 s wait: kept
            assert d.executor.submit_drain(expired, 1, 0, "reclaim")  # no ack, grace 1 s runs out: drained
            await until(lambda: not d.view.inflight, 15, "the flows")
            assert state(d, acked) == S.MACHINE_STATE_IDLE
            assert state(d, kept) == S.MACHINE_STATE_CONFIGURED
            assert state(d, expired) == S.MACHINE_STATE_IDLE
            when = {mid: t for t, mid in d.drains}
            assert set(when) == {acked, expired}
            assert when[acked] >= received[acked]
            assert when[expired] >= received[expired] + 1.0 - 0.05  # its grace ran out after delivery
            assert outcome(d.metrics, "Reclaim", "reclaim_no_ack") == 1
            assert outcome(d.metrics, "Reclaim", "success") == 2
            assert len(ops[1].reclaims()) == 1  # the operator did get it (a later cycle may retry)
        finally:
            for op in ops:
                await op.close()


async def test_a_drain_cancelled_while_waiting_for_its_ack_never_drains() -> None:
    async with drain_rig(1, reclaim_ack_timeout=30.0) as d:
        mid = d.ids[0]
        async with FakeOperator(d.target, "c0", ack_reclaims=False) as op:
            await until(lambda: len(d.registry) == 1, 10, "the session")
            assert d.executor.submit_drain(mid, 60, 0, "reclaim")
            await until(lambda: len(op.reclaims()) == 1, 10, "the instruction")
            await d.executor.drain_all(0.1)  # shutdown: what is left is cancelled
            await asyncio.sleep(0.3)
            assert d.drains == []
            assert (await d.client.get(mid)).state == S.MACHINE_STATE_CONFIGURED

