"""pysyncobj driven by the asyncio event loop, with a thread that keeps it alive when the loop stalls.

pysyncobj's own tick thread and the daemon's event loop shared one GIL: every message a peer sent
woke the thread, which had to take the GIL from the loop (and back), and every outcome hopped back
to the loop through ``call_soon_threadsafe``. Here pysyncobj's sockets are the loop's readers and
writers, a tick runs on the loop right after any of them fires (or a command is queued), and a
timer covers pysyncobj's own clocks (heartbeats, elections, reconnects).

A loop can be busy for seconds, though (a new shard leader reading 500 000 machines): a member
whose ticks wait for it sends no heartbeats and reads no replies, and loses its leadership. So a
watcher thread ticks in the loop's stead while no loop tick has run for ``stall_after`` seconds,
polling pysyncobj's sockets itself. One lock keeps the two from ever being inside pysyncobj at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import threading
import time
from collections.abc import Callable
from typing import Any

from pysyncobj.poller import POLL_EVENT_TYPE

from bigfleet.observability import get_logger

log = get_logger("bigfleet.raft")

_READ = POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR
_WRITE = POLL_EVENT_TYPE.WRITE


class LoopPoller:
    """pysyncobj's Poller interface over the loop's selector.

    ``subscribe``/``unsubscribe`` record what pysyncobj wants and bring the loop's registration in
    line (at once on the loop's thread, through ``call_soon_threadsafe`` from the watcher). ``poll``
    does nothing on the loop's thread (the loop delivers events); on the watcher it is a
    non-blocking ``poll`` over the wanted descriptors.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, lock: threading.Lock, wake: Callable[[], None]) -> None:
        self._loop = loop
        self._loop_thread = threading.get_ident()
        self._lock = lock
        self._wake = wake
        self._callbacks: dict[int, Callable[[int, int], None]] = {}
        self._wanted: dict[int, int] = {}
        self._registered: dict[int, int] = {}

    def subscribe(self, fd: int, callback: Callable[[int, int], None], mask: int) -> None:
        self._callbacks[fd] = callback
        self._wanted[fd] = mask
        self._follow(fd)

    def unsubscribe(self, fd: int) -> None:
        self._callbacks.pop(fd, None)
        self._wanted.pop(fd, None)
        self._follow(fd)

    def poll(self, timeout: float) -> None:
        if threading.get_ident() == self._loop_thread:
            return  # (events reach pysyncobj from the loop as they happen)
        p = select.poll()  # (not select(): a shard with thousands of sessions has descriptors past 1024)
        for fd, mask in list(self._wanted.items()):
            p.register(fd, (select.POLLIN if mask & _READ else 0) | (select.POLLOUT if mask & _WRITE else 0))
        for fd, ev in p.poll(0):
            event = (POLL_EVENT_TYPE.READ if ev & (select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL)
                     else 0) | (POLL_EVENT_TYPE.WRITE if ev & select.POLLOUT else 0)
            cb = self._callbacks.get(fd)
            if cb is not None and event:
                cb(fd, event)

    def close(self) -> None:
        for fd in list(self._wanted):
            self.unsubscribe(fd)

    def _follow(self, fd: int) -> None:
        if threading.get_ident() == self._loop_thread:
            self._register(fd)
        else:
            self._loop.call_soon_threadsafe(self._register, fd)

    def _register(self, fd: int) -> None:
        """The loop's interest in ``fd`` as pysyncobj wants it now (loop thread only). pysyncobj
        closes a socket before it unsubscribes it: the selector then fails on the closed descriptor
        and drops it (selectors unregisters on that error), which is the aim."""
        want, have = self._wanted.get(fd, 0), self._registered.get(fd, 0)
        loop = self._loop
        try:
            for bit, add, remove, event in ((_READ, loop.add_reader, loop.remove_reader, POLL_EVENT_TYPE.READ),
                                            (_WRITE, loop.add_writer, loop.remove_writer, POLL_EVENT_TYPE.WRITE)):
                if want & bit and not have & bit:
                    add(fd, self._fire, fd, event)
                elif have & bit and not want & bit:
                    remove(fd)
        except OSError:  # (closed under pysyncobj: it notices the dead peer by its own timeout)
            with contextlib.suppress(OSError):
                loop.remove_reader(fd)
                loop.remove_writer(fd)
            self._registered.pop(fd, None)
            return
        if want:
            self._registered[fd] = want
        else:
            self._registered.pop(fd, None)

    def _fire(self, fd: int, event: int) -> None:
        with self._lock:
            cb = self._callbacks.get(fd)  # (read under the lock: the watcher may have dropped it)
            if cb is not None:
                cb(fd, event)
        self._wake()


class LoopDriver:
    """Ticks a pysyncobj member on the loop, soon after a wake (coalesced) and at least every
    ``period`` seconds, and from a watcher thread while the loop has not ticked for ``stall_after``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, period: float, stall_after: float) -> None:
        self._loop = loop
        self._period = period
        self._stall_after = stall_after
        self._lock = threading.Lock()
        self.poller = LoopPoller(loop, self._lock, self.wake)
        self._tick: Callable[[float], Any] = lambda _wait: None
        self._pending = False
        self._timer: asyncio.TimerHandle | None = None
        self._stopped = threading.Event()
        self._last = time.monotonic()
        self._watcher = threading.Thread(target=self._watch, name="raft-stall-watch", daemon=True)
        self.rescued = 0  # watcher ticks so far (the loop stalled)

    @property
    def lock(self) -> threading.Lock:
        """Held while pysyncobj runs (a tick or a socket event): take it to read its collections."""
        return self._lock

    def start(self, tick: Callable[[float], Any]) -> None:
        self._tick = tick
        self._timer = self._loop.call_later(self._period, self._on_timer)
        self._watcher.start()
        self.wake()

    def wake(self) -> None:
        if not self._pending and not self._stopped.is_set():
            self._pending = True
            self._loop.call_soon(self._run)

    def stop(self, then: Callable[[], None]) -> None:
        """Stop ticking, then run ``then`` (pysyncobj's destroy) with the member to itself."""
        self._stopped.set()
        if self._timer is not None:
            self._timer.cancel()
        with self._lock:
            then()
        self.poller.close()

    def _on_timer(self) -> None:
        if self._stopped.is_set():
            return
        self._timer = self._loop.call_later(self._period, self._on_timer)
        self._run()

    def _run(self) -> None:
        self._pending = False
        if self._stopped.is_set():
            return
        with self._lock:
            self._safe_tick()
        self._last = time.monotonic()

    def _safe_tick(self) -> None:
        try:
            self._tick(0.0)
        except Exception:  # (as pysyncobj's own tick thread did: log it, the next tick tries again)
            log.exception("raft tick failed")

    def _watch(self) -> None:
        calm = max(self._period, self._stall_after / 2)
        while not self._stopped.wait(calm if time.monotonic() - self._last < self._stall_after else self._period):
            if time.monotonic() - self._last < self._stall_after:
                continue
            with self._lock:
                if self._stopped.is_set():
                    return
                self.rescued += 1
                self._safe_tick()
