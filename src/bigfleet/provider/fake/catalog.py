"""The simulated cloud's catalog: committed hosts and elastic tiers with prices and risk.

Pure data and a deterministic generator: the same arguments always give the
same machines, ids and zones, so tests, the simulator and the shard's
integration tests can reason about what they will see. Prices are
illustrative, in the range of real list prices.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bigfleet.provider.kit.model import CapacityType, HostRef, Instance, State


@dataclass(frozen=True)
class Tier:
    cloud: str
    instance_type: str
    capacity_type: CapacityType
    price_per_hour: float
    interruption_probability: float
    zones: tuple[str, ...]
    resources: dict[str, str] = field(default_factory=dict)
    allocatable: dict[str, str] = field(default_factory=dict)
    racks: tuple[str, ...] = ()
    billing: str = ""


def _shape(cpu: int, mem_gi: int) -> tuple[dict[str, str], dict[str, str]]:
    req = {"cpu": str(cpu), "memory": f"{mem_gi}Gi", "pods": "110"}
    alloc = {"cpu": f"{cpu * 1000 - 500}m", "memory": f"{mem_gi - 2}Gi", "pods": "110"}
    return req, alloc


_S8 = _shape(8, 32)
_S16 = _shape(16, 64)

# Machines that exist already (IDLE with a host): owned racks and reserved instances.
COMMITTED: tuple[Tier, ...] = (
    Tier("onprem", "bare-metal-8vcpu", CapacityType.BARE_METAL, 0.0, 0.0, ("onprem-dc1",), *_S8,
         racks=("dc1-rack-1", "dc1-rack-2", "dc1-rack-3", "dc1-rack-4"), billing="owned"),
    Tier("aws", "m6i.2xlarge", CapacityType.RESERVED, 0.0, 0.0, ("us-east-1a", "us-east-1b", "us-east-1c"), *_S8,
         billing="reserved"),
)

# Quota slots (SPECULATIVE): on-demand and spot in two clouds, two shapes.
ELASTIC: tuple[Tier, ...] = (
    Tier("aws", "m5.2xlarge", CapacityType.ON_DEMAND, 0.384, 0.0, ("us-east-1a", "us-east-1b", "us-east-1c"),
         *_S8, billing="on-demand"),
    Tier("aws", "m5.2xlarge", CapacityType.SPOT, 0.12, 0.30, ("us-east-1a", "us-east-1b", "us-east-1c"),
         *_S8, billing="spot"),
    Tier("gcp", "n2-standard-8", CapacityType.ON_DEMAND, 0.388, 0.0, ("us-central1-a", "us-central1-b"),
         *_S8, billing="on-demand"),
    Tier("gcp", "n2-standard-8", CapacityType.SPOT, 0.097, 0.25, ("us-central1-a", "us-central1-b"),
         *_S8, billing="spot"),
    Tier("aws", "c6i.4xlarge", CapacityType.ON_DEMAND, 0.68, 0.0, ("us-east-1a", "us-east-1b"),
         *_S16, billing="on-demand"),
    Tier("aws", "c6i.4xlarge", CapacityType.SPOT, 0.27, 0.15, ("us-east-1a", "us-east-1b"),
         *_S16, billing="spot"),
)


def _instance(tier: Tier, idx: int, n_in_tier: int, provider: str, committed: bool) -> Instance:
    mid = f"{tier.cloud}-{idx:05d}"
    zone = tier.zones[n_in_tier % len(tier.zones)]
    labels = {
        "node.kubernetes.io/instance-type": tier.instance_type,
        "topology.kubernetes.io/zone": zone,
        "bigfleet.fake/cloud": tier.cloud,
        "bigfleet.fake/billing": tier.billing,
        "bigfleet.fake/simulated": "true",
    }
    if tier.racks:
        labels["bigfleet.fake/rack"] = tier.racks[n_in_tier % len(tier.racks)]
    return Instance(
        id=mid, instance_type=tier.instance_type, zone=zone, capacity_type=tier.capacity_type,
        price_per_hour=tier.price_per_hour, interruption_probability=tier.interruption_probability,
        resources=dict(tier.resources), allocatable=dict(tier.allocatable), labels=labels,
        host=HostRef(f"{provider}-{tier.cloud}", f"host-{mid}") if committed else None,
        state=State.IDLE if committed else State.SPECULATIVE,
    )


def build_catalog(
    seed_count: int,
    committed_count: int = 0,
    provider: str = "fake",
    elastic: tuple[Tier, ...] = ELASTIC,
    committed: tuple[Tier, ...] = COMMITTED,
) -> list[Instance]:
    """``committed_count`` IDLE hosts then ``seed_count`` SPECULATIVE slots, tiers round-robin."""
    if seed_count < 0 or committed_count < 0:
        raise ValueError("counts must be >= 0")
    out: list[Instance] = []
    per_cloud: dict[str, int] = {}
    per_tier: dict[int, int] = {}
    for pool, count, is_committed in ((committed, committed_count, True), (elastic, seed_count, False)):
        for i in range(count):
            t = i % len(pool)
            tier = pool[t]
            key = id(tier)
            idx = per_cloud.get(tier.cloud, 0)
            per_cloud[tier.cloud] = idx + 1
            n = per_tier.get(key, 0)
            per_tier[key] = n + 1
            out.append(_instance(tier, idx, n, provider, is_committed))
    return out
