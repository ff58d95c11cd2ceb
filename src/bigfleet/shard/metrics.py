"""The shard's Prometheus metrics (names from protocols.md §17 where they exist)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

#: `bigfleet_shard_shortfalls_aged` buckets: (label, lowest age in cycles), oldest last
SHORTFALL_AGE_BUCKETS: tuple[tuple[str, int], ...] = (("1-9", 1), ("10-59", 10), ("60-299", 60), ("300+", 300))


def shortfall_age_bucket(age_cycles: int) -> str:
    """The `bucket` label of a shortfall unmet for ``age_cycles`` consecutive cycles (ages start at 1)."""
    label = SHORTFALL_AGE_BUCKETS[0][0]
    for name, low in SHORTFALL_AGE_BUCKETS:
        if age_cycles >= low:
            label = name
    return label


def _exp(start: float, factor: float, count: int) -> list[float]:
    return [start * factor**i for i in range(count)]


class DemandCollector(Collector):
    """``bigfleet_shard_demand_machines{interruption_penalty_bucket}``, computed when scraped from the
    leading daemon's last cycle (``source``; None when this replica does not lead: no series).

    A walk over every need's verdict costs O(needs); done at scrape time it runs once per scrape,
    not once per cycle on the session loop. ``source`` reads an immutable per-cycle record."""

    NAME = "bigfleet_shard_demand_machines"
    HELP = ("Machines the clusters' needs hold after the last cycle (credited to a need, or bootstrapped or "
            "provisioned for it by that cycle), by the need's interruption penalty bucket")

    def __init__(self, registry: CollectorRegistry) -> None:
        self.source: Callable[[], Mapping[str, int]] | None = None
        registry.register(self)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(self.NAME, self.HELP, labels=["interruption_penalty_bucket"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily(self.NAME, self.HELP, labels=["interruption_penalty_bucket"])
        source = self.source
        if source is not None:
            for bucket, n in sorted(source().items()):
                fam.add_metric([bucket], n)
        yield fam


class ShardMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        for declare in (self._cycles, self._sessions, self._provider, self._runtime, self._features):
            declare(registry)

    def _cycles(self, r: CollectorRegistry) -> None:
        """Decision cycles and the actions they emit."""
        # Powers of two, plus the scale targets (0.25 s and 1 s cycle p99, issue #12) and a few
        # neighbours, so a quantile can be read against a target instead of "somewhere in (0.128, 0.256]".
        cyc = sorted(set(_exp(0.001, 2, 14)) | {0.05, 0.1, 0.15, 0.2, 0.25, 0.3, 0.75, 1.0, 1.5})
        self.cycle_duration = Histogram("bigfleet_shard_cycle_duration_seconds", "Whole decision cycle", buckets=cyc, registry=r)
        self.phase_duration = Histogram(
            "bigfleet_shard_cycle_phase_duration_seconds", "Cycle time per phase", ["phase"], buckets=cyc, registry=r
        )
        self.cycles = Counter("bigfleet_shard_cycles_total", "Decision cycles run", registry=r)
        self.actions = Counter("bigfleet_shard_actions_total", "Actions emitted by the engine", ["kind"], registry=r)
        self.action_outcomes = Counter(
            "bigfleet_shard_action_execute_outcomes_total", "Executed actions by outcome", ["kind", "outcome"], registry=r
        )
        self.actions_deduped = Counter("bigfleet_shard_actions_deduped_total", "Actions for machines already in flight", registry=r)
        self.actions_suppressed = Counter(
            "bigfleet_shard_actions_suppressed_total", "Actions not executed while paused", ["kind"], registry=r
        )
        self.actions_dryrun = Counter("bigfleet_shard_actions_dryrun_total", "Actions computed in dry-run", ["kind"], registry=r)
        self.execute_inflight = Gauge("bigfleet_shard_execute_inflight", "Actions executing now", registry=r)
        self.inventory = Gauge(
            "bigfleet_shard_inventory_machines",
            "Machines by state, capacity type and the interruption penalty bucket their need stamped on them "
            "('none': not assigned to a need)",
            ["state", "capacity_type", "interruption_penalty_bucket"], registry=r,
        )
        self.shortfalls = Gauge("bigfleet_shard_shortfalls", "Shortfalls reported by the last cycle", registry=r)
        self.shortfalls_aged = Gauge(
            "bigfleet_shard_shortfalls_aged",
            "Short profiles after the last cycle (report cap not applied) by how many consecutive cycles "
            "they have been short", ["bucket"], registry=r,
        )
        for name, _ in SHORTFALL_AGE_BUCKETS:  # (every replica exports the four, 0 unless leading)
            self.shortfalls_aged.labels(name).set(0)
        self.demand = DemandCollector(r)
        self.reclaims_capped = Counter(
            "bigfleet_shard_reclaims_capped_total",
            "Excess Configured machines the per-cluster reclaim cap kept from draining, summed over cycles "
            "(a machine held back for 3 cycles counts 3)", registry=r,
        )

    def clear_cycle_results(self) -> None:
        """Drop what the last cycle published (the replica stopped leading): a follower or deposed
        leader exports no inventory, demand or shortfall figures, so sums over a replica group count
        the leader's alone. Counters and histograms keep their totals."""
        self.inventory.clear()
        self.shortfalls.set(0)
        for name, _ in SHORTFALL_AGE_BUCKETS:
            self.shortfalls_aged.labels(name).set(0)
        self.consolidation_savings.set(0)
        self.demand.source = None

    def _sessions(self, r: CollectorRegistry) -> None:
        """Operator sessions and the roll-ups they carry."""
        self.session_lifecycle = Counter(
            "bigfleet_shard_session_lifecycle_total", "Session installs, replacements, removals", ["event"], registry=r
        )
        self.identity_rejected = Counter(
            "bigfleet_shard_session_identity_rejected_total", "Sessions whose certificate did not name the cluster",
            registry=r,
        )
        self.active_sessions = Gauge("bigfleet_shard_active_sessions", "Open operator sessions", registry=r)
        self.rollups = Counter("bigfleet_shard_rollups_total", "Roll-ups accepted", registry=r)
        self.rollups_rejected = Counter(
            "bigfleet_shard_rollups_rejected_total", "Roll-ups rejected by validation", ["cluster"], registry=r
        )
        self.rollup_quarantined = Gauge(
            "bigfleet_shard_rollup_quarantined", "Roll-ups held by the empty-roll-up guard", ["cluster"], registry=r
        )
        self.rollup_duration = Histogram(
            "bigfleet_shard_rollup_handle_seconds", "Validate and apply one roll-up", buckets=_exp(0.0001, 2, 16), registry=r
        )
        self.hints_queued = Gauge(
            "bigfleet_shard_available_capacity_queued", "AvailableCapacityUpdates decided, waiting for their paced send",
            registry=r,
        )
        self.rollup_ack = Histogram(
            "bigfleet_shard_rollup_ack_seconds",
            "Roll-up frame read off the stream until its Ack is written back (queues included)",
            # (with buckets at the 50 ms target and its neighbours, so p99 can be read against it)
            buckets=sorted(set(_exp(0.0001, 2, 16)) | {0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2}),
            registry=r,
        )

    def _provider(self, r: CollectorRegistry) -> None:
        """Calls to the provider and what it reported."""
        self.machines_rejected = Counter(
            "bigfleet_shard_machines_rejected_total", "Provider records rejected at ingest", ["reason"], registry=r
        )
        self.provider_rpc = Histogram(
            "bigfleet_shard_provider_rpc_duration_seconds", "Provider RPC latency per attempt", ["rpc"],
            buckets=_exp(0.001, 2, 16), registry=r,
        )
        self.provider_errors = Counter(
            "bigfleet_shard_provider_rpc_errors_total", "Provider RPC failures per attempt", ["rpc", "code"], registry=r
        )
        self.provider_reachable = Gauge(
            "bigfleet_shard_provider_reachable", "1 while the provider's last List answered, 0 after one failed "
            "(per provider of the pool; 'default' for a single unnamed one)", ["provider"], registry=r
        )

    def _runtime(self, r: CollectorRegistry) -> None:
        """The shard process itself: pause, event loop, engine worker, collector."""
        self.paused = Gauge("bigfleet_shard_actuation_paused", "1 while actuation is paused", registry=r)
        self.outbox_overflow = Counter(
            "bigfleet_shard_outbox_overflow_total", "Sessions closed because their outbox overflowed", registry=r
        )
        self.loop_lag = Histogram(
            "bigfleet_shard_event_loop_lag_seconds", "How late a 100 ms timer fires (event loop stalls)",
            buckets=_exp(0.001, 2, 14), registry=r,
        )
        self.bootstrap_duration = Histogram(
            "bigfleet_shard_request_bootstrap_seconds", "Bootstrap pull round trip", buckets=_exp(0.01, 2, 16), registry=r
        )
        # The engine worker process (shard/engineproc.py).
        self.engine_worker_restarts = Counter(
            "bigfleet_shard_engine_worker_restarts_total", "Engine worker processes replaced (died, stuck, broken pipe)",
            registry=r,
        )
        self.engine_worker_resyncs = Counter(
            "bigfleet_shard_engine_worker_resyncs_total", "Cycles that sent the engine worker a full copy of its inputs",
            registry=r,
        )
        self.gc_pause = Histogram(
            "bigfleet_shard_gc_pause_seconds", "Cyclic garbage collector pauses (they stall the session loop)",
            ["generation"], buckets=_exp(0.001, 2, 12), registry=r,
        )

    def _features(self, r: CollectorRegistry) -> None:
        """Replication, retirements, budgets, verdicts, handoff, what-if and consolidation."""
        # The replicated state (shard/ha): roll-ups refused because their commit failed.
        self.rollups_not_committed = Counter(
            "bigfleet_shard_ha_rollups_not_committed", "Roll-ups refused: not committed to the replicated state",
            registry=r,
        )
        # Machines handed back after their Node never registered (shard/retire.py).
        self.retirements = Counter(
            "bigfleet_shard_retirements_total", "Machines failed for a registration timeout and handed back",
            ["outcome"], registry=r,
        )
        # Disruption budgets (shard/budgets.py).
        self.disruptions = Counter(
            "bigfleet_shard_disruptions_total", "Disruptions dispatched within a budget that covers them",
            ["reason"], registry=r,
        )
        self.disruptions_held = Counter(
            "bigfleet_shard_disruptions_held_total",
            "Disruptions held back (decided again next cycle): the cluster's or the fleet's budget is spent",
            ["reason", "scope"], registry=r,
        )
        # Per-need verdicts and node-registration reports (shard/verdicts.py).
        self.registration_timeouts = Counter(
            "bigfleet_shard_registration_timeouts_total",
            "Operator reports of a Configured machine whose Node never registered, by outcome (failed: marked "
            "FAILED and replaced; the others were ignored)", ["outcome"], registry=r,
        )
        self.verdict_frames = Counter(
            "bigfleet_shard_need_verdict_frames_total", "NeedVerdicts frames queued for operators", registry=r,
        )
        # Cross-shard handoff (shard/handoff.py).
        self.handoff_machines = Counter(
            "bigfleet_shard_handoff_machines_total", "Machines released to or adopted from other shards",
            ["direction", "kind"], registry=r,
        )
        self.handoff_sessions_refused = Counter(
            "bigfleet_shard_handoff_sessions_refused_total", "Sessions refused: the cluster was handed to another shard",
            registry=r,
        )
        self.handoff_sessions_held = Counter(
            "bigfleet_shard_handoff_sessions_held_total",
            "Sessions answered UNAVAILABLE: the cluster was still being handed to this shard", registry=r,
        )
        # What-if (ShardRead.WhatIf, decision/whatif.py) and consolidation (decision/consolidation.py).
        self.whatif_calls = Counter(
            "bigfleet_shard_whatif_calls_total", "ShardRead.WhatIf calls by result (ok, invalid, unavailable)",
            ["result"], registry=r,
        )
        self.whatif_duration = Histogram(
            "bigfleet_shard_whatif_duration_seconds", "One WhatIf answer (an engine pass per candidate need)",
            buckets=_exp(0.001, 2, 14), registry=r,
        )
        self.consolidation_replacements = Counter(
            "bigfleet_shard_consolidation_replacements_total",
            "Consolidation decisions (kind: acquired = a cheaper replacement configured or created, retired = a "
            "machine drained once its replacement is CONFIGURED)",
            ["kind"], registry=r,
        )
        self.consolidation_savings = Gauge(
            "bigfleet_shard_consolidation_savings_dollars_per_hour",
            "$/hour the moves consolidation decided in the last cycle save (replacements acquired, machines retired)",
            registry=r,
        )
