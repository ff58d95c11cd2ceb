"""Raft member settings and their translation into a ``SyncObjConf``.

The fixed choices are the measured ones (spec decision 15 / python-ecosystem §1): a password always
(pysyncobj's transport is pickle, so an unauthenticated peer could run code), ``useFork=False``
(forking for log compaction breaks gRPC's threads), a 1 s leader fallback, 0.5 s reconnects and
short elections. What legitimately differs between users (heartbeat, batching, compaction size,
file names) is a field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pysyncobj import SyncObjConf

#: pysyncobj drops a peer connection silent for this long; it requires election timeouts within it.
CONNECTION_TIMEOUT = 1.0


class RaftSettingsError(ValueError):
    """Settings pysyncobj would refuse with a bare AssertionError; ``problems`` says which and why."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid Raft settings: " + "; ".join(problems))
        self.problems = problems


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
    #: pysyncobj drops a peer connection silent this long (election timeouts must fit within it)
    connection_timeout: float = CONNECTION_TIMEOUT
    #: how often pysyncobj's timers (heartbeats, elections, reconnects) are looked at; ticks also
    #: follow every message and command on the event loop, so this does not delay a write
    tick_period: float = 0.01
    #: the group's members are kept in its log and snapshot (changed by `add_node`/`remove_node`). False
    #: for a member whose address is new at every start (a shard's group of one on a free loopback
    #: port): its snapshot would bring back its last address as a second member that never answers,
    #: so the restarted member could never win an election.
    membership_in_log: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    def other_peers(self) -> list[str]:
        """The peer list without this member (operators may pass the full group to every replica)."""
        return [p for p in self.peers if p and p != self.self_address]


def sync_obj_conf(s: RaftSettings, journal_file: str, dump_file: str) -> SyncObjConf:
    """Build the pysyncobj configuration; journal and dump live under ``s.data_dir``.

    Raises :class:`RaftSettingsError` for timings pysyncobj would only assert on.
    """
    conf = _conf(s, journal_file, dump_file)
    problems = _problems(conf, {})
    if problems:
        raise RaftSettingsError(problems)
    return conf


#: which SyncObjConf attribute each settings field (or fixed choice) becomes
_FIELD_OF = {
    "raftMinTimeout": "election_min",
    "raftMaxTimeout": "election_max",
    "appendEntriesPeriod": "heartbeat_period",
    "leaderFallbackTimeout": "leader_fallback",
    "connectionTimeout": "connection timeout",
    "logCompactionMinEntries": "compaction_min_entries",
    "logCompactionMinTime": "compaction_min_time",
}


def timing_problems(s: RaftSettings, names: Mapping[str, str] | None = None) -> list[str]:
    """Why pysyncobj would refuse these settings (empty when it will not), in words.

    The same conditions as pysyncobj's ``SyncObjConf.validate`` asserts for the timings and the
    compaction thresholds, plus finiteness. ``names`` maps a field (``election_max``) to what the
    user typed (``--raft-election-max``) so a CLI can report its own flags.
    """
    return _problems(_conf(s, "journal", "dump"), names or {})


def _problems(conf: SyncObjConf, names: Mapping[str, str]) -> list[str]:
    def name(attr: str) -> str:
        f = _FIELD_OF[attr]
        return names.get(f, f)

    out: list[str] = []
    values: dict[str, float] = {}
    for attr in _FIELD_OF:
        v = getattr(conf, attr)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            out.append(f"{name(attr)} must be a finite number, got {v!r}")
        else:
            values[attr] = float(v)
    if out:
        return out
    hb, lo, hi = values["appendEntriesPeriod"], values["raftMinTimeout"], values["raftMaxTimeout"]
    conn, fallback = values["connectionTimeout"], values["leaderFallbackTimeout"]
    if not hb > 0:
        out.append(f"{name('appendEntriesPeriod')} must be above 0 s, got {hb:g}")
    elif not lo > 3 * hb:
        out.append(f"{name('raftMinTimeout')} must be above 3 heartbeat periods ({3 * hb:g} s), got {lo:g}")
    if not hi > lo:
        out.append(f"{name('raftMaxTimeout')} must be above {name('raftMinTimeout')} ({lo:g} s), got {hi:g}")
    if not hi <= conn:
        out.append(f"{name('raftMaxTimeout')} must be at most {conn:g} s, got {hi:g}: pysyncobj drops a Raft "
                   f"connection silent for {conn:g} s and requires election timeouts within that")
    if hb > 0 and not fallback > hb:
        out.append(f"{name('leaderFallbackTimeout')} must be above the heartbeat period ({hb:g} s), got {fallback:g}")
    if not values["logCompactionMinEntries"] >= 2:
        out.append(f"{name('logCompactionMinEntries')} must be at least 2, got {values['logCompactionMinEntries']:g}")
    if not values["logCompactionMinTime"] > 0:
        out.append(f"{name('logCompactionMinTime')} must be above 0 s, got {values['logCompactionMinTime']:g}")
    return out


def _conf(s: RaftSettings, journal_file: str, dump_file: str) -> SyncObjConf:
    return SyncObjConf(
        password=s.password,
        useFork=False,
        leaderFallbackTimeout=s.leader_fallback,
        connectionRetryTime=0.5,
        connectionTimeout=s.connection_timeout,
        raftMinTimeout=s.election_min,
        raftMaxTimeout=s.election_max,
        appendEntriesPeriod=s.heartbeat_period,
        appendEntriesUseBatch=s.batch,
        autoTickPeriod=s.tick_period,
        dynamicMembershipChange=s.membership_in_log,
        journalFile=str(s.data_dir / journal_file),
        fullDumpFile=str(s.data_dir / dump_file),
        logCompactionMinEntries=s.compaction_min_entries,
        logCompactionMinTime=s.compaction_min_time,
        bindAddress=s.bind_address,
        **s.extra,
    )
