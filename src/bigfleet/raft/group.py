"""Group commit: writes that arrive while one Raft command is committing go out together in the next.

At 500 changed roll-ups a second, one command per roll-up meant 500 log entries, 500 callbacks
from pysyncobj's thread and 500 hand-overs of the GIL between that thread and the event loop; the
waits in those hand-overs were most of a roll-up's ack time. A lone write still goes at once (no
timer, no added latency); under load a batch holds whatever queued during the previous commit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

E = TypeVar("E")

#: commits ``(entries, epoch)`` and answers one result per entry, in order
Commit = Callable[[tuple[E, ...], int], Awaitable[tuple[bool, ...]]]


class GroupCommit(Generic[E]):
    """One batch in flight at a time; entries of another epoch wait for a batch of their own."""

    def __init__(self, commit: Commit[E], max_batch: int = 512) -> None:
        self._commit = commit
        self.max_batch = max_batch
        self._queued: list[tuple[E, int, asyncio.Future[bool]]] = []
        self._task: asyncio.Task[None] | None = None

    async def submit(self, entry: E, epoch: int) -> bool:
        """Queue ``entry`` for the next batch and wait for its own result (or the batch's error)."""
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._queued.append((entry, epoch, fut))
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="raft-group-commit")
        return await fut

    async def _drain(self) -> None:
        while self._queued:
            batch = self._take()
            if not batch:
                continue
            try:
                results = await self._commit(tuple(e for e, _, _ in batch), batch[0][1])
            except BaseException as exc:
                for _, _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc if isinstance(exc, Exception) else asyncio.CancelledError())
                if not isinstance(exc, Exception):
                    self._fail_queued()
                    raise
                continue
            for (_, _, fut), ok in zip(batch, results, strict=True):
                if not fut.done():
                    fut.set_result(ok)

    def _take(self) -> list[tuple[E, int, asyncio.Future[bool]]]:
        """The next batch: queued entries of the first one's epoch, oldest first, at most max_batch
        (an entry whose writer stopped waiting before its batch left is dropped, never committed)."""
        live = [item for item in self._queued if not item[2].done()]
        if not live:
            self._queued = []
            return []
        epoch = live[0][1]
        batch = [item for item in live if item[1] == epoch][: self.max_batch]
        taken = {id(item) for item in batch}
        self._queued = [item for item in live if id(item) not in taken]
        return batch

    def _fail_queued(self) -> None:
        queued, self._queued = self._queued, []
        for _, _, fut in queued:
            if not fut.done():
                fut.cancel()
