"""pysyncobj glue: one replicated ``apply(command_json)`` over :class:`FleetState`.

Settings follow the measured pitfalls (spec decision 15): a password always
(its transport is pickle), ``useFork=False`` (fork during compaction breaks
gRPC), ``leaderFallbackTimeout`` 1 s, ``connectionRetryTime`` 0.5 s, short
election timeouts and no append batching (sub-ms single writes). The event
loop never blocks on a write: the Raft tick thread's callback resolves an
asyncio future through ``loop.call_soon_threadsafe``. Writes are submitted on
the leader only (the gRPC layer refuses them on followers) and every command
is idempotent, so a lost callback is answered by retrying.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from pysyncobj import FAIL_REASON, SyncObj, SyncObjConf, SyncObjConsumer, replicated

from bigfleet.coordinator.state import FleetState

T = TypeVar("T")

JOURNAL_FILE = "raft.journal"
DUMP_FILE = "raft.dump"
RESTORE_FILE = "restore.json"


class RaftError(Exception):
    """A write did not commit (no leader, timeout, or pysyncobj failure)."""


class _Replicated(SyncObjConsumer):  # type: ignore[misc]
    def __init__(self) -> None:
        # Attributes set before the base __init__ are not serialised into snapshots.
        self.lock = threading.RLock()
        self.on_applied: Callable[[], None] | None = None
        super().__init__()
        self.fsm = FleetState()

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def apply(self, cmd_json: str) -> dict[str, Any]:
        cmd = json.loads(cmd_json)
        with self.lock:
            result = self.fsm.apply(cmd)
        if self.on_applied is not None:
            self.on_applied()
        return result

    def _deserialize(self, data: dict[str, Any]) -> None:
        with self.lock:
            super()._deserialize(data)


@dataclass
class RaftConfig:
    self_address: str
    peers: list[str]
    data_dir: Path
    password: str
    bind_address: str | None = None
    election_min: float = 0.3
    election_max: float = 0.6
    heartbeat_period: float = 0.05
    leader_fallback: float = 1.0
    compaction_min_entries: int = 20_000
    extra: dict[str, Any] = field(default_factory=dict)


class RaftNode:
    """A coordinator replica's Raft member; construct it on the event loop's thread."""

    def __init__(self, cfg: RaftConfig) -> None:
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
            appendEntriesUseBatch=False,
            autoTickPeriod=0.01,
            dynamicMembershipChange=True,
            journalFile=str(cfg.data_dir / JOURNAL_FILE),
            fullDumpFile=str(cfg.data_dir / DUMP_FILE),
            logCompactionMinEntries=cfg.compaction_min_entries,
            logCompactionMinTime=60,
            bindAddress=cfg.bind_address,
            **cfg.extra,
        )
        peers = [p for p in cfg.peers if p and p != cfg.self_address]
        self._obj = SyncObj(cfg.self_address, peers, conf, consumers=[self._repl])

    # ------------------------------------------------------------- status
    def is_leader(self) -> bool:
        return bool(self._obj._isLeader())

    def leader(self) -> str | None:
        node = self._obj._getLeader()
        return None if node is None else str(node.address if hasattr(node, "address") else node)

    def raft_term(self) -> int:
        return int(self._obj.raftCurrentTerm)

    def term(self) -> int:
        """The coordinator term shards fence on: restore floor + Raft term."""
        with self._repl.lock:
            offset = self._repl.fsm.term_offset
        return offset + self.raft_term()

    def last_applied(self) -> int:
        return int(self._obj.raftLastApplied)

    def has_quorum(self) -> bool:
        return bool(self._obj.hasQuorum)

    def status(self) -> dict[str, Any]:
        return dict(self._obj.getStatus())

    def set_on_applied(self, fn: Callable[[], None] | None) -> None:
        self._repl.on_applied = fn

    # -------------------------------------------------------------- reads
    def read(self, fn: Callable[[FleetState], T]) -> T:
        """Run ``fn`` on the local state under the apply lock (keep it short)."""
        with self._repl.lock:
            return fn(self._repl.fsm)

    # ------------------------------------------------------------- writes
    async def submit(self, cmd: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[dict[str, Any]] = loop.create_future()

        def done(res: Any, err: Any) -> None:
            def settle() -> None:
                if fut.done():
                    return
                if err == FAIL_REASON.SUCCESS:
                    fut.set_result(res)
                else:
                    fut.set_exception(RaftError(f"raft write failed: {_reason(err)}"))

            loop.call_soon_threadsafe(settle)

        self._repl.apply(json.dumps(cmd, sort_keys=True), callback=done)
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError as exc:
            raise RaftError(f"raft write timed out after {timeout}s") from exc

    async def add_node(self, address: str, timeout: float = 10.0) -> None:
        await self._membership(self._obj.addNodeToCluster, address, timeout)

    async def remove_node(self, address: str, timeout: float = 10.0) -> None:
        await self._membership(self._obj.removeNodeFromCluster, address, timeout)

    async def _membership(self, fn: Callable[..., Any], address: str, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def done(res: Any, err: Any) -> None:
            def settle() -> None:
                if fut.done():
                    return
                if err == FAIL_REASON.SUCCESS:
                    fut.set_result(None)
                else:
                    fut.set_exception(RaftError(f"membership change failed: {_reason(err)}"))

            loop.call_soon_threadsafe(settle)

        fn(address, callback=done)
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError as exc:
            raise RaftError("membership change timed out") from exc

    def members(self) -> list[str]:
        return sorted([self.cfg.self_address, *[str(n.address) for n in self._obj.otherNodes]])

    def destroy(self) -> None:
        self._obj.destroy()


_REASONS = {v: k for k, v in vars(FAIL_REASON).items() if not k.startswith("_") and isinstance(v, int)}


def _reason(err: Any) -> str:
    return str(_REASONS.get(err, err))
