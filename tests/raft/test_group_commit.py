"""Group commit (raft/group.py): a lone write goes at once, writes queued behind a commit go
together, epochs never mix, an error reaches only its own batch, and a writer that stopped
waiting before its batch left is not committed."""

from __future__ import annotations

import asyncio

import pytest

from bigfleet.raft import GroupCommit, RaftError


class _Log:
    def __init__(self) -> None:
        self.batches: list[tuple[tuple[str, ...], int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_next = False
        self.started = asyncio.Event()  # a batch reached the log

    async def commit(self, entries: tuple[str, ...], epoch: int) -> tuple[bool, ...]:
        self.batches.append((entries, epoch))
        self.started.set()
        await self.gate.wait()
        if self.fail_next:
            self.fail_next = False
            raise RaftError("roll-up commit failed: not leader")
        return tuple(not e.startswith("stale") for e in entries)


async def test_a_lone_write_commits_at_once_alone() -> None:
    log = _Log()
    g: GroupCommit[str] = GroupCommit(log.commit)
    assert await asyncio.wait_for(g.submit("a", 1), 10.0)
    assert log.batches == [(("a",), 1)]


async def test_writes_queued_behind_a_commit_go_together_and_keep_their_answers() -> None:
    log = _Log()
    g: GroupCommit[str] = GroupCommit(log.commit)
    log.gate.clear()
    first = asyncio.create_task(g.submit("a", 1))
    await log.started.wait()  # "a" is committing
    rest = [asyncio.create_task(g.submit(x, 1)) for x in ("b", "stale-c", "d")]
    await asyncio.sleep(0)  # (one loop turn: the new writers queue)
    assert log.batches == [(("a",), 1)]
    log.gate.set()
    assert await first
    assert await asyncio.gather(*rest) == [True, False, True]  # each writer gets its own answer
    assert log.batches == [(("a",), 1), (("b", "stale-c", "d"), 1)]


async def test_epochs_never_share_a_batch_and_batches_are_bounded() -> None:
    log = _Log()
    g: GroupCommit[str] = GroupCommit(log.commit, max_batch=2)
    log.gate.clear()
    first = asyncio.create_task(g.submit("a", 1))
    await log.started.wait()
    rest = [asyncio.create_task(g.submit(x, e)) for x, e in (("b", 1), ("c", 2), ("d", 1), ("e", 1))]
    await asyncio.sleep(0)  # (one loop turn: the new writers queue)
    log.gate.set()
    await asyncio.gather(first, *rest)
    assert log.batches == [(("a",), 1), (("b", "d"), 1), (("c",), 2), (("e",), 1)]


async def test_an_error_fails_its_batch_only() -> None:
    log = _Log()
    g: GroupCommit[str] = GroupCommit(log.commit)
    log.gate.clear()
    log.fail_next = True
    first = asyncio.create_task(g.submit("a", 1))
    await log.started.wait()
    later = asyncio.create_task(g.submit("b", 1))
    log.gate.set()
    with pytest.raises(RaftError):
        await first
    assert await later
    assert [b for b, _ in log.batches] == [("a",), ("b",)]


async def test_a_writer_that_gave_up_before_its_batch_left_is_not_committed() -> None:
    log = _Log()
    g: GroupCommit[str] = GroupCommit(log.commit)
    log.gate.clear()
    first = asyncio.create_task(g.submit("a", 1))
    await log.started.wait()
    gave_up = asyncio.create_task(g.submit("b", 1))
    kept = asyncio.create_task(g.submit("c", 1))
    await asyncio.sleep(0)  # (one loop turn: the new writers queue)
    gave_up.cancel()
    log.gate.set()
    assert await first and await kept
    assert [b for b, _ in log.batches] == [("a",), ("c",)]
