"""A 3-member group with unbatched appends under many concurrent writes: the leader keeps several
AppendEntries in flight per follower, and a success reply for an older one must not move the
follower's next index back. pysyncobj 0.3.17 did: the leader re-sent entries the follower had
applied, and the follower truncated and re-appended them with a CRITICAL "truncating already-applied
log entries ... state machine may have diverged" (bigfleet.raft.bridge installs the fix)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from bigfleet.raft import RaftSettings
from bigfleet.testing import free_port, wait_until

from .test_bridge import _Node


class _Catch(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.timeout(120)
async def test_in_flight_appends_never_resend_applied_entries(tmp_path: Path) -> None:
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    catch = _Catch()
    logging.getLogger("pysyncobj").addHandler(catch)
    nodes = [_Node(RaftSettings(a, addrs, tmp_path / f"n{i}", "pw", tick_period=0.002))
             for i, a in enumerate(addrs)]
    try:
        wait_until(lambda: any(n.is_leader() for n in nodes), timeout=30, what="a leader")
        leader = next(n for n in nodes if n.is_leader())

        async def writer(k: int) -> None:
            for i in range(40):
                await leader.add(f"k{k}", 1)
                if i % 7 == 0:
                    await asyncio.sleep(0.001)

        await asyncio.gather(*(writer(k) for k in range(300)))
        wait_until(lambda: all(n.last_applied() >= leader.last_applied() for n in nodes), timeout=30,
                   what="followers caught up")
        want = {f"k{k}": 40 for k in range(300)}
        states = [n.read(lambda s: dict(s)) for n in nodes]
        assert all(st == want for st in states), [
            (n.is_leader(), n.last_applied(), {k: v for k, v in st.items() if want.get(k) != v})
            for n, st in zip(nodes, states, strict=True)]
    finally:
        for n in nodes:
            n.destroy()
        logging.getLogger("pysyncobj").removeHandler(catch)
    assert not [m for m in catch.messages if "truncating already-applied" in m], catch.messages[:3]
