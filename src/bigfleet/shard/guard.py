"""Empty-roll-up guard: a sudden collapse of a cluster's demand is held until it is restated.

An operator that briefly lists nothing (an apiserver hiccup, a bad deploy, a crashing informer)
would otherwise make the shard reclaim the cluster's whole fleet. Demand is measured two ways: its
rows (needs) and its total CPU. A roll-up keeping less than ``keep_fraction`` of the last accepted
one on either measure is a collapse, whatever the cluster's size: 3 needs dropping to 0 is held
just like 300 dropping to 2 (3 dropping to 1 is an ordinary scale-down). A collapse applies only
once it was restated ``confirmations`` times in a row *and* at least ``min_hold_seconds`` after it
was first held; any roll-up that is not a collapse ends the hold. Pure: the caller passes the
clock and persists the held counts (the shard's replicated state).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GuardConfig:
    enabled: bool = True
    keep_fraction: float = 0.10
    confirmations: int = 3
    min_hold_seconds: float = 30.0


@dataclass(frozen=True)
class DemandSize:
    rows: int
    cpu_milli: int = 0


@dataclass
class _ClusterGuard:
    baseline: DemandSize | None = None
    held: int = 0
    since_unix_nanos: int = 0


@dataclass
class EmptyRollupGuard:
    config: GuardConfig = field(default_factory=GuardConfig)
    _clusters: dict[str, _ClusterGuard] = field(default_factory=dict)

    def collapse(self, baseline: DemandSize, new: DemandSize) -> bool:
        keep = self.config.keep_fraction
        if baseline.rows <= 0:
            return False
        return new.rows < keep * baseline.rows or (baseline.cpu_milli > 0 and new.cpu_milli < keep * baseline.cpu_milli)

    def admit(self, cluster_id: str, new: DemandSize, now_unix_nanos: int = 0) -> bool:
        """True to accept the roll-up now; False to hold it (the previous demand stays)."""
        g = self._clusters.setdefault(cluster_id, _ClusterGuard())
        if not self.config.enabled or g.baseline is None or not self.collapse(g.baseline, new):
            g.baseline, g.held, g.since_unix_nanos = new, 0, 0
            return True
        if g.held == 0:
            g.since_unix_nanos = now_unix_nanos
        g.held += 1
        waited = (now_unix_nanos - g.since_unix_nanos) / 1e9
        if g.held >= self.config.confirmations and waited >= self.config.min_hold_seconds:
            g.baseline, g.held, g.since_unix_nanos = new, 0, 0
            return True
        return False

    def seed(self, cluster_id: str, baseline: DemandSize, held: int = 0, since_unix_nanos: int = 0) -> None:
        """Continue from the replicated state (a new leader, a restart): the last accepted demand
        and the collapse held since (how many restatements, since when)."""
        self._clusters[cluster_id] = _ClusterGuard(baseline, held, since_unix_nanos)

    def held(self, cluster_id: str) -> int:
        g = self._clusters.get(cluster_id)
        return g.held if g else 0

    def held_since(self, cluster_id: str) -> int:
        g = self._clusters.get(cluster_id)
        return g.since_unix_nanos if g else 0

    def forget(self, cluster_id: str) -> None:
        self._clusters.pop(cluster_id, None)
