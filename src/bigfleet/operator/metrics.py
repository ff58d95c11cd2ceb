"""The operator's Prometheus metrics (names and buckets from the protocol spec §17)."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from bigfleet.observability import new_registry


def _exp(start: float, factor: float, n: int) -> list[float]:
    return [start * factor**i for i in range(n)]


@dataclass
class OperatorMetrics:
    registry: CollectorRegistry = field(default_factory=new_registry)

    def __post_init__(self) -> None:
        r = self.registry
        self.rollup_duration = Histogram("bigfleet_operator_rollup_duration_seconds",
                                         "Roll-up build time (list + build + enqueue; excludes acks)",
                                         buckets=_exp(0.001, 2, 16), registry=r)
        self.rollup_phase_duration = Histogram("bigfleet_operator_rollup_phase_duration_seconds",
                                               "Roll-up phases", ["phase"], buckets=_exp(0.001, 2, 16), registry=r)
        self.acknowledge_duration = Histogram("bigfleet_operator_acknowledge_duration_seconds",
                                              "Time to acknowledge the pending CRs of one roll-up",
                                              buckets=_exp(0.01, 2, 16), registry=r)
        self.acknowledged = Counter("bigfleet_operator_acknowledged_total", "CapacityRequests acknowledged",
                                    registry=r)
        self.reconnects = Counter("bigfleet_operator_session_reconnects_total", "Session reconnect attempts",
                                  registry=r)
        self.outbox_dropped = Counter("bigfleet_operator_outbox_dropped_total",
                                      "Responses dropped because the outbox was full", registry=r)
        self.node_state_duration = Histogram("bigfleet_operator_node_state_update_duration_seconds",
                                             "NodeStateUpdate handling", ["phase"], buckets=_exp(0.001, 2, 17),
                                             registry=r)
        self.upcoming_writes = Counter("bigfleet_operator_upcoming_node_writes_total", "UpcomingNode writes",
                                       ["op", "outcome"], registry=r)
        self.dispatch_inflight = Gauge("bigfleet_operator_dispatch_inflight", "Handlers running", registry=r)
        self.rollups_sent = Counter("bigfleet_operator_rollups_sent_total", "Roll-ups written to the stream",
                                    registry=r)
        self.rollup_needs = Gauge("bigfleet_operator_rollup_needs", "Needs in the last roll-up", registry=r)
        self.crs_skipped = Gauge("bigfleet_operator_capacityrequests_skipped",
                                 "CapacityRequests left out of the last roll-up as invalid", registry=r)
        self.session_connected = Gauge("bigfleet_operator_session_connected",
                                       "1 while a Session to the shard is open", registry=r)
        self.is_leader = Gauge("bigfleet_operator_leader", "1 while this replica holds the Lease", registry=r)
        self.evictions = Counter("bigfleet_operator_evictions_total", "Pod evictions", ["outcome"], registry=r)
        self.reclaims = Counter("bigfleet_operator_reclaim_nodes_total", "Reclaimed nodes by outcome", ["outcome"],
                                registry=r)
        self.events = Counter("bigfleet_operator_events_total",
                              "Kubernetes Events by reason and outcome (created, updated: a repeat bumped the "
                              "count of the existing Event; dropped: rate-limited; error)", ["reason", "outcome"],
                              registry=r)
        self.verdict_frames = Counter("bigfleet_operator_need_verdict_frames_total",
                                      "NeedVerdicts frames applied to CapacityRequest status", registry=r)
        self.status_writes = Counter("bigfleet_operator_capacityrequest_status_writes_total",
                                     "CapacityRequest condition/status patches by outcome", ["outcome"], registry=r)
        self.registration_timeouts = Counter("bigfleet_operator_registration_timeouts_total",
                                             "Configured machines whose Node did not register in time (reported "
                                             "to the shard)", registry=r)
