"""A shard replica group's replicated state: roll-ups, the engine snapshot and the leader claim.

The Raft plumbing (settings, asyncio bridge, role queries) is :mod:`bigfleet.raft`. Arguments travel
pickled inside pysyncobj's password-encrypted transport, so roll-ups ride as their wire bytes and are
not re-encoded. Appends are batched and heartbeats short: roll-ups from many clusters arrive together.
"""

from __future__ import annotations

from dataclasses import dataclass

from pysyncobj import replicated

from bigfleet.decision.types import EngineState
from bigfleet.raft import LockedConsumer, RaftBridge, RaftError, RaftSettings
from bigfleet.shard.ha.state import HAState

__all__ = ["DUMP_FILE", "JOURNAL_FILE", "RaftError", "ShardRaft", "ShardRaftConfig"]

JOURNAL_FILE = "shard-raft.journal"
DUMP_FILE = "shard-raft.dump"


class _Replicated(LockedConsumer[HAState]):
    def __init__(self) -> None:
        super().__init__(HAState())

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def replace(self, cluster_id: str, data: bytes, now: int, epoch: int) -> bool:
        with self.lock:
            return self.fsm.replace(cluster_id, data, now, epoch)

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def save_engine(self, state: EngineState, version: int, epoch: int) -> bool:
        with self.lock:
            return self.fsm.save_engine(state, version, epoch)

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def claim(self, raft_term: int, node: str, advertise: str, floor: int = 0) -> int:
        with self.lock:
            return self.fsm.claim(raft_term, node, advertise, floor)


@dataclass
class ShardRaftConfig(RaftSettings):
    heartbeat_period: float = 0.02
    compaction_min_entries: int = 5_000
    batch: bool = True


class ShardRaft(RaftBridge[HAState]):
    """One replica's Raft member; construct on the event loop's thread."""

    journal_file = JOURNAL_FILE
    dump_file = DUMP_FILE

    def __init__(self, cfg: ShardRaftConfig) -> None:
        self.cfg = cfg
        self._ha = _Replicated()
        super().__init__(cfg, self._ha)

    async def replace(self, cluster_id: str, data: bytes, now: int, epoch: int, timeout: float = 5.0) -> bool:
        return bool(await self.call(self._ha.replace, cluster_id, data, now, epoch, timeout=timeout))

    async def save_engine(self, state: EngineState, version: int, epoch: int, timeout: float = 5.0) -> bool:
        return bool(await self.call(self._ha.save_engine, state, version, epoch, timeout=timeout))

    async def claim(self, advertise: str, floor: int = 0, timeout: float = 5.0) -> tuple[int, int]:
        """(epoch, raft term claimed); epoch 0 means refused."""
        term = self.raft_term()
        epoch = int(await self.call(self._ha.claim, term, self.address, advertise, floor, timeout=timeout))
        return epoch, term
