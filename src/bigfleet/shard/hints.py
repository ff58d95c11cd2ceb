"""Capacity hints: which AvailableCapacityUpdates are due after a cycle, and their pace.

Walking every need costs O(needs) on the session loop and a busy shard cycles several times a
second, so the full walk runs once per ``interval`` (the hint's own rate limit) or when sessions
came or went; in between, only clusters whose demand changed are looked at (a new need gets its
hint right after the cycle). Due hints go into a queue (newest wins per need) that a sender drains
at ``rate`` frames per second shard-wide: a shape's free count crossing the 2 % line makes every
need that can use it due at once (50 000 frames on a 5 000-session shard), and written as one burst
they stood in front of every roll-up's ack for up to 0.8 s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from bigfleet.needs import Need, NeedsTable
from bigfleet.shard import availability
from bigfleet.shard.metrics import ShardMetrics
from bigfleet.shard.sessions import SessionRegistry


class CapacityHints:
    #: how often the paced sender wakes up (it sends ``rate`` x this per tick; short ticks keep
    #: each write burst, and so the wait of the roll-up acks queued behind it, to a few ms)
    TICK = 0.01

    def __init__(self, sessions: SessionRegistry, table: Callable[[], NeedsTable], frozen_clusters: set[str],
                 metrics: ShardMetrics, interval: float, rate: float, clock: Callable[[], float],
                 paced: bool) -> None:
        self.sessions = sessions
        self.table = table
        self.frozen_clusters = frozen_clusters  # the daemon's live set
        self.metrics = metrics
        self.interval = interval
        self.rate = rate
        self.clock = clock
        self.paced = paced and rate > 0
        self.emitter = availability.AvailabilityEmitter(interval)
        self.queue = availability.HintQueue()
        self.ready = asyncio.Event()
        self.pending: tuple[Iterable[Need], dict[Any, availability.Availability]] | None = None
        self._at = float("-inf")
        self._sessions_version = -1
        self._frozen = 0
        self._dirty: set[str] = set()
        sessions.on_removed.append(self.emitter.forget_cluster)

    def changed(self, cluster_id: str) -> None:
        """The cluster's demand changed: its needs are looked at after the next cycle."""
        self._dirty.add(cluster_id)

    async def after_cycle(self, needs: Iterable[Need], hints: dict[Any, availability.Availability]) -> None:
        if self.paced:
            # Advisory work: it runs on the sender's task, not inside the cycle.
            self.pending = (needs, hints)
            self.ready.set()
        else:
            await self.emit(needs, hints)

    async def emit(self, needs: Iterable[Need], hints: dict[Any, availability.Availability]) -> None:
        """Send (or queue) the due AvailableCapacityUpdates of the connected clusters among ``needs``."""
        now = self.clock()
        full = (now - self._at >= self.interval or self.sessions.version != self._sessions_version
                or len(self.frozen_clusters) != self._frozen)
        if full:
            self._at, self._sessions_version = now, self.sessions.version
            self._frozen = len(self.frozen_clusters)
            self._dirty.clear()
            todo: Iterable[Need] = needs
        elif self._dirty:
            table, fc = self.table(), self.frozen_clusters
            dirty, self._dirty = self._dirty, set()
            todo = [n for c in dirty if c not in fc for n in table.cluster(c)]
        else:
            return
        get = self.sessions.get
        for i, need in enumerate(todo):
            if i % 64 == 63:
                await asyncio.sleep(0)  # long lists must not hold the loop (measured: 2 000 needs ≈ 60 ms)
            if get(need.cluster_id) is None:
                continue
            a = hints.get(need.requirements)
            if a is not None and self.emitter.due(need.cluster_id, need.fingerprint, a, now):
                if self.paced:
                    self.queue.put(need, a)
                else:
                    self.sessions.send(need.cluster_id, availability.update_message(need, a))

    async def run(self) -> None:
        """The paced sender: walk the newest cycle's hints, write the due ones at ``rate`` per second."""
        per_tick = max(1, int(self.rate * self.TICK))
        get = self.sessions.get
        while True:
            await self.ready.wait()
            self.ready.clear()
            while True:
                if self.pending is not None:
                    needs, hints = self.pending
                    self.pending = None
                    await self.emit(needs, hints)
                if not len(self.queue):
                    break
                for need, a in self.queue.take(per_tick):
                    session = get(need.cluster_id)
                    if session is not None:  # (a cluster that went away meanwhile gets nothing)
                        session.send(availability.update_message(need, a))
                self.metrics.hints_queued.set(len(self.queue))
                await asyncio.sleep(self.TICK)
