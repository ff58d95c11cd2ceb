"""A 3-member group, one process per member as deployed, with unbatched appends under many concurrent
writes: the leader keeps several AppendEntries in flight per follower, and a success reply for an
older one must not move the follower's next index back. pysyncobj 0.3.17 did: the leader re-sent
entries the follower had applied, and the follower truncated and re-appended them with a CRITICAL
"truncating already-applied log entries ... state machine may have diverged" (bigfleet.raft.bridge
installs the fix, `PipelinedSyncObj`)."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import time
from pathlib import Path
from typing import Any

import pytest

from bigfleet.raft import RaftSettings
from bigfleet.testing import free_port

WRITERS, WRITES = 200, 40


def _member(i: int, addrs: list[str], data: str, out: Any, stop: Any) -> None:
    """One member: the leader runs the writers; every member reports its state and the log lines."""
    seen: list[str] = []

    class _Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    logging.getLogger("pysyncobj").addHandler(_Catch(logging.WARNING))
    asyncio.run(_serve_member(i, addrs, data, out, stop, seen))


async def _serve_member(i: int, addrs: list[str], data: str, out: Any, stop: Any, seen: list[str]) -> None:
    from .test_bridge import _Node

    # Long election and fallback timeouts: a leader change on a loaded machine re-sends entries for a
    # real reason, which is not what this test is about.
    node = _Node(RaftSettings(addrs[i], addrs, Path(data) / f"n{i}", "pw", election_min=4.0,
                              election_max=5.0, connection_timeout=6.0, leader_fallback=6.0))
    try:
        deadline = time.monotonic() + 60
        while node.leader() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if node.is_leader():
            async def writer(k: int) -> None:
                for _ in range(WRITES):
                    await node.add(f"k{k}", 1)

            await asyncio.gather(*(writer(k) for k in range(WRITERS)))
            out.put(("done", i, node.last_applied()))
        await asyncio.get_running_loop().run_in_executor(None, stop.wait, 120)  # (the member keeps ticking)
        out.put(("state", i, node.is_leader(), node.last_applied(), node.read(lambda s: dict(s)), seen))
    finally:
        node.destroy()


@pytest.mark.timeout(180)
def test_in_flight_appends_never_resend_applied_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (spawned members import this module by its test-package name: the tests folder must be on their path)
    root = str(Path(__file__).resolve().parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p))
    ctx = mp.get_context("spawn")
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    out, stop = ctx.Queue(), ctx.Event()
    procs = [ctx.Process(target=_member, args=(i, addrs, str(tmp_path), out, stop), daemon=True) for i in range(3)]
    for p in procs:
        p.start()
    try:
        kind, _, applied = out.get(timeout=150)
        assert kind == "done"
        time.sleep(2.0)  # (followers apply the last commit index with the next heartbeat)
        stop.set()
        states = [out.get(timeout=30) for _ in range(3)]
    finally:
        stop.set()
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
    want = {f"k{k}": WRITES for k in range(WRITERS)}
    assert sum(1 for s in states if s[2]) == 1, [s[:4] for s in states]
    assert all(s[3] >= applied and s[4] == want for s in states), [(s[:4], len(s[4])) for s in states]
    lines = [m for s in states for m in s[5] if "truncating already-applied" in m]
    assert not lines, lines[:3]


@pytest.mark.parametrize("cls", ["plain", "pipelined"])
def test_a_late_success_reply_does_not_move_the_next_index_back(tmp_path: Path, cls: str) -> None:
    """The rule itself, on a member put in the leader role by hand: appends up to index 19 went out
    (next index 20) and the reply for the one ending at 14 arrives late. pysyncobj moved the next
    index back to 15 (so 15..19 would be sent again); the fix keeps 20 and still records the match."""
    from pysyncobj import SyncObj
    from pysyncobj.syncobj import _RAFT_STATE

    from bigfleet.raft.pipelined import PipelinedSyncObj
    from bigfleet.raft.settings import sync_obj_conf

    me, peer = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    conf = sync_obj_conf(RaftSettings(me, [me, peer], tmp_path, "pw"), "j", "d")
    conf.autoTick = False
    obj = (PipelinedSyncObj if cls == "pipelined" else SyncObj)(me, [peer], conf)
    try:
        (node,) = obj._SyncObj__otherNodes
        obj._SyncObj__raftState = _RAFT_STATE.LEADER
        obj._SyncObj__raftNextIndex[node] = 20
        obj._SyncObj__raftMatchIndex[node] = 9
        obj._SyncObj__onMessageReceived(node, {"type": "next_node_idx", "next_node_idx": 15, "success": True,
                                                "reset": False})
        assert obj._SyncObj__raftMatchIndex[node] == 14
        assert obj._SyncObj__raftNextIndex[node] == (20 if cls == "pipelined" else 15)
        # a reset (the follower's log does not hold what was sent) still moves it back
        obj._SyncObj__onMessageReceived(node, {"type": "next_node_idx", "next_node_idx": 12, "success": False,
                                                "reset": True})
        assert obj._SyncObj__raftNextIndex[node] == 12
    finally:
        obj.destroy()
