"""Where the shard keeps its demand and the engine's carried state.

Behind a small interface so that issue #6 can swap the local implementation
for a Raft-replicated one (``apply_rollup`` and ``save_engine_state`` become
replicated, idempotent commands) without touching the session or cycle code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from bigfleet.decision.types import EngineState
from bigfleet.needs import Need, NeedsTable


class DemandStore(Protocol):
    @property
    def table(self) -> NeedsTable: ...

    def apply_rollup(self, cluster_id: str, needs: Sequence[Need], now_unix_nanos: int) -> bool:
        """Replace ``cluster_id``'s demand; True when the table changed."""
        ...

    def mark_first_rollup(self, cluster_id: str) -> None:
        """Record that the cluster has spoken since this shard (leader) started (the Phase 3 gate)."""
        ...

    def engine_state(self) -> EngineState: ...

    def save_engine_state(self, state: EngineState) -> None: ...


class LocalDemandStore:
    """Single-replica store: everything in memory, nothing survives a restart (by design: the
    first-roll-up gate must start closed, and the provider's records carry bindings)."""

    def __init__(self) -> None:
        self._table = NeedsTable()
        self._state = EngineState()
        self._rolled_up: set[str] = set()
        self._unfolded: set[str] = set()  # marked, not yet in the engine state

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

    def save_engine_state(self, state: EngineState) -> None:
        # Keep the gate monotonic even if an engine forgot a flag.
        self._state = state.with_first_rollups(self._rolled_up - state.first_rollup)
        self._unfolded = set()
