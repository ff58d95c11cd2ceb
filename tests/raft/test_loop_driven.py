"""pysyncobj on the event loop: its sockets as the loop's readers, small messages framed cheaply but
still readable by a plain pysyncobj peer, and peer names looked up without blocking the loop."""

from __future__ import annotations

import asyncio
import os
import pickle
import resource
import socket
import threading
import time
import zlib
from pathlib import Path

from pysyncobj import SyncObj, SyncObjConf
from pysyncobj.poller import POLL_EVENT_TYPE

from bigfleet.raft import RaftSettings, framing
from bigfleet.raft.dns import BackgroundResolver
from bigfleet.raft.looptick import LoopDriver, LoopPoller
from bigfleet.testing import free_port, wait_until_async

from .test_bridge import _Counter, _Node


async def test_poller_delivers_reads_and_drops_a_descriptor_closed_before_unsubscribe() -> None:
    """pysyncobj closes a socket and only then unsubscribes it: the selector must not raise (it did,
    EBADF, and the member's connection state was left half torn down)."""
    loop = asyncio.get_running_loop()
    woke: list[int] = []
    poller = LoopPoller(loop, threading.Lock(), lambda: woke.append(1))
    a, b = socket.socketpair()
    a.setblocking(False)
    got: list[tuple[int, int]] = []
    both = POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.WRITE | POLL_EVENT_TYPE.ERROR
    poller.subscribe(a.fileno(), lambda fd, ev: got.append((fd, ev)) or a.recv(16), both)
    poller.subscribe(a.fileno(), lambda fd, ev: got.append((fd, ev)) or a.recv(16),
                     POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)  # (the write interest is dropped)
    b.send(b"x")
    await wait_until_async(lambda: got, 5, what="a read event")
    assert got[0][1] == POLL_EVENT_TYPE.READ and woke
    fd = a.fileno()
    poller.subscribe(fd, lambda fd, ev: None, both)
    a.close()
    poller.unsubscribe(fd)  # closed first, as pysyncobj does: no error
    b.close()
    poller.close()


async def test_off_the_loop_the_poller_polls_itself_and_defers_registration() -> None:
    """What the stall watcher relies on: from another thread, `poll` finds ready sockets with a
    non-blocking select and a subscription reaches the loop's selector once the loop runs."""
    loop = asyncio.get_running_loop()
    poller = LoopPoller(loop, threading.Lock(), lambda: None)
    a0, b = socket.socketpair()
    # (a descriptor past select()'s 1024: a shard with thousands of Sessions has such Raft sockets)
    high = max(1500, a0.fileno()) if resource.getrlimit(resource.RLIMIT_NOFILE)[0] > 1600 else a0.fileno()
    a = socket.socket(fileno=os.dup2(a0.fileno(), high)) if high != a0.fileno() else a0
    a.setblocking(False)
    got: list[int] = []
    b.send(b"y")

    def off_loop() -> None:
        poller.subscribe(a.fileno(), lambda fd, ev: got.append(ev) or a.recv(16),
                         POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR)
        poller.poll(0)

    await asyncio.to_thread(off_loop)
    assert got == [POLL_EVENT_TYPE.READ]
    b.send(b"z")  # now the loop's own reader delivers it
    await wait_until_async(lambda: len(got) == 2, 5, what="the loop's reader")
    poller.close()
    for sock in {a, a0, b}:
        sock.close()


async def test_driver_coalesces_wakes_and_keeps_its_timer() -> None:
    loop = asyncio.get_running_loop()
    ticks: list[float] = []
    d = LoopDriver(loop, 0.05, 5.0)
    d.start(lambda _wait: ticks.append(time.monotonic()))
    await asyncio.sleep(0)
    n0 = len(ticks)
    for _ in range(10):
        d.wake()
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert len(ticks) == n0 + 1  # ten wakes before the loop ran: one tick
    await asyncio.sleep(0.28)
    assert 4 <= len(ticks) - n0 <= 8  # the timer alone: every 50 ms
    stopped: list[int] = []
    d.stop(lambda: stopped.append(len(ticks)))
    d.wake()
    await asyncio.sleep(0.12)
    assert stopped == [len(ticks)] and d.rescued == 0


async def test_a_stalled_loop_is_ticked_by_the_watcher() -> None:
    loop = asyncio.get_running_loop()
    where: list[bool] = []
    d = LoopDriver(loop, 0.01, 0.1)
    d.start(lambda _wait: where.append(threading.current_thread() is threading.main_thread()))
    await asyncio.sleep(0.05)
    time.sleep(0.6)  # the loop is busy (and lets go of the GIL, as most long work does now and then)
    await asyncio.sleep(0)
    d.stop(lambda: None)
    assert d.rescued >= 10 and where.count(False) == d.rescued  # the watcher ticked, off the loop
    assert where[-1] or where.count(True) > 1


async def test_a_member_whose_loop_stalls_keeps_its_leadership(tmp_path: Path) -> None:
    """Three members on one loop, 0.3-0.6 s elections: the loop blocked for 2 s would let every
    follower's election timer run out (the term would move) unless the watcher kept the
    heartbeats and replies flowing meanwhile."""
    addrs = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    nodes = [_Node(RaftSettings(a, addrs, tmp_path / f"n{i}", "pw", election_min=0.3, election_max=0.6))
             for i, a in enumerate(addrs)]
    try:
        await wait_until_async(lambda: sum(n.is_leader() for n in nodes) == 1, 30, what="a leader")
        leader = next(n for n in nodes if n.is_leader())
        assert await leader.add("k", 1) == 1
        term = leader.raft_term()
        time.sleep(2.0)
        await asyncio.sleep(0.3)
        assert leader.is_leader() and leader.raft_term() == term
        assert all(n.stall_ticks > 0 for n in nodes)
        assert await leader.add("k", 1) == 2
    finally:
        for n in nodes:
            n.destroy()


def test_small_messages_are_stored_deflate_streams_any_peer_reads() -> None:
    small = pickle.dumps({"type": "append_entries", "entries": [(b"a" * 500, 7, 2)]})
    big = pickle.dumps({"type": "append_entries", "entries": [(b"b" * 50_000, 8, 2)]})
    for data in (small, big, b""):
        assert zlib.decompress(framing.compress(data, 3)) == data  # (what a plain pysyncobj peer does)
    assert len(framing.compress(big, 3)) < len(big) // 10  # large ones are still compressed
    assert len(framing.compress(small, 3)) >= len(small)  # small ones are stored


def _plain(me: str, peers: list[str]) -> tuple[SyncObj, _Counter]:
    """A stock pysyncobj member (its own tick thread, zlib framing) with the same state machine."""
    counter = _Counter()
    conf = SyncObjConf(password="pw", appendEntriesUseBatch=False, raftMinTimeout=0.3, raftMaxTimeout=0.6,
                       appendEntriesPeriod=0.05)
    return SyncObj(me, peers, conf, consumers=[counter]), counter


async def test_a_loop_driven_member_and_a_plain_pysyncobj_member_replicate_together(tmp_path: Path) -> None:
    """The framing and the loop-driven ticks stay wire-compatible with stock pysyncobj (a rolling
    upgrade has both in one group). The plain member ticks on its own thread."""
    me, other = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    plain, counter = _plain(other, [me])
    node = _Node(RaftSettings(me, [me, other], tmp_path, "pw", election_min=0.3, election_max=0.6))
    try:
        await wait_until_async(lambda: node.leader() is not None, 30, what="a leader")
        if node.is_leader():
            assert await node.add("k", 3) == 3
            await wait_until_async(lambda: counter.fsm.get("k") == 3, 10, what="the plain member applies it")
        else:
            done = threading.Event()
            counter.add("k", 3, callback=lambda res, err: done.set())
            await wait_until_async(done.is_set, 10, what="the plain leader commits")
            await wait_until_async(lambda: node.read(lambda s: s.get("k")) == 3, 10, what="this member applies it")
    finally:
        node.destroy()
        plain.destroy()


def test_resolver_answers_from_what_it_knows_and_looks_up_on_a_thread() -> None:
    r = BackgroundResolver(retry=0.2)
    assert r.resolve("127.0.0.1") == "127.0.0.1"  # literals: no lookup at all
    assert r.resolve("[::1]") == "::1"
    r.prime(["localhost"])
    assert r.resolve("localhost") in {"127.0.0.1", "::1"}
    slow = threading.Event()
    calls: list[str] = []

    def lookup(host: str) -> list[str]:
        calls.append(host)
        slow.wait(5)
        return ["10.0.0.7"]

    r._lookup = lookup  # type: ignore[method-assign]
    t0 = time.monotonic()
    assert r.resolve("peer-1.example") is None  # unknown yet: pysyncobj retries its connection
    assert r.resolve("peer-1.example") is None
    assert time.monotonic() - t0 < 0.5 and calls == ["peer-1.example"]  # one lookup in flight, not waited on
    slow.set()
    deadline = time.monotonic() + 5
    while r.resolve("peer-1.example") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert r.resolve("peer-1.example") == "10.0.0.7"


def test_a_failed_refresh_keeps_the_addresses_a_peer_had() -> None:
    """A DNS hiccup must not cut a healthy peer off: the last addresses stay until a lookup works."""
    r = BackgroundResolver(ttl=0.0, retry=0.0)
    answers = [["10.0.0.8"], []]
    r._lookup = lambda host: answers.pop(0) if answers else []  # type: ignore[method-assign,assignment]
    r.prime(["peer-2.example"])
    assert r.resolve("peer-2.example") == "10.0.0.8"  # (due again at once: a refresh that fails starts)
    deadline = time.monotonic() + 5
    while answers and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)
    assert not answers and r.resolve("peer-2.example") == "10.0.0.8"
