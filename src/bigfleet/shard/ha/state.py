"""The shard's one replicated state machine (pure: no I/O, no clock, no threads).

Everything that must outlive a process or a leader: every cluster's last accepted roll-up (kept as
wire bytes, decoded only by the replica that becomes leader), the clusters that have spoken (the
Phase 3 gate), the engine's carried state, the shard epoch, the ownership ledger of cross-shard
handoffs, and the runtime actuation switch. A single-replica shard runs this same machine in a Raft
group of one. Every command is idempotent and, except ``claim``, guarded by the epoch it was
issued under, so a deposed leader's late write never lands.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from bigfleet.budget import Disruption
from bigfleet.decision.types import EngineState


@dataclass(frozen=True)
class Rollup:
    data: bytes  # a serialized ClusterCapacityNeeds
    received_unix_nanos: int
    seq: int  # the roll-up's sequence in the replicated log order (monotonic per cluster)


@dataclass(frozen=True)
class ReleasedCluster:
    to_shard: str
    address: str
    machines: tuple[str, ...]
    # The binding epoch the recipient holds (0: released before it was recorded). A binding of the
    # cluster back to this shard with a newer epoch (its recipient was removed) lets it serve again.
    binding_epoch: int = 0


@dataclass
class Ledger:
    """Which provider machines this shard handed away or received (the ownership rule reads it)."""

    released: dict[str, str] = field(default_factory=dict)  # machine id -> cluster or "transfer:<id>"
    adopted: set[str] = field(default_factory=set)
    released_clusters: dict[str, ReleasedCluster] = field(default_factory=dict)

    def release(self, machine_ids: Iterable[str], why: str) -> None:
        for mid in machine_ids:
            self.released[mid] = why
            self.adopted.discard(mid)

    def adopt(self, machine_ids: Iterable[str], cluster_id: str = "") -> None:
        for mid in machine_ids:
            self.released.pop(mid, None)
            self.adopted.add(mid)
        if cluster_id:
            self.released_clusters.pop(cluster_id, None)

    def released_for(self, why: str) -> list[str]:
        return sorted(k for k, w in self.released.items() if w == why)

    def copy(self) -> Ledger:
        return Ledger(dict(self.released), set(self.adopted), dict(self.released_clusters))


@dataclass(frozen=True)
class Retiring:
    """A machine failed for a node-registration timeout whose hand-back (reclaim, drain, delete) is
    under way: a new leader fails it again and finishes the hand-back instead of counting it as
    healthy supply because the provider still says Configured."""

    cluster: str
    node: str
    reason: str
    since_unix_nanos: int


@dataclass(frozen=True)
class Actuation:
    """The runtime kill switch (ShardAdmin.SetActuation / bigfleetctl pause); None = never set."""

    paused: bool
    dry_run: bool


@dataclass
class HAState:
    rollups: dict[str, Rollup] = field(default_factory=dict)
    first_rollup: set[str] = field(default_factory=set)
    engine: EngineState = field(default_factory=EngineState)
    engine_version: int = 0
    epoch: int = 0
    claim_term: int = -1
    leader_node: str = ""
    leader_advertise: str = ""
    replaces: int = 0
    ledger: Ledger = field(default_factory=Ledger)
    actuation: Actuation | None = None
    # the --paused/--dry-run flags the last leader started with: a change of flags (a new Helm
    # value) wins over an older runtime switch; unchanged flags leave the runtime switch in force
    actuation_flags: Actuation | None = None
    # the empty-roll-up guard: collapsing roll-ups held so far per cluster (its baseline is the
    # row count of the cluster's replicated roll-up)
    guard_held: dict[str, tuple[int, int]] = field(default_factory=dict)  # cluster -> (held, since ns)
    # disruptions dispatched per cluster ("" = machines of no cluster, e.g. idle releases), newest
    # last: the disruption budgets' sliding windows hold across cycles, restarts and failovers
    disruptions: dict[str, tuple[Disruption, ...]] = field(default_factory=dict)
    # machines being handed back after a node-registration timeout (shard/retire.py)
    retiring: dict[str, Retiring] = field(default_factory=dict)

    def replace(self, cluster_id: str, data: bytes, now_unix_nanos: int, epoch: int) -> bool:
        """Store the cluster's newest roll-up; refused (False) from a leader whose epoch is stale."""
        if epoch != self.epoch or not cluster_id:
            return False
        self.replaces += 1
        self.rollups[cluster_id] = Rollup(bytes(data), now_unix_nanos, self.replaces)
        self.first_rollup.add(cluster_id)
        self.guard_held.pop(cluster_id, None)
        return True

    def replace_many(self, entries: tuple[tuple[str, bytes, int], ...], epoch: int) -> tuple[bool, ...]:
        """`replace` for each ``(cluster_id, data, now)`` of a group commit, one answer each."""
        return tuple(self.replace(c, data, now, epoch) for c, data, now in entries)

    def hold_rollup(self, cluster_id: str, held: int, since_unix_nanos: int, epoch: int) -> bool:
        """The guard held a collapsing roll-up: ``held`` in a row so far, the first at ``since`` (a
        new leader continues the confirmation instead of starting it over)."""
        if epoch != self.epoch or not cluster_id:
            return False
        self.first_rollup.add(cluster_id)
        self.guard_held[cluster_id] = (held, since_unix_nanos)
        return True

    def forget(self, cluster_id: str, epoch: int) -> bool:
        """The cluster left this shard: its demand, its gate flag and its carried engine state go."""
        if epoch != self.epoch:
            return False
        self.rollups.pop(cluster_id, None)
        self.first_rollup.discard(cluster_id)
        self.guard_held.pop(cluster_id, None)
        self.engine = self.engine.forget_cluster(cluster_id)
        return True

    def save_engine(self, state: EngineState, version: int, epoch: int) -> bool:
        """Carried state from the current leader; older versions (reordered retries) are ignored."""
        if epoch != self.epoch or version <= self.engine_version:
            return False
        self.engine = state
        self.engine_version = version
        return True

    def claim(self, raft_term: int, node: str, advertise: str, floor: int = 0) -> int:
        """A new leader takes the shard: one epoch bump per Raft term. Retrying the same claim
        returns the same epoch; a claim from an older term, or a second node in the same term,
        gets 0 (refused). ``floor`` is the highest epoch the claimant knows was used (its data
        dir's epoch file), so a group built over older data dirs never goes backwards."""
        if raft_term > self.claim_term:
            self.claim_term = raft_term
            self.epoch = max(self.epoch, floor) + 1
            self.leader_node = node
            self.leader_advertise = advertise
            self.engine_version = 0
            return self.epoch
        if raft_term == self.claim_term and node == self.leader_node:
            return self.epoch
        return 0

    # -- ownership ledger (cross-shard handoff) ------------------------------------------------

    def release_cluster(self, cluster_id: str, machine_ids: tuple[str, ...], to_shard: str, address: str,
                        epoch: int, binding_epoch: int = 0) -> tuple[str, ...] | None:
        """Hand a cluster and its machines away; a repeat returns what the first release recorded."""
        if epoch != self.epoch or not cluster_id:
            return None
        prev = self.ledger.released_clusters.get(cluster_id)
        if prev is not None:
            return prev.machines
        ids = tuple(sorted(set(machine_ids)))
        self.ledger.released_clusters[cluster_id] = ReleasedCluster(to_shard, address, ids, binding_epoch)
        self.ledger.release(ids, cluster_id)
        self.rollups.pop(cluster_id, None)
        self.first_rollup.discard(cluster_id)
        self.guard_held.pop(cluster_id, None)
        self.engine = self.engine.forget_cluster(cluster_id)
        return ids

    def release_machines(self, machine_ids: tuple[str, ...], why: str, epoch: int) -> tuple[str, ...] | None:
        """Hand machines away under ``why`` ("transfer:<id>"); a repeat returns the first answer."""
        if epoch != self.epoch or not why:
            return None
        again = self.ledger.released_for(why)
        if again:
            return tuple(again)
        self.ledger.release(machine_ids, why)
        return tuple(machine_ids)

    def adopt(self, machine_ids: tuple[str, ...], cluster_id: str, epoch: int) -> bool:
        if epoch != self.epoch:
            return False
        self.ledger.adopt(machine_ids, cluster_id)
        return True

    def record_disruptions(self, entries: tuple[tuple[str, Disruption], ...], keep_after_unix_nanos: int,
                           epoch: int) -> bool:
        """Disruptions about to be dispatched, per cluster; entries older than the longest budget
        window (``keep_after``) are dropped. A retry of the same entries is not counted twice."""
        if epoch != self.epoch:
            return False
        touched: dict[str, list[Disruption]] = {}
        for cluster_id, d in entries:
            cur = touched.get(cluster_id)
            if cur is None:
                cur = touched[cluster_id] = [x for x in self.disruptions.get(cluster_id, ())
                                             if x.at_unix_nanos > keep_after_unix_nanos]
            if d not in cur:
                cur.append(d)
        for cluster_id, cur in touched.items():
            self.disruptions[cluster_id] = tuple(cur)
        return True

    def set_actuation(self, paused: bool, dry_run: bool, epoch: int) -> bool:
        if epoch != self.epoch:
            return False
        self.actuation = Actuation(paused, dry_run)
        return True

    def apply_actuation_flags(self, paused: bool, dry_run: bool, epoch: int) -> bool:
        """A new leader's flags: if they differ from the flags last seen, they are the newest word
        and set the switch; if not, the runtime switch (if any) stays."""
        if epoch != self.epoch:
            return False
        flags = Actuation(paused, dry_run)
        if flags != self.actuation_flags:
            self.actuation_flags = flags
            self.actuation = flags
        return True

    def __setstate__(self, state: dict[str, object]) -> None:
        """A snapshot from an earlier release lacks the newer fields: they start at their defaults."""
        self.__dict__.update(HAState().__dict__)
        self.__dict__.update(state)

    def track_retiring(self, machine_id: str, entry: Retiring | None, epoch: int) -> bool:
        """A hand-back started (``entry``) or ended (None)."""
        if epoch != self.epoch or not machine_id:
            return False
        if entry is None:
            self.retiring.pop(machine_id, None)
        else:
            self.retiring[machine_id] = entry
        return True

    def carried(self) -> EngineState:
        """The engine state a new leader starts from, with every cluster that spoke marked."""
        return self.engine.with_first_rollups(self.first_rollup - self.engine.first_rollup)

    def copy(self) -> HAState:
        """A copy a new leader can read from without the apply lock (the big values are immutable)."""
        return replace(self, rollups=dict(self.rollups), first_rollup=set(self.first_rollup),
                       ledger=self.ledger.copy(), guard_held=dict(self.guard_held), disruptions=dict(self.disruptions),
                       retiring=dict(self.retiring))
