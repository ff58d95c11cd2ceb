"""Coordinator benchmarks: failover distribution, placement quality and cost, Raft-backed RPC rates.

`python -m bench coordinator` (or `python -m bench.bench_coordinator --runs 20`).
Failover = SIGKILL the leader of a 3-process group, then time until another
replica serves as a caught-up leader, and until its first committed write.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from bigfleet.coordclient.client import CoordinatorClient
from bigfleet.coordinator.localgroup import CoordGroup
from bigfleet.placement import loads, place, plan_rebalance
from bigfleet.placement.hrw import max_over_mean
from bigfleet.process.procs import health_status
from bigfleet.testing import wait_until
from bigfleet.v1alpha1 import coordinator_pb2 as pb


def _pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p * (len(s) - 1)))]


def bench_placement() -> None:
    print("\n### placement (pure, bounded-load HRW, c = 1.25)")
    print(
        f"{'clusters':>9} {'shards':>6} {'place all (s)':>13} {'max/mean':>8} {'+1 shard: moved':>15} "
        f"{'(full HRW)':>10} {'ideal 1/N+1':>11} {'plan (s)':>8}"
    )
    for k, n in ((10_000, 8), (10_000, 200), (100_000, 50)):
        shards = [f"shard-{i}" for i in range(n)]
        ld = dict.fromkeys(shards, 0)
        b: dict[str, str] = {}
        t0 = time.perf_counter()
        for i in range(k):
            cid = f"cluster-{i:06d}"
            s = place(cid, shards, ld)
            assert s is not None
            b[cid] = s
            ld[s] += 1
        t_place = time.perf_counter() - t0
        grown = [*shards, f"shard-{n}"]
        joined = {**dict.fromkeys(shards, 0), f"shard-{n}": 2}
        t0 = time.perf_counter()
        plan = plan_rebalance(b, grown, joined_at=joined, bound_at=dict.fromkeys(b, 1))
        t_plan = time.perf_counter() - t0
        full = plan_rebalance(b, grown)
        print(
            f"{k:>9} {n:>6} {t_place:>13.2f} {max_over_mean(loads(b, shards)):>8.3f} "
            f"{len(plan.moves) / k:>15.4f} {len(full.moves) / k:>10.4f} {1 / (n + 1):>11.4f} {t_plan:>8.2f}"
        )


async def _rpc_rates(g: CoordGroup, leader: int) -> None:
    client = CoordinatorClient([g.addr(leader)])
    try:
        for s in range(8):
            await client.call("ReportShard", pb.ShardReport(shard_id=f"bench-shard-{s}", shard_address=f"10.1.0.{s}:7780"))
        n = 500
        t0 = time.perf_counter()
        for i in range(n):
            await client.call("LookupCluster", pb.LookupClusterRequest(cluster_id=f"bench-c-{i}"))
        seq = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        await asyncio.gather(*(client.call("LookupCluster", pb.LookupClusterRequest(cluster_id=f"bench-p-{i}")) for i in range(n)))
        par = n / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        await asyncio.gather(*(client.call("LookupCluster", pb.LookupClusterRequest(cluster_id=f"bench-c-{i}")) for i in range(n)))
        cached = n / (time.perf_counter() - t0)
        shards = 200
        t0 = time.perf_counter()
        await asyncio.gather(
            *(client.call("ReportShard", pb.ShardReport(shard_id=f"hb-{i}", shard_address=f"10.2.0.{i}:1")) for i in range(shards))
        )
        first = shards / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        await asyncio.gather(*(client.call("ReportShard", pb.ShardReport(shard_id=f"hb-{i}")) for i in range(shards)))
        steady = shards / (time.perf_counter() - t0)
        print("\n### RPC rates on a 3-replica group (one client process)")
        print(f"{'what':<52} {'per s':>8}")
        print(f"{'LookupCluster, new cluster (1 Raft write), sequential':<52} {seq:>8.0f}")
        print(f"{'LookupCluster, new cluster, 500 concurrent':<52} {par:>8.0f}")
        print(f"{'LookupCluster, already bound (read), 500 concurrent':<52} {cached:>8.0f}")
        print(f"{'ReportShard, first report (registers), 200 concurrent':<52} {first:>8.0f}")
        print(f"{'ReportShard, steady heartbeat (no write), 200 conc.':<52} {steady:>8.0f}")
    finally:
        await client.close()


def bench_failover(runs: int, root: Path) -> None:
    g = CoordGroup(root, 3, extra=("--rebalance-interval", "0"))
    g.start_all()
    try:
        leader = g.leader()
        asyncio.run(_rpc_rates(g, leader))
        g.call(leader, "ReportShard", pb.ShardReport(shard_id="fo-shard", shard_address="x:1"))
        elected: list[float] = []
        first_write: list[float] = []
        acked: dict[str, str] = {}
        lost = 0
        for r in range(runs):
            # Keep the shard live (it would count as down after --down-after without reports).
            g.call(leader, "ReportShard", pb.ShardReport(shard_id="fo-shard", shard_address="x:1"))
            for c in range(5):
                cid = f"fo-{r}-{c}"
                acked[cid] = g.call(leader, "LookupCluster", pb.LookupClusterRequest(cluster_id=cid)).shard_id  # type: ignore[attr-defined]
            g.kill(leader)
            t0 = time.monotonic()
            new = g.leader(timeout=30)
            elected.append(time.monotonic() - t0)
            g.call(new, "LookupCluster", pb.LookupClusterRequest(cluster_id=f"fo-{r}-after"), timeout=10)
            first_write.append(time.monotonic() - t0)
            got = g.call(new, "ListClusterBindings", pb.ListClusterBindingsRequest()).bindings  # type: ignore[attr-defined]
            have = {b.cluster_id: b.shard_id for b in got}
            lost += sum(1 for c, s in acked.items() if have.get(c) != s)
            g.start(leader)
            killed = leader
            wait_until(lambda k=killed: health_status(g.addr(k), "bigfleet.v1alpha1.Coordinator") == 1, 30, what="rejoin")
            time.sleep(1.0)  # let the restarted replica catch up before the next kill
            leader = new
        under2 = sum(1 for x in elected if x < 2.0)
        print(f"\n### failover: SIGKILL the leader, {runs} runs (3 processes, election 0.3-0.6 s)")
        print(f"{'measure':<34} {'min':>6} {'p50':>6} {'p90':>6} {'max':>6} {'mean':>6}")
        for name, xs in (("new leader serving (s)", elected), ("first committed write (s)", first_write)):
            print(f"{name:<34} {min(xs):>6.2f} {_pct(xs, 0.5):>6.2f} {_pct(xs, 0.9):>6.2f} {max(xs):>6.2f} {statistics.mean(xs):>6.2f}")
        print(f"runs with a new leader < 2 s: {under2}/{runs}; acknowledged writes lost: {lost} of {len(acked)}")
        print("all samples (s): " + " ".join(f"{x:.2f}" for x in elected))
    finally:
        g.stop_all()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench.bench_coordinator")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--skip-placement", action="store_true")
    args = p.parse_args(argv)
    if not args.skip_placement:
        bench_placement()
    with tempfile.TemporaryDirectory(prefix="bench-coord-") as d:
        bench_failover(args.runs, Path(d))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
