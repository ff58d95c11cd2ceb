"""The log under the shard's replicated state: a Raft member, or an in-process group of one.

:class:`ShardRaft` is the production log (pysyncobj; a single-replica shard is a Raft group of one
on loopback, so its state is journalled exactly as a replica group's). :class:`LocalLog` applies
commands in process, synchronously: the simulator's virtual clock cannot wait on a Raft thread.
Both answer the same :class:`ShardLog` protocol, so the shard is assembled one way.

Arguments travel pickled inside pysyncobj's password-encrypted transport, so roll-ups ride as their
wire bytes and are not re-encoded. Roll-ups from many clusters arrive together, so they are group
committed (one command per batch) and each command is sent to the followers at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeVar

from pysyncobj import replicated

from bigfleet.budget import Disruption
from bigfleet.decision.types import EngineState
from bigfleet.raft import GroupCommit, LockedConsumer, RaftBridge, RaftError, RaftSettings
from bigfleet.shard.ha.state import HAState, Ledger, Retiring

__all__ = ["DUMP_FILE", "JOURNAL_FILE", "LocalLog", "RaftError", "ShardLog", "ShardRaft", "ShardRaftConfig"]

JOURNAL_FILE = "shard-raft.journal"
DUMP_FILE = "shard-raft.dump"
T = TypeVar("T")


class ShardLog(Protocol):
    """What the shard needs from the log its state machine runs on."""

    @property
    def address(self) -> str: ...

    def is_leader(self) -> bool: ...

    def leader(self) -> str | None: ...

    def raft_term(self) -> int: ...

    def read(self, fn: Callable[[HAState], T]) -> T: ...

    def ledger(self) -> Ledger:
        """The live ledger (read without the lock: membership tests only)."""
        ...

    async def claim(self, advertise: str, floor: int = 0, timeout: float = 5.0) -> tuple[int, int]: ...

    async def replace(self, cluster_id: str, data: bytes, now: int, epoch: int, timeout: float = 5.0) -> bool: ...

    async def save_engine(self, state: EngineState, version: int, epoch: int, timeout: float = 5.0) -> bool: ...

    async def hold_rollup(self, cluster_id: str, held: int, since: int, epoch: int, timeout: float = 5.0) -> bool: ...

    async def record_disruptions(self, entries: tuple[tuple[str, Disruption], ...], keep_after: int, epoch: int,
                                 timeout: float = 5.0) -> bool: ...

    async def release_cluster(self, cluster_id: str, machine_ids: tuple[str, ...], to_shard: str, address: str,
                              epoch: int, binding_epoch: int = 0, timeout: float = 10.0) -> tuple[str, ...] | None: ...

    async def release_machines(self, machine_ids: tuple[str, ...], why: str, epoch: int,
                               timeout: float = 10.0) -> tuple[str, ...] | None: ...

    async def adopt(self, machine_ids: tuple[str, ...], cluster_id: str, epoch: int,
                    timeout: float = 10.0) -> bool: ...

    async def set_actuation(self, paused: bool, dry_run: bool, epoch: int, timeout: float = 10.0) -> bool: ...

    async def apply_actuation_flags(self, paused: bool, dry_run: bool, epoch: int, timeout: float = 10.0) -> bool: ...

    async def track_retiring(self, machine_id: str, entry: Retiring | None, epoch: int,
                             timeout: float = 10.0) -> bool: ...

    def destroy(self) -> None: ...


class _Replicated(LockedConsumer[HAState]):
    """The replicated commands. pysyncobj numbers them by name, in sorted order, and journals hold
    the numbers: a new command's name must sort after every existing one (tests/shard_ha pins the
    order), or a journal written by the previous release replays into the wrong methods."""

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
    def hold_rollup(self, cluster_id: str, held: int, since: int, epoch: int) -> bool:
        with self.lock:
            return self.fsm.hold_rollup(cluster_id, held, since, epoch)

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def record_disruptions(self, entries: tuple[tuple[str, Disruption], ...], keep_after: int, epoch: int) -> bool:
        with self.lock:
            return self.fsm.record_disruptions(entries, keep_after, epoch)

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def claim(self, raft_term: int, node: str, advertise: str, floor: int = 0) -> int:
        with self.lock:
            return self.fsm.claim(raft_term, node, advertise, floor)

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def release_cluster(self, cluster_id: str, machine_ids: tuple[str, ...], to_shard: str, address: str,
                        epoch: int, binding_epoch: int = 0) -> tuple[str, ...] | None:
        with self.lock:
            return self.fsm.release_cluster(cluster_id, machine_ids, to_shard, address, epoch, binding_epoch)

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def release_machines(self, machine_ids: tuple[str, ...], why: str, epoch: int) -> tuple[str, ...] | None:
        with self.lock:
            return self.fsm.release_machines(machine_ids, why, epoch)

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def adopt(self, machine_ids: tuple[str, ...], cluster_id: str, epoch: int) -> bool:
        with self.lock:
            return self.fsm.adopt(machine_ids, cluster_id, epoch)

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def set_actuation(self, paused: bool, dry_run: bool, epoch: int) -> bool:
        with self.lock:
            return self.fsm.set_actuation(paused, dry_run, epoch)

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def apply_actuation_flags(self, paused: bool, dry_run: bool, epoch: int) -> bool:
        with self.lock:
            return self.fsm.apply_actuation_flags(paused, dry_run, epoch)

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def track_retiring(self, machine_id: str, entry: Retiring | None, epoch: int) -> bool:
        with self.lock:
            return self.fsm.track_retiring(machine_id, entry, epoch)

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def upsert_rollups(self, entries: tuple[tuple[str, bytes, int], ...], epoch: int) -> tuple[bool, ...]:
        with self.lock:
            return self.fsm.replace_many(entries, epoch)


@dataclass
class ShardRaftConfig(RaftSettings):
    heartbeat_period: float = 0.02
    compaction_min_entries: int = 5_000
    # Unbatched: a new command wakes pysyncobj at once and goes to the followers at once. Batched
    # appends waited for the next heartbeat (20 ms), which was most of a 3-replica commit (p50
    # 22-30 ms -> 3 ms). Batching is done above pysyncobj instead, by group commit (raft/group.py).
    batch: bool = False


class ShardRaft(RaftBridge[HAState]):
    """One replica's Raft member; construct on the event loop's thread."""

    journal_file = JOURNAL_FILE
    dump_file = DUMP_FILE

    def __init__(self, cfg: ShardRaftConfig) -> None:
        self.cfg = cfg
        self._ha = _Replicated()
        super().__init__(cfg, self._ha)
        # Roll-ups go out as group commits (raft/group.py): one command per batch, not per roll-up.
        self.rollups: GroupCommit[tuple[str, bytes, int]] = GroupCommit(self._commit_rollups)

    def ledger(self) -> Ledger:
        return self._ha.fsm.ledger

    async def replace(self, cluster_id: str, data: bytes, now: int, epoch: int, timeout: float = 5.0) -> bool:
        try:
            return await asyncio.wait_for(self.rollups.submit((cluster_id, bytes(data), now), epoch), timeout)
        except TimeoutError as exc:  # (queued behind a slow batch, or in a batch that timed out)
            raise RaftError(f"roll-up commit timed out after {timeout}s") from exc

    async def _commit_rollups(self, entries: tuple[tuple[str, bytes, int], ...], epoch: int) -> tuple[bool, ...]:
        results = await self.call(self._ha.upsert_rollups, entries, epoch, timeout=5.0, what="roll-up commit")
        return tuple(bool(r) for r in results)

    async def save_engine(self, state: EngineState, version: int, epoch: int, timeout: float = 5.0) -> bool:
        return bool(await self.call(self._ha.save_engine, state, version, epoch, timeout=timeout))

    async def hold_rollup(self, cluster_id: str, held: int, since: int, epoch: int, timeout: float = 5.0) -> bool:
        return bool(await self.call(self._ha.hold_rollup, cluster_id, held, since, epoch, timeout=timeout,
                                    what="hold_rollup"))

    async def record_disruptions(self, entries: tuple[tuple[str, Disruption], ...], keep_after: int, epoch: int,
                                 timeout: float = 5.0) -> bool:
        return bool(await self.call(self._ha.record_disruptions, entries, keep_after, epoch, timeout=timeout,
                                    what="record_disruptions"))

    async def claim(self, advertise: str, floor: int = 0, timeout: float = 5.0) -> tuple[int, int]:
        """(epoch, raft term claimed); epoch 0 means refused."""
        term = self.raft_term()
        epoch = int(await self.call(self._ha.claim, term, self.address, advertise, floor, timeout=timeout))
        return epoch, term

    async def release_cluster(self, cluster_id: str, machine_ids: tuple[str, ...], to_shard: str, address: str,
                              epoch: int, binding_epoch: int = 0, timeout: float = 10.0) -> tuple[str, ...] | None:
        res = await self.call(self._ha.release_cluster, cluster_id, tuple(machine_ids), to_shard, address, epoch,
                              binding_epoch, timeout=timeout, what="release_cluster")
        return None if res is None else tuple(res)

    async def release_machines(self, machine_ids: tuple[str, ...], why: str, epoch: int,
                               timeout: float = 10.0) -> tuple[str, ...] | None:
        res = await self.call(self._ha.release_machines, tuple(machine_ids), why, epoch, timeout=timeout,
                              what="release_machines")
        return None if res is None else tuple(res)

    async def adopt(self, machine_ids: tuple[str, ...], cluster_id: str, epoch: int, timeout: float = 10.0) -> bool:
        return bool(await self.call(self._ha.adopt, tuple(machine_ids), cluster_id, epoch, timeout=timeout,
                                    what="adopt"))

    async def set_actuation(self, paused: bool, dry_run: bool, epoch: int, timeout: float = 10.0) -> bool:
        return bool(await self.call(self._ha.set_actuation, paused, dry_run, epoch, timeout=timeout,
                                    what="set_actuation"))

    async def apply_actuation_flags(self, paused: bool, dry_run: bool, epoch: int, timeout: float = 10.0) -> bool:
        return bool(await self.call(self._ha.apply_actuation_flags, paused, dry_run, epoch, timeout=timeout,
                                    what="apply_actuation_flags"))

    async def track_retiring(self, machine_id: str, entry: Retiring | None, epoch: int,
                             timeout: float = 10.0) -> bool:
        return bool(await self.call(self._ha.track_retiring, machine_id, entry, epoch, timeout=timeout,
                                    what="track_retiring"))


class LocalLog:
    """The state machine applied in process: always the leader of a group of one, never durable.

    For the simulator (a virtual clock cannot wait on a Raft thread) and in-process tests; every
    command is the same :class:`HAState` method the Raft log applies."""

    address = "local"

    def __init__(self, state: HAState | None = None) -> None:
        self.state = state if state is not None else HAState()
        self.term = 1

    def is_leader(self) -> bool:
        return True

    def leader(self) -> str | None:
        return self.address

    def raft_term(self) -> int:
        return self.term

    def read(self, fn: Callable[[HAState], T]) -> T:
        return fn(self.state)

    def ledger(self) -> Ledger:
        return self.state.ledger

    async def claim(self, advertise: str, floor: int = 0, timeout: float = 5.0) -> tuple[int, int]:
        return self.state.claim(self.term, self.address, advertise, floor), self.term

    async def replace(self, cluster_id: str, data: bytes, now: int, epoch: int, timeout: float = 5.0) -> bool:
        return self.state.replace(cluster_id, data, now, epoch)

    async def save_engine(self, state: EngineState, version: int, epoch: int, timeout: float = 5.0) -> bool:
        return self.state.save_engine(state, version, epoch)

    async def hold_rollup(self, cluster_id: str, held: int, since: int, epoch: int, timeout: float = 5.0) -> bool:
        return self.state.hold_rollup(cluster_id, held, since, epoch)

    async def record_disruptions(self, entries: tuple[tuple[str, Disruption], ...], keep_after: int, epoch: int,
                                 timeout: float = 5.0) -> bool:
        return self.state.record_disruptions(entries, keep_after, epoch)

    async def release_cluster(self, cluster_id: str, machine_ids: tuple[str, ...], to_shard: str, address: str,
                              epoch: int, binding_epoch: int = 0, timeout: float = 10.0) -> tuple[str, ...] | None:
        return self.state.release_cluster(cluster_id, tuple(machine_ids), to_shard, address, epoch, binding_epoch)

    async def release_machines(self, machine_ids: tuple[str, ...], why: str, epoch: int,
                               timeout: float = 10.0) -> tuple[str, ...] | None:
        return self.state.release_machines(tuple(machine_ids), why, epoch)

    async def adopt(self, machine_ids: tuple[str, ...], cluster_id: str, epoch: int, timeout: float = 10.0) -> bool:
        return self.state.adopt(tuple(machine_ids), cluster_id, epoch)

    async def set_actuation(self, paused: bool, dry_run: bool, epoch: int, timeout: float = 10.0) -> bool:
        return self.state.set_actuation(paused, dry_run, epoch)

    async def apply_actuation_flags(self, paused: bool, dry_run: bool, epoch: int, timeout: float = 10.0) -> bool:
        return self.state.apply_actuation_flags(paused, dry_run, epoch)

    def destroy(self) -> None:
        pass

    async def track_retiring(self, machine_id: str, entry: Retiring | None, epoch: int,
                             timeout: float = 10.0) -> bool:
        return self.state.track_retiring(machine_id, entry, epoch)
