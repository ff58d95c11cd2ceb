"""Invariants checked after every simulated cycle (and every provider state change).

Ground truth is the simulated provider's records; the shard's view is
checked against it. A violation is recorded, never raised, so a run reports
every broken rule with its cycle.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from bigfleet.machine.state import TRANSITIONS, MachineState
from bigfleet.wire.machine import decode_shard_metadata

TRANSITIONAL = {MachineState.CREATING, MachineState.CONFIGURING, MachineState.DRAINING, MachineState.DELETING}
BOUND = {MachineState.CONFIGURING, MachineState.CONFIGURED}


@dataclass(frozen=True)
class Violation:
    cycle: int
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"cycle {self.cycle}: {self.rule}: {self.detail}"


@dataclass
class InvariantChecker:
    total_machines: int
    execute_timeout: float
    provider_timeout: float
    cycle_seconds: float
    reclaim_cap_fraction: float
    #: cycles a reclaim takes to show (reclaim ack, drain dwell, one cycle of slack)
    reclaim_lag_cycles: int = 4
    violations: list[Violation] = field(default_factory=list)
    cycle: int = 0
    _since: dict[str, float] = field(default_factory=dict)
    _state: dict[str, int] = field(default_factory=dict)
    _now: float = 0.0
    _drops: dict[str, list[tuple[int, int, int]]] = field(default_factory=dict)  # (cycle, machines, held)
    _last_demand: dict[str, int] = field(default_factory=dict)
    _held_peak: dict[str, int] = field(default_factory=dict)  # most bound while the guard held a collapse
    max_violations: int = 200

    def _v(self, rule: str, detail: str) -> None:
        if len(self.violations) < self.max_violations:
            self.violations.append(Violation(self.cycle, rule, detail))

    # -- every provider state change -------------------------------------------------------------

    def transition(self, machine_id: str, before: int, after: int) -> None:
        prev = self._state.get(machine_id, before)
        if prev >= 0 and prev != after and MachineState(after) not in TRANSITIONS.get(MachineState(prev), frozenset()):
            self._v("legal-transition", f"{machine_id}: {MachineState(prev).name} -> {MachineState(after).name}")
        if prev != after:
            self._since[machine_id] = self._now
        self._state[machine_id] = after

    # -- after each cycle ------------------------------------------------------------------------

    def after_cycle(self, cycle: int, now: float, provider: Any, view: Any, demand: dict[str, int],
                    creates: Counter[str], need_bounds: dict[tuple[str, str], int] | None = None,
                    cluster_nodes: dict[str, dict[str, int]] | None = None,
                    guard_held: frozenset[str] = frozenset()) -> None:
        self.cycle, self._now = cycle, now
        machines = provider.core.machines
        self._check_inventory(machines, view, now)
        per_cluster, per_need = self._check_records(machines, view, now)
        # no double create for one need: never more machines being created for a need than it can use
        for key, n in per_need.items():
            bound = (need_bounds or {}).get(key)
            if bound is not None and n > bound:
                self._v("no-double-create", f"{n} machines CREATING for need {key[1][:12]} of {key[0]} "
                                            f"(it can use at most {bound})")
        # no machine in two clusters, as the clusters themselves see it (from NodeStateUpdates)
        owners: dict[str, str] = {}
        for cluster, nodes in sorted((cluster_nodes or {}).items()):
            for mid, nst in nodes.items():
                if nst != MachineState.CONFIGURED:
                    continue
                if mid in owners:
                    self._v("one-cluster", f"{mid} is a Configured node of both {owners[mid]} and {cluster}")
                owners[mid] = cluster
        # `creates`: Creates started per machine in its current lifetime (a machine deleted back to
        # Speculative and created again later is a new lifetime, not a double create)
        for mid, n in creates.items():
            if n > 1 and MachineState(int(machines[mid].state)) == MachineState.CREATING:
                self._v("no-double-create", f"{mid} has {n} Creates started and is CREATING")
        self._check_overprovision(cycle, per_cluster, demand, guard_held)
        for cluster, want in demand.items():
            self._last_demand[cluster] = want

    def _check_inventory(self, machines: dict[str, Any], view: Any, now: float) -> None:
        """Inventory conserved (the provider never gains or loses a record; the shard forgets none),
        and one cluster per machine (the provider's binding and the shard's agree)."""
        if len(machines) != self.total_machines:
            self._v("inventory-conserved", f"provider has {len(machines)} machines, started with {self.total_machines}")
        missing = set(machines) - set(view.ids())
        if missing:
            self._v("inventory-conserved", f"shard lost track of {sorted(missing)[:5]}")
        for mid in machines:
            self._state.setdefault(mid, int(machines[mid].state))
            self._since.setdefault(mid, now)
        for pb in view.all():
            rec = machines.get(pb.id)
            if rec is None:
                continue
            if pb.cluster and rec.cluster and pb.cluster != rec.cluster:
                self._v("one-cluster", f"{pb.id}: shard says {pb.cluster}, provider says {rec.cluster}")

    def _check_records(self, machines: dict[str, Any], view: Any, now: float
                       ) -> tuple[Counter[str], Counter[tuple[str, str]]]:
        """Nothing stuck in a transition, every FAILED with a reason; returns machines bound per
        cluster and CREATING per (cluster, need fingerprint)."""
        per_cluster: Counter[str] = Counter()
        per_need: Counter[tuple[str, str]] = Counter()
        for mid, rec in machines.items():
            st = MachineState(int(rec.state))
            since = self._since.get(mid, now)
            limit = self.provider_timeout + 2 * self.cycle_seconds
            if st in TRANSITIONAL and now - since > limit:
                self._v("stuck-transitional", f"{mid} {st.name} for {now - since:.0f}s (> {limit:.0f}s)")
            shown = view.get(mid)
            # the shard shows a transition nobody drives: must settle within the execute timeout
            if shown is not None and MachineState(int(shown.state)) in TRANSITIONAL and mid not in view.inflight \
                    and now - since > self.execute_timeout + 2 * self.cycle_seconds:
                self._v("stuck-transitional", f"shard shows {mid} {MachineState(int(shown.state)).name} undriven")
            if st == MachineState.FAILED and not rec.last_error:
                self._v("failed-has-reason", f"{mid} FAILED without last_error")
            if shown is not None and int(shown.state) == MachineState.FAILED and not shown.last_error:
                self._v("failed-has-reason", f"shard shows {mid} FAILED without last_error")
            if st in BOUND and rec.cluster:
                per_cluster[rec.cluster] += 1
            if st == MachineState.CREATING:
                fp = decode_shard_metadata(rec.shard_metadata).need_fingerprint or ""
                cl = view.reserved_for.get(mid) or ""
                per_need[(cl, fp)] += 1
                if cl:
                    per_cluster[cl] += 1
        return per_cluster, per_need

    def _check_overprovision(self, cycle: int, per_cluster: Counter[str], demand: dict[str, int],
                             guard_held: frozenset[str]) -> None:
        """Configured capacity never exceeds demand by more than one machine beyond the reclaim lag."""
        for cluster, have in per_cluster.items():
            want = demand.get(cluster, 0)
            prev = self._last_demand.get(cluster, want)
            if want < prev:
                self._drops.setdefault(cluster, []).append((cycle, prev - want, 0))
            if cluster in guard_held:
                # The empty-roll-up guard holds a collapse of this cluster's demand on purpose (until
                # it is restated for long enough): the shard keeps serving the demand it accepted
                # last, so nothing is checked against the collapsed one until the hold ends; then
                # whatever is bound counts as one drop to the demand of that moment.
                self._held_peak[cluster] = max(self._held_peak.get(cluster, 0), have)
                continue
            if cluster in self._held_peak:
                peak = self._held_peak.pop(cluster)
                self._drops[cluster] = [(cycle, max(0, peak - want), 0)]
            cap = max(1, math.floor(self.reclaim_cap_fraction * have))
            allowance = 0
            keep = []
            for at, amount, held in self._drops.get(cluster, []):
                left = amount - cap * max(0, cycle - at - self.reclaim_lag_cycles - held)
                if left > 0:
                    allowance += left
                    keep.append((at, amount, held))
            self._drops[cluster] = keep
            if have > want + 1 + allowance:
                self._v("no-overprovision", f"{cluster}: {have} machines bound for a demand of at most {want} "
                                            f"(+1, +{allowance} reclaim lag)")

    def at_end(self, now: float, provider: Any, view: Any) -> None:
        """The run ends with nothing in flight and nothing transitional past its timeout."""
        self._now = now
        if view.inflight:
            self._v("ends-settled", f"{len(view.inflight)} actions still in flight: {sorted(view.inflight)[:5]}")
        for mid, rec in provider.core.machines.items():
            st = MachineState(int(rec.state))
            if st in TRANSITIONAL and now - self._since.get(mid, now) > self.provider_timeout:
                self._v("ends-settled", f"{mid} still {st.name}")
