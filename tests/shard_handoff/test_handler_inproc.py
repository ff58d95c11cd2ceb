"""ShardHandoff driven directly against a real shard daemon (in-process, real gRPC Session server)
and a real fake-provider process behind a recording spy: release/adopt of a cluster with the
Session redirect, idempotent redelivery, and a cross-shard drain through the executor."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from shard.cluster import start_provider
from shard.opsim import FakeOperator, need
from shard.spy import SpyProvider, spy_provider, until

from bigfleet.observability import new_registry
from bigfleet.shard.cli import build_server
from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
from bigfleet.shard.ha.node import LocalLog
from bigfleet.shard.ha.state import HAState, ReleasedCluster
from bigfleet.shard.handoff import ShardHandoff
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.v1alpha1 import coordinator_pb2 as cpb
from bigfleet.v1alpha1 import provider_pb2, shard_pb2_grpc

pytestmark = pytest.mark.slow
S = provider_pb2.MachineState


@contextlib.asynccontextmanager
async def running(tmp_path: Path) -> AsyncIterator[tuple[ShardDaemon, ShardHandoff, SpyProvider, str]]:
    prov, paddr = start_provider("--seed-count", "0", "--committed-count", "3")
    try:
        async with spy_provider(paddr) as (spy, spy_addr):
            cfg = DaemonConfig(shard_id="A", provider=spy_addr, epoch=1, cycle_interval=0.2, min_cycle_gap=0.05,
                               reconcile_interval=0.2)
            log = LocalLog(HAState(epoch=1))
            daemon = ShardDaemon(cfg, ShardMetrics(new_registry()), log=log)
            handoff = daemon.handoff
            server, _ = build_server()
            shard_pb2_grpc.add_ShardServicer_to_server(daemon.servicer, server)
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            await daemon.start()
            try:
                yield daemon, handoff, spy, f"127.0.0.1:{port}"
            finally:
                await daemon.stop(drain_timeout=2.0)
                await server.stop(None)
    finally:
        prov.stop()


def bound(daemon: ShardDaemon, cluster: str) -> list[str]:
    return [pb.id for pb in daemon.view.bound_to(cluster) if pb.state == S.MACHINE_STATE_CONFIGURED]


async def trailer(op: FakeOperator, key: str) -> str:
    md = await op._call.trailing_metadata()
    return next((str(v) for k, v in (md or ()) if k == key), "")


async def test_release_redirects_refuses_and_adopts_back(tmp_path: Path) -> None:
    async with running(tmp_path) as (daemon, handoff, spy, addr):
        async with FakeOperator(addr, "c2") as op:
            await op.send_rollup([need("4", count=1)])
            await until(lambda: bound(daemon, "c2"), 40, "c2 bound")
            ids = sorted(bound(daemon, "c2"))
            msg = cpb.ReleaseCluster(cluster_id="c2", handoff_id="h1", to_shard_id="B", to_shard_address="10.0.0.2:7780")
            released = await handoff.release_cluster(msg)
            assert released == ids
            await until(lambda: op.status is not None, 20, "c2's session closed")
            assert op.status == grpc.StatusCode.FAILED_PRECONDITION and "10.0.0.2:7780" in op.details
            assert await trailer(op, "bigfleet-redirect") == "10.0.0.2:7780"
        assert await handoff.release_cluster(msg) == ids  # redelivery: same answer, nothing redone
        assert all(daemon.view.get(i) is None for i in ids)
        # committed to the shard's replicated state (a new leader reads the same ledger)
        assert daemon.log.read(lambda st: st.ledger.released_clusters["c2"]) == ReleasedCluster(
            "B", "10.0.0.2:7780", tuple(ids))
        configures = spy.per_machine("Configure")
        await until(lambda: daemon.cycles >= 10, 30, "more cycles")
        await daemon.reconcile(full=True)
        assert all(daemon.view.get(i) is None for i in ids)  # a full List does not bring them back
        async with FakeOperator(addr, "c2") as again:
            await until(lambda: again.status is not None, 20, "refusal")
            assert again.status == grpc.StatusCode.FAILED_PRECONDITION
        # The coordinator hands them back (a failed adopt elsewhere): served again, untouched.
        await handoff.adopt_cluster(cpb.AdoptCluster(cluster_id="c2", handoff_id="h1", machine_ids=ids))
        async with FakeOperator(addr, "c2") as back:
            await back.send_rollup([need("4", count=1)])
            await until(lambda: back.acks("rollup"), 20, "c2 served again")
            await until(lambda: sorted(bound(daemon, "c2")) == ids, 20, "c2's machines back")
        assert daemon.metrics.handoff_machines.labels("released", "cluster")._value.get() == len(ids)
        assert daemon.metrics.handoff_machines.labels("adopted", "cluster")._value.get() == len(ids)
        assert daemon.metrics.handoff_sessions_refused._value.get() >= 1
        assert spy.per_machine("Configure") == configures, [(n, getattr(r, "machine_id", getattr(r, "id", ""))) for n, r in spy.calls if n != "List"]
        assert not spy.of("Drain")


async def test_cross_shard_drain_drains_lowest_score_and_releases(tmp_path: Path) -> None:
    async with running(tmp_path) as (daemon, handoff, spy, addr), FakeOperator(addr, "low") as op:
        await op.send_rollup([need("4", count=1, priority=10)])
        await until(lambda: bound(daemon, "low"), 40, "low bound")
        victim = bound(daemon, "low")[0]
        msg = cpb.CrossShardDrain(preemptor_priority=1000, to_shard_id="B", transfer_id="t9",
                                  deficit=provider_pb2.Resources(resources={"cpu": "1"}))
        got = await handoff.cross_shard_drain(msg)
        assert got == [victim]
        assert [n for r in op.reclaims() for n in r.nodes]  # the operator was asked to move its pods
        assert spy.per_machine("Drain") == {victim: 1}
        assert daemon.view.get(victim) is None
        assert await handoff.cross_shard_drain(msg) == [victim]  # redelivery
        drains = len(spy.of("Drain"))
        # The cluster still wants capacity: another machine, never the released one.
        await until(lambda: [m for m in bound(daemon, "low") if m != victim], 40, "low re-served elsewhere")
        assert victim not in {r.machine_id for r in spy.of("Configure")[1:]}
        assert len(spy.of("Drain")) == drains


async def test_release_that_cannot_settle_fails_and_keeps_serving(tmp_path: Path) -> None:
    async with running(tmp_path) as (daemon, handoff, _spy, addr):
        async with FakeOperator(addr, "c3") as op:
            await op.send_rollup([need("4", count=1)])
            await until(lambda: bound(daemon, "c3"), 40, "c3 bound")
            ids = bound(daemon, "c3")
            daemon.view.inflight[ids[0]] = "held-by-test"  # a provider call that does not settle
            handoff.settle_timeout = 0.3
            with pytest.raises(TimeoutError):
                await handoff.release_cluster(cpb.ReleaseCluster(cluster_id="c3", to_shard_id="B",
                                                                 to_shard_address="10.0.0.2:7780"))
            del daemon.view.inflight[ids[0]]
        assert "c3" not in daemon.frozen_clusters and not daemon.frozen_machines
        assert "c3" not in handoff.ledger.released_clusters and not handoff.ledger.released
        async with FakeOperator(addr, "c3") as back:  # still served here (the coordinator aborted the move)
            await back.send_rollup([need("4", count=1)])
            await until(lambda: back.acks("rollup"), 20, "c3 served again")
            assert back.status is None
        assert sorted(bound(daemon, "c3")) == sorted(ids) and daemon.view.get(ids[0]) is not None


class _Coordinator:
    """Stands in for the coordinator client: answers GetClusterStatus from a script, counts calls."""

    def __init__(self, answer: object) -> None:
        self.answer = answer
        self.calls = 0

    async def call(self, method: str, request: object, timeout: float | None = None) -> object:
        assert method == "GetClusterStatus" and isinstance(request, cpb.GetClusterStatusRequest)
        self.calls += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def test_handoff_window_hold_rules(tmp_path: Path) -> None:
    async with running(tmp_path) as (daemon, handoff, _spy, addr):
        incoming = cpb.GetClusterStatusResponse(cluster_id="c9", bound=True, shard_id="B", binding_epoch=2,
                                                handoff_to_shard_id="A", handoff_phase="adopting")
        coord = _Coordinator(incoming)
        handoff.coordinator, handoff.adoption_hold = coord, 0.3
        # Being handed to us and not adopted yet: held, then UNAVAILABLE + retry-later, nothing served.
        async with FakeOperator(addr, "c9") as op:
            await until(lambda: op.status is not None, 20, "the early Hello answered")
            assert op.status == grpc.StatusCode.UNAVAILABLE and "being handed to this shard" in op.details
            assert await trailer(op, "bigfleet-retry-later") == "handoff" and not op.frames
        assert daemon.metrics.handoff_sessions_held._value.get() == 1
        # A held Hello is admitted the moment the adoption finishes.
        handoff.adoption_hold = 30.0
        async with FakeOperator(addr, "c9") as op2:
            await until(lambda: coord.calls == 2, 20, "the second Hello checked")
            assert not op2.acks("hello")
            await handoff.adopt_cluster(cpb.AdoptCluster(cluster_id="c9", handoff_id="h9", from_shard_id="B"))
            await until(lambda: op2.acks("hello"), 20, "the held Hello admitted")
        # Adopted here: later Hellos cost no round trip.
        async with FakeOperator(addr, "c9") as op3:
            await until(lambda: op3.acks("hello"), 20, "c9 admitted again")
        assert coord.calls == 2
        # Bound elsewhere with no handoff to us (a misdirected operator): admitted as before.
        coord.answer = cpb.GetClusterStatusResponse(cluster_id="c8", bound=True, shard_id="B")
        async with FakeOperator(addr, "c8") as op4:
            await until(lambda: op4.acks("hello"), 20, "c8 admitted")
        # Coordinator down: admitted, and the next unknown Hellos do not wait on it for a while.
        coord.answer = RuntimeError("coordinator unreachable")
        async with FakeOperator(addr, "c7") as op5:
            await until(lambda: op5.acks("hello"), 20, "c7 admitted despite the coordinator")
        calls = coord.calls
        async with FakeOperator(addr, "c6") as op6:
            await until(lambda: op6.acks("hello"), 20, "c6 admitted")
        assert coord.calls == calls


async def test_a_released_cluster_is_served_again_only_for_a_newer_binding_here(tmp_path: Path) -> None:
    """Its recipient removed, a cluster is bound anew: the old shard lifts its release only when the
    coordinator binds the cluster to it with an epoch above the one released at (an old coordinator
    snapshot naming this shard, another shard, or a handoff in flight keep it refused)."""
    async with running(tmp_path) as (daemon, handoff, spy, addr):
        async with FakeOperator(addr, "c3") as op:
            await op.send_rollup([need("4", count=1)])
            await until(lambda: bound(daemon, "c3"), 40, "c3 bound")
        ids = sorted(bound(daemon, "c3"))
        await handoff.release_cluster(cpb.ReleaseCluster(cluster_id="c3", handoff_id="h3", to_shard_id="B",
                                                         to_shard_address="10.0.0.2:7780", binding_epoch=2))
        assert daemon.log.read(lambda st: st.ledger.released_clusters["c3"].binding_epoch) == 2
        coord = _Coordinator(None)
        handoff.coordinator = coord

        async def refused(answer: cpb.GetClusterStatusResponse) -> None:
            coord.answer = answer
            async with FakeOperator(addr, "c3") as op:
                await until(lambda: op.status is not None, 20, "refusal")
                assert op.status == grpc.StatusCode.FAILED_PRECONDITION, (answer, op.details)

        st = cpb.GetClusterStatusResponse
        await refused(st(cluster_id="c3", bound=True, shard_id="A", binding_epoch=2))  # not newer
        await refused(st(cluster_id="c3", bound=True, shard_id="B", binding_epoch=3))  # elsewhere
        await refused(st(cluster_id="c3", bound=True, shard_id="A", binding_epoch=3, handoff_phase="releasing",
                         handoff_to_shard_id="B"))
        await refused(st(cluster_id="c3"))  # not bound at all
        configures = spy.per_machine("Configure")
        coord.answer = st(cluster_id="c3", bound=True, shard_id="A", binding_epoch=3)
        async with FakeOperator(addr, "c3") as back:
            await back.send_rollup([need("4", count=1)])
            await until(lambda: back.acks("rollup"), 20, "c3 served again")
            await until(lambda: sorted(bound(daemon, "c3")) == ids, 20, "its released machine back")
        assert "c3" not in daemon.log.read(lambda s: dict(s.ledger.released_clusters))
        assert spy.per_machine("Configure") == configures and not spy.of("Drain")
