"""AvailableCapacityUpdate hints: how much of each demanded profile the shard could supply soon.

Computed once per distinct profile per cycle (many clusters share profiles),
then sent per (cluster, fingerprint) only when (count, confidence, cost)
changed and at most once per interval per key.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from bigfleet.needs import Need, Profile, requirement_to_proto
from bigfleet.v1alpha1 import provider_pb2, shard_pb2

S = provider_pb2.MachineState
Conf = shard_pb2.AvailableCapacityUpdate


@dataclass(frozen=True)
class Availability:
    count: int
    confidence: int
    cost: float
    resources: Mapping[str, str]


def machine_labels(pb: provider_pb2.Machine) -> dict[str, str]:
    labels = dict(pb.labels)
    if pb.instance_type:
        labels.setdefault("node.kubernetes.io/instance-type", pb.instance_type)
    if pb.zone:
        labels.setdefault("topology.kubernetes.io/zone", pb.zone)
    return labels


def availability_for(profile: Profile, machines: Iterable[provider_pb2.Machine], inflight: Mapping[str, str]) -> Availability:
    idle = spec = 0
    idle_cost = spec_cost = float("inf")
    shape: Mapping[str, str] = {}
    for pb in machines:
        if pb.state not in (S.MACHINE_STATE_IDLE, S.MACHINE_STATE_SPECULATIVE) or pb.id in inflight:
            continue
        if not profile.matches(machine_labels(pb)):
            continue
        if not shape:
            shape = dict(pb.resources.resources)
        if pb.state == S.MACHINE_STATE_IDLE:
            idle += 1
            idle_cost = min(idle_cost, pb.price_per_hour)
        else:
            spec += 1
            spec_cost = min(spec_cost, pb.price_per_hour)
    if idle:
        conf, cost = Conf.CONFIDENCE_HIGH, idle_cost
    elif spec:
        conf, cost = Conf.CONFIDENCE_MEDIUM, spec_cost
    else:
        conf, cost = Conf.CONFIDENCE_NONE, 0.0
    return Availability(idle + spec, conf, cost, shape)


def update_message(need: Need, a: Availability) -> shard_pb2.ShardMessage:
    return shard_pb2.ShardMessage(
        available_capacity=shard_pb2.AvailableCapacityUpdate(
            supersedes_key=f"available:{need.fingerprint}",
            requirements=[requirement_to_proto(r) for r in need.requirements],
            resources=provider_pb2.Resources(resources=dict(a.resources)),
            available_count=a.count,
            confidence=a.confidence,  # type: ignore[arg-type]
            cost_per_hour=a.cost,
        )
    )


class AvailabilityEmitter:
    def __init__(self, interval_seconds: float = 5.0) -> None:
        self.interval = interval_seconds
        self._last: dict[tuple[str, str], tuple[tuple[int, int, float], float]] = {}

    def due(self, cluster_id: str, fingerprint: str, a: Availability, now: float) -> bool:
        key = (cluster_id, fingerprint)
        sig = (a.count, a.confidence, a.cost)
        prev = self._last.get(key)
        if prev is not None and (prev[0] == sig or now - prev[1] < self.interval):
            return False
        self._last[key] = (sig, now)
        return True

    def forget_cluster(self, cluster_id: str) -> None:
        for k in [k for k in self._last if k[0] == cluster_id]:
            del self._last[k]
