"""A coordinator cross-shard drain whose shard is killed (kill -9) after its provider Drain started.

The coordinator redelivers the unacknowledged ``CrossShardDrain`` to the restarted shard. The victim
the dead process was draining is already given up by its cluster (its operator got the
ReclaimInstruction, the provider is draining it): the restarted shard must carry that drain through
and hand the machine over. Before the fix it picked a *second* victim (whose drain it then dropped:
the cluster's operator had not reconnected yet), released nothing, and let its own engine configure
the first victim back for the low-priority cluster once the provider finished draining it; the
coordinator, remembering the empty drain, did not ask that shard again for 300 s, so the
high-priority need starved (found black-box on the chart topology).

Real processes: a 3-replica coordinator, two shard processes (exclusive A, shared B) on one fake
provider behind a recording spy, and operator stand-ins that re-resolve their shard like operators.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest
from shard.cluster import ShardProc, print_shard_logs, start_provider, stop_shards
from topology.fleet import RoutedOperator, S, start_spy, until, violations

from bigfleet.coordclient.client import CoordinatorClient
from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.placement.hrw import preferred
from bigfleet.v1alpha1 import coordinator_pb2 as pb

pytestmark = pytest.mark.slow

A, B = "shard-a", "shard-b"
UNIT = "7"  # one 8-vCPU host (7.5 allocatable) per unit of demand
LOW, HIGH = 100, 1000


def shard_args(sid: str, coord: list[str], *extra: str) -> tuple[str, ...]:
    return ("--shard-id", sid, "--coordinator", ",".join(coord), "--heartbeat-interval", "0.3", *extra)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kill_at", ["draining", "queued"])
async def test_restarted_shard_carries_out_the_redelivered_cross_shard_drain(tmp_path: Path, kill_at: str) -> None:
    """``draining``: killed once the provider drains the victim. ``queued``: the shard is stopped
    (SIGSTOP) before the coordinator queues the drain and killed while it is queued, so the restarted
    shard gets it on its first report, before any operator has reconnected."""
    low = next(c for c in (f"low-{i}" for i in range(100)) if preferred(c, [A, B]) == A)
    high = next(c for c in (f"high-{i}" for i in range(100)) if preferred(c, [A, B]) == B)
    g = CoordGroup(tmp_path / "coord", 3, extra=("--rebalance-interval", "0.5", "--transfer-cooldown", "1"))
    g.start_all()
    # A long drain: the restarted shard is back (and the drain redelivered) before the provider ends it.
    prov, paddr = start_provider("--seed-count", "0", "--committed-count", "3", "--configure-delay", "0.3",
                                 "--drain-delay", "12")
    spy, server, spy_addr = await start_spy(paddr)
    client = CoordinatorClient(g.addresses, timeout=10)
    a = b = None
    ops: list[RoutedOperator] = []
    try:
        a = await ShardProc(spy_addr, extra=shard_args(A, g.addresses)).start()

        async def shards() -> dict[str, str]:
            return {s.shard_id: s.address for s in (await client.call("ListShards", pb.ListShardsRequest())).shards}

        async def configured() -> dict[str, int]:
            out: dict[str, int] = {}
            for m in await spy.machines():
                if m.cluster and m.state == S.MACHINE_STATE_CONFIGURED:
                    out[m.cluster] = out.get(m.cluster, 0) + 1
            return out

        await until(lambda: _has(shards, A), 60, "shard A registered")
        op_low = RoutedOperator(g.addresses, low, cpu=UNIT, priority=LOW, count=3).start()
        ops.append(op_low)
        await until(lambda: _equals(configured, {low: 3}), 90, "the low cluster on all three hosts")

        b = await ShardProc(spy_addr, extra=shard_args(B, g.addresses, "--ownership", "shared")).start()
        await until(lambda: _has(shards, B), 60, "shard B registered")
        assert (await client.call("LookupCluster", pb.LookupClusterRequest(cluster_id=high))).shard_id == B
        t0 = time.monotonic()
        assert a.proc is not None
        if kill_at == "queued":
            a.proc.signal(signal.SIGSTOP)
        ops.append(RoutedOperator(g.addresses, high, cpu=UNIT, priority=HIGH, count=1).start())

        # Tier 2: A drains one of low's hosts for high.
        if kill_at == "queued":
            await until(lambda: _drain_queued(client, A), 120, "a cross-shard drain queued for shard A")
        else:
            await until(lambda: [c for c in spy.mutating(A, since=t0) if c.rpc == "Drain"], 120,
                        "shard A draining a victim")
        a.proc.kill()
        a.proc = None
        a = await ShardProc(spy_addr, data_dir=a.data_dir, addr=a.addr, extra=shard_args(A, g.addresses)).start()

        await until(lambda: _equals(configured, {low: 2, high: 1}), 90, "high served with the drained host")
        drained = [c.machine_id for c in spy.mutating(A, since=t0) if c.rpc == "Drain"]
        assert len(drained) == 1, f"a second victim was drained: {drained}"
        assert [m.cluster for m in await spy.machines() if m.id == drained[0]] == [high]
        assert not violations(spy, ops, list((await client.call("ListTransfers", pb.ListTransfersRequest())).transfers))
    except BaseException:
        print_shard_logs({"A": a, "B": b}, g.logs())
        raise
    finally:
        for op in ops:
            await op.stop()
        stop_shards(a, b)
        await server.stop(0)
        await spy.channel.close()
        await client.close()
        prov.stop()
        g.stop_all()


async def _has(shards: object, sid: str) -> bool:
    return sid in await shards()  # type: ignore[operator]


async def _equals(configured: object, want: dict[str, int]) -> bool:
    return bool(await configured() == want)  # type: ignore[operator]


async def _drain_queued(client: CoordinatorClient, frm: str) -> bool:
    ts = (await client.call("ListTransfers", pb.ListTransfersRequest())).transfers
    return any(t.kind == "drain" and t.from_shard_id == frm and t.phase == "releasing" for t in ts)
