"""Synthetic fleets in the shapes of decision-engine.md §18 (sizes are parameters)."""

from __future__ import annotations

from dataclasses import dataclass

from bigfleet.machine import CapacityType, Inventory, Machine, MachineState
from bigfleet.needs import Need, Operator, PenaltyBucket, Profile, Requirement, Resources

S = MachineState
TYPE_KEY = "node.kubernetes.io/instance-type"
RACK_KEY = "topology.kubernetes.io/rack"
GI = (1 << 30) * 1000


def res(cpu: float = 0, mem_gi: float = 0, gpu: int = 0) -> Resources:
    d = {}
    if cpu:
        d["cpu"] = int(cpu * 1000)
    if mem_gi:
        d["memory"] = int(mem_gi * GI)
    if gpu:
        d["nvidia.com/gpu"] = gpu * 1000
    return Resources.from_milli(d)


@dataclass(frozen=True)
class Arch:
    name: str
    alloc: Resources
    price: float
    ctype: CapacityType
    prob: float = 0.0


def mk(mid: str, state: MachineState, a: Arch, rack: str, cluster: str = "", prio: int = 0,
       fp: str = "", ipd: float = 0.0, rpd: float = 0.0, since: int = 0) -> Machine:
    host = "" if state is S.SPECULATIVE else "bench"
    return Machine(mid, state, instance_type=a.name, zone=rack[:6], capacity_type=a.ctype, price_per_hour=a.price,
                   interruption_probability=a.prob, labels={RACK_KEY: rack}, resources=a.alloc,
                   cluster=cluster if state in (S.CONFIGURED, S.CONFIGURING) else "", host_provider=host,
                   host_ref=mid if host else "", assigned_priority=prio, assigned_need_fingerprint=fp,
                   assigned_interruption_penalty_dollars=ipd, assigned_reclamation_penalty_dollars=rpd,
                   state_since_unix_nanos=since)


def type_req(name: str) -> Requirement:
    return Requirement(TYPE_KEY, Operator.IN, (name,))


# --- uber-5k ---------------------------------------------------------------------------------

TINY = Arch("tiny-16", res(16, 64), 0.8, CapacityType.ON_DEMAND)
SVC = Arch("svc-32", res(32, 128), 1.6, CapacityType.ON_DEMAND)
MEMC = Arch("memc-64", res(64, 512), 4.0, CapacityType.ON_DEMAND)
GPU = Arch("gpu-8", res(96, 1024, 8), 30.0, CapacityType.RESERVED)
UBER_ARCHES = (TINY, SVC, MEMC, GPU)


def uber5k(clusters: int = 20) -> tuple[list[Need], Inventory]:
    """20 clusters × (2 plain + 95 memcache gangs of 4 + 32 GPU gangs of 5) = 2 580 needs (~93 % gangs);
    5 000 Configured, 1 000 Idle, 12 000 Speculative; racks in blocks of 8, 12 racks per archetype."""
    needs: list[Need] = []
    machines: list[Machine] = []
    same_rack = Requirement(RACK_KEY, Operator.SAME, ())
    for ci in range(clusters):
        c = f"cluster-{ci:02d}"
        tiny = Profile.build([type_req(TINY.name)], priority=1000, interruption_bucket=PenaltyBucket.B64)
        svc = Profile.build([type_req(SVC.name)], priority=5000, interruption_bucket=PenaltyBucket.B512)
        needs.append(Need(c, tiny, res(0.16, 0.64).scale(17_500), res(0.16, 0.64), 1))
        needs.append(Need(c, svc, res(3.2, 12.8).scale(300), res(3.2, 12.8), 2))
        for g in range(95):
            p = Profile.build([type_req(MEMC.name), same_rack], priority=8000,
                              interruption_bucket=PenaltyBucket.B4096, group=f"memc-{g}")
            needs.append(Need(c, p, res(6.4, 51.2).scale(4), res(6.4, 51.2), 10 + g))
        for g in range(32):
            p = Profile.build([type_req(GPU.name), same_rack], priority=100_000,
                              interruption_bucket=PenaltyBucket.B65536, group=f"gpu-{g}")
            needs.append(Need(c, p, res(96, 1024, 8).scale(5), res(96, 1024, 8), 200 + g))
        for a, n in ((TINY, 175), (SVC, 30), (MEMC, 30), (GPU, 15)):
            for i in range(n):
                rack = f"{a.name}-r{(ci * n + i) // 8 % 12:02d}"
                machines.append(mk(f"{c}-{a.name}-{i:04d}", S.CONFIGURED, a, rack, c, prio=1000))
    k = 0
    for state, total in ((S.IDLE, 1000), (S.SPECULATIVE, 12_000)):
        for i in range(total):
            a = UBER_ARCHES[i % 4]
            rack = f"{a.name}-r{(i // 4) // 8 % 12:02d}"
            machines.append(mk(f"free-{k:06d}", state, a, rack))
            k += 1
    return needs, Inventory(machines)


# --- realistic-50k ---------------------------------------------------------------------------

ARCH6 = (
    (Arch("m6i.2xlarge", res(8, 32), 0.384, CapacityType.ON_DEMAND), 30),
    (Arch("m6i.4xlarge", res(16, 64), 0.768, CapacityType.ON_DEMAND), 20),
    (Arch("c6i.4xlarge", res(16, 32), 0.68, CapacityType.SPOT, 0.05), 20),
    (Arch("r6i.4xlarge", res(16, 128), 1.008, CapacityType.ON_DEMAND), 15),
    (Arch("g5.2xlarge", res(8, 32, 1), 1.21, CapacityType.ON_DEMAND), 10),
    (Arch("p4d.24xlarge", res(96, 1152, 8), 32.77, CapacityType.RESERVED), 5),
)


def realistic50k(idle: int = 60_000, clusters: int = 50, per_cluster: int = 1000) -> tuple[list[Need], Inventory]:
    """60 000 Idle over six weighted archetypes; 50 clusters × 1 000 single-unit needs."""
    machines: list[Machine] = []
    weights = [w for _, w in ARCH6]
    total_w = sum(weights)
    k = 0
    for a, w in ARCH6:
        for i in range(idle * w // total_w):
            machines.append(mk(f"idle-{k:06d}", S.IDLE, a, f"{a.name}-r{i % 16:02d}"))
            k += 1
    needs: list[Need] = []
    for ci in range(clusters):
        c = f"cluster-{ci:02d}"
        for j in range(per_cluster):
            a = ARCH6[j % 6][0]
            p = Profile.build([type_req(a.name)], priority=(j % 10) * 1000,
                              interruption_bucket=PenaltyBucket.B64, group=f"pod-{j}")
            needs.append(Need(c, p, a.alloc, a.alloc, j + 1))
    return needs, Inventory(machines)


# --- aggregated-500k -------------------------------------------------------------------------

TYPES5 = tuple(Arch(f"type-{i}", res(8 * (i + 1), 32 * (i + 1)), 0.4 * (i + 1), CapacityType.ON_DEMAND)
               for i in range(5))


def agg_needs(cluster: str, per_cluster: int, machines_each: int, bump: int = 0) -> list[Need]:
    out = []
    for j in range(per_cluster):
        a = TYPES5[j % 5]
        p = Profile.build([type_req(a.name)], priority=1000 + j, interruption_bucket=PenaltyBucket.B64)
        out.append(Need(cluster, p, a.alloc.scale(machines_each + bump), a.alloc, j + 1))
    return out


def aggregated500k(machines: int = 500_000, clusters: int = 5000, per_cluster: int = 10,
                   idle_fraction: float = 0.02) -> tuple[list[Need], Inventory, list[str]]:
    """Every cluster's needs exactly met by its Configured machines, plus a little Idle."""
    configured = int(machines * (1 - idle_fraction))
    per_c = configured // clusters
    each = max(1, per_c // per_cluster)
    ms: list[Machine] = []
    needs: list[Need] = []
    names = [f"c{ci:05d}" for ci in range(clusters)]
    for ci, c in enumerate(names):
        cn = agg_needs(c, per_cluster, each)
        needs.extend(cn)
        for j in range(per_cluster):
            a = TYPES5[j % 5]
            for i in range(each):
                ms.append(mk(f"{c}-{j}-{i:03d}", S.CONFIGURED, a, f"r{(ci + i) % 64:02d}", c, prio=1000 + j,
                             fp=cn[j].fingerprint))
    k = 0
    while len(ms) < machines:
        a = TYPES5[k % 5]
        ms.append(mk(f"idle-{k:06d}", S.IDLE, a, f"r{k % 64:02d}", since=10**18))
        k += 1
    return needs, Inventory(ms), names


# --- phase2-inversions / phase3-high-demand --------------------------------------------------

def configured_fleet(machines: int, clusters: int, prio: int, rpd_mod: int = 7) -> list[Machine]:
    out = []
    for i in range(machines):
        a = TYPES5[i % 5]
        out.append(mk(f"m{i:07d}", S.CONFIGURED, a, f"r{i % 64:02d}", f"c{(i // 5) % clusters:03d}", prio=prio,
                      ipd=float(1 << (i % 12)), rpd=float(i % rpd_mod)))
    return out


def phase2_inversions(machines: int = 500_000, needs: int = 100) -> tuple[list[Need], Inventory]:
    """500 000 Configured at priority 100 (10 clusters, 5 types); 100 short needs at 1M, one type each."""
    fleet = configured_fleet(machines, 10, 100)
    out = []
    for j in range(needs):
        a = TYPES5[j % 5]
        p = Profile.build([type_req(a.name)], priority=1_000_000, interruption_bucket=PenaltyBucket.B8192,
                          group=f"hi-{j}")
        out.append(Need(f"hi-{j:03d}", p, a.alloc.scale(10), a.alloc, 1))
    return out, Inventory(fleet)


def phase3_high_demand(machines: int = 500_000, clusters: int = 50) -> tuple[list[Need], Inventory, list[str]]:
    """500 000 Configured over 50 clusters, 3 needs per cluster (wanting ~90 % of what they hold)."""
    fleet = configured_fleet(machines, clusters, 1000)
    per_cluster_type = machines // clusters // 5
    out = []
    names = [f"c{ci:03d}" for ci in range(clusters)]
    for c in names:
        for j in range(3):
            a = TYPES5[j]
            p = Profile.build([type_req(a.name)], priority=1000, interruption_bucket=PenaltyBucket.B64)
            out.append(Need(c, p, a.alloc.scale(per_cluster_type * 9 // 10), a.alloc, 1))
    return out, Inventory(fleet), names


# --- persistent unmet demand -----------------------------------------------------------------

UNIT = Arch("unit-8", res(8, 32), 0.4, CapacityType.ON_DEMAND)


def unmet_needs(cluster: str, count: int, bump: int = 0) -> list[Need]:
    """`count` single-machine needs of one cluster, each its own job (distinct fingerprints)."""
    out = []
    for j in range(count):
        prof = Profile.build([type_req(UNIT.name)], (), 1000, PenaltyBucket.B64, PenaltyBucket.B64,
                             f"job-{j}")
        units = 1 + bump if j == 0 else 1
        out.append(Need(cluster, prof, res(8 * units, 32 * units), res(8, 32), 1 + j))
    return out


def unmet_demand(needs: int = 50_000, machines: int = 6_000, clusters: int = 500
                 ) -> tuple[list[Need], Inventory, list[str]]:
    """Far more single-machine needs than machines, every machine already bound to a cluster and
    stamped for one of its needs: the shape of a stockout that lasts (most needs unmet every cycle)."""
    names = [f"cluster-{c:04d}" for c in range(clusters)]
    per = needs // clusters
    all_needs: list[Need] = []
    ms: list[Machine] = []
    each = machines // clusters
    for c in names:
        ns = unmet_needs(c, per)
        all_needs += ns
        for k in range(each):
            n = ns[k % per]
            ms.append(mk(f"{c}-m{k:03d}", S.CONFIGURED, UNIT, f"rack-{k % 10:02d}", c, prio=n.priority,
                         fp=n.fingerprint, rpd=64.0))
    return all_needs, Inventory(ms), names
