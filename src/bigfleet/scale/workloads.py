"""Roll-up shapes for the scale harness (pure: the same arguments always give the same needs).

Shapes follow the upstream scale-test profiles (operations-and-scale.md §1.6) mapped onto the
fake provider's catalog (8/16-vCPU machines in six zones, no GPUs, racks only on bare metal):

* ``uber-5k``: per cluster 2 plain needs, 95 memcache gangs and 32 GPU-like needs of which 25 are
  gangs (129 needs, 93 % carrying Same; 20 clusters give upstream's 2 580 needs). Gangs co-locate
  by zone, the one topology key every catalog machine carries.
* ``aggregated``: a few plain zone-pinned needs per cluster (thousands of clusters).
* ``realistic``: a per-cluster mix after the archetype table (tiny stateless, services, batch,
  cache and DB gangs) at several priorities and both penalty kinds.

Demand is expressed in machine-sized units (``min_unit`` = the catalog's smallest allocatable
CPU) so ``machines_per_cluster`` says how many machines a cluster asks for in total.
"""

from __future__ import annotations

from dataclasses import dataclass

from bigfleet.v1alpha1 import capacity_pb2

Req = capacity_pb2.NodeSelectorRequirement
ZONE_KEY = "topology.kubernetes.io/zone"
ZONES = ("us-east-1a", "us-east-1b", "us-east-1c", "us-central1-a", "us-central1-b")
UNIT_MILLI = 7500  # allocatable CPU of the catalog's 8-vCPU machines: one unit = one machine
SHAPES = ("uber-5k", "aggregated", "realistic")


@dataclass(frozen=True)
class NeedSpec:
    """One need of a cluster before sizing: relative weight, gang or not, zone, priority."""

    name: str
    weight: float
    gang: bool
    zone: str
    priority: int
    interruption: int  # PenaltyBucket value
    unit_fraction: float = 1.0  # min_unit as a fraction of a machine


def _uber5k(cluster: int) -> list[NeedSpec]:
    out = [NeedSpec(f"plain-{k}", 4.0, False, ZONES[(cluster + k) % len(ZONES)], 100, capacity_pb2.PENALTY_BUCKET_8)
           for k in range(2)]
    out += [NeedSpec(f"memcache-{k}", 1.0, True, ZONES[(cluster + k) % len(ZONES)], 1000,
                     capacity_pb2.PENALTY_BUCKET_512, 0.25) for k in range(95)]
    out += [NeedSpec(f"gpu-{k}", 1.5, k < 25, ZONES[(cluster * 7 + k) % len(ZONES)], 1000,
                     capacity_pb2.PENALTY_BUCKET_4096) for k in range(32)]
    return out


def _aggregated(cluster: int, per_cluster: int) -> list[NeedSpec]:
    return [NeedSpec(f"agg-{k}", 1.0, False, ZONES[(cluster + k) % len(ZONES)], 100 + 100 * (k % 3),
                     capacity_pb2.PENALTY_BUCKET_64, 0.5) for k in range(per_cluster)]


# (name, weight, gang, priority, interruption bucket, unit fraction) after ADR-0032's archetypes
_ARCHETYPES = (
    ("tiny-stateless", 6.0, False, 100, capacity_pb2.PENALTY_BUCKET_1, 0.05),
    ("cpu-service", 2.0, False, 1000, capacity_pb2.PENALTY_BUCKET_256, 0.3),
    ("cpu-batch", 1.0, False, 100, capacity_pb2.PENALTY_BUCKET_4, 0.5),
    ("memory-cache", 0.5, True, 1000, capacity_pb2.PENALTY_BUCKET_1024, 0.25),
    ("stateful-db", 0.5, True, 1000, capacity_pb2.PENALTY_BUCKET_2048, 1.0),
    ("critical-realtime", 0.2, False, 1_000_000, capacity_pb2.PENALTY_BUCKET_16384, 0.5),
)


def _realistic(cluster: int) -> list[NeedSpec]:
    out = []
    for k, (name, w, gang, prio, pen, unit) in enumerate(_ARCHETYPES):
        for z in range(2):  # each archetype in two zones of the cluster's region pair
            out.append(NeedSpec(f"{name}-{z}", w, gang, ZONES[(cluster + k + z) % len(ZONES)], prio, pen, unit))
    return out


def need_specs(shape: str, cluster: int, needs_per_cluster: int = 3) -> list[NeedSpec]:
    if shape == "uber-5k":
        return _uber5k(cluster)
    if shape == "aggregated":
        return _aggregated(cluster, needs_per_cluster)
    if shape == "realistic":
        return _realistic(cluster)
    raise ValueError(f"unknown shape {shape!r}; one of {', '.join(SHAPES)}")


def cluster_id(index: int) -> str:
    return f"scale-{index:05d}"


def rollup_needs(shape: str, cluster: int, machines: float, variant: int = 0,
                 needs_per_cluster: int = 3) -> list[capacity_pb2.CapacityNeed]:
    """The cluster's needs asking for about ``machines`` machines in total.

    ``variant`` models demand churn: it moves one need's size up or down by one unit, so a
    changed roll-up changes exactly one need (what the incremental engine sees in steady state).
    """
    specs = need_specs(shape, cluster, needs_per_cluster)
    total_w = sum(s.weight for s in specs)
    out = []
    for i, s in enumerate(specs):
        unit = max(100, round(UNIT_MILLI * s.unit_fraction / 100) * 100)
        units = max(1, round(machines * s.weight / total_w * UNIT_MILLI / unit))
        if variant and i == variant % len(specs):
            units += 1 if variant % 2 else -1
            units = max(1, units)
        reqs = [Req(key=ZONE_KEY, operator=Req.OPERATOR_IN, values=[s.zone])]
        if s.gang:
            reqs.append(Req(key=ZONE_KEY, operator=Req.OPERATOR_SAME))
        out.append(capacity_pb2.CapacityNeed(
            requirements=reqs,
            aggregate_resources={"cpu": f"{unit * units}m"},
            priority=s.priority,
            min_unit={"cpu": f"{unit}m"},
            interruption_penalty_bucket=s.interruption,  # type: ignore[arg-type]
            reclamation_penalty_bucket=capacity_pb2.PENALTY_BUCKET_64,
            group=f"{s.name}" if s.gang else "",
        ))
    return out
