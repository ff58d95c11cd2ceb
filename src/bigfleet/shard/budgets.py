"""Disruption budgets at the dispatch boundary (the rules themselves are :mod:`bigfleet.budget`).

Before a cycle's disruptive actions reach the executor, each is checked against its cluster's
budget (the cluster's own rules from its roll-up, else the shard's defaults) and the fleet-wide
budget; what fits is recorded in the shard's replicated state *before* it is dispatched, so the
sliding windows hold however often cycles run and across restarts and failovers. What does not fit
is held (counted, logged) and decided again next cycle. Machines of no cluster (idle releases) are
limited by the fleet-wide budget only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from bigfleet.budget import BudgetRule, Disruption, allowance
from bigfleet.machine import MachineState
from bigfleet.observability import get_logger
from bigfleet.shard.ha.node import RaftError, ShardLog
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.view import MachineView
from bigfleet.v1alpha1 import provider_pb2

log = get_logger("bigfleet.shard.budgets")
CONFIGURED = provider_pb2.MachineState.MACHINE_STATE_CONFIGURED
NS = 1_000_000_000
#: disruptions are kept at least this long in the replicated state (a budget's window may be longer)
MIN_KEEP_SECONDS = 3600.0


@dataclass(frozen=True)
class Candidate:
    cluster_id: str  # "" for a machine bound to no cluster
    machine_id: str
    reason: str  # reclaim | preempt | release | consolidate


class DisruptionBudgets:
    def __init__(self, log_: ShardLog, epoch: int, defaults: Sequence[BudgetRule], fleet: Sequence[BudgetRule],
                 overrides: Callable[[str], Sequence[BudgetRule] | None], view: MachineView,
                 metrics: ShardMetrics, wall_ns: Callable[[], int]) -> None:
        self.log = log_
        self.epoch = epoch
        self.defaults = tuple(defaults)
        self.fleet = tuple(fleet)
        self.overrides = overrides
        self.view = view
        self.metrics = metrics
        self.wall_ns = wall_ns

    def rules_for(self, cluster_id: str) -> Sequence[BudgetRule]:
        if not cluster_id:
            return ()
        own = self.overrides(cluster_id)
        return own if own is not None else self.defaults

    def _configured(self, cluster_id: str) -> int:
        return sum(1 for m in (self.view.machine(pb.id) for pb in self.view.bound_to(cluster_id))
                   if m is not None and m.state is MachineState.CONFIGURED and m.cluster == cluster_id)

    def _keep_after(self, now: int) -> int:
        longest = max((r.window_seconds for r in (*self.defaults, *self.fleet)), default=0.0)
        return now - int(max(longest, MIN_KEEP_SECONDS) * NS)

    def room(self, cluster_ids: Iterable[str], reason: str = "consolidate") -> tuple[tuple[str, int], ...]:
        """(cluster, how many more ``reason`` disruptions its budget and the fleet's allow now), for
        clusters some rule limits; the engine plans no more than this (dispatch still checks)."""
        now = self.wall_ns()
        past = self.log.read(lambda s: dict(s.disruptions))
        fleet_left: int | None = None
        if any(reason in r.reasons for r in self.fleet):
            fleet_left = allowance(self.fleet, reason, self.view.counts().get(CONFIGURED, 0),
                                   [d for ds in past.values() for d in ds], now)
        out = []
        for c in sorted(cluster_ids):
            left = allowance(self.rules_for(c), reason, self._configured(c), past.get(c, ()), now)
            if fleet_left is not None:
                left = fleet_left if left is None else min(left, fleet_left)
            if left is not None:
                out.append((c, left))
        return tuple(out)

    async def admit(self, candidates: Sequence[Candidate]) -> set[str]:
        """The machine ids whose disruption fits every budget now, recorded as dispatched."""
        if not candidates:
            return set()
        now = self.wall_ns()
        past = self.log.read(lambda s: dict(s.disruptions))
        fleet_hist: list[Disruption] = [d for ds in past.values() for d in ds] if self.fleet else []
        fleet_configured = self.view.counts().get(CONFIGURED, 0) if self.fleet else 0
        hist: dict[str, list[Disruption]] = {}
        configured: dict[str, int] = {}
        approved: list[tuple[str, Disruption]] = []
        free: set[str] = set()  # no budget covers them: dispatched, not recorded
        held: Counter[tuple[str, str]] = Counter()
        for c in candidates:
            rules = self.rules_for(c.cluster_id)
            if rules and not any(c.reason in r.reasons for r in rules):
                rules = ()
            if not rules and not any(c.reason in r.reasons for r in self.fleet):
                free.add(c.machine_id)
                continue
            if rules:
                h = hist.setdefault(c.cluster_id, list(past.get(c.cluster_id, ())))
                n = configured.setdefault(c.cluster_id, self._configured(c.cluster_id))
                left = allowance(rules, c.reason, n, h, now)
                if left is not None and left <= 0:
                    held[(c.reason, "cluster")] += 1
                    continue
            left_fleet = allowance(self.fleet, c.reason, fleet_configured, fleet_hist, now)
            if left_fleet is not None and left_fleet <= 0:
                held[(c.reason, "fleet")] += 1
                continue
            d = Disruption(c.machine_id, c.reason, now)
            approved.append((c.cluster_id, d))
            if rules:
                hist[c.cluster_id].append(d)
            fleet_hist.append(d)
        for (reason, scope), n in held.items():
            self.metrics.disruptions_held.labels(reason, scope).inc(n)
        if held:
            log.info("disruptions held by budget", held={f"{r}/{s}": n for (r, s), n in held.items()})
        if not approved:
            return free
        try:
            ok = await self.log.record_disruptions(tuple(approved), self._keep_after(now), self.epoch)
        except RaftError as exc:
            log.warning("disruptions not recorded; none dispatched this cycle", error=str(exc))
            ok = False
        if not ok:
            return free
        for reason, n in Counter(d.reason for _, d in approved).items():
            self.metrics.disruptions.labels(reason).inc(n)
        return free | {d.machine_id for _, d in approved}
