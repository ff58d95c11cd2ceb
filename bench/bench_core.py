"""Domain core micro-benchmarks: quantities, resource vectors, fingerprints, NeedsTable, Machine
records and the Inventory at fleet scale (time per operation and bytes per machine).

    python -m bench.bench_core                 # 500 000 machines
    python -m bench.bench_core --machines 100000 --quick
"""

from __future__ import annotations

import argparse
import gc
import time
import tracemalloc
from collections.abc import Callable

from bigfleet.machine import CapacityType, Inventory, Machine, MachineState
from bigfleet.needs import (
    Need,
    NeedsTable,
    Operator,
    PenaltyBucket,
    Profile,
    Requirement,
    Resources,
    TopologySpread,
    parse_quantity,
)
from bigfleet.wire.machine import machine_from_proto, machine_to_proto
from bigfleet.wire.needs import rollup_from_proto, rollup_to_proto

S = MachineState


def per_op(fn: Callable[[], object], n: int) -> float:
    """Best-of-3 seconds per call of `fn` over `n` calls."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def fmt_t(seconds: float) -> str:
    if seconds < 1e-6:
        return f"{seconds * 1e9:.0f} ns"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


def fleet_machine(i: int, state: MachineState, types: list[tuple[str, str, Resources]]) -> Machine:
    t, z, r = types[i % len(types)]
    kw: dict[str, object] = {}
    if state is not S.SPECULATIVE:
        kw.update(host_provider="aws-eu-west-1", host_ref=f"i-{i:017x}")
    if state is S.CONFIGURED:
        kw.update(
            cluster=f"cluster-{i % 200:03d}",
            node_name=f"ip-10-{i % 256}-{i // 256 % 256}-{i // 65536 % 256}.eu-west-1.compute.internal",
            assigned_priority=(i % 5) * 1000,
            assigned_interruption_penalty_dollars=64.0,
            assigned_need_fingerprint=f"{i % 400:032x}",
        )
    return Machine(
        f"m-{i:08d}",
        state,
        instance_type=t,
        zone=z,
        capacity_type=CapacityType.ON_DEMAND,
        labels={"pool": t.split(".")[0], "arch": "amd64"},
        resources=r,
        price_per_hour=0.05 * (1 + i % 20),
        interruption_probability=0.01,
        state_since_unix_nanos=1_700_000_000_000_000_000 + i,
        **kw,  # type: ignore[arg-type]
    )


def machine_types() -> list[tuple[str, str, Resources]]:
    out = []
    for fam in ("m5", "c5", "r5", "p4d", "g5"):
        for size, cpu in (("large", 2), ("xlarge", 4), ("2xlarge", 8), ("4xlarge", 16), ("8xlarge", 32), ("16xlarge", 64)):
            for z in ("eu-1a", "eu-1b", "eu-1c"):
                out.append((f"{fam}.{size}", z, Resources.parse({"cpu": str(cpu), "memory": f"{cpu * 4}Gi"})))
    return out


def build_inventory(n: int, mix: list[MachineState]) -> Inventory:
    types = machine_types()
    inv = Inventory()
    for i in range(n):
        inv.add(fleet_machine(i, mix[i % len(mix)], types))
    return inv


def bytes_per_machine(n: int, mix: list[MachineState]) -> float:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    inv = build_inventory(n, mix)
    gc.collect()
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del inv
    return used / n


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench.bench_core")
    ap.add_argument("--machines", type=int, default=500_000)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions of the micro-benchmarks")
    args = ap.parse_args(argv)
    k = 10 if args.quick else 1
    rows: list[tuple[str, str]] = []

    # --- quantities and vectors
    for q in ("500m", "16Gi", "1.5", "1e3"):
        rows.append((f"parse_quantity({q!r})", fmt_t(per_op(lambda q=q: parse_quantity(q), 20_000 // k))))
    wire = {"cpu": "3500m", "memory": "14Gi", "nvidia.com/gpu": "1"}
    rows.append(("Resources.parse (3 dims)", fmt_t(per_op(lambda: Resources.parse(wire), 20_000 // k))))
    a = Resources.parse({"cpu": "4", "memory": "16Gi"})
    b = Resources.parse({"cpu": "8", "memory": "32Gi", "ephemeral-storage": "100Gi"})
    c = Resources.parse({"cpu": "16", "memory": "8Gi"})
    rows.append(("fits_in, 2 dims, true", fmt_t(per_op(lambda: a.fits_in(b), 200_000 // k))))
    rows.append(("fits_in, 2 dims, false on 2nd", fmt_t(per_op(lambda: a.fits_in(c), 200_000 // k))))
    rows.append(("Resources + (2+3 dims)", fmt_t(per_op(lambda: a + b, 100_000 // k))))
    rows.append(("saturating_sub (3-2 dims)", fmt_t(per_op(lambda: b.saturating_sub(a), 100_000 // k))))
    rows.append(("hash(Resources)", fmt_t(per_op(lambda: hash(b), 200_000 // k))))

    # --- profiles, needs, table
    reqs = (Requirement("zone", Operator.IN, ("a", "b")), Requirement("gpu", Operator.EXISTS))
    spread = (TopologySpread("zone", 1),)
    rows.append(("Profile(...) + fingerprint", fmt_t(per_op(
        lambda: Profile(reqs, spread, 1000, PenaltyBucket.B8, PenaltyBucket.B64, ""), 20_000 // k))))
    needs = [
        Need("c1", Profile(reqs, spread, p, PenaltyBucket.B8, PenaltyBucket(3 + p % 20), f"g{p % 7}"),
             Resources.parse({"cpu": str(1 + p % 64)}), a, 0)
        for p in range(1000)
    ]
    pb = rollup_to_proto("c1", needs)
    blob = pb.SerializeToString()
    rows.append(("roll-up wire size, 1000 needs", f"{len(blob) / 1024:.0f} KiB"))
    rows.append(("rollup_from_proto, 1000 needs", fmt_t(per_op(lambda: rollup_from_proto(pb, 1), max(1, 20 // k)))))
    t = NeedsTable()
    t.replace("c1", needs, 1)
    flip = [needs, [n.with_arrival(0) for n in reversed(needs)]]
    state = {"i": 0}

    def replace_same() -> None:
        state["i"] ^= 1
        t.replace("c1", flip[state["i"]], 2)

    rows.append(("NeedsTable.replace, 1000 needs, unchanged", fmt_t(per_op(replace_same, max(1, 20 // k)))))
    big = NeedsTable()
    for ci in range(100):
        big.replace(f"c{ci:03d}", [Need(f"c{ci:03d}", n.profile, n.aggregate_resources, n.min_unit, 0)
                                   for n in needs[:100]], ci)

    def resnap() -> None:
        big._snapshot = None
        big.snapshot()

    rows.append(("NeedsTable.snapshot, 10 000 needs, cold", fmt_t(per_op(resnap, max(1, 10 // k)))))

    # --- machines
    types = machine_types()
    rows.append(("Machine(...) flat kwargs, configured", fmt_t(per_op(
        lambda: fleet_machine(12345, S.CONFIGURED, types), 20_000 // k))))
    mpb = machine_to_proto(fleet_machine(12345, S.CONFIGURED, types))
    rows.append(("machine_from_proto, configured", fmt_t(per_op(lambda: machine_from_proto(mpb), 20_000 // k))))
    m = fleet_machine(1, S.IDLE, types)
    rows.append(("Machine.replace(state=...)", fmt_t(per_op(lambda: m.replace(state=S.CONFIGURING), 100_000 // k))))

    n = args.machines
    mix = [S.SPECULATIVE] * 4 + [S.IDLE] + [S.CONFIGURED] * 5
    t0 = time.perf_counter()
    inv = build_inventory(n, mix)
    build = time.perf_counter() - t0
    rows.append((f"Inventory build, {n} machines (40% spec/10% idle/50% conf)", fmt_t(build)))
    rows.append(("  per machine", fmt_t(build / n)))
    ids = [f"m-{i:08d}" for i in range(4, n, 10)][: 20_000 // k]  # idle machines
    t0 = time.perf_counter()
    for j, mid in enumerate(ids):
        inv.transition(mid, S.CONFIGURING, 10 + j, cluster="cluster-x", assigned_priority=5)
    dt = time.perf_counter() - t0
    rows.append(("Inventory.transition Idle→Configuring", fmt_t(dt / max(1, len(ids)))))
    t0 = time.perf_counter()
    total = sum(1 for _ in inv.by_state(S.IDLE))
    rows.append((f"iterate by_state(IDLE) ({total})", fmt_t(time.perf_counter() - t0)))
    t0 = time.perf_counter()
    snap = inv.copy()
    rows.append((f"Inventory.copy ({n})", fmt_t(time.perf_counter() - t0)))
    del snap, inv
    gc.collect()
    rows.append((f"bytes/machine incl. indexes, {n}, mixed", f"{bytes_per_machine(n, mix):.0f} B"))
    rows.append((f"bytes/machine incl. indexes, {n}, all configured", f"{bytes_per_machine(n, [S.CONFIGURED]):.0f} B"))
    rows.append((f"bytes/machine incl. indexes, {n}, all speculative", f"{bytes_per_machine(n, [S.SPECULATIVE]):.0f} B"))

    width = max(len(r[0]) for r in rows)
    print(f"{'operation'.ljust(width)} | result")
    print(f"{'-' * width}-|-------")
    for name, val in rows:
        print(f"{name.ljust(width)} | {val}")
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(main(sys.argv[1:]))
