"""Raft member settings and their translation into a ``SyncObjConf``.

The fixed choices are the measured ones (spec decision 15 / python-ecosystem §1): a password always
(pysyncobj's transport is pickle, so an unauthenticated peer could run code), ``useFork=False``
(forking for log compaction breaks gRPC's threads), a 1 s leader fallback, 0.5 s reconnects and
short elections. What legitimately differs between users (heartbeat, batching, compaction size,
file names) is a field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pysyncobj import SyncObjConf


@dataclass
class RaftSettings:
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
    compaction_min_time: float = 60.0
    # Batched appends put many commands in one AppendEntries: higher latency for a lone write (up to
    # one heartbeat period), far higher throughput when writes arrive together.
    batch: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def other_peers(self) -> list[str]:
        """The peer list without this member (operators may pass the full group to every replica)."""
        return [p for p in self.peers if p and p != self.self_address]


def sync_obj_conf(s: RaftSettings, journal_file: str, dump_file: str) -> SyncObjConf:
    """Build the pysyncobj configuration; journal and dump live under ``s.data_dir``."""
    return SyncObjConf(
        password=s.password,
        useFork=False,
        leaderFallbackTimeout=s.leader_fallback,
        connectionRetryTime=0.5,
        connectionTimeout=1.0,
        raftMinTimeout=s.election_min,
        raftMaxTimeout=s.election_max,
        appendEntriesPeriod=s.heartbeat_period,
        appendEntriesUseBatch=s.batch,
        autoTickPeriod=0.01,
        dynamicMembershipChange=True,
        journalFile=str(s.data_dir / journal_file),
        fullDumpFile=str(s.data_dir / dump_file),
        logCompactionMinEntries=s.compaction_min_entries,
        logCompactionMinTime=s.compaction_min_time,
        bindAddress=s.bind_address,
        **s.extra,
    )
