"""bigfleet.raft on its own: a one-member group commits, a member without quorum times out into RaftError,
and a snapshot round trip keeps the lock out of the replicated state."""

from __future__ import annotations

import asyncio
from pathlib import Path

from pysyncobj import FAIL_REASON, replicated

from bigfleet.raft import LockedConsumer, RaftBridge, RaftError, RaftSettings, fail_reason
from bigfleet.testing import free_port, wait_until_async


class _Counter(LockedConsumer[dict[str, int]]):
    def __init__(self) -> None:
        super().__init__({})

    @replicated  # type: ignore[untyped-decorator,misc,unused-ignore]
    def add(self, key: str, n: int) -> int:
        with self.lock:
            self.fsm[key] = self.fsm.get(key, 0) + n
            return self.fsm[key]


class _Node(RaftBridge[dict[str, int]]):
    journal_file = "t.journal"
    dump_file = "t.dump"

    def __init__(self, cfg: RaftSettings) -> None:
        self.counter = _Counter()
        super().__init__(cfg, self.counter)

    async def add(self, key: str, n: int, timeout: float = 5.0) -> int:
        return int(await self.call(self.counter.add, key, n, timeout=timeout))


async def test_single_member_commits_and_reads(tmp_path: Path) -> None:
    me = f"127.0.0.1:{free_port()}"
    node = _Node(RaftSettings(me, [me], tmp_path, "pw"))
    try:
        # (pysyncobj ticks on this loop: the wait must not block it)
        await wait_until_async(node.is_leader, timeout=30, what="a single member elects itself")
        assert await node.add("a", 2) == 2
        assert await node.add("a", 3) == 5
        assert node.read(lambda s: dict(s)) == {"a": 5}
        assert node.leader() == me and node.members() == [me] and node.has_quorum()
        assert node.raft_term() >= 1 and node.last_applied() >= 2
        assert (tmp_path / "t.journal").exists()
        # The lock is local: only the state machine is part of a snapshot.
        assert set(node.counter._serialize()) == {"fsm"}
    finally:
        node.destroy()


async def test_no_quorum_is_a_raft_error(tmp_path: Path) -> None:
    me, ghost = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    node = _Node(RaftSettings(me, [me, ghost], tmp_path, "pw"))
    try:
        await asyncio.sleep(0)  # nobody answers the vote: never leader, writes cannot commit
        try:
            await node.add("a", 1, timeout=1.0)
        except RaftError as exc:
            assert "timed out" in str(exc) or "failed" in str(exc)
        else:
            raise AssertionError("a write without quorum committed")
        assert not node.is_leader()
    finally:
        node.destroy()


def test_fail_reason_names_pysyncobj_codes() -> None:
    assert fail_reason(FAIL_REASON.NOT_LEADER) == "NOT_LEADER"
    assert fail_reason(12345) == "12345"
