"""Shard-side handoff costs: the ownership filter every reconcile applies to each provider record,
and the durable ledger write that precedes every release/adopt ack."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from bigfleet.shard.handoff import EXCLUSIVE, OWNER_KEY, SHARED, OwnershipLedger, save_ledger
from bigfleet.v1alpha1 import provider_pb2


def _records(n: int) -> list[provider_pb2.Machine]:
    out = []
    for i in range(n):
        pb = provider_pb2.Machine(id=f"m-{i:06d}")
        if i % 2:
            pb.cluster = f"c{i % 100}"
            pb.shard_metadata[OWNER_KEY] = "A" if i % 4 == 1 else "B"
        out.append(pb)
    return out


def main(argv: list[str]) -> int:
    recs = _records(100_000)
    print("| case | records | released/adopted | total ms | ns/record |")
    print("|---|---:|---:|---:|---:|")
    for mode, label in ((EXCLUSIVE, "owns() exclusive"), (SHARED, "owns() shared")):
        led = OwnershipLedger("A", mode)
        led.release((r.id for r in recs[::10]), "c")
        led.adopt(r.id for r in recs[5::10])
        t0 = time.perf_counter()
        mine = sum(1 for r in recs if led.owns(r))
        dt = time.perf_counter() - t0
        print(f"| {label} ({mine} mine) | {len(recs)} | {len(led.released)}/{len(led.adopted)} | {dt * 1e3:.1f} | {dt / len(recs) * 1e9:.0f} |")
    with tempfile.TemporaryDirectory() as d:
        for n in (1_000, 10_000, 100_000):
            led = OwnershipLedger("A")
            led.release_cluster("c", (f"m-{i:06d}" for i in range(n)), "B", "h:1")
            t0 = time.perf_counter()
            reps = 5
            for _ in range(reps):
                save_ledger(Path(d) / "ownership.json", led)
            dt = (time.perf_counter() - t0) / reps
            print(f"| save_ledger (fsync) | - | {n}/0 | {dt * 1e3:.1f} | - |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main([]))
