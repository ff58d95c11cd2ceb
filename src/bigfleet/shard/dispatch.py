"""Dispatch: hand a cycle's decided actions to the executor, with the rails at the boundary.

Each submission claims its machine on its own (the executor checks state and in-flight again),
so the loop may run between chunks: a cycle that creates 5 000 machines costs ~0.5 s of record
parsing and would otherwise hold every session for that long (measured: 130-260 ms stalls at
6 000 actions). Rails here: nothing reaches a cluster or machine being handed to another shard; a
voluntary reclaim waits for the cluster's first roll-up; disruptions (drains, idle releases) fit the
disruption budgets or wait; one Create is held back per orphan Create of a previous incarnation.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable, Mapping

from bigfleet.decision.types import Action, Configure, Create, Decision, Delete, Drain
from bigfleet.machine import MachineState
from bigfleet.shard.budgets import Candidate, DisruptionBudgets
from bigfleet.shard.executor import Binding, Executor
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.view import MachineView
from bigfleet.wire.needs import requirement_to_proto


def binding_of(a: Create | Configure) -> Binding:
    return Binding(a.cluster_id, a.need_fingerprint, a.priority, a.interruption_penalty_dollars,
                   a.reclamation_penalty_dollars, tuple(requirement_to_proto(r) for r in a.requirements), a.group)


class Dispatcher:
    #: actions handed to the executor between two returns to the session loop
    CHUNK = 64

    def __init__(self, view: MachineView, executor: Executor, metrics: ShardMetrics, budgets: DisruptionBudgets,
                 frozen_clusters: set[str], frozen_machines: set[str], has_rolled_up: Callable[[str], bool],
                 wall_ns: Callable[[], int], execute_timeout: float, chunked: bool = True) -> None:
        self.view = view
        self.budgets = budgets
        self.executor = executor
        self.metrics = metrics
        self.frozen_clusters = frozen_clusters  # the daemon's live sets: a handoff begun meanwhile counts
        self.frozen_machines = frozen_machines
        self.has_rolled_up = has_rolled_up
        self.wall_ns = wall_ns
        self.execute_timeout = execute_timeout
        self.chunked = chunked  # the simulator's virtual-clock cycles dispatch in one go

    def count(self, decision: Decision, suppressed_counts: Mapping[str, int] | None) -> None:
        # (the worker ships only a sample of suppressed actions, with the full counts beside them)
        suppressed = suppressed_counts if suppressed_counts is not None else Counter(
            type(a).__name__ for a in decision.suppressed)
        counter = self.metrics.actions_dryrun if decision.mode == "dry_run" else self.metrics.actions_suppressed
        for kind, n in suppressed.items():
            counter.labels(kind).inc(n)
        for kind, n in Counter(type(a).__name__ for a in decision.actions).items():
            self.metrics.actions.labels(kind).inc(n)
        st = decision.stats  # consolidation's share (decision/consolidation.py), decided even when paused
        if st.consolidation_replacements:
            self.metrics.consolidation_replacements.labels("acquired").inc(st.consolidation_replacements)
        if st.consolidation_drains:
            self.metrics.consolidation_replacements.labels("retired").inc(st.consolidation_drains)
        self.metrics.consolidation_savings.set(st.consolidation_savings_per_hour)
        if st.reclaims_deferred:  # excess machines the per-cluster reclaim cap held back this cycle
            self.metrics.reclaims_capped.inc(st.reclaims_deferred)

    async def dispatch(self, decision: Decision, suppressed_counts: Mapping[str, int] | None = None) -> None:
        self.count(decision, suppressed_counts)
        actions = [a for a in decision.actions if self._admissible(a)]
        allowed = await self.budgets.admit([c for a in actions if (c := self._disruption(a)) is not None])
        orphans = self.orphan_creates() if actions else 0
        for i, a in enumerate(actions):
            if self.chunked and i % self.CHUNK == self.CHUNK - 1:
                await asyncio.sleep(0)
            if self._frozen(a):  # (the live sets: a handoff begun during this dispatch counts)
                self.metrics.action_outcomes.labels(type(a).__name__, "frozen_handoff").inc()
                continue
            if isinstance(a, Drain | Delete) and a.machine_id not in allowed and a.machine_id not in self.view.inflight:
                # Over the cluster's or the fleet's disruption budget: decided again next cycle.
                self.metrics.action_outcomes.labels(type(a).__name__, "budget_held").inc()
                continue
            if isinstance(a, Create) and orphans:
                # A Create from a previous incarnation (or one we lost track of) is still running:
                # its machine will be Idle shortly and the engine will hand it out then. Creating
                # another in its place would over-acquire because the old reservation died with the
                # process; so one Create is held back per orphan, and the rest go ahead.
                orphans -= 1
                self.metrics.action_outcomes.labels("Provision", "deferred_orphan_create").inc()
                continue
            self.submit(a)

    def _admissible(self, a: Action) -> bool:
        """The rails that drop an action before any budget is spent on it."""
        if self._frozen(a):
            # Decided before a handoff froze them: never act on a machine being handed away.
            self.metrics.action_outcomes.labels(type(a).__name__, "frozen_handoff").inc()
            return False
        if isinstance(a, Drain) and a.reason in ("reclaim", "consolidate") and not self.has_rolled_up(a.cluster_id):
            # Phase 3 waits for the cluster's first roll-up: a restart alone never reclaims.
            self.metrics.action_outcomes.labels("Reclaim", "gated_first_rollup").inc()
            return False
        return True

    def _disruption(self, a: Action) -> Candidate | None:
        """The budget candidate of a disruptive action (one already in flight is the executor's
        duplicate to drop, not a new disruption)."""
        if a.machine_id in self.view.inflight:
            return None
        if isinstance(a, Drain):
            return Candidate(a.cluster_id, a.machine_id, a.reason)
        if isinstance(a, Delete):
            return Candidate("", a.machine_id, "release")
        return None

    def submit(self, a: Action) -> None:
        if isinstance(a, Create):
            self.executor.submit_create(a.machine_id, binding_of(a))
        elif isinstance(a, Configure):
            self.executor.submit_configure(a.machine_id, binding_of(a))
        elif isinstance(a, Drain):
            self.executor.submit_drain(a.machine_id, a.grace_period_seconds, a.preemptor_priority, a.reason)
        elif isinstance(a, Delete):
            self.executor.submit_delete(a.machine_id)

    def _frozen(self, a: Action) -> bool:
        fc, fm = self.frozen_clusters, self.frozen_machines
        if not (fc or fm):
            return False
        if a.machine_id in fm or getattr(a, "cluster_id", "") in fc:
            return True
        shown = self.view.get(a.machine_id)
        return shown is not None and self.view.route(shown) in fc

    def orphan_creates(self) -> int:
        """CREATING machines nobody here is driving, seen for less than two execute timeouts
        (after that they no longer hold back new Creates: the provider is expected to fail them)."""
        window = int(2 * self.execute_timeout * 1e9)
        now = self.wall_ns()
        n = 0
        for mid in self.view.creating:
            m = self.view.machine(mid)
            if m is not None and m.state == MachineState.CREATING and mid not in self.view.inflight \
                    and now - m.state_since_unix_nanos < window:
                n += 1
        return n
