"""Where the shard keeps its demand and the engine's carried state.

The leader's working copy is in memory (:class:`LocalDemandStore`); the durable copy is the shard's
replicated state (:mod:`bigfleet.shard.ha.state`). :class:`ReplicatedStore` loads a new leader's
copy from it and writes the engine's carried state back after cycles (at most one write a second).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from bigfleet.decision.types import EngineState
from bigfleet.needs import Need, NeedsTable, ValidationError
from bigfleet.observability import get_logger
from bigfleet.shard.ha.node import RaftError, ShardLog
from bigfleet.shard.ha.state import HAState
from bigfleet.v1alpha1 import capacity_pb2
from bigfleet.wire.needs import rollup_from_proto

log = get_logger("bigfleet.shard.store")


class LocalDemandStore:
    """Single-replica store: everything in memory, nothing survives a restart (by design: the
    first-roll-up gate must start closed, and the provider's records carry bindings)."""

    def __init__(self) -> None:
        self._table = NeedsTable()
        self._state = EngineState()
        self._rolled_up: set[str] = set()
        self._unfolded: set[str] = set()  # marked, not yet in the engine state
        self._forgotten: set[str] = set()  # handed away since the last saved engine state

    @property
    def table(self) -> NeedsTable:
        return self._table

    def apply_rollup(self, cluster_id: str, needs: Sequence[Need], now_unix_nanos: int) -> bool:
        return self._table.replace(cluster_id, needs, now_unix_nanos)

    def mark_first_rollup(self, cluster_id: str) -> None:
        # Folded into the engine state when it is next read: one copy of the flag set per read,
        # not one per cluster (thousands of sessions say their first roll-up within seconds).
        if cluster_id not in self._rolled_up:
            self._rolled_up.add(cluster_id)
            self._unfolded.add(cluster_id)

    def has_rolled_up(self, cluster_id: str) -> bool:
        return cluster_id in self._rolled_up

    def engine_state(self) -> EngineState:
        if self._unfolded:
            self._state = self._state.with_first_rollups(self._unfolded)
            self._unfolded = set()
        return self._state

    def forget_cluster(self, cluster_id: str) -> None:
        """The cluster was handed to another shard: drop its needs and per-cluster engine state and
        close its reclaim gate again (if it ever comes back, nothing is reclaimed before its roll-up)."""
        self._table.remove(cluster_id)
        self._rolled_up.discard(cluster_id)
        self._unfolded.discard(cluster_id)
        self._state = self._state.forget_cluster(cluster_id)
        self._forgotten.add(cluster_id)

    def save_engine_state(self, state: EngineState) -> None:
        # A cycle that was computing while a cluster was handed away returns the state it started
        # from: it must not open that cluster's reclaim gate again (adopted back before its next
        # roll-up, its machines would be reclaimed as excess of an empty demand).
        for c in self._forgotten - self._rolled_up:
            state = state.forget_cluster(c)
        self._forgotten.clear()
        # Keep the gate monotonic even if an engine forgot a flag.
        self._state = state.with_first_rollups(self._rolled_up - state.first_rollup)
        self._unfolded = set()


class ReplicatedStore(LocalDemandStore):
    """The leader's in-memory store, loaded from the replicated state; carried engine state is
    written back through the log (coalesced: at most one write in flight, the newest state wins)."""

    #: seconds between carried-state writes while cycles run back to back. Each write replicates the
    #: whole state (every unmet need's age: ~125 kB at 2 500 unmet needs, MBs at 50 000) to every
    #: replica; under churn a cycle runs every 0.2 s, and a new leader only needs a recent copy
    #: (ages restart at most this much lower).
    WRITE_GAP = 1.0

    def __init__(self, log: ShardLog, epoch: int, write_gap: float = WRITE_GAP) -> None:
        super().__init__()
        self._log = log
        self._epoch = epoch
        self._write_gap = write_gap
        self._version = 0
        self._pending: EngineState | None = None
        self._writer: asyncio.Task[None] | None = None
        self.engine_writes = 0

    def restore(self, snap: HAState) -> int:
        """Load a new leader's demand from the replicated state; returns the number of clusters."""
        for cluster_id, r in sorted(snap.rollups.items()):
            pb = capacity_pb2.ClusterCapacityNeeds.FromString(r.data)
            try:
                _, needs = rollup_from_proto(pb, r.received_unix_nanos)
            except ValidationError as exc:  # it validated when accepted; a schema change is the only way here
                log.error("replicated roll-up no longer decodes; skipped", cluster=cluster_id, error=str(exc))
                continue
            self.apply_rollup(cluster_id, needs, r.received_unix_nanos)
        for c in snap.first_rollup:
            self.mark_first_rollup(c)
        LocalDemandStore.save_engine_state(self, snap.carried())
        return len(snap.rollups)

    def save_engine_state(self, state: EngineState) -> None:
        super().save_engine_state(state)
        self._pending = self.engine_state()
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write_engine())

    async def _write_engine(self) -> None:
        """Write the newest state, then hold further writes for ``write_gap`` (the states saved in
        between coalesce: only the newest is written)."""
        loop = asyncio.get_running_loop()
        while self._pending is not None:
            st, self._pending = self._pending, None
            self._version += 1
            started = loop.time()
            try:
                await self._log.save_engine(st, self._version, self._epoch)
                self.engine_writes += 1
            except RaftError as exc:
                log.warning("carried engine state not replicated", error=str(exc))
            await asyncio.sleep(max(0.0, self._write_gap - (loop.time() - started)))

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
            await asyncio.gather(self._writer, return_exceptions=True)
