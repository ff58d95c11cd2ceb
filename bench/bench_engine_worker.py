"""What one cycle costs the shard process when the engine runs in its worker (shard/engineproc.py).

Builds a real `MachineView` (provider records) and demand store, starts a real worker process and
runs cycles through it: the first one a full resync, then steady cycles with no change, then
cycles with a few machine and demand changes. Per cycle it reports the request and reply sizes,
the shard-side time to build the request (on the event loop), to pickle it and to unpickle the
reply (on a thread), and the worker's round trip (engine included). The point: everything the
shard process does per cycle is proportional to what changed, not to the fleet.

    python -m bench.bench_engine_worker --machines 100000 --clusters 1000
"""

from __future__ import annotations

import argparse
import os
import pickle
import random
import time

from bigfleet.decision.types import EngineConfig
from bigfleet.process.procstat import proc_rss_mb
from bigfleet.shard.engineproc import EngineWorker, MirrorFeed, read_frame, write_frame
from bigfleet.shard.store import LocalDemandStore
from bigfleet.shard.view import MachineView
from bigfleet.v1alpha1 import capacity_pb2, provider_pb2
from bigfleet.wire.needs import rollup_from_proto

S = provider_pb2.MachineState
NOW = 1_900_000_000 * 1_000_000_000
ZONES = ("us-east-1a", "us-east-1b", "us-east-1c")
TYPES = (("m5.2xlarge", "8", 0.38), ("m5.4xlarge", "16", 0.77), ("c5.2xlarge", "8", 0.34))


def machine(i: int, state: int = S.MACHINE_STATE_SPECULATIVE) -> provider_pb2.Machine:
    itype, cpu, price = TYPES[i % len(TYPES)]
    zone = ZONES[(i // 3) % len(ZONES)]
    pb = provider_pb2.Machine(id=f"m-{i:07d}", state=state, instance_type=itype, zone=zone,  # type: ignore[arg-type]
                              price_per_hour=price, labels={"topology.kubernetes.io/zone": zone})
    pb.resources.resources.update({"cpu": cpu, "memory": "32Gi"})
    if state != S.MACHINE_STATE_SPECULATIVE:
        pb.host.provider, pb.host.ref = "bench", f"h-{i}"
    return pb


def rollup(cluster: int, rng: random.Random) -> capacity_pb2.ClusterCapacityNeeds:
    needs = []
    for j in range(10):
        cpu = rng.choice((1, 2, 4))
        needs.append(capacity_pb2.CapacityNeed(
            requirements=[capacity_pb2.NodeSelectorRequirement(
                key="topology.kubernetes.io/zone", operator=capacity_pb2.NodeSelectorRequirement.OPERATOR_IN,
                values=[ZONES[(cluster + j) % 3]])],
            aggregate_resources={"cpu": str(cpu * rng.randint(1, 8))}, min_unit={"cpu": str(cpu)},
            priority=100 + j))
    return capacity_pb2.ClusterCapacityNeeds(cluster_id=f"c{cluster:05d}", needs=needs)


def cycle(worker: EngineWorker, feed: MirrorFeed, view: MachineView, store: LocalDemandStore, cfg: EngineConfig,
          now: int) -> dict[str, float]:
    proc = worker.proc
    assert proc is not None and proc.stdin is not None and proc.stdout is not None
    t0 = time.perf_counter()
    req = feed.build(view, store.table, view.inflight, now, store.engine_state(), cfg)
    t1 = time.perf_counter()
    data = pickle.dumps(req, protocol=pickle.HIGHEST_PROTOCOL)
    t2 = time.perf_counter()
    write_frame(proc.stdin, data)
    raw = read_frame(proc.stdout)
    t3 = time.perf_counter()
    assert raw is not None
    reply = pickle.loads(raw)
    t4 = time.perf_counter()
    assert reply.status == "ok", reply.error
    decision = feed.accept(req, reply)
    store.save_engine_state(decision.state)
    return {"req_kb": len(data) / 1024, "reply_kb": len(raw) / 1024, "build_ms": (t1 - t0) * 1e3,
            "pickle_ms": (t2 - t1) * 1e3, "unpickle_ms": (t4 - t3) * 1e3, "roundtrip_ms": (t3 - t2) * 1e3,
            "engine_ms": reply.compute_seconds * 1e3, "upserts": len(req.upserts), "clusters": len(req.needs),
            "actions": len(decision.actions) + sum(reply.suppressed_counts.values())}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench_engine_worker")
    p.add_argument("--machines", type=int, default=100_000)
    p.add_argument("--clusters", type=int, default=1_000)
    p.add_argument("--cycles", type=int, default=5, help="cycles per kind")
    args = p.parse_args(argv)
    rng = random.Random(1)
    view = MachineView(wall_ns=lambda: NOW)
    for i in range(args.machines):
        # a steady fleet: a third idle, a third bound, a third speculative slots
        st = (S.MACHINE_STATE_SPECULATIVE, S.MACHINE_STATE_IDLE, S.MACHINE_STATE_CONFIGURED)[i % 3]
        pb = machine(i, st)
        if st == S.MACHINE_STATE_CONFIGURED:
            pb.cluster = f"c{(i // 3) % args.clusters:05d}"
        view.set(pb)
    store = LocalDemandStore()
    for c in range(args.clusters):
        _, needs = rollup_from_proto(rollup(c, rng), NOW)
        store.mark_first_rollup(f"c{c:05d}")
        store.apply_rollup(f"c{c:05d}", needs, NOW)
    cfg = EngineConfig(dry_run=True)
    worker = EngineWorker()
    worker.start()
    feed = MirrorFeed()
    rows: list[tuple[str, dict[str, float]]] = []
    now = NOW
    try:
        rows.append(("full resync", cycle(worker, feed, view, store, cfg, now)))
        for _ in range(args.cycles):
            now += 2_000_000_000
            rows.append(("no change", cycle(worker, feed, view, store, cfg, now)))
        for _ in range(args.cycles):
            now += 2_000_000_000
            for _ in range(100):  # 100 machine records change
                i = rng.randrange(args.machines)
                cur = view.get(f"m-{i:07d}")
                if cur is not None and cur.state == S.MACHINE_STATE_SPECULATIVE:
                    view.set(machine(i, S.MACHINE_STATE_IDLE))
                elif cur is not None and cur.state == S.MACHINE_STATE_IDLE:
                    view.set(machine(i, S.MACHINE_STATE_SPECULATIVE))
            for _ in range(50):  # 50 clusters change their demand
                c = rng.randrange(args.clusters)
                _, needs = rollup_from_proto(rollup(c, rng), now)
                store.apply_rollup(f"c{c:05d}", needs, now)
            rows.append(("100 machines + 50 clusters changed", cycle(worker, feed, view, store, cfg, now)))
        worker_rss = proc_rss_mb(worker.pid or 0)
    finally:
        proc = worker.proc
        if proc is not None and proc.stdin is not None:
            proc.stdin.close()
            proc.wait(10)
    print(f"machines={args.machines} clusters={args.clusters} needs={len(store.table)} (dry-run engine config); "
          f"RSS: this process (view + store) {proc_rss_mb(os.getpid()):.0f} MB, worker {worker_rss:.0f} MB")
    cols = ["req_kb", "reply_kb", "build_ms", "pickle_ms", "unpickle_ms", "roundtrip_ms", "engine_ms", "upserts",
            "clusters", "actions"]
    print("| cycle | " + " | ".join(cols) + " |")
    print("|---|" + "---|" * len(cols))
    for name, r in rows:
        print(f"| {name} | " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
