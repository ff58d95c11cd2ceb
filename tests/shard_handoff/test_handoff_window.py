"""The handoff window, with real processes: after the old shard redirects the operator, the new shard
answers a Session for the moving cluster with UNAVAILABLE + ``bigfleet-retry-later: handoff`` until it
has adopted the cluster (it asks the coordinator's side-effect-free GetClusterStatus), and so never
provisions for a cluster whose machines are still on their way. Once adopted, the same operator is
served on the moved machines."""

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
from bigfleet.v1alpha1 import coordinator_pb2 as pb
from bigfleet.v1alpha1 import provider_pb2

pytestmark = pytest.mark.slow

A, B = "shard-a", "shard-b"
CONFIGURED = provider_pb2.MachineState.MACHINE_STATE_CONFIGURED
B_HEARTBEAT = 12.0  # B learns of AdoptCluster only on its next report: a wide, deterministic window


def ctl(coord: list[str], *args: str) -> object:
    out = subprocess.run([sys.executable, "-m", "bigfleet.ctl.main", "--coordinator", ",".join(coord), "-o", "json",
                          *args], capture_output=True, text=True, timeout=60, check=True).stdout
    return json.loads(out)


async def test_new_shard_holds_the_session_until_it_adopted_the_cluster(tmp_path: Path) -> None:
    move = next(c for c in (f"cl-{i}" for i in range(100)) if preferred(c, [A, B]) == B)
    g = CoordGroup(tmp_path / "coord", 1, extra=("--rebalance-interval", "0"))
    g.start_all()
    prov, paddr = start_provider("--seed-count", "6")
    a = b = None
    try:
        async with spy_provider(paddr) as (spy, spy_addr):
            a = await ShardProc(spy_addr, extra=("--shard-id", A, "--coordinator", g.addresses[0],
                                                 "--heartbeat-interval", "0.3")).start()

            def shards() -> dict[str, str]:
                return {s.shard_id: s.address for s in g.call(g.leader(), "ListShards", pb.ListShardsRequest()).shards}  # type: ignore[attr-defined]

            await until(lambda: A in shards(), 60, "shard A registered")
            bound = g.call(g.leader(), "LookupCluster", pb.LookupClusterRequest(cluster_id=move))
            assert bound.shard_id == A  # type: ignore[attr-defined]
            op = await FakeOperator(a.addr, move).__aenter__()
            try:
                await op.send_rollup([need("4", count=2)])

                async def bound_on_a() -> list[str]:
                    ms = [m for m in await spy.list_machines() if m.cluster == move]
                    return [m.id for m in ms] if len(ms) == 2 and all(m.state == CONFIGURED for m in ms) else []

                moved = sorted(await until(bound_on_a, 90, "the cluster's machines Configured on A"))
                b = await ShardProc(spy_addr, extra=("--shard-id", B, "--coordinator", g.addresses[0],
                                                     "--heartbeat-interval", str(B_HEARTBEAT),
                                                     "--ownership", "shared")).start()
                await until(lambda: shards().get(B) == b.addr, 60, "shard B registered")  # type: ignore[union-attr]
                t_registered = time.monotonic()
                plan = ctl(g.addresses, "rebalance", "--plan")
                assert isinstance(plan, dict) and [m["cluster_id"] for m in plan["moves"]] == [move], plan
                ctl(g.addresses, "rebalance", "--apply", "--plan-id", plan["plan_id"])
                await until(lambda: op.status is not None, 60, "A closing the moved cluster's session")
                assert op.status == grpc.StatusCode.FAILED_PRECONDITION, op.details
            finally:
                await op.close()

            # The redirected operator reaches B before B has adopted: held back, not served.
            async with FakeOperator(b.addr, move) as early:
                await until(lambda: early.status is not None, 30, "B answering the early Hello")
                held_for = time.monotonic() - t_registered
                md = {k: str(v) for k, v in (await asyncio.wait_for(early._call.trailing_metadata(), 5) or ())}
            assert held_for < B_HEARTBEAT, f"B may have adopted already ({held_for:.1f}s); the window was missed"
            assert early.status == grpc.StatusCode.UNAVAILABLE, (early.status, early.details)
            assert md.get("bigfleet-retry-later") == "handoff" and "being handed to this shard" in early.details
            assert not early.frames  # not even the Hello ack: nothing was served

            # Retrying as an operator does: admitted once the adoption is done, on A's machines.
            async def admitted() -> FakeOperator | None:
                o = await FakeOperator(b.addr, move).__aenter__()
                await until(lambda: o.status is not None or o.of("ack"), 30, "B answering a Hello")
                if o.status is None:
                    return o
                await o.close()
                return None

            op_b = await until(admitted, 60, "B admitting the moved cluster after adopting it", interval=0.5)
            try:
                assert (await b.counts(move)).bound_by_cluster.get(move, 0) == len(moved)  # type: ignore[union-attr]
                await op_b.send_rollup([need("4", count=2)])
                await until(lambda: op_b.acks("rollup"), 30, "B accepting the roll-up")
                await until(lambda: {m for m, s in op_b.latest_node_states().items() if s == CONFIGURED} == set(moved),
                            30, "B replaying the moved machines as Configured")
                await b.wait_cycles(3)
            finally:
                await op_b.close()
            # B never acted on the provider: nothing provisioned for the cluster in the window or after.
            assert not [r for name in ("Create", "Configure", "Drain", "Delete") for r in spy.of(name)
                        if r.shard_id == B]
            assert "session held back" in b.logs()
    except BaseException:
        print_shard_logs({"A": a, "B": b}, g.logs())
        raise
    finally:
        stop_shards(a, b)
        prov.stop()
        g.stop_all()
