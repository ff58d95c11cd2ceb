"""Public value types of the decision engine: configuration, carried state, actions, results.

Everything here is immutable and plain so that a decision can be compared byte for byte,
logged, and (for `EngineState`) replicated through Raft as JSON-able data.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from bigfleet.needs import EMPTY_RESOURCES, Requirement, Resources

# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineConfig:
    """Cycle constants. Defaults are the binding values of the spec (decision-engine.md §15)."""

    #: at most this many shortfalls are reported per cycle (highest priority first)
    shortfall_report_cap: int = 100
    #: a shortfall older than this many cycles is "escalated" (coordinator rebalancing)
    escalation_after_cycles: int = 5
    #: Phase 3 reclaims at most max(1, floor(fraction × Configured)) per cluster per cycle; 0 disables
    reclaim_cap_fraction: float = 0.05
    #: grace given to a voluntary reclaim drain
    reclaim_grace_seconds: int = 600
    #: idle holds before an elastic machine is released; None means never
    on_demand_hold_seconds: int | None = 600
    spot_hold_seconds: int | None = 60
    #: a Same gang that made no progress for this many cycles stops acquiring ...
    park_after_cycles: int = 8
    #: ... except on every multiple of this age, when it re-probes for one cycle
    reprobe_every_cycles: int = 32
    #: Phase 2 preempts only for a shortfall at least this many cycles old (1 = this cycle)
    preempt_after_cycles: int = 1
    #: empty-roll-up guard parameters (the guard itself runs at the shard's ingest boundary)
    rollup_guard_enabled: bool = True
    rollup_guard_min_rows: int = 10
    rollup_guard_keep_fraction: float = 0.10
    rollup_guard_confirmations: int = 3
    #: 0 = unlimited; otherwise the merged action list (P1, P2, P3) is truncated
    max_actions_per_cycle: int = 0
    #: within one priority level, Same gangs credit their cluster's bound machines before plain
    #: needs (prevents a plain need from taking a gang's own machines: "need swapping")
    gangs_credit_first: bool = True
    #: compute everything, emit nothing (actions are reported as suppressed)
    paused: bool = False
    #: compute everything, emit nothing (actions are reported as dry-run)
    dry_run: bool = False
    #: consolidation (decision/consolidation.py), a phase after Phase 3; off unless enabled here or
    #: for a cluster in `consolidation_overrides` ((cluster, on) pairs, which win)
    consolidation: bool = False
    consolidation_overrides: tuple[tuple[str, bool], ...] = ()
    #: a move must save more than this fraction of the effective $/h it replaces ...
    consolidation_margin: float = 0.10
    #: ... and repay its price (reclamation penalty + the old machine's drain grace) within this many hours
    consolidation_payback_hours: float = 24.0
    #: consolidate drains (machines to retire) a cluster may have decided per cycle
    consolidation_max_moves: int = 4
    #: (cluster, consolidate disruptions its budget allows now), from the shard; unlisted: no limit
    consolidation_room: tuple[tuple[str, int], ...] = ()


# --------------------------------------------------------------------------------------------
# Carried state
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineState:
    """What must survive a restart or failover. Round-trips through JSON-able dicts.

    * `cycle`: number of decisions made so far.
    * `shortfall_ages`: shortfall key (profile fingerprint) → consecutive cycles unresolved.
    * `unmet_ages`: need key (cluster + fingerprint) → consecutive cycles the need was unmet.
    * `parking`: gang key → cycles without progress (acquisition parking ledger).
    * `same_domains`: gang key → the co-location domain chosen last cycle (stickiness).
    * `first_rollup`: clusters whose first roll-up since start was seen (Phase 3 gate).

    Idle hold timers are not carried here: they run off `Machine.state_since_unix_nanos`,
    which the inventory owns; a reset clock only ever delays a release.
    """

    cycle: int = 0
    shortfall_ages: Mapping[str, int] = field(default_factory=dict)
    unmet_ages: Mapping[str, int] = field(default_factory=dict)
    parking: Mapping[str, int] = field(default_factory=dict)
    same_domains: Mapping[str, str] = field(default_factory=dict)
    first_rollup: frozenset[str] = frozenset()

    def with_first_rollup(self, cluster_id: str) -> EngineState:
        """Mark that `cluster_id` sent a roll-up (even an empty or held one)."""
        return self.with_first_rollups((cluster_id,))

    def with_first_rollups(self, cluster_ids: Iterable[str]) -> EngineState:
        """`with_first_rollup` for many clusters in one copy (one per cluster is quadratic in
        clusters: thousands of first roll-ups arrive while one cycle runs on a busy shard)."""
        new = frozenset(cluster_ids) - self.first_rollup
        if not new:
            return self
        return EngineState(
            cycle=self.cycle,
            shortfall_ages=self.shortfall_ages,
            unmet_ages=self.unmet_ages,
            parking=self.parking,
            same_domains=self.same_domains,
            first_rollup=self.first_rollup | new,
        )

    def forget_cluster(self, cluster_id: str) -> EngineState:
        """Drop per-cluster entries (the cluster moved to another shard)."""
        prefix = cluster_id + "\x00"
        return EngineState(
            cycle=self.cycle,
            shortfall_ages=self.shortfall_ages,
            unmet_ages={k: v for k, v in self.unmet_ages.items() if not k.startswith(prefix)},
            parking={k: v for k, v in self.parking.items() if not k.startswith(prefix)},
            same_domains={k: v for k, v in self.same_domains.items() if not k.startswith(prefix)},
            first_rollup=self.first_rollup - {cluster_id},
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "cycle": self.cycle,
            "shortfall_ages": dict(sorted(self.shortfall_ages.items())),
            "unmet_ages": dict(sorted(self.unmet_ages.items())),
            "parking": dict(sorted(self.parking.items())),
            "same_domains": dict(sorted(self.same_domains.items())),
            "first_rollup": sorted(self.first_rollup),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> EngineState:
        def ints(name: str) -> dict[str, int]:
            raw = d.get(name) or {}
            if not isinstance(raw, Mapping):
                raise ValueError(f"EngineState.{name}: expected a mapping")
            return {str(k): int(v) for k, v in raw.items()}

        domains = d.get("same_domains") or {}
        if not isinstance(domains, Mapping):
            raise ValueError("EngineState.same_domains: expected a mapping")
        first = d.get("first_rollup") or []
        if isinstance(first, (str, bytes)) or not isinstance(first, (list, tuple, set, frozenset)):
            raise ValueError("EngineState.first_rollup: expected a list")
        return cls(
            cycle=int(d.get("cycle", 0)),
            shortfall_ages=ints("shortfall_ages"),
            unmet_ages=ints("unmet_ages"),
            parking=ints("parking"),
            same_domains={str(k): str(v) for k, v in domains.items()},
            first_rollup=frozenset(str(c) for c in first),
        )


# --------------------------------------------------------------------------------------------
# Actions
# --------------------------------------------------------------------------------------------

#: reasons carried by actions (stable strings, used as metric labels)
REASON_IDLE = "phase1.idle"
REASON_SPECULATIVE = "phase1.speculative"
REASON_PREEMPT = "preempt"
REASON_RECLAIM = "reclaim"
REASON_RELEASE = "release"
REASON_CONSOLIDATE = "consolidate"


@dataclass(frozen=True)
class Create:
    """Speculative → Creating. Once Idle the machine is configured for the same need; the shard
    records the reservation (cluster + need fingerprint on the Machine) so later cycles credit it."""

    machine_id: str
    cluster_id: str
    need_fingerprint: str
    priority: int
    interruption_penalty_dollars: float = 0.0
    reclamation_penalty_dollars: float = 0.0
    requirements: tuple[Requirement, ...] = ()
    group: str = ""
    reason: str = REASON_SPECULATIVE
    kind: Literal["create"] = "create"


@dataclass(frozen=True)
class Configure:
    """Idle → Configuring for a cluster; the shard pulls a bootstrap blob from the operator first."""

    machine_id: str
    cluster_id: str
    need_fingerprint: str
    priority: int
    interruption_penalty_dollars: float
    reclamation_penalty_dollars: float
    requirements: tuple[Requirement, ...]
    group: str = ""
    reason: str = REASON_IDLE
    kind: Literal["configure"] = "configure"


@dataclass(frozen=True)
class Drain:
    """Configured → Draining: a ReclaimInstruction to the operator, then provider Drain."""

    machine_id: str
    cluster_id: str
    grace_period_seconds: int
    preemptor_priority: int
    reason: Literal["reclaim", "preempt", "consolidate"]
    kind: Literal["drain"] = "drain"


@dataclass(frozen=True)
class Delete:
    """Idle → Deleting → Speculative: release of idle elastic capacity after its hold."""

    machine_id: str
    reason: str = REASON_RELEASE
    kind: Literal["delete"] = "delete"


Action = Create | Configure | Drain | Delete


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


class UnmetReason(enum.IntEnum):
    """Same numbers as shardread.proto `UnmetReason`."""

    SATISFIED = 0
    PRIORITY_STARVED = 1
    NO_MATCHING_SUPPLY = 2
    TOPOLOGY_UNSATISFIABLE = 3
    PREEMPTION_EXHAUSTED = 4
    OTHER = 5


@dataclass(frozen=True)
class Shortfall:
    """Unresolved demand of one profile (summed over clusters/gangs sharing the fingerprint)."""

    fingerprint: str
    requirements: tuple[Requirement, ...]
    deficit: Resources
    priority: int
    age_cycles: int
    interruption_bucket: int
    reason: UnmetReason
    clusters: tuple[str, ...]
    #: age exceeds `EngineConfig.escalation_after_cycles`
    escalated: bool = False
    #: per-dimension max of the summed needs' min units: a machine serves the shortfall only if its
    #: allocatable holds one (what cross-shard rebalancing moves or drains for it)
    min_unit: Resources = EMPTY_RESOURCES


@dataclass(frozen=True)
class MatchingSupply:
    """Per-state count of machines matching a need (each capped at `cap`)."""

    idle: int = 0
    configured: int = 0
    speculative: int = 0
    capped: bool = False


@dataclass(frozen=True)
class Verdict:
    """Why one need is (un)satisfied this cycle — what ShardRead.InspectNeeds serves."""

    cluster_id: str
    fingerprint: str
    satisfied: bool
    deficit: Resources
    claimed_count: int
    bootstrap_count: int
    provision_count: int
    same_domain: str
    same_satisfiable: bool
    parked: bool
    parked_age_cycles: int
    #: the `EngineState.cycle` this need's current unmet streak is counted from (-1 when met): its
    #: age is `age_at(decision.state.cycle)`. Kept as a start, not an age, so a need that stays
    #: unmet keeps the same verdict from cycle to cycle (50 000 of them under a lasting stockout)
    unmet_since: int
    unmet_reason: UnmetReason
    matching_supply: MatchingSupply
    victims_found: int = 0
    capacity_freed: Resources | None = None
    #: set when this need was folded (sub-machine gang → plain need) into another row
    folded_into: str = ""
    #: of `claimed_count`, the machines Configured now (the rest are on their way: Configuring,
    #: Creating, or acquired this cycle); what the need's cluster is told serves it
    claimed_configured: int = 0

    def age_at(self, cycle: int) -> int:
        """Consecutive cycles unmet as of the decision whose state carries ``cycle`` (0 when met)."""
        return cycle - self.unmet_since if self.unmet_since >= 0 else 0


@dataclass(frozen=True)
class PhaseStats:
    """Per-phase counts of the work done (all deterministic; durations are measured by the caller)."""

    needs_in: int = 0
    needs_normalized: int = 0
    needs_folded: int = 0
    machines: int = 0
    machine_classes: int = 0
    credited: int = 0
    bootstraps: int = 0
    provisions: int = 0
    unsatisfied: int = 0
    parked: int = 0
    preempts: int = 0
    unresolved: int = 0
    victims_scanned: int = 0
    reclaims: int = 0
    reclaims_deferred: int = 0
    releases: int = 0
    actions_truncated: int = 0
    clusters_recomputed: int = 0
    clusters_reused: int = 0
    #: consolidation: replacements acquired, machines it retires, and the $/h its decided moves save
    consolidation_replacements: int = 0
    consolidation_drains: int = 0
    consolidation_savings_per_hour: float = 0.0


@dataclass(frozen=True)
class Decision:
    """The output of one cycle.

    `actions` is what the shard should execute, in order (empty when paused or dry-run).
    `suppressed` holds the actions that would have run when `paused`/`dry_run` is set.
    `deferred` holds reclaims held back by the reclaim cap and actions truncated by
    `max_actions_per_cycle` (they come back naturally next cycle).
    """

    actions: tuple[Action, ...]
    shortfalls: tuple[Shortfall, ...]
    verdicts: tuple[Verdict, ...]
    stats: PhaseStats
    state: EngineState
    suppressed: tuple[Action, ...] = ()
    deferred: tuple[Action, ...] = ()
    mode: Literal["normal", "paused", "dry_run"] = "normal"

    @property
    def follow_up(self) -> bool:
        """True when truncation deferred work that should run in an immediate extra cycle."""
        return self.stats.actions_truncated > 0


#: Drain grace by priority gap (seeds): (gap strictly above, seconds), widest gap first; any other gap
#: gets :data:`DRAIN_GRACE_DEFAULT_SECONDS`.
DRAIN_GRACE_TIERS: tuple[tuple[int, int], ...] = ((900_000, 10), (500_000, 30), (100_000, 120))
DRAIN_GRACE_DEFAULT_SECONDS = 600


def drain_grace_seconds(preemptor_priority: int, victim_priority: int) -> int:
    """Drain grace by priority gap (seeds): a bigger gap drains faster."""
    gap = preemptor_priority - victim_priority
    for above, seconds in DRAIN_GRACE_TIERS:
        if gap > above:
            return seconds
    return DRAIN_GRACE_DEFAULT_SECONDS


def effective_cost(price_per_hour: float, interruption_probability: float, penalty_dollars: float) -> float:
    """price + p × penalty, with 0 × ∞ taken as 0 so a pinned penalty never yields NaN."""
    if interruption_probability <= 0.0 or penalty_dollars <= 0.0:
        return price_per_hour
    if math.isinf(penalty_dollars):
        return math.inf
    return price_per_hour + interruption_probability * penalty_dollars


def victim_score(interruption_penalty: float, reclamation_penalty: float, drain_grace_remaining_s: float,
                 price_per_hour: float) -> float:
    """Seeds' victim score: the lowest is preempted first. Never NaN (inf only).

    ``drain_grace_remaining_s`` is how long the victim keeps running (and costing
    ``price_per_hour``) after it is chosen: Phase 2 candidates are CONFIGURED machines whose drain
    has not started, so the engine passes the whole grace their preempt Drain would carry,
    ``drain_grace_seconds(preemptor, victim)`` (docs/decision-engine.md, "Victim score").
    """
    drain_term = 0.0
    if drain_grace_remaining_s > 0 and price_per_hour > 0:
        drain_term = drain_grace_remaining_s / 3600.0 * price_per_hour
    return max(0.0, interruption_penalty) + max(0.0, reclamation_penalty) + drain_term
