"""AvailableCapacityUpdate hints: how much of each demanded profile the shard could supply soon.

Matching depends only on a need's requirements and a machine's shape, so the work is done per
(distinct requirement set × distinct machine shape), never per (need × machine): thousands of
clusters sharing a handful of requirement sets cost a handful of evaluations. Pure; the daemon
runs it off the event loop. Sending is rate-limited per (cluster, fingerprint) and only on change.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bigfleet.machine import Machine, MachineShape, MachineState
from bigfleet.needs import Need, Requirement
from bigfleet.v1alpha1 import provider_pb2, shard_pb2
from bigfleet.wire.needs import requirement_to_proto

Conf = shard_pb2.AvailableCapacityUpdate


@dataclass(frozen=True)
class Availability:
    count: int
    confidence: int
    cost: float
    resources: Mapping[str, str]


@dataclass
class _ShapeSupply:
    idle: int = 0
    spec: int = 0


def supply_by_shape(machines: Iterable[Machine], busy: frozenset[str]) -> dict[MachineShape, _ShapeSupply]:
    out: dict[MachineShape, _ShapeSupply] = {}
    for m in machines:
        st = m.state
        if (st is not MachineState.IDLE and st is not MachineState.SPECULATIVE) or m.id in busy or m.cluster:
            continue
        s = out.get(m.shape)
        if s is None:
            s = out[m.shape] = _ShapeSupply()
        if st is MachineState.IDLE:
            s.idle += 1
        else:
            s.spec += 1
    return out


def availability_for(requirements: Sequence[Requirement], supply: Mapping[MachineShape, _ShapeSupply]) -> Availability:
    idle = spec = 0
    idle_cost = spec_cost = float("inf")
    shape_res: Mapping[str, str] = {}
    best: tuple[Any, ...] | None = None
    for shape, s in supply.items():
        labels = shape.match_labels
        if not all(r.matches(labels) for r in requirements):
            continue
        # The advertised shape: the cheapest one the supply would come from (idle first), with a
        # total order so the answer never depends on the order machines were seen in.
        res = shape.resources.to_wire()
        key = (0 if s.idle else 1, shape.price_per_hour, sorted(res.items()))
        if best is None or key < best:
            best, shape_res = key, res
        if s.idle:
            idle += s.idle
            idle_cost = min(idle_cost, shape.price_per_hour)
        if s.spec:
            spec += s.spec
            spec_cost = min(spec_cost, shape.price_per_hour)
    if idle:
        conf, cost = Conf.CONFIDENCE_HIGH, idle_cost
    elif spec:
        conf, cost = Conf.CONFIDENCE_MEDIUM, spec_cost
    else:
        conf, cost = Conf.CONFIDENCE_NONE, 0.0
    return Availability(idle + spec, conf, cost, shape_res)


def compute(needs: Sequence[Need], machines: Iterable[Machine], busy: frozenset[str]) -> dict[tuple[Requirement, ...], Availability]:
    """One Availability per distinct requirement set among ``needs``."""
    supply = supply_by_shape(machines, busy)
    out: dict[tuple[Requirement, ...], Availability] = {}
    for n in needs:
        key = n.requirements
        if key not in out:
            out[key] = availability_for(key, supply)
    return out


def compute_from_supply(needs: Iterable[Need], supply: Mapping[MachineShape, tuple[int, int]]
                        ) -> dict[tuple[Requirement, ...], Availability]:
    """`compute` from (idle, speculative) free counts per shape that someone already keeps (the
    engine's index: `Engine.free_supply`), so no walk over the fleet."""
    by_shape = {shape: _ShapeSupply(i, sp) for shape, (i, sp) in supply.items() if i > 0 or sp > 0}
    out: dict[tuple[Requirement, ...], Availability] = {}
    for n in needs:
        key = n.requirements
        if key not in out:
            out[key] = availability_for(key, by_shape)
    return out


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
    """Rate limit and change filter for the advisory AvailableCapacityUpdate.

    A count that moved by less than ``min_relative_change`` of its previous value (and by at least
    one machine below that) is not a change: in a busy shard the free count of a shape moves by a
    few machines every cycle, and re-advertising every need's hint for that would cost a message
    per need every interval while telling the operator nothing it can act on. Confidence and cost
    changes always count."""

    def __init__(self, interval_seconds: float = 5.0, min_relative_change: float = 0.02) -> None:
        self.interval = interval_seconds
        self.min_relative_change = min_relative_change
        # cluster -> fingerprint -> (signature, sent at): nested so that forgetting a cluster (a
        # session ending) costs that cluster's needs, not a scan of every need the shard holds
        self._last: dict[str, dict[str, tuple[tuple[int, int, float], float]]] = {}

    def _same(self, old: tuple[int, int, float], new: tuple[int, int, float]) -> bool:
        if old[1:] != new[1:]:
            return False
        return abs(new[0] - old[0]) < max(1.0, self.min_relative_change * old[0])

    def due(self, cluster_id: str, fingerprint: str, a: Availability, now: float) -> bool:
        sig = (a.count, a.confidence, a.cost)
        last = self._last.get(cluster_id)
        if last is None:
            last = self._last[cluster_id] = {}
        prev = last.get(fingerprint)
        if prev is not None:
            if self._same(prev[0], sig):
                return False
            if now - prev[1] < self.interval:
                return False  # held back, not lost: the daemon walks every need once per interval
        last[fingerprint] = (sig, now)
        return True

    def forget_cluster(self, cluster_id: str) -> None:
        self._last.pop(cluster_id, None)


class HintQueue:
    """Hints decided but not yet sent: one per (cluster, fingerprint), the newest decision wins and
    keeps its place in the line. The daemon drains it at a bounded rate: a change in a shape's free
    count can make every need of every cluster due at once (5 000 sessions x 10 needs = 50 000
    frames), and written in one burst those frames queue every roll-up's ack behind them."""

    def __init__(self) -> None:
        self._q: OrderedDict[tuple[str, str], tuple[Need, Availability]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._q)

    def put(self, need: Need, a: Availability) -> None:
        self._q[(need.cluster_id, need.fingerprint)] = (need, a)

    def take(self, n: int) -> list[tuple[Need, Availability]]:
        out: list[tuple[Need, Availability]] = []
        q = self._q
        while q and len(out) < n:
            out.append(q.popitem(last=False)[1])
        return out
