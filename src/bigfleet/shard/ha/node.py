"""pysyncobj glue for a shard replica group (settings follow spec decision 15 / python-ecosystem §1).

A password always (the transport is pickle), ``useFork=False`` (fork during compaction breaks gRPC),
1 s leader fallback, 0.5 s reconnect, short elections, no append batching. Replicated methods run
on pysyncobj's tick thread; the event loop never blocks on a write: each callback settles an
asyncio future through ``loop.call_soon_threadsafe``. Arguments travel pickled inside the
password-encrypted transport, so roll-ups ride as their wire bytes and are not re-encoded.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, SyncObjConsumer, replicated

from bigfleet.decision.types import EngineState
from bigfleet.shard.ha.state import HAState

T = TypeVar("T")

JOURNAL_FILE = "shard-raft.journal"
DUMP_FILE = "shard-raft.dump"


class RaftError(Exception):
    """A write did not commit (not leader, no quorum, timeout)."""


class _Replicated(SyncObjConsumer):  # type: ignore[misc]
    def __init__(self) -> None:
        # Set before the base __init__: not part of snapshots.
        self.lock = threading.RLock()
        super().__init__()
        self.fsm = HAState()

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

    def _deserialize(self, data: dict[str, Any]) -> None:
        with self.lock:
            super()._deserialize(data)


@dataclass
class ShardRaftConfig:
    self_address: str
    peers: list[str]
    data_dir: Path
    password: str
    election_min: float = 0.3
    election_max: float = 0.6
    heartbeat_period: float = 0.02
    leader_fallback: float = 1.0
    compaction_min_entries: int = 5_000
    compaction_min_time: float = 60.0
    # Batched appends: many commands per AppendEntries (and per encrypted message). Higher latency for
    # a lone write (up to one heartbeat period), far higher throughput when roll-ups arrive together.
    batch: bool = True


class ShardRaft:
    """One replica's Raft member; construct on the event loop's thread."""

    def __init__(self, cfg: ShardRaftConfig) -> None:
        self.cfg = cfg
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self._repl = _Replicated()
        conf = SyncObjConf(
            password=cfg.password,
            useFork=False,
            leaderFallbackTimeout=cfg.leader_fallback,
            connectionRetryTime=0.5,
            connectionTimeout=1.0,
            raftMinTimeout=cfg.election_min,
            raftMaxTimeout=cfg.election_max,
            appendEntriesPeriod=cfg.heartbeat_period,
            appendEntriesUseBatch=cfg.batch,
            autoTickPeriod=0.01,
            dynamicMembershipChange=True,
            journalFile=str(cfg.data_dir / JOURNAL_FILE),
            fullDumpFile=str(cfg.data_dir / DUMP_FILE),
            logCompactionMinEntries=cfg.compaction_min_entries,
            logCompactionMinTime=cfg.compaction_min_time,
        )
        peers = [p for p in cfg.peers if p and p != cfg.self_address]
        self._obj = SyncObj(cfg.self_address, peers, conf, consumers=[self._repl])

    @property
    def address(self) -> str:
        return self.cfg.self_address

    def is_leader(self) -> bool:
        return bool(self._obj._isLeader())

    def leader(self) -> str | None:
        node = self._obj._getLeader()
        return None if node is None else str(getattr(node, "address", node))

    def raft_term(self) -> int:
        return int(self._obj.raftCurrentTerm)

    def status(self) -> dict[str, Any]:
        return dict(self._obj.getStatus())

    def read(self, fn: Callable[[HAState], T]) -> T:
        """Run ``fn`` on the local state under the apply lock (keep it short)."""
        with self._repl.lock:
            return fn(self._repl.fsm)

    async def _submit(self, method: Callable[..., Any], *args: Any, timeout: float) -> Any:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()

        def done(res: Any, err: Any) -> None:
            def settle() -> None:
                if fut.done():
                    return
                if err == FAIL_REASON.SUCCESS:
                    fut.set_result(res)
                else:
                    fut.set_exception(RaftError(f"raft write failed: {_reason(err)}"))

            loop.call_soon_threadsafe(settle)

        method(*args, callback=done)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError as exc:
            raise RaftError(f"raft write timed out after {timeout}s") from exc

    async def replace(self, cluster_id: str, data: bytes, now: int, epoch: int, timeout: float = 5.0) -> bool:
        return bool(await self._submit(self._repl.replace, cluster_id, data, now, epoch, timeout=timeout))

    async def save_engine(self, state: EngineState, version: int, epoch: int, timeout: float = 5.0) -> bool:
        return bool(await self._submit(self._repl.save_engine, state, version, epoch, timeout=timeout))

    async def claim(self, advertise: str, floor: int = 0, timeout: float = 5.0) -> tuple[int, int]:
        """(epoch, raft term claimed); epoch 0 means refused."""
        term = self.raft_term()
        epoch = int(await self._submit(self._repl.claim, term, self.address, advertise, floor, timeout=timeout))
        return epoch, term

    async def add_node(self, address: str, timeout: float = 10.0) -> None:
        await self._membership(self._obj.addNodeToCluster, address, timeout)

    async def remove_node(self, address: str, timeout: float = 10.0) -> None:
        await self._membership(self._obj.removeNodeFromCluster, address, timeout)

    async def _membership(self, fn: Callable[..., Any], address: str, timeout: float) -> None:
        await self._submit(fn, address, timeout=timeout)

    def members(self) -> list[str]:
        return sorted([self.address, *[str(n.address) for n in self._obj.otherNodes]])

    def destroy(self) -> None:
        self._obj.destroy()


_REASONS = {v: k for k, v in vars(FAIL_REASON).items() if not k.startswith("_") and isinstance(v, int)}


def _reason(err: Any) -> str:
    return str(_REASONS.get(err, err))
