"""The replicated state machine of a shard replica group (pure: no I/O, no clock, no threads).

What a standby must hold to take over without waiting for the next roll-ups: every cluster's last
accepted roll-up (kept as the wire bytes, decoded only by the replica that becomes leader), the
clusters that have spoken (the Phase 3 gate), the engine's carried state, and the shard epoch.
Every command is idempotent or guarded so a retried write is harmless.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bigfleet.decision.types import EngineState


@dataclass(frozen=True)
class Rollup:
    data: bytes  # a serialized ClusterCapacityNeeds
    received_unix_nanos: int
    seq: int  # the roll-up's sequence in the replicated log order (monotonic per cluster)


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

    def replace(self, cluster_id: str, data: bytes, now_unix_nanos: int, epoch: int) -> bool:
        """Store the cluster's newest roll-up; refused (False) from a leader whose epoch is stale."""
        if epoch != self.epoch or not cluster_id:
            return False
        self.replaces += 1
        self.rollups[cluster_id] = Rollup(bytes(data), now_unix_nanos, self.replaces)
        self.first_rollup.add(cluster_id)
        return True

    def forget(self, cluster_id: str, epoch: int) -> bool:
        if epoch != self.epoch:
            return False
        self.rollups.pop(cluster_id, None)
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
        dir's epoch file), so a group built over single-replica data dirs never goes backwards."""
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

    def carried(self) -> EngineState:
        """The engine state a new leader starts from, with every cluster that spoke marked."""
        return self.engine.with_first_rollups(self.first_rollup - self.engine.first_rollup)
