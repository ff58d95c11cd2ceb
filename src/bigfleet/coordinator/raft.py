"""The coordinator's replicated state: one ``apply(command_json)`` over :class:`FleetState`.

The Raft plumbing (settings, asyncio bridge, role queries) is :mod:`bigfleet.raft`; this module
keeps only what is the coordinator's own: the command, the term that shards fence on, and an
"applied" hook that wakes watchers. Writes go to the leader only (the gRPC layer refuses them on
followers), no append batching (sub-ms single writes), and every command is idempotent, so a lost
callback is answered by retrying.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pysyncobj import replicated

from bigfleet.coordinator.state import FleetState
from bigfleet.raft import LockedConsumer, RaftBridge, RaftError, RaftSettings

__all__ = ["DUMP_FILE", "JOURNAL_FILE", "RESTORE_FILE", "RaftConfig", "RaftError", "RaftNode"]

T = TypeVar("T")

JOURNAL_FILE = "raft.journal"
DUMP_FILE = "raft.dump"
RESTORE_FILE = "restore.json"


class _Replicated(LockedConsumer[FleetState]):
    def __init__(self) -> None:
        # Set before the base __init__ so it is not serialised into snapshots.
        self.on_applied: Callable[[], None] | None = None
        super().__init__(FleetState())

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def apply(self, cmd_json: str) -> dict[str, Any]:
        cmd = json.loads(cmd_json)
        with self.lock:
            result = self.fsm.apply(cmd)
        if self.on_applied is not None:
            self.on_applied()
        return result


@dataclass
class RaftConfig(RaftSettings):
    """Coordinator defaults: 50 ms heartbeats, unbatched appends, compaction every 20 000 entries."""


class RaftNode(RaftBridge[FleetState]):
    """A coordinator replica's Raft member; construct it on the event loop's thread."""

    journal_file = JOURNAL_FILE
    dump_file = DUMP_FILE

    def __init__(self, cfg: RaftConfig) -> None:
        self.cfg = cfg
        self._fleet = _Replicated()
        super().__init__(cfg, self._fleet)

    def term(self) -> int:
        """The coordinator term shards fence on: restore floor + Raft term."""
        offset = self.read(lambda fsm: fsm.term_offset)
        return offset + self.raft_term()

    def set_on_applied(self, fn: Callable[[], None] | None) -> None:
        self._fleet.on_applied = fn

    async def submit(self, cmd: dict[str, Any], timeout: float = 5.0) -> dict[str, Any]:
        result: dict[str, Any] = await self.call(self._fleet.apply, json.dumps(cmd, sort_keys=True), timeout=timeout)
        return result
