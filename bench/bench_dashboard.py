"""Dashboard cost: one /api/fleet snapshot (ShardSource) over a large in-memory shard, and its JSON size.

The shard is real (ShardDaemon with inline engine, paused so no provider calls are made); only the
provider is absent. Reports median snapshot time, the JSON encode time and the payload size.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time

from bigfleet.dashboard.sources import ShardSource
from bigfleet.decision.types import EngineConfig
from bigfleet.observability import new_registry
from bigfleet.shard.daemon import DaemonConfig, ShardDaemon
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2
from bigfleet.wire.machine import META_NEED_FINGERPRINT

S = provider_pb2.MachineState
CASES = [(1_000, 100, 200), (10_000, 1_000, 2_000), (50_000, 1_000, 5_000)]  # machines, clusters, needs


def machine(i: int, clusters: int) -> provider_pb2.Machine:
    state = (S.MACHINE_STATE_SPECULATIVE, S.MACHINE_STATE_IDLE, S.MACHINE_STATE_CONFIGURED)[i % 3]
    cluster = f"c{i % clusters}" if state == S.MACHINE_STATE_CONFIGURED else ""
    pb = provider_pb2.Machine(id=f"m{i}", state=state, instance_type="m5.2xlarge", zone="us-east-1a",
                              price_per_hour=0.1, cluster=cluster, labels={"topology.kubernetes.io/zone": "us-east-1a"})
    pb.resources.resources.update({"cpu": "8", "memory": "32Gi"})
    if state != S.MACHINE_STATE_SPECULATIVE:
        pb.host.provider, pb.host.ref = "fake", f"host-{i}"
    if cluster:
        pb.shard_metadata[META_NEED_FINGERPRINT] = "fp"
    return pb


async def case(machines: int, clusters: int, needs: int) -> list[str]:
    cfg = DaemonConfig(shard_id="bench", provider="127.0.0.1:1", epoch=1, compute_inline=True,
                       reconcile_interval=1e9, engine=EngineConfig(paused=True))
    d = ShardDaemon(cfg, ShardMetrics(new_registry()))
    for i in range(machines):
        d.view.set(machine(i, clusters))
    per = max(1, needs // clusters)
    for c in range(clusters):
        ns = [capacity_pb2.CapacityNeed(aggregate_resources={"cpu": f"{(k % 7) + 1}"}, priority=100 + k,
                                        min_unit={"cpu": "1"}) for k in range(per)]
        await d.handle_rollup(f"c{c}", capacity_pb2.ClusterCapacityNeeds(cluster_id=f"c{c}", needs=ns))
    d.reconciled.set()
    d.reconciler.last_at = cfg.clock()
    await d.run_cycle()
    src = ShardSource(d, "127.0.0.1:7780")
    times, enc = [], []
    body = b""
    for _ in range(7):
        t0 = time.perf_counter()
        snap = await src.snapshot(time.time())
        t1 = time.perf_counter()
        body = json.dumps(snap, sort_keys=True).encode()
        enc.append(time.perf_counter() - t1)
        times.append(t1 - t0)
    await d.stop(drain_timeout=0.1)
    return [f"{machines:>8}", f"{clusters:>8}", f"{needs:>6}", f"{statistics.median(times) * 1000:>10.1f}",
            f"{statistics.median(enc) * 1000:>8.1f}", f"{len(body) / 1024:>8.0f}"]


def main(argv: list[str]) -> int:
    print("machines  clusters  needs  snapshot_ms  json_ms  json_KiB")
    for m, c, n in CASES:
        print("  ".join(asyncio.run(case(m, c, n))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
