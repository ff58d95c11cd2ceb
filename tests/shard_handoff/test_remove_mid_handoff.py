"""`bigfleetctl shards remove` of a shard that a cluster is being, or was, handed to.

The runbook removes a shard that is lost for good. If that shard was the recipient of a cluster
handoff still in ``adopting`` (the old shard has already released the cluster and its machines,
the new one died before adopting them), the machines must go back to the releasing shard and the
cluster with them: before the fix the transfer was simply aborted, the machines were owned by no
shard, and the old shard refused the cluster's Sessions for ever (redirecting to the dead shard).

Real processes: a 3-replica coordinator, two shard processes sharing one fake provider (behind a
recording spy), and an operator stand-in.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from shard.cluster import ShardProc, print_shard_logs, start_provider, stop_shards
from shard.opsim import FakeOperator, need
from shard.spy import SpyProvider, spy_provider, until

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


class Fleet:
    """A 3-replica coordinator, shard A serving cluster ``move`` on one Configured machine ``mid``, and
    (after ``start_b``) shard B on the same provider, which HRW prefers for ``move``."""

    def __init__(self, g: CoordGroup, spy: SpyProvider, spy_addr: str, move: str) -> None:
        self.g, self.spy, self.spy_addr, self.move = g, spy, spy_addr, move
        self.a: ShardProc | None = None
        self.b: ShardProc | None = None
        self.mid = ""

    def call(self, method: str, req: object) -> Any:
        return self.g.call(self.g.leader(), method, req)

    def lookup(self) -> pb.LookupClusterResponse:
        return self.call("LookupCluster", pb.LookupClusterRequest(cluster_id=self.move))  # type: ignore[no-any-return]

    def shards(self) -> dict[str, str]:
        return {s.shard_id: s.address for s in self.call("ListShards", pb.ListShardsRequest()).shards}

    async def transfers(self) -> list[pb.TransferStatus]:
        return list(self.call("ListTransfers", pb.ListTransfersRequest()).transfers)

    async def configured(self) -> list[str]:
        return [m.id for m in await self.spy.list_machines() if m.cluster == self.move and m.state == CONFIGURED]

    def provider_calls(self) -> dict[str, int]:
        return {k: len(self.spy.of(k)) for k in ("Create", "Configure", "Drain", "Delete")}

    async def start_b(self) -> ShardProc:
        b = self.b = await ShardProc(self.spy_addr, extra=shard_args(B, self.g.addresses, "--ownership", "shared")).start()
        await until(lambda: self.shards().get(B) == b.addr, 60, "shard B registered")
        return b

    def move_to_b(self) -> None:
        plan = ctl(self.g.addresses, "rebalance", "--plan")
        assert isinstance(plan, dict) and [m["cluster_id"] for m in plan["moves"]] == [self.move], plan
        ctl(self.g.addresses, "rebalance", "--apply", "--plan-id", plan["plan_id"])

    def remove_b(self) -> None:
        """B is lost for good (killed); the runbook removes it."""
        assert self.b is not None and self.b.proc is not None
        self.b.proc.kill()
        self.b.proc = None
        subprocess.run([sys.executable, "-m", "bigfleet.ctl.main", "--coordinator", ",".join(self.g.addresses),
                        "shards", "remove", B], capture_output=True, text=True, timeout=60, check=True)

    async def served_by_a_on_its_machine(self, since: dict[str, int]) -> None:
        """A serves the cluster again, on the same machine, with no provider call since ``since``."""
        a = self.a
        assert a is not None
        async with FakeOperator(a.addr, self.move) as op:
            await op.send_rollup([need("4", count=1)])
            await until(lambda: op.acks("rollup"), 30, "A serving the cluster again")
            assert op.status is None, op.details
            await until(lambda: _bound(a, self.move, 1), 30, "A holding the cluster's machine")
            await a.wait_cycles(3)
        assert await self.configured() == [self.mid]
        assert self.provider_calls() == since


@contextlib.asynccontextmanager
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    g = CoordGroup(tmp_path / "coord", 3, extra=("--rebalance-interval", "0"))
    g.start_all()
    prov, paddr = start_provider("--seed-count", "4")
    f: Fleet | None = None
    try:
        async with spy_provider(paddr) as (spy, spy_addr):
            f = Fleet(g, spy, spy_addr, next(c for c in (f"cl-{i}" for i in range(100)) if preferred(c, [A, B]) == B))
            a = f.a = await ShardProc(spy_addr, extra=shard_args(A, g.addresses)).start()
            await until(lambda: A in f.shards(), 60, "shard A registered")
            assert f.lookup().shard_id == A
            async with FakeOperator(a.addr, f.move) as op:
                await op.send_rollup([need("4", count=1)])
                [f.mid] = await until(f.configured, 90, "the cluster's machine Configured on shard A")
                await until(lambda: _bound(a, f.move, 1), 30, "shard A counting it")
            yield f
    except BaseException:
        print_shard_logs({"A": f.a if f else None, "B": f.b if f else None}, g.logs())
        raise
    finally:
        stop_shards(f.a if f else None, f.b if f else None)
        prov.stop()
        g.stop_all()


@pytest.mark.timeout(300)
async def test_removing_the_recipient_mid_adopt_returns_the_cluster_and_its_machines(tmp_path: Path) -> None:
    async with fleet(tmp_path) as f:
        assert f.a is not None
        b = await f.start_b()
        # B stops answering (still registered and live), so the handoff stalls in "adopting".
        assert b.proc is not None
        b.proc.signal(signal.SIGSTOP)
        calls_before = f.provider_calls()
        f.move_to_b()
        [t] = await until(lambda: _in_phase(f.transfers, "adopting"), 60, "A released the cluster")
        assert list(t.machine_ids) == [f.mid]
        assert f.move not in (await f.a.counts()).bound_by_cluster
        f.remove_b()
        # The machines and the cluster go back to A: nothing is left without an owner.
        await until(lambda: _phase_of(f.transfers, t.transfer_id, "done"), 60, "the transfer finishing on A")
        assert f.lookup().shard_id == A
        # Served on the same machine: nothing created, configured, drained or deleted since the move.
        await f.served_by_a_on_its_machine(calls_before)


@pytest.mark.timeout(300)
async def test_removing_the_recipient_after_a_finished_move_lets_the_old_shard_serve_again(tmp_path: Path) -> None:
    """A move that finished, then its recipient lost for good and removed: the cluster is placed anew
    (here on its old shard, the only one left, with a newer binding epoch). The old shard must serve
    it, with the machine it released, instead of redirecting it to the removed shard for ever."""
    async with fleet(tmp_path) as f:
        b = await f.start_b()
        f.move_to_b()
        await until(lambda: _all_done(f.transfers), 60, "the move finishing")
        moved = f.lookup()
        assert moved.shard_id == B and moved.binding_epoch == 2
        await until(lambda: _bound(b, f.move, 1), 30, "shard B holding the machine")
        f.remove_b()
        again = f.lookup()
        assert (again.shard_id, again.binding_epoch, again.newly_bound) == (A, 3, True)
        await f.served_by_a_on_its_machine(f.provider_calls())


async def _bound(s: ShardProc, cluster: str, n: int) -> bool:
    return (await s.counts(cluster)).bound_by_cluster.get(cluster, 0) == n


async def _in_phase(transfers: Callable[[], Awaitable[list[pb.TransferStatus]]], phase: str) -> list[pb.TransferStatus]:
    return [t for t in await transfers() if t.phase == phase]


async def _phase_of(transfers: Callable[[], Awaitable[list[pb.TransferStatus]]], tid: str, phase: str) -> bool:
    return any(t.transfer_id == tid and t.phase == phase for t in await transfers())


async def _all_done(transfers: Callable[[], Awaitable[list[pb.TransferStatus]]]) -> bool:
    ts = await transfers()
    return bool(ts) and all(t.phase == "done" for t in ts)
