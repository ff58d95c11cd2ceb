"""Roll-up intake: validate a cluster's roll-up, hold a sudden collapse, commit, apply.

Order matters and is the contract with the operator: size bounds, then full validation (one bad
field rejects the whole roll-up and the table keeps the previous content), then the empty-roll-up
guard, then the commit to the shard's replicated state, and only then the in-memory table and the
ack. A roll-up that cannot be committed (lost quorum, deposed leader, a term that ended) is refused
and the operator resends it.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence

from bigfleet.budget import BudgetError, BudgetRule, parse_budget
from bigfleet.needs import Need, ValidationError
from bigfleet.observability import get_logger
from bigfleet.security.limits import LimitExceeded, check_rollup
from bigfleet.shard.guard import DemandSize, EmptyRollupGuard, GuardConfig
from bigfleet.shard.ha.node import RaftError, ShardLog
from bigfleet.shard.ha.state import HAState
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.sessions import RollupOutcome
from bigfleet.shard.store import ReplicatedStore
from bigfleet.v1alpha1 import capacity_pb2
from bigfleet.wire.needs import rollup_from_proto

log = get_logger("bigfleet.shard.intake")


def demand_size(needs: Sequence[Need]) -> DemandSize:
    """What the empty-roll-up guard compares: rows and total CPU (milli)."""
    return DemandSize(len(needs), sum(int(n.aggregate_resources.get("cpu") or 0) for n in needs))


def needs_digest(pb: capacity_pb2.ClusterCapacityNeeds) -> bytes:
    h = hashlib.blake2b(b"\x00".join(n.SerializeToString(deterministic=True) for n in pb.needs), digest_size=16)
    if pb.disruption_budgets:
        h.update(b"\x01" + "\x00".join(pb.disruption_budgets).encode())
    if pb.consolidation:
        h.update(b"\x02" + pb.consolidation.encode())
    return h.digest()


#: ClusterCapacityNeeds.consolidation values: the cluster's override of the shard's switch
CONSOLIDATION_VALUES = {"": None, "on": True, "off": False}


class RollupIntake:
    def __init__(self, store: ReplicatedStore, log_: ShardLog, epoch: int, guard: GuardConfig,
                 metrics: ShardMetrics, wall_ns: Callable[[], int], on_changed: Callable[[str], None],
                 restored: HAState, cycle_seconds: float = 10.0) -> None:
        self.store = store
        self.log = log_
        self.epoch = epoch
        self.metrics = metrics
        self.wall_ns = wall_ns
        self.on_changed = on_changed
        self.guard = EmptyRollupGuard(guard)
        for cluster_id in restored.rollups:  # the guard goes on where the previous term left it
            held, since = restored.guard_held.get(cluster_id, (0, 0))
            self.guard.seed(cluster_id, demand_size(store.table.cluster(cluster_id)), held, since)
        self.closed = False
        self.cycle_seconds = cycle_seconds
        self._digest: dict[str, bytes] = {}
        self._quarantine_shown: set[str] = set()
        # each cluster's own disruption budget, when its roll-up carries one
        self._budgets: dict[str, tuple[BudgetRule, ...]] = {}
        # each cluster's consolidation switch, when its roll-up sets one (replicated with the roll-up)
        self._consolidation: dict[str, bool] = {}
        for cluster_id, r in restored.rollups.items():
            pb = capacity_pb2.ClusterCapacityNeeds.FromString(r.data)
            self._keep_budget(cluster_id, pb)
            # Every operator resends its unchanged roll-up when it reconnects to a new leader: ack
            # those after the digest check instead of decoding and committing them again (measured:
            # 600-3 500 needless commits before a new leader's first cycle at 100K-500K machines).
            self._digest[cluster_id] = needs_digest(pb)

    def budget_for(self, cluster_id: str) -> tuple[BudgetRule, ...] | None:
        return self._budgets.get(cluster_id)

    def consolidation_overrides(self) -> tuple[tuple[str, bool], ...]:
        """(cluster, on) for every cluster whose roll-up overrides the shard's consolidation switch."""
        return tuple(sorted(self._consolidation.items()))

    def _keep_budget(self, cluster_id: str, pb: capacity_pb2.ClusterCapacityNeeds) -> None:
        try:
            rules = parse_budget(pb.disruption_budgets, self.cycle_seconds)
        except BudgetError:  # it validated when accepted; only a schema change gets here
            rules = ()
        if rules:
            self._budgets[cluster_id] = rules
        else:
            self._budgets.pop(cluster_id, None)
        on = CONSOLIDATION_VALUES.get(pb.consolidation)
        if on is None:
            self._consolidation.pop(cluster_id, None)
        else:
            self._consolidation[cluster_id] = on

    def forget(self, cluster_id: str) -> None:
        """The cluster left: an identical roll-up after it comes back must apply again."""
        self._digest.pop(cluster_id, None)
        self._budgets.pop(cluster_id, None)
        self._consolidation.pop(cluster_id, None)
        self.guard.forget(cluster_id)

    async def handle(self, cluster_id: str, pb: capacity_pb2.ClusterCapacityNeeds) -> RollupOutcome:
        started = time.perf_counter()
        # Operators resend the same demand every 10 s. A roll-up byte-identical (needs only) to the
        # last one accepted for this cluster, with nothing held by the guard, would validate and
        # apply to exactly the same table: ack it without decoding again.
        digest = needs_digest(pb)
        if self._digest.get(cluster_id) == digest and not self.guard.held(cluster_id) and not self.closed:
            self.metrics.rollups.inc()
            self.metrics.rollup_duration.observe(time.perf_counter() - started)
            return RollupOutcome(True)
        now = self.wall_ns()
        if not pb.cluster_id:
            fixed = capacity_pb2.ClusterCapacityNeeds()
            fixed.CopyFrom(pb)
            fixed.cluster_id = cluster_id
            pb = fixed
        try:
            check_rollup(pb)  # size bounds first: cheap, and before anything is decoded
            _, needs = rollup_from_proto(pb, now)
            try:
                parse_budget(pb.disruption_budgets, self.cycle_seconds)
            except BudgetError as exc:
                raise ValidationError("disruption_budgets", str(exc)) from None
            if pb.consolidation not in CONSOLIDATION_VALUES:
                raise ValidationError("consolidation", f"must be on, off or empty, got {pb.consolidation[:20]!r}")
        except (ValidationError, LimitExceeded) as exc:
            self.metrics.rollups_rejected.labels(cluster_id).inc()
            log.warning("roll-up rejected", cluster=cluster_id, error=str(exc))
            return RollupOutcome(False, error=str(exc))
        if not self.guard.admit(cluster_id, demand_size(needs), now):
            return await self._held(cluster_id, len(needs))
        if cluster_id in self._quarantine_shown:
            # Per-cluster series exist only while (or since) a cluster was held: one zero-valued
            # child per cluster would make every scrape of a 5 000-session shard walk 5 000 series.
            self.metrics.rollup_quarantined.labels(cluster_id).set(0)
        if not await self._commit(cluster_id, pb, now):
            return RollupOutcome(False, error="roll-up not replicated (shard replica not leading); resend")
        # The reclaim gate opens with the demand it guards, in one step: a cycle that ran while the
        # commit was in flight must not see the gate open over the cluster's old (or, just after an
        # adoption, empty) demand and reclaim what the new roll-up wants.
        self.store.mark_first_rollup(cluster_id)
        changed = self.store.apply_rollup(cluster_id, needs, now)
        self._keep_budget(cluster_id, pb)
        self._digest[cluster_id] = digest
        self.metrics.rollups.inc()
        if changed:
            self.on_changed(cluster_id)
        self.metrics.rollup_duration.observe(time.perf_counter() - started)
        return RollupOutcome(True)

    async def _held(self, cluster_id: str, rows: int) -> RollupOutcome:
        held = self.guard.held(cluster_id)
        self.metrics.rollup_quarantined.labels(cluster_id).set(held)
        self._quarantine_shown.add(cluster_id)
        log.warning("roll-up held by the empty-roll-up guard", cluster=cluster_id, rows=rows, held=held)
        try:
            ok = not self.closed and await self.log.hold_rollup(cluster_id, held, self.guard.held_since(cluster_id),
                                                                 self.epoch)
        except RaftError as exc:
            log.warning("held roll-up not committed", cluster=cluster_id, error=str(exc))
            ok = False
        if not ok:
            return RollupOutcome(False, error="roll-up not replicated (shard replica not leading); resend")
        self.store.mark_first_rollup(cluster_id)  # (the cluster has spoken; the demand it accepted last stays)
        return RollupOutcome(False, quarantined=True)

    async def _commit(self, cluster_id: str, pb: capacity_pb2.ClusterCapacityNeeds, now: int) -> bool:
        """Commit the roll-up to the replicated state before it is applied and acknowledged; a
        term that ended refuses it too (a fenced leader can still hold the epoch)."""
        if self.closed:
            return False
        try:
            ok = await self.log.replace(cluster_id, pb.SerializeToString(), now, self.epoch)
        except RaftError as exc:
            log.warning("roll-up not committed", cluster=cluster_id, error=str(exc))
            self.metrics.rollups_not_committed.inc()
            return False
        if not ok:
            log.warning("roll-up refused by the replicated state (stale epoch)", cluster=cluster_id)
        return ok
