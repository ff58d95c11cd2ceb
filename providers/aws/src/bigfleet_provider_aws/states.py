"""Pure mappings from EC2 facts to the provider contract: no I/O, unit-tested on their own.

- ``create_outcome``: what an EC2 instance state means for a Create in flight
  (keep waiting = CREATING, done = IDLE, failed = FAILED with the reason).
- ``capacity_type``: configured market + instance type -> the contract's CapacityType.
- ``client_token``: the RunInstances idempotency token of one fenced operation.
- ``allocatable``: DescribeInstanceTypes capacity minus the configured system reserve.
- ``interruption_mark``: what an observed instance says about a spot interruption.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass
from typing import Any

from bigfleet.provider.kit import CapacityType
from bigfleet_provider_aws.config import SystemReserve


class Outcome(enum.Enum):
    WAIT = "wait"  # still CREATING
    READY = "ready"  # IDLE: the host exists and runs
    FAILED = "failed"  # FAILED: it will never run


# EC2 instance-state-name values (DescribeInstances State.Name).
PENDING, RUNNING = "pending", "running"
SHUTTING_DOWN, TERMINATED = "shutting-down", "terminated"
STOPPING, STOPPED = "stopping", "stopped"
GONE = frozenset({SHUTTING_DOWN, TERMINATED})
ALIVE = frozenset({PENDING, RUNNING, STOPPING, STOPPED})

# StateReason codes (https://docs.aws.amazon.com/AWSEC2/latest/APIReference/API_StateReason.html).
REASON_SPOT = "Server.SpotInstanceTermination"
REASON_SPOT_SHUTDOWN = "Server.SpotInstanceShutdown"
REASON_USER = "Client.UserInitiatedShutdown"


def create_outcome(state: str, reason: str = "") -> tuple[Outcome, str]:
    """Map an instance's state during a Create to (outcome, error text for FAILED)."""
    if state == RUNNING:
        return Outcome.READY, ""
    if state == PENDING:
        return Outcome.WAIT, ""
    why = f" ({reason})" if reason else ""
    if state in GONE:
        return Outcome.FAILED, f"instance is {state} before it ever ran{why}"
    if state in (STOPPING, STOPPED):
        return Outcome.FAILED, f"instance is {state}; BigFleet does not restart stopped instances{why}"
    return Outcome.FAILED, f"unexpected instance state {state!r}{why}"


def is_metal(instance_type: str) -> bool:
    return instance_type.endswith(".metal") or ".metal-" in instance_type


def capacity_type(market: CapacityType, instance_type: str) -> CapacityType:
    """On-demand ``.metal`` is bare metal (a whole physical host); spot stays spot (it is reclaimable)."""
    if market == CapacityType.ON_DEMAND and is_metal(instance_type):
        return CapacityType.BARE_METAL
    return market


CAPACITY_TAG = {CapacityType.ON_DEMAND: "on-demand", CapacityType.SPOT: "spot", CapacityType.RESERVED: "reserved",
                CapacityType.BARE_METAL: "bare-metal"}
CAPACITY_FROM_TAG = {v: k for k, v in CAPACITY_TAG.items()}
SHORT = {CapacityType.ON_DEMAND: "od", CapacityType.SPOT: "spot", CapacityType.RESERVED: "rsv",
         CapacityType.BARE_METAL: "metal"}


def slot_id(provider: str, capacity: CapacityType, instance_type: str, zone: str, index: int) -> str:
    return f"{provider}-{SHORT[capacity]}-{instance_type}-{zone}-{index:03d}"


def client_token(provider: str, machine_id: str, operation_id: str) -> str:
    """Derived from the fenced operation: the same transition (and only it) always gets the same token.

    The kit hands every accepted transition a fresh operation id that is stable
    across the shard's retries and never reused (its counter is persisted), so
    the token is too. At most 64 ASCII characters, as RunInstances requires.
    """
    digest = hashlib.sha256(f"{provider}\x00{machine_id}\x00{operation_id}".encode()).hexdigest()
    return f"bf-{digest[:48]}"


def allocatable(info: dict[str, Any], reserve: SystemReserve) -> tuple[dict[str, str], dict[str, str]]:
    """(resources, allocatable) of an instance type from its DescribeInstanceTypes entry."""
    vcpus = int(info["VCpuInfo"]["DefaultVCpus"])
    mem_mib = int(info["MemoryInfo"]["SizeInMiB"])
    net = info.get("NetworkInfo") or {}
    if reserve.max_pods is not None:
        pods = reserve.max_pods
    else:
        enis = int(net.get("MaximumNetworkInterfaces") or 0)
        ips = int(net.get("Ipv4AddressesPerInterface") or 0)
        pods = enis * (ips - 1) + 2 if enis and ips else 110
    gpus = sum(int(g.get("Count", 0)) for g in (info.get("GpuInfo") or {}).get("Gpus", []) or []
               if str(g.get("Manufacturer", "")).upper() == "NVIDIA")
    resources = {"cpu": str(vcpus), "memory": f"{mem_mib}Mi", "pods": str(pods)}
    cpu_m = vcpus * 1000 - reserve.cpu_millis - int(vcpus * 1000 * reserve.cpu_percent / 100)
    mem = mem_mib - reserve.memory_mib - int(mem_mib * reserve.memory_percent / 100)
    alloc = {"cpu": f"{max(cpu_m, 0)}m", "memory": f"{max(mem, 0)}Mi", "pods": str(pods)}
    if gpus:
        resources["nvidia.com/gpu"] = alloc["nvidia.com/gpu"] = str(gpus)
    return resources, alloc


@dataclass(frozen=True)
class Mark:
    """An observed interruption signal for one machine."""

    kind: str  # "warning" | "rebalance" | "interrupted"
    probability: float


def interruption_mark(state: str, reason_code: str, tag: str, notice_p: float, rebalance_p: float,
                      released: bool = False) -> Mark | None:
    """What one observed spot instance says: a durable notice tag, or an AWS-initiated termination.

    ``released``: BigFleet itself deleted the instance (``bigfleet:released`` tag), so its end says
    nothing about the slot, which is SPECULATIVE again.
    """
    if released:
        return None
    if state in GONE or state in (STOPPING, STOPPED):
        if reason_code in (REASON_SPOT, REASON_SPOT_SHUTDOWN):
            return Mark("interrupted", 1.0)
        if reason_code != REASON_USER and tag == "warning":
            return Mark("interrupted", 1.0)
        return None
    if tag == "warning":
        return Mark("warning", notice_p)
    if tag == "rebalance":
        return Mark("rebalance", rebalance_p)
    return None
