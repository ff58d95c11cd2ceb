"""Empty-roll-up guard: a sudden collapse of a cluster's demand is held until confirmed.

An operator that briefly lists nothing (an apiserver hiccup, a bad deploy)
would otherwise make the shard reclaim the cluster's whole fleet. A roll-up
keeping fewer than 10 % of a baseline of at least 10 rows is held; three
consecutive such roll-ups confirm it. Pure: the caller owns persistence.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GuardConfig:
    enabled: bool = True
    min_baseline_rows: int = 10
    keep_fraction: float = 0.10
    confirmations: int = 3


@dataclass
class _ClusterGuard:
    baseline: int | None = None
    held: int = 0


@dataclass
class EmptyRollupGuard:
    config: GuardConfig = field(default_factory=GuardConfig)
    _clusters: dict[str, _ClusterGuard] = field(default_factory=dict)

    def admit(self, cluster_id: str, new_rows: int) -> bool:
        """True to accept the roll-up now; False to hold it (the previous demand stays)."""
        g = self._clusters.setdefault(cluster_id, _ClusterGuard())
        if not self.config.enabled or g.baseline is None:
            g.baseline, g.held = new_rows, 0
            return True
        suspicious = g.baseline >= self.config.min_baseline_rows and new_rows < self.config.keep_fraction * g.baseline
        if not suspicious:
            g.baseline, g.held = new_rows, 0
            return True
        g.held += 1
        if g.held >= self.config.confirmations:
            g.baseline, g.held = new_rows, 0
            return True
        return False

    def held(self, cluster_id: str) -> int:
        g = self._clusters.get(cluster_id)
        return g.held if g else 0

    def forget(self, cluster_id: str) -> None:
        self._clusters.pop(cluster_id, None)
