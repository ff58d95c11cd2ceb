"""`bigfleetctl shards remove` of a shard while a cluster is being handed to it.

The runbook removes a shard that is lost for good. If that shard was the recipient of a cluster
handoff still in ``adopting`` (the old shard has already released the cluster and its machines,
the new one died before adopting them), the machines must go back to the releasing shard and the
cluster with them: before the fix the transfer was simply aborted, the machines were owned by no
shard, and the old shard refused the cluster's Sessions for ever (redirecting to the dead shard).

Real processes: a 3-replica coordinator, two shard processes sharing one fake provider (behind a
recording spy), and an operator stand-in.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from shard.cluster import ShardProc, print_shard_logs, start_provider, stop_shards
from shard.opsim import FakeOperator, need
from shard.spy import spy_provider, until

from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.placement.hrw import preferred
from bigfleet.v1alpha1 import coordinator_pb2 as pb
from bigfleet.v1alpha1 import provider_pb2

pytestmark = pytest.mark.slow

A, B = "shard-a", "shard-b"
CONFIGURED = provider_pb2.MachineState.MACHINE_STATE_CONFIGURED


def ctl(coord: list[str], *args: str) -> object:
    out = subprocess.run([sys.executable, "-m", "bigfleet.ctl.main", "--coordinator", ",".join(coord), "-o", "json",
                          *args], capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out) if out.strip().startswith(("{", "[")) else out


def shard_args(sid: str, coord: list[str], *extra: str) -> tuple[str, ...]:
    return ("--shard-id", sid, "--coordinator", ",".join(coord), "--heartbeat-interval", "0.3", *extra)


@pytest.mark.timeout(300)
async def test_removing_the_recipient_mid_adopt_returns_the_cluster_and_its_machines(tmp_path: Path) -> None:
    move = next(c for c in (f"cl-{i}" for i in range(100)) if preferred(c, [A, B]) == B)
    g = CoordGroup(tmp_path / "coord", 3, extra=("--rebalance-interval", "0"))
    g.start_all()
    prov, paddr = start_provider("--seed-count", "4")
    a = b = None
    try:
        async with spy_provider(paddr) as (spy, spy_addr):
            a = await ShardProc(spy_addr, extra=shard_args(A, g.addresses)).start()

            def call(method: str, req: object) -> object:
                return g.call(g.leader(), method, req)

            def shards() -> dict[str, str]:
                return {s.shard_id: s.address for s in call("ListShards", pb.ListShardsRequest()).shards}  # type: ignore[attr-defined]

            async def transfers() -> list[pb.TransferStatus]:
                return list(call("ListTransfers", pb.ListTransfersRequest()).transfers)  # type: ignore[attr-defined]

            await until(lambda: A in shards(), 60, "shard A registered")
            assert call("LookupCluster", pb.LookupClusterRequest(cluster_id=move)).shard_id == A  # type: ignore[attr-defined]
            async with FakeOperator(a.addr, move) as op:
                await op.send_rollup([need("4", count=1)])

                async def configured() -> list[str]:
                    return [m.id for m in await spy.list_machines() if m.cluster == move and m.state == CONFIGURED]

                [mid] = await until(configured, 90, "the cluster's machine Configured on shard A")
                await until(lambda: _bound(a, move, 1), 30, "shard A counting it")

            b = await ShardProc(spy_addr, extra=shard_args(B, g.addresses, "--ownership", "shared")).start()
            await until(lambda: shards().get(B) == b.addr, 60, "shard B registered")  # type: ignore[union-attr]
            # B stops answering (still registered and live), so the handoff stalls in "adopting".
            assert b.proc is not None
            b.proc.signal(signal.SIGSTOP)
            calls_before = {k: len(spy.of(k)) for k in ("Create", "Configure", "Drain", "Delete")}
            plan = ctl(g.addresses, "rebalance", "--plan")
            assert isinstance(plan, dict) and [m["cluster_id"] for m in plan["moves"]] == [move], plan
            ctl(g.addresses, "rebalance", "--apply", "--plan-id", plan["plan_id"])
            [t] = await until(lambda: _in_phase(transfers, "adopting"), 60, "A released the cluster")
            assert list(t.machine_ids) == [mid]
            assert move not in (await a.counts()).bound_by_cluster

            # B is lost for good; the runbook removes it.
            b.proc.kill()
            b.proc = None
            subprocess.run([sys.executable, "-m", "bigfleet.ctl.main", "--coordinator", ",".join(g.addresses),
                            "shards", "remove", B], capture_output=True, text=True, timeout=60, check=True)

            # The machines and the cluster go back to A: nothing is left without an owner.
            await until(lambda: _phase_of(transfers, t.transfer_id, "done"), 60, "the transfer finishing on A")
            assert call("LookupCluster", pb.LookupClusterRequest(cluster_id=move)).shard_id == A  # type: ignore[attr-defined]
            await until(lambda: _bound(a, move, 1), 30, "shard A counting the cluster's machine again")
            async with FakeOperator(a.addr, move) as op:
                await op.send_rollup([need("4", count=1)])
                await until(lambda: op.acks("rollup"), 30, "A serving the cluster again")
                assert op.status is None, op.details
                await a.wait_cycles(3)
            assert await configured() == [mid]
            # Served on the same machine: nothing created, configured, drained or deleted since the move.
            assert {k: len(spy.of(k)) for k in calls_before} == calls_before
    except BaseException:
        print_shard_logs({"A": a, "B": b}, g.logs())
        raise
    finally:
        stop_shards(a, b)
        prov.stop()
        g.stop_all()


async def _bound(s: ShardProc, cluster: str, n: int) -> bool:
    return (await s.counts(cluster)).bound_by_cluster.get(cluster, 0) == n


async def _in_phase(transfers: object, phase: str) -> list[pb.TransferStatus]:
    return [t for t in await transfers() if t.phase == phase]  # type: ignore[operator]


async def _phase_of(transfers: object, tid: str, phase: str) -> bool:
    return any(t.transfer_id == tid and t.phase == phase for t in await transfers())  # type: ignore[operator]



@pytest.mark.timeout(300)
async def test_removing_the_recipient_after_a_finished_move_lets_the_old_shard_serve_again(tmp_path: Path) -> None:
    """A move that finished, then its recipient lost for good and removed: the cluster is placed anew
    (here on its old shard, the only one left, with a newer binding epoch). The old shard must serve
    it, with the machine it released, instead of redirecting it to the removed shard for ever."""
    move = next(c for c in (f"cl-{i}" for i in range(100)) if preferred(c, [A, B]) == B)
    g = CoordGroup(tmp_path / "coord", 3, extra=("--rebalance-interval", "0"))
    g.start_all()
    prov, paddr = start_provider("--seed-count", "4")
    a = b = None
    try:
        async with spy_provider(paddr) as (spy, spy_addr):
            a = await ShardProc(spy_addr, extra=shard_args(A, g.addresses)).start()

            def call(method: str, req: object) -> object:
                return g.call(g.leader(), method, req)

            def lookup() -> pb.LookupClusterResponse:
                return call("LookupCluster", pb.LookupClusterRequest(cluster_id=move))  # type: ignore[return-value]

            def shards() -> dict[str, str]:
                return {s.shard_id: s.address for s in call("ListShards", pb.ListShardsRequest()).shards}  # type: ignore[attr-defined]

            async def configured() -> list[str]:
                return [m.id for m in await spy.list_machines() if m.cluster == move and m.state == CONFIGURED]

            await until(lambda: A in shards(), 60, "shard A registered")
            assert lookup().shard_id == A
            async with FakeOperator(a.addr, move) as op:
                await op.send_rollup([need("4", count=1)])
                [mid] = await until(configured, 90, "the cluster's machine Configured on shard A")
                await until(lambda: _bound(a, move, 1), 30, "shard A counting it")

            b = await ShardProc(spy_addr, extra=shard_args(B, g.addresses, "--ownership", "shared")).start()
            await until(lambda: shards().get(B) == b.addr, 60, "shard B registered")  # type: ignore[union-attr]
            plan = ctl(g.addresses, "rebalance", "--plan")
            assert isinstance(plan, dict) and [m["cluster_id"] for m in plan["moves"]] == [move], plan
            ctl(g.addresses, "rebalance", "--apply", "--plan-id", plan["plan_id"])
            await until(lambda: _done(transfers_of(call)), 60, "the move finishing")
            moved = lookup()
            assert moved.shard_id == B and moved.binding_epoch == 2
            await until(lambda: _bound(b, move, 1), 30, "shard B holding the machine")  # type: ignore[arg-type]

            # B is lost for good; the runbook removes it, and the cluster is placed again.
            assert b.proc is not None
            b.proc.kill()
            b.proc = None
            subprocess.run([sys.executable, "-m", "bigfleet.ctl.main", "--coordinator", ",".join(g.addresses),
                            "shards", "remove", B], capture_output=True, text=True, timeout=60, check=True)
            again = lookup()
            assert (again.shard_id, again.binding_epoch, again.newly_bound) == (A, 3, True)
            calls_before = {k: len(spy.of(k)) for k in ("Create", "Configure", "Drain", "Delete")}
            async with FakeOperator(a.addr, move) as op:
                await op.send_rollup([need("4", count=1)])
                await until(lambda: op.acks("rollup"), 30, "A serving the cluster again")
                assert op.status is None, op.details
                await until(lambda: _bound(a, move, 1), 30, "A holding the machine it released")
                await a.wait_cycles(3)
            assert await configured() == [mid]
            assert {k: len(spy.of(k)) for k in calls_before} == calls_before  # served on the same machine
    except BaseException:
        print_shard_logs({"A": a, "B": b}, g.logs())
        raise
    finally:
        stop_shards(a, b)
        prov.stop()
        g.stop_all()


def transfers_of(call: object) -> list[pb.TransferStatus]:
    return list(call("ListTransfers", pb.ListTransfersRequest()).transfers)  # type: ignore[operator]


def _done(transfers: list[pb.TransferStatus]) -> bool:
    return bool(transfers) and all(t.phase == "done" for t in transfers)
