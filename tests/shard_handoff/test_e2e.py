"""A real cluster handoff: coordinator (3 Raft replicas) + two shard processes sharing one fake provider
(behind a recording spy) + operator stand-ins. ``bigfleetctl rebalance --plan/--apply`` moves one
cluster; the old shard stops acting for it and redirects its operator, the new shard serves it on
the same Configured machines, and no machine ever sees lifecycle calls from both shards."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from shard.cluster import ShardProc, print_shard_logs, start_provider, stop_shards
from shard.opsim import FakeOperator, need
from shard.spy import spy_provider, until

from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.placement.hrw import preferred
from bigfleet.shard.handoff import OWNER_KEY
from bigfleet.v1alpha1 import coordinator_pb2 as pb
from bigfleet.v1alpha1 import provider_pb2

pytestmark = pytest.mark.slow

A, B = "shard-a", "shard-b"
MUTATING = ("Create", "Configure", "Drain", "Delete")
CONFIGURED = provider_pb2.MachineState.MACHINE_STATE_CONFIGURED


def pick(want: str) -> str:
    """A cluster id whose rendezvous-preferred shard (of A and B) is ``want``."""
    return next(c for c in (f"cl-{i}" for i in range(100)) if preferred(c, [A, B]) == want)


def ctl(coord: list[str], *args: str) -> object:
    out = subprocess.run([sys.executable, "-m", "bigfleet.ctl.main", "--coordinator", ",".join(coord), "-o", "json",
                          *args], capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


async def trailers(op: FakeOperator) -> dict[str, str]:
    md = await asyncio.wait_for(op._call.trailing_metadata(), 5)
    return {k: str(v) for k, v in (md or ())}


def shard_args(sid: str, coord: list[str], *extra: str) -> tuple[str, ...]:
    return ("--shard-id", sid, "--coordinator", ",".join(coord), "--heartbeat-interval", "0.3", *extra)


async def test_rebalance_moves_a_cluster_between_shards_sharing_a_provider(tmp_path: Path) -> None:
    move, stay = pick(B), pick(A)
    g = CoordGroup(tmp_path / "coord", 3, extra=("--rebalance-interval", "0"))
    g.start_all()
    prov, paddr = start_provider("--seed-count", "8")
    a = b = None
    try:
        async with spy_provider(paddr) as (spy, spy_addr):
            a = await ShardProc(spy_addr, extra=shard_args(A, g.addresses)).start()

            def shards() -> dict[str, str]:
                return {s.shard_id: s.address for s in g.call(g.leader(), "ListShards", pb.ListShardsRequest()).shards}  # type: ignore[attr-defined]

            await until(lambda: A in shards(), 60, "shard A registered")
            for c in (move, stay):
                r = g.call(g.leader(), "LookupCluster", pb.LookupClusterRequest(cluster_id=c))
                assert r.shard_id == A  # type: ignore[attr-defined]

            op_move = await FakeOperator(a.addr, move).__aenter__()
            op_stay = await FakeOperator(a.addr, stay).__aenter__()
            try:
                await op_move.send_rollup([need("4", count=2)])
                await op_stay.send_rollup([need("4", count=2)])

                machines: list[provider_pb2.Machine] = []

                async def both_bound() -> bool:
                    # (nothing still on its way: a machine Creating for a cluster carries no
                    # cluster at the provider yet, and would be configured after the move)
                    c = await a.counts()  # type: ignore[union-attr]
                    if c.in_flight or any(c.by_state.get(s, 0) for s in ("MACHINE_STATE_CREATING",
                                                                        "MACHINE_STATE_CONFIGURING")):
                        return False
                    machines[:] = await spy.list_machines()
                    for c in (move, stay):
                        ms = [m for m in machines if m.cluster == c]
                        if not ms or any(m.state != CONFIGURED for m in ms):
                            return False
                        if (await a.counts(c)).bound_by_cluster.get(c, 0) != len(ms):  # type: ignore[union-attr]
                            return False
                    return True

                await until(both_bound, 90, "both clusters' machines Configured on shard A")
                moved_ids = sorted(m.id for m in machines if m.cluster == move)
                n_stay = sum(1 for m in machines if m.cluster == stay)
                # Every bound machine carries its owner in shard_metadata (stamped by the fenced Configure).
                assert {m.shard_metadata.get(OWNER_KEY) for m in machines if m.cluster} == {A}
                configures_before = spy.per_machine("Configure")

                # A second shard on the same provider, in shared mode: it sees none of A's machines.
                b = await ShardProc(spy_addr, extra=shard_args(B, g.addresses, "--ownership", "shared")).start()
                await until(lambda: shards().get(B) == b.addr, 60, "shard B registered")  # type: ignore[union-attr]
                await b.wait_cycles(2)
                assert sum((await b.counts()).by_state.values()) == 0

                plan = ctl(g.addresses, "rebalance", "--plan")
                assert isinstance(plan, dict)
                assert [(m["cluster_id"], m["from"], m["to"]) for m in plan["moves"]] == [(move, A, B)], plan
                t_apply = time.monotonic()
                applied = ctl(g.addresses, "rebalance", "--apply", "--plan-id", plan["plan_id"])
                assert isinstance(applied, dict) and len(applied["started"]) == 1

                # The old shard closes the moved cluster's Session with FAILED_PRECONDITION + redirect.
                await until(lambda: op_move.status is not None, 60, "the moved cluster's session closed by A")
                assert op_move.status == grpc.StatusCode.FAILED_PRECONDITION, op_move.details
                assert (await trailers(op_move)).get("bigfleet-redirect") == b.addr
                t_redirect = time.monotonic()

                def handed_off() -> bool:
                    r = g.call(g.leader(), "LookupCluster", pb.LookupClusterRequest(cluster_id=move))
                    return r.shard_id == B  # type: ignore[attr-defined,no-any-return]

                await until(handed_off, 60, "the coordinator binding the moved cluster to B")
                t_bound = time.monotonic()
            finally:
                await op_move.close()

            # A refuses the cluster from now on, naming B.
            async with FakeOperator(a.addr, move) as again:
                await until(lambda: again.status is not None, 30, "A refusing the moved cluster")
                assert again.status == grpc.StatusCode.FAILED_PRECONDITION
                assert (await trailers(again)).get("bigfleet-redirect") == b.addr

            # B serves it on the same machines, still Configured: nothing created, configured or drained.
            async with FakeOperator(b.addr, move) as op_b:
                await op_b.send_rollup([need("4", count=2)])
                await until(lambda: op_b.acks("rollup"), 30, "B accepting the moved cluster's roll-up")
                await until(lambda: {m for m, s in op_b.latest_node_states().items() if s == CONFIGURED} == set(moved_ids),
                            30, "B replaying the moved machines as Configured")
                t_served = time.monotonic()
                print(f"handoff timing (heartbeat 0.3 s): apply->redirect {t_redirect - t_apply:.2f}s, "
                      f"apply->bound to B {t_bound - t_apply:.2f}s, apply->served by B {t_served - t_apply:.2f}s "
                      f"({len(moved_ids)} machines)")
                await b.wait_cycles(5)
                cnt_b = await b.counts(move)
                assert cnt_b.bound_by_cluster.get(move, 0) == len(moved_ids)
                records = {m.id: m for m in await spy.list_machines()}
                assert all(records[i].state == CONFIGURED and records[i].cluster == move for i in moved_ids)
                assert spy.per_machine("Configure") == configures_before  # no double Configure
                assert not spy.of("Drain")

            # A no longer counts the moved machines; the staying cluster is untouched.
            cnt_a = await a.counts()
            assert move not in cnt_a.bound_by_cluster and cnt_a.bound_by_cluster.get(stay) == n_stay
            await op_stay.close()

            # A restart of A does not re-adopt the released machines from the provider's List.
            assert a.proc is not None
            a.proc.stop()
            a.proc = None
            a = await ShardProc(spy_addr, data_dir=a.data_dir, addr=a.addr, extra=shard_args(A, g.addresses)).start()
            await a.wait_cycles(3)
            cnt_a = await a.counts()
            assert move not in cnt_a.bound_by_cluster and cnt_a.bound_by_cluster.get(stay) == n_stay

            # A restart of B (shared ownership) keeps the adopted machines: its ledger names them.
            assert b.proc is not None
            b.proc.stop()
            b.proc = None
            b = await ShardProc(spy_addr, data_dir=b.data_dir, addr=b.addr,
                                extra=shard_args(B, g.addresses, "--ownership", "shared")).start()
            await b.wait_cycles(3)
            assert (await b.counts()).bound_by_cluster.get(move) == len(moved_ids)
            assert sum((await b.counts()).by_state.values()) == len(moved_ids)

            # Over the whole run, no machine got lifecycle calls from both shards.
            by_machine: dict[str, set[str]] = {}
            for name in MUTATING:
                for req in spy.of(name):
                    by_machine.setdefault(req.machine_id, set()).add(req.shard_id)
            assert by_machine and all(len(s) == 1 for s in by_machine.values()), by_machine
            assert all(by_machine[i] == {A} for i in moved_ids)
    except BaseException:
        print_shard_logs({"A": a, "B": b}, g.logs())
        raise
    finally:
        stop_shards(a, b)
        prov.stop()
        g.stop_all()
