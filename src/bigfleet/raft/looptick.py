"""pysyncobj driven by the asyncio event loop instead of its own tick thread.

pysyncobj's tick thread and the daemon's event loop shared one GIL: every message a peer sent woke
the thread, which had to take the GIL from the loop (and back), and every outcome hopped back to the
loop through ``call_soon_threadsafe``. Here pysyncobj's sockets are the loop's readers and writers,
a tick runs on the loop right after any of them fires (or a command is queued), and a timer covers
pysyncobj's own clocks (heartbeats, elections, reconnects).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from pysyncobj.poller import POLL_EVENT_TYPE

_READ = POLL_EVENT_TYPE.READ | POLL_EVENT_TYPE.ERROR
_WRITE = POLL_EVENT_TYPE.WRITE


class LoopPoller:
    """pysyncobj's Poller interface over the loop's selector; ``poll`` never waits (the loop does)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self._loop = loop
        self._wake = wake
        self._callbacks: dict[int, Callable[[int, int], None]] = {}
        self._masks: dict[int, int] = {}

    def subscribe(self, fd: int, callback: Callable[[int, int], None], mask: int) -> None:
        self._callbacks[fd] = callback
        old = self._masks.get(fd, 0)
        self._masks[fd] = mask
        try:
            if mask & _READ and not old & _READ:
                self._loop.add_reader(fd, self._fire, fd, POLL_EVENT_TYPE.READ)
            elif old & _READ and not mask & _READ:
                self._loop.remove_reader(fd)
            if mask & _WRITE and not old & _WRITE:
                self._loop.add_writer(fd, self._fire, fd, POLL_EVENT_TYPE.WRITE)
            elif old & _WRITE and not mask & _WRITE:
                self._loop.remove_writer(fd)
        except OSError:  # (a descriptor closed under pysyncobj: it notices the dead peer by its timeout)
            self.unsubscribe(fd)

    def unsubscribe(self, fd: int) -> None:
        # pysyncobj closes a socket before it unsubscribes it: the selector then fails to modify the
        # closed descriptor, and drops it (selectors unregisters on that error), which is the aim
        self._callbacks.pop(fd, None)
        mask = self._masks.pop(fd, 0)
        for wanted, remove in ((_READ, self._loop.remove_reader), (_WRITE, self._loop.remove_writer)):
            if mask & wanted:
                with contextlib.suppress(OSError):
                    remove(fd)

    def poll(self, timeout: float) -> None:
        """(events reach pysyncobj from the loop as they happen)"""

    def close(self) -> None:
        for fd in list(self._masks):
            self.unsubscribe(fd)

    def _fire(self, fd: int, event: int) -> None:
        cb = self._callbacks.get(fd)
        if cb is not None:
            cb(fd, event)
        self._wake()


class LoopTicker:
    """Runs ``tick`` soon after ``wake`` (coalesced) and at least every ``period`` seconds."""

    def __init__(self, loop: asyncio.AbstractEventLoop, tick: Callable[[], Any], period: float) -> None:
        self._loop = loop
        self._tick = tick
        self._period = period
        self._pending = False
        self._timer: asyncio.TimerHandle | None = None
        self._stopped = False

    def start(self) -> None:
        self._timer = self._loop.call_later(self._period, self._on_timer)

    def wake(self) -> None:
        if not self._pending and not self._stopped:
            self._pending = True
            self._loop.call_soon(self._run)

    def stop(self) -> None:
        self._stopped = True
        if self._timer is not None:
            self._timer.cancel()

    def _on_timer(self) -> None:
        if self._stopped:
            return
        self._timer = self._loop.call_later(self._period, self._on_timer)
        self._run()

    def _run(self) -> None:
        self._pending = False
        if not self._stopped:
            self._tick()
